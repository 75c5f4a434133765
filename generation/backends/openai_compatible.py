"""The `openai` backend: instruction writer and judge over any server that speaks OpenAI chat completions.

vLLM, SGLang, Ollama, LM Studio or a hosted API serve as writer, refiner and judge with the SAME prompts and verdict
schema as the Gemini backend (gemini.py: writer_prompt, judge_prompt, parse_verdict). The judge asks for structured
output (a JSON schema) and, when the server rejects that with a 400, falls back to plain text read by a tolerant
parser (JSON in prose or fences, <think> blocks stripped) for the rest of the run.

Calls reuse the Gemini transport's retry machinery (transport.RetryPolicy, shared_limiter, parse_retry_after):
bounded retries with back-off and jitter on 408/429/5xx, timeouts and connection errors; Retry-After honoured.
The key comes from OPENAI_API_KEY (local servers usually need none); it is never stored or printed: answers are
scrubbed (secrets.py) as they arrive, before they are read or cached. With a cache_dir, completed answers are kept
by a hash of the request, so a resumed run never asks twice.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import os
import random
import re
from pathlib import Path

from .base import APIError, InstructionWriter, Judge
from .gemini import (JudgeAnswer, clean_instruction, judge_prompt, load_prompt, parse_verdict, reask_note, unusable,
                     verdict_from_answer, writer_prompt)
from ..records import Attempt, EditedImage, Instruction, SourceImage, Task, Usage, Verdict
from ..secrets import hold, scrub, scrub_model
from .gemini_transport import (CallFailure, RetryPolicy, call_with_retries, classify, failure_for_status,
                        parse_retry_after, shared_limiter)

API_KEY_VARIABLE = "OPENAI_API_KEY"
NO_KEY = "not-needed"  # the client insists on a key; servers without authentication ignore it
PIP_HINT = "pip install 'medbanana[openai]'"
THINK_BLOCK = re.compile(r"<think>(.*?)</think>", re.DOTALL)


def _import_openai():
    try:
        import openai
    except ImportError as exc:
        raise ImportError(f"the openai backend needs the openai client: {PIP_HINT}") from exc
    return openai


def classify_openai(exc: BaseException) -> CallFailure:
    """A failed chat-completions call as a kind; what the openai client does not raise goes to transport.classify."""
    openai = _import_openai()
    if isinstance(exc, openai.APITimeoutError):
        return CallFailure("timeout", "no answer within the per-call timeout", True)
    if isinstance(exc, openai.APIConnectionError):
        return CallFailure("transport", f"{type(exc).__name__}: {exc}", True)
    if isinstance(exc, openai.APIStatusError):
        code = exc.status_code
        message = f"HTTP {code}: {exc.message}"
        return failure_for_status(code, message, parse_retry_after(exc.response.headers.get("retry-after")))
    return classify(exc)


class OpenAITransport:
    """The openai async client plus timeout, rate limit and retries (the client's own retries are off)."""

    def __init__(self, *, base_url: str | None = None, api_key: str | None = None, timeout: float = 180.0,
                 max_attempts: int = 6, retry_base_delay: float = 2.0, retry_max_delay: float = 60.0,
                 rpm: float | None = None, cache_dir: str | Path | None = None, sleep=asyncio.sleep,
                 jitter_seed: int | None = None):
        openai = _import_openai()
        self._secret = (api_key or os.environ.get(API_KEY_VARIABLE) or NO_KEY).strip()
        hold(self._secret if self._secret != NO_KEY else None)  # an `api_key=` option too must be scrubbed
        self.base_url = base_url or os.environ.get("OPENAI_BASE_URL") or None
        self._client = openai.AsyncOpenAI(api_key=self._secret, base_url=self.base_url, timeout=timeout + 5,
                                          max_retries=0)
        self.timeout = timeout
        self.retry = RetryPolicy(max_attempts=max_attempts, base_delay=retry_base_delay, max_delay=retry_max_delay)
        self.rpm = rpm
        self.cache_dir = Path(cache_dir) if cache_dir else None
        self._completion_type = openai.types.chat.ChatCompletion
        self._sleep = sleep
        self._rng = random.Random(jitter_seed)
        self.network_calls = 0
        self.cache_hits = 0

    def redact(self, text: str) -> str:
        return scrub(text)

    def cache_key(self, model: str, request: dict) -> str:
        """sha256 of the request (the key is not part of it, so it never reaches a file name)."""
        payload = json.dumps({"model": model, **request}, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(payload.encode()).hexdigest()

    def _cache_path(self, key: str) -> Path:
        return self.cache_dir / key[:2] / f"{key}.json"

    def forget(self, key: str) -> None:
        """Drop an answer that proved unusable, so that `--retry-failed` asks again."""
        if self.cache_dir:
            self._cache_path(key).unlink(missing_ok=True)

    async def complete(self, model: str, **request):
        """One chat completion (from the cache when this request completed before); APIError(kind) once it cannot
        succeed."""
        key = self.cache_key(model, request) if self.cache_dir else ""
        if key and self._cache_path(key).exists():
            try:
                completion = self._completion_type.model_validate_json(self._cache_path(key).read_text())
                self.cache_hits += 1
                return scrub_model(completion)  # a file written before answers were scrubbed
            except ValueError:  # a torn or foreign file: asked again and replaced
                pass
        # an endpoint may echo the request's headers, the key with them: scrubbed before it is read or cached
        completion = scrub_model(await self._call(model, request))
        if key:
            path = self._cache_path(key)
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
            tmp.write_text(completion.model_dump_json(), encoding="utf-8")
            os.replace(tmp, path)
        return completion

    async def _call(self, model: str, request: dict):
        return await call_with_retries(
            self, model, lambda: self._client.chat.completions.create(model=model, **request), classify_openai,
            timeout=self.timeout, limiter=shared_limiter(model, self.rpm) if self.rpm else None)

    async def aclose(self) -> None:
        await self._client.close()


def image_part(data: bytes, mime_type: str) -> dict:
    return {"type": "image_url", "image_url": {"url": f"data:{mime_type};base64,{base64.b64encode(data).decode()}"}}


def text_part(text: str) -> dict:
    return {"type": "text", "text": text}


def split_thinking(message) -> tuple[str, str]:
    """(answer, thinking): reasoning from `reasoning_content` (vLLM, SGLang) or `reasoning`, or <think> blocks."""
    text = message.content or ""
    thoughts = [t.strip() for t in THINK_BLOCK.findall(text)]
    text = THINK_BLOCK.sub("", text).strip()
    if text.startswith("<think>"):  # a reasoning that ran out of tokens: no answer follows it
        thoughts, text = thoughts + [text.removeprefix("<think>").strip()], ""
    extra = getattr(message, "reasoning_content", None) or getattr(message, "reasoning", None)
    if isinstance(extra, str) and extra.strip():
        thoughts.insert(0, extra.strip())
    return text, "\n".join(thoughts)


def parse_verdict_tolerant(text: str) -> JudgeAnswer:
    """parse_verdict, else the outermost {...} of an answer that wraps its JSON in prose; ValueError if neither."""
    try:
        return parse_verdict(text)
    except ValueError as first:
        start, end = text.find("{"), text.rfind("}")
        if start < 0 or end <= start:
            raise first
        return parse_verdict(text[start:end + 1])


def _usage(completion) -> Usage:
    usage = completion.usage
    if usage is None:
        return Usage()
    details = getattr(usage, "completion_tokens_details", None)
    return Usage(input_tokens=usage.prompt_tokens or 0, output_tokens=usage.completion_tokens or 0,
                 thinking_tokens=(details and details.reasoning_tokens) or 0)


class _OpenAIBackend:
    """Shared: the model, sampling, the transport (built from options or shared) and the re-ask loop."""

    name = "openai"

    def __init__(self, *, model: str, temperature: float | None = None, max_reasks: int = 2,
                 max_tokens: int | None = None, transport: OpenAITransport | None = None, **transport_options):
        if not model:
            raise ValueError("the openai backend needs a model name (--openai-model, as the server names it)")
        self.model = model
        self.temperature = temperature
        self.max_reasks = max_reasks
        self.max_tokens = max_tokens
        self.transport = transport or OpenAITransport(**transport_options)

    async def _ask(self, content: list[dict], parse, what: str, response_format: dict | None = None):
        """(parsed, thinking, usage, tries); a bounded number of re-asks when the answer cannot be used.

        When it ends in an APIError, the answers it got are dropped from the cache: they were unusable, and
        `--retry-failed` must ask again rather than replay them (as gemini.run_exchange does)."""
        answered: list[str] = []
        try:
            return await self._ask_until_usable(content, parse, what, response_format, answered)
        except APIError:
            for key in answered:
                self.transport.forget(key)
            raise

    def _request(self, content: list[dict], note: str | None, response_format: dict | None) -> dict:
        request = {"messages": [{"role": "user", "content": content + ([text_part(note)] if note else [])}]}
        if self.temperature is not None:
            request["temperature"] = self.temperature
        if self.max_tokens:
            request["max_tokens"] = self.max_tokens
        if response_format:
            request["response_format"] = response_format
        return request

    async def _ask_until_usable(self, content, parse, what, response_format, answered: list[str]):
        usage, note, tries, problem = Usage(), None, 1 + self.max_reasks, ""
        for number in range(1, tries + 1):
            request = self._request(content, note, response_format)
            completion = await self.transport.complete(self.model, **request)
            if self.transport.cache_dir:
                answered.append(self.transport.cache_key(self.model, request))
            more = _usage(completion)
            usage = Usage(usage.input_tokens + more.input_tokens, usage.output_tokens + more.output_tokens,
                          usage.thinking_tokens + more.thinking_tokens)
            if not completion.choices:
                raise APIError("bad_response", f"{self.model} answered without a choice")
            choice = completion.choices[0]
            if choice.finish_reason == "content_filter" or getattr(choice.message, "refusal", None):
                raise APIError("refused", f"{self.model} refused the {what}: "
                                          f"{(choice.message.refusal or choice.finish_reason)[:200]}")
            text, thinking = split_thinking(choice.message)
            try:
                return parse(text), thinking, usage, number
            except ValueError as exc:
                problem = f"{type(exc).__name__}: {str(exc)[:200]}"
            note = reask_note(problem, number, tries)
        raise unusable(what, self.model, tries, problem)


class OpenAIWriter(_OpenAIBackend, InstructionWriter):
    """Round 1 from the task (and the source image when image_aware); later rounds from the original image and
    every earlier instruction with its verdict (the Gemini writer's prompts)."""

    def __init__(self, *, image_aware: bool = True, **options):
        super().__init__(**options)
        self.image_aware = image_aware

    async def write(self, task: Task, source: SourceImage, history: list[Attempt]) -> Instruction:
        _, text = writer_prompt(task, history)
        content = [text_part(text)]
        if history or self.image_aware:
            content.insert(0, image_part(source.data, source.mime_type))
        instruction, thinking, usage, _ = await self._ask(content, clean_instruction, "instruction")
        return Instruction(text=instruction, thinking_summary=thinking, model=self.model, usage=usage)


VERDICT_FORMAT = {"type": "json_schema",
                  "json_schema": {"name": "verdict", "strict": True,
                                  "schema": {**JudgeAnswer.model_json_schema(), "additionalProperties": False}}}


class OpenAIJudge(_OpenAIBackend, Judge):
    """Original and edited image plus the instruction in; a verdict out (the Gemini judge's prompt and schema).

    structured_output: "json_schema" (default), "json_object" or "none". A server that rejects the format with
    HTTP 400 is asked again without it, and not asked for it again by this judge; requests that were already in
    flight with it when the first 400 came are each asked again once too. Instruction compliance is
    enforced as in GeminiJudge: the model's own `qualified` is kept in details.
    """

    def __init__(self, *, structured_output: str = "json_schema", **options):
        super().__init__(**options)
        formats = {"json_schema": VERDICT_FORMAT, "json_object": {"type": "json_object"}, "none": None}
        if structured_output not in formats:
            raise ValueError(f"structured_output must be one of {', '.join(formats)}, not {structured_output!r}")
        self.response_format = formats[structured_output]

    async def judge(self, task: Task, source: SourceImage, edited: EditedImage, instruction: str) -> Verdict:
        content = [text_part("ORIGINAL image:"), image_part(source.data, source.mime_type),
                   text_part("EDITED image:"), image_part(edited.data, edited.mime_type),
                   text_part(judge_prompt(task, instruction))]
        # The format this request goes out with: other tasks' requests are in flight too, and the first 400 among
        # them turns the format off for later ones, but must not leave these without their plain-text retry.
        asked_for, fallback = self.response_format, ""
        try:
            answer = await self._ask(content, parse_verdict_tolerant, "verdict", asked_for)
        except APIError as exc:
            if exc.kind != "invalid_argument" or asked_for is None:
                raise
            fallback = f"response_format rejected ({str(exc)[:200]}); parsed from plain text"
            self.response_format = asked_for = None
            answer = await self._ask(content, parse_verdict_tolerant, "verdict")
        ans, thinking, usage, tries = answer
        details = {"prompt": load_prompt("judge").tag, "model_qualified": ans.qualified, "tries": tries,
                   "structured_output": (asked_for or {}).get("type", "none")}
        if fallback:
            details["structured_output_fallback"] = fallback
        return verdict_from_answer(ans, task, thinking=thinking, model=self.model, usage=usage, details=details)
