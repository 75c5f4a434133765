"""The Gemini backend: instruction writer, image editor and judge over the google-genai async client.

The prompts and the reading of answers are `generation/prompts.py`'s (shared with the OpenAI-compatible backend);
the response schemas that make Gemini answer in their shape are here. Calls go through
`gemini_transport.GeminiTransport` (cache, rate limit, retries, timeout). Permanent editor failures raise
`EditRefused(kind, ...)`; writer and judge failures, and anything that survived the transport's retries, raise
`APIError(kind, ...)`.

Each backend's logic (what to send, how to read the answer, when to ask again) is written once, as an exchange:
a generator that yields `Request`s and is sent the `Answer` to each (or has the call's `APIError` thrown in).
`write` / `edit` / `judge` drive it call by call (http.drive); `batch.py` drives the exchanges of many tasks at once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeVar

from google.genai import types

from .base import APIError, Editor, EditRefused, InstructionWriter, Judge
from ..prompts import (WRITER_PROMPTS, JudgeAnswer, ScoreAnswer, clean_instruction, editor_prompt, judge_prompt,
                       load_prompt, parse_scores, parse_verdict, score_prompt, verdict_from_answer, writer_prompt)
from ..records import (Attempt, EditedImage, EditScores, Instruction, SourceImage, Task, Usage, Verdict,
                       VERDICT_BOOLEANS, decode_rgb, encode_jpeg)
from ..secrets import scrub
from .gemini_transport import GeminiTransport, Request
from . import http
from .http import add_usage, ask_until_usable, drive

DEFAULT_EDITOR_MODEL = "gemini-2.5-flash-image"
DEFAULT_TEXT_MODEL = "gemini-2.5-pro"  # writer and judge
# Finish reasons that are a refusal: asking again with the same content will not help.
REFUSAL_REASONS = {"SAFETY", "IMAGE_SAFETY", "PROHIBITED_CONTENT", "IMAGE_PROHIBITED_CONTENT", "BLOCKLIST",
                   "SPII", "RECITATION", "IMAGE_RECITATION"}
JPEG_MAGIC, JPEG_END = b"\xff\xd8\xff", b"\xff\xd9"

# ---------------------------------------------------------------- response schemas (prompts.py's answer models)

_BOOL = types.Schema(type="BOOLEAN")
VERDICT_SCHEMA = types.Schema(
    type="OBJECT", properties={**dict.fromkeys(VERDICT_BOOLEANS, _BOOL), "reason": types.Schema(type="STRING")},
    required=list(JudgeAnswer.model_fields), property_ordering=list(JudgeAnswer.model_fields))

_SCORE = types.Schema(type="INTEGER", minimum=0, maximum=10)
SCORE_SCHEMA = types.Schema(
    type="OBJECT", properties={"editing_accuracy": _SCORE, "visual_quality": _SCORE,
                               "reason": types.Schema(type="STRING")},
    required=list(ScoreAnswer.model_fields), property_ordering=list(ScoreAnswer.model_fields))


@dataclass
class Answer:
    """The parts of a generateContent response that we use."""

    text: str
    thoughts: str
    images: list[types.Blob]
    finish_reason: str
    block_reason: str
    usage: Usage


def read_answer(response: types.GenerateContentResponse) -> Answer:
    meta = response.usage_metadata
    usage = Usage(input_tokens=(meta and meta.prompt_token_count) or 0,
                  output_tokens=(meta and meta.candidates_token_count) or 0,
                  thinking_tokens=(meta and meta.thoughts_token_count) or 0)
    blocked = response.prompt_feedback.block_reason if response.prompt_feedback else None
    block = str(getattr(blocked, "value", blocked)) if blocked else ""
    candidate = response.candidates[0] if response.candidates else None
    finish = getattr(candidate.finish_reason, "value", candidate.finish_reason) if candidate else None
    parts = candidate.content.parts if candidate and candidate.content and candidate.content.parts else []
    texts = [p.text for p in parts if p.text and not p.thought]
    thoughts = [p.text for p in parts if p.text and p.thought]
    images = [p.inline_data for p in parts if p.inline_data and p.inline_data.data and not p.thought
              and (p.inline_data.mime_type or "").startswith("image/")]
    # scrubbed here too, for answers replayed from caches written before the transport scrubbed them
    return Answer(scrub("".join(texts).strip()), scrub("\n".join(thoughts).strip()), images, str(finish or ""), block,
                  usage)


# Parts of our own making, built without validation: the SDK's types check every field of every model built (about
# 30 us each, ~10 per call), and these hold a str, or bytes and a MIME type, by construction.
def _image_part(data: bytes, mime_type: str) -> types.Part:
    return types.Part.model_construct(inline_data=types.Blob.model_construct(data=data, mime_type=mime_type))


def _text_part(text: str) -> types.Part:
    return types.Part.model_construct(text=text)


T = TypeVar("T")
Exchange = http.Exchange[Request, Answer, T]  # yields requests, is sent answers, returns the backend's result


async def run_exchange(exchange: Exchange[T], transport: GeminiTransport) -> T:
    """Drive an exchange call by call through the transport (http.drive: the answers of an exchange that ends in
    an APIError are dropped from the request cache)."""
    async def call(request: Request) -> Answer:
        return read_answer(await transport.generate(request.model, request.contents, request.config))

    return await drive(exchange, call, lambda r: transport.forget(r.model, r.contents, r.config), needs_decoding)


def needs_decoding(answer: Answer) -> bool:
    """Whether the editor must decode the answer's image (to re-encode it, or to prove it whole): see
    GeminiEditor._edited. The exchange then reads it on a worker thread."""
    return bool(answer.images) and not _whole_jpeg(answer.images[-1].data)


def _whole_jpeg(data: bytes) -> bool:
    return data[:3] == JPEG_MAGIC and data.rstrip(b"\0").endswith(JPEG_END)


# ---------------------------------------------------------------- backends

class _GeminiBackend:
    """Shared construction: the model id, sampling options and the transport (built from options or shared).

    Transport options: api_key, base_url, timeout, max_attempts, retry_base_delay, retry_max_delay, cache_dir,
    rpm, tpm, sleep, jitter_seed (see GeminiTransport).
    """

    name = "gemini"

    def __init__(self, *, model: str, temperature: float | None = None, transport: GeminiTransport | None = None,
                 **transport_options):
        self.model = model
        self.temperature = temperature
        self.transport = transport or GeminiTransport(**transport_options)

    @property
    def vertex(self) -> dict | None:
        """The Vertex AI target as the run records it (project, location), None on the Gemini API."""
        return self.transport.vertex.describe() if self.transport.vertex is not None else None

    def _request(self, parts: list[types.Part], config: types.GenerateContentConfig) -> Request:
        return Request(self.model, [types.Content.model_construct(role="user", parts=parts)], config)


class _TextBackend(_GeminiBackend):
    """Writer and judge: a text answer, re-asked a bounded number of times when it cannot be used."""

    def __init__(self, *, model: str = DEFAULT_TEXT_MODEL, max_reasks: int = 2, thinking: bool = True, **options):
        super().__init__(model=model, **options)
        self.max_reasks = max_reasks
        self.thinking = thinking

    def _config(self, **extra) -> types.GenerateContentConfig:
        thinking = types.ThinkingConfig(include_thoughts=True) if self.thinking else None
        return types.GenerateContentConfig(temperature=self.temperature, thinking_config=thinking, **extra)

    def _ask(self, parts: list[types.Part], config: types.GenerateContentConfig, parse, what: str):
        """Exchange returning (parsed, answer of the last call, total usage, calls made); APIError when no usable
        answer came (http.ask_until_usable)."""
        def text_of(answer: Answer) -> str:
            if answer.block_reason:
                raise APIError("prompt_blocked", f"{self.model} blocked the {what} prompt: {answer.block_reason}")
            if answer.finish_reason in REFUSAL_REASONS:
                raise APIError(answer.finish_reason.lower(), f"{self.model} refused the {what}: {answer.finish_reason}")
            return answer.text

        return ask_until_usable(
            lambda note: self._request(parts + ([_text_part(note)] if note else []), config),
            lambda answer: answer.usage, text_of, parse, what=what, model=self.model, max_reasks=self.max_reasks)


class GeminiWriter(_TextBackend, InstructionWriter):
    """Round 1 from the task (and the source image when image_aware); later rounds from the original image and
    every earlier instruction with its verdict."""

    prompts = WRITER_PROMPTS

    def __init__(self, *, image_aware: bool = True, **options):
        super().__init__(**options)
        self.image_aware = image_aware

    async def write(self, task: Task, source: SourceImage, history: list[Attempt]) -> Instruction:
        return await run_exchange(self.write_exchange(task, source, history), self.transport)

    def write_exchange(self, task: Task, source: SourceImage, history: list[Attempt]) -> Exchange[Instruction]:
        _, text = writer_prompt(task, history)
        parts = [_text_part(text)]
        if history or self.image_aware:
            parts = [_image_part(source.data, source.mime_type)] + parts
        instruction, answer, usage, _ = yield from self._ask(parts, self._config(), clean_instruction, "instruction")
        return Instruction(text=instruction, thinking_summary=answer.thoughts, model=self.model, usage=usage)


class GeminiEditor(_GeminiBackend, Editor):
    """Sends the source bytes as they are; keeps returned JPEG bytes as they are, other formats become JPEG q95.

    Text-only and NO_IMAGE answers are stochastic: asked again with the next seed up to max_image_retries times.
    """

    prompts = ("editor",)

    def __init__(self, *, model: str = DEFAULT_EDITOR_MODEL, max_image_retries: int = 2, **options):
        super().__init__(model=model, **options)
        self.max_image_retries = max_image_retries

    async def edit(self, task: Task, source: SourceImage, instruction: str, seed: int) -> EditedImage:
        return await run_exchange(self.edit_exchange(task, source, instruction, seed), self.transport)

    def edit_exchange(self, task: Task, source: SourceImage, instruction: str, seed: int) -> Exchange[EditedImage]:
        parts = [_image_part(source.data, source.mime_type), _text_part(editor_prompt(task, instruction))]
        usage, tries = Usage(), 1 + self.max_image_retries
        for number in range(1, tries + 1):
            config = types.GenerateContentConfig(response_modalities=["TEXT", "IMAGE"], temperature=self.temperature,
                                                 seed=(seed + number - 1) % 2**31)
            try:
                answer = yield self._request(parts, config)
            except APIError as exc:
                if exc.kind == "invalid_argument":
                    raise EditRefused(exc.kind, str(exc).partition(": ")[2]) from None
                raise
            usage = add_usage(usage, answer.usage)
            if answer.block_reason:
                raise EditRefused("prompt_blocked", f"{self.model} blocked the edit prompt: {answer.block_reason}",
                                  usage)
            if answer.finish_reason in REFUSAL_REASONS:
                raise EditRefused(answer.finish_reason.lower(),
                                  f"{self.model} refused the edit ({answer.finish_reason}): {answer.text[:200]}", usage)
            if answer.images:
                return self._edited(answer, usage, number, config.seed)
            missing = "no_image" if answer.finish_reason == "NO_IMAGE" else "text_only"
        raise EditRefused(missing, f"{self.model} returned no image in {tries} tries (last finish reason "
                                   f"{answer.finish_reason or 'none'}): {answer.text[:200]!r}", usage)

    def _edited(self, answer: Answer, usage: Usage, tries: int, seed: int) -> EditedImage:
        data, mime_type = answer.images[-1].data, answer.images[-1].mime_type
        is_jpeg = data[:3] == JPEG_MAGIC
        # A JPEG that ends with its end-of-image marker is kept without decoding (a full decode costs more than
        # the rest of the call on the client); anything else must decode, to re-encode or to prove it whole.
        if not _whole_jpeg(data):
            try:
                array = decode_rgb(data)
            except ValueError as exc:
                raise EditRefused("truncated_image", f"{self.model} returned unreadable image bytes "
                                                     f"({len(data)} bytes, {mime_type}): {exc}") from None
            if not is_jpeg:
                data = encode_jpeg(array, quality=95)
        return EditedImage(data=data, model=self.model, text=answer.text, usage=usage,
                           details={"prompt": load_prompt("editor").tag, "finish_reason": answer.finish_reason,
                                    "tries": tries, "seed": seed, "returned_mime_type": mime_type,
                                    "reencoded": not is_jpeg})


class GeminiJudge(_TextBackend, Judge):
    """Original and edited image plus the instruction in; a verdict through a JSON response schema out.
    `score` grades an edit 0-10 for evaluation instead (prompts/eval_score.txt), with a ground-truth edit if given.

    Instruction compliance is enforced here: after `remove` has_disease must be false (after `add`, true) for
    the edit to qualify, whatever the model said; the model's own call is kept in details.
    """

    prompts = ("judge",)
    scoring_prompt = "eval_score"

    async def judge(self, task: Task, source: SourceImage, edited: EditedImage, instruction: str) -> Verdict:
        return await run_exchange(self.judge_exchange(task, source, edited, instruction), self.transport)

    def judge_exchange(self, task: Task, source: SourceImage, edited: EditedImage,
                       instruction: str) -> Exchange[Verdict]:
        parts = [_text_part("ORIGINAL image:"), _image_part(source.data, source.mime_type),
                 _text_part("EDITED image:"), _image_part(edited.data, edited.mime_type),
                 _text_part(judge_prompt(task, instruction))]
        config = self._config(response_mime_type="application/json", response_schema=VERDICT_SCHEMA)
        ans, answer, usage, tries = yield from self._ask(parts, config, parse_verdict, "verdict")
        return verdict_from_answer(ans, task, thinking=answer.thoughts, model=self.model, usage=usage,
                                   details={"prompt": load_prompt("judge").tag, "model_qualified": ans.qualified,
                                            "tries": tries})

    async def score(self, task: Task, source: SourceImage, edited: EditedImage, instruction: str,
                    ground_truth: SourceImage | None = None) -> EditScores:
        return await run_exchange(self.score_exchange(task, source, edited, instruction, ground_truth),
                                  self.transport)

    def score_exchange(self, task: Task, source: SourceImage, edited: EditedImage, instruction: str,
                       ground_truth: SourceImage | None = None) -> Exchange[EditScores]:
        truth = ([_text_part("GROUND-TRUTH edit:"), _image_part(ground_truth.data, ground_truth.mime_type)]
                 if ground_truth is not None else [])
        parts = [_text_part("ORIGINAL image:"), _image_part(source.data, source.mime_type), *truth,
                 _text_part("EDITED image:"), _image_part(edited.data, edited.mime_type),
                 _text_part(score_prompt(task, instruction, ground_truth is not None))]
        config = self._config(response_mime_type="application/json", response_schema=SCORE_SCHEMA)
        ans, answer, usage, tries = yield from self._ask(parts, config, parse_scores, "scores")
        return EditScores(editing_accuracy=float(ans.editing_accuracy), visual_quality=float(ans.visual_quality),
                          reason=ans.reason, model=self.model, usage=usage,
                          details={"prompt": load_prompt("eval_score").tag, "tries": tries,
                                   "ground_truth": ground_truth is not None, "thinking_summary": answer.thoughts})

