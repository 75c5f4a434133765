"""The `openai` backend: instruction writer and judge over any server that speaks OpenAI chat completions.

vLLM, SGLang, Ollama, LM Studio or a hosted API serve as writer, refiner and judge with the SAME prompts and verdict
schema as the Gemini backend (prompts.py: writer_prompt, judge_prompt, parse_verdict). The judge asks for structured
output (a JSON schema) and, when the server rejects that with a 400, falls back to plain text read by a tolerant
parser (JSON in prose or fences, <think> blocks stripped) for the rest of the run.

Calls go through http.Transport, as the Gemini backend's do: bounded retries with back-off and jitter on
408/429/5xx, timeouts and connection errors, Retry-After honoured, per-model limits owned by the transport.
The key comes from OPENAI_API_KEY (local servers usually need none); it is never stored or printed: answers are
scrubbed (secrets.py) as they arrive, before they are read or cached. With a cache_dir, completed answers are kept
by a hash of the request, so a resumed run never asks twice.
"""

from __future__ import annotations

import base64
import os
import re

from ..extras import require
from .base import APIError, InstructionWriter, Judge
from .guard import capped_transport, check_text, http_library, httpx_event_hooks, refused_in, strings_in
from ..prompts import (WRITER_PROMPTS, JudgeAnswer, clean_instruction, judge_prompt, load_prompt,
                       parse_verdict_tolerant, verdict_from_answer, writer_prompt)
from ..records import Attempt, EditedImage, Instruction, SourceImage, Task, Usage, Verdict
from ..secrets import hold, scrub_model, url_credentials
from .http import CallFailure, Transport, ask_until_usable, classify_common, drive, failure_for_status, parse_retry_after
from .response_cache import ResponseCache
from ..failures import UsageError

__all__ = ["OpenAIJudge", "OpenAITransport", "OpenAIWriter"]

API_KEY_VARIABLE = "OPENAI_API_KEY"
NO_KEY = "not-needed"  # the client insists on a key; servers without authentication ignore it
THINK_BLOCK = re.compile(r"<think>(.*?)</think>", re.DOTALL)


def _import_openai():
    return require("openai", needed_for="the openai backend", extra="openai")


def classify_openai(exc: BaseException) -> CallFailure:
    """A failed chat-completions call as a kind; what the openai client does not raise goes to
    http.classify_common."""
    openai = _import_openai()
    if refused_in(exc):  # guard.py's refusal, which the client wraps as a connection error: not retried
        return classify_common(exc)
    if isinstance(exc, openai.APITimeoutError):
        return CallFailure("timeout", "no answer within the per-call timeout", True)
    if isinstance(exc, openai.APIConnectionError):
        return CallFailure("transport", f"{type(exc).__name__}: {exc}", True)
    if isinstance(exc, openai.APIStatusError):
        code = exc.status_code
        message = f"HTTP {code}: {exc.message}"
        return failure_for_status(code, message, parse_retry_after(exc.response.headers.get("retry-after")))
    return classify_common(exc)


class OpenAITransport(Transport):
    """The openai async client plus what http.Transport adds (the client's own retries are off). Options as
    http.Transport's, plus base_url (else OPENAI_BASE_URL) and api_key (else OPENAI_API_KEY)."""

    def __init__(self, *, base_url: str | None = None, api_key: str | None = None, **options):
        openai = _import_openai()
        self._secret = (api_key or os.environ.get(API_KEY_VARIABLE) or NO_KEY).strip()
        hold(self._secret if self._secret != NO_KEY else None)  # an `api_key=` option too must be scrubbed
        super().__init__(**options)
        self.base_url = base_url or os.environ.get("OPENAI_BASE_URL") or None
        hold(*url_credentials(self.base_url))  # a password in it is sent (Basic auth) and may be echoed
        # every answer passes guard.py: no redirect to another host (the key and the images would go along), a
        # size limit on the bytes received
        client_class = openai.DefaultAsyncHttpxClient
        http_client = client_class(transport=capped_transport(http_library(client_class)),
                                   event_hooks=httpx_event_hooks())
        self._client = openai.AsyncOpenAI(api_key=self._secret, base_url=self.base_url, timeout=self.timeout + 5,
                                          max_retries=0, http_client=http_client)
        self._completion_type = openai.types.chat.ChatCompletion

    @staticmethod
    def cache_key(model: str, request: dict) -> str:
        """sha256 of the request (the key is not part of it, so it never reaches a file name)."""
        return ResponseCache.hash({"model": model, **request})

    def forget(self, model: str, request: dict) -> None:
        """Drop an answer that proved unusable, so that `--retry-failed` asks again."""
        if self.cache:
            self.cache.forget(self.cache_key(model, request))

    async def complete(self, model: str, **request):
        """One chat completion (from the cache when this request completed before); APIError(kind) once it cannot
        succeed."""
        key = self.cache_key(model, request) if self.cache else ""
        if key and (text := self.cache.read(key)) is not None:
            try:
                completion = self._completion_type.model_validate_json(text)
                self.cache_hits += 1
                return scrub_model(completion)  # a file written before answers were scrubbed
            except ValueError:  # a torn or foreign file: asked again and replaced
                pass
        # an endpoint may echo the request's headers, the key with them: scrubbed before it is read or cached
        async def create():
            answer = await self._client.chat.completions.create(model=model, **request)
            check_text(strings_in(answer.model_dump(exclude_none=True)))  # guard.py's limit on an answer's text
            return answer

        completion = scrub_model(await self.limited_call(
            model, create, classify_openai, lambda answer: (answer.usage.total_tokens or 0) if answer.usage else 0))
        if key:
            self.cache.put_json(key, completion.model_dump_json())
        return completion

    async def aclose(self) -> None:
        await self._client.close()
        if self.cache:
            self.cache.close()


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
            raise UsageError("the openai backend needs a model name (--openai-model, as the server names it)")
        self.model = model
        self.temperature = temperature
        self.max_reasks = max_reasks
        self.max_tokens = max_tokens
        self.transport = transport or OpenAITransport(**transport_options)

    async def _ask(self, content: list[dict], parse, what: str, response_format: dict | None = None):
        """(parsed, thinking, usage, tries); a bounded number of re-asks when the answer cannot be used
        (http.ask_until_usable; the answers of an ask that ends in an APIError leave the cache, see http.drive)."""
        def text_of(completion) -> str:
            if not completion.choices:
                raise APIError("bad_response", f"{self.model} answered without a choice")
            choice = completion.choices[0]
            if choice.finish_reason == "content_filter" or getattr(choice.message, "refusal", None):
                raise APIError("refused", f"{self.model} refused the {what}: "
                                          f"{(choice.message.refusal or choice.finish_reason)[:200]}")
            return split_thinking(choice.message)[0]

        exchange = ask_until_usable(lambda note: self._request(content, note, response_format), _usage, text_of,
                                    parse, what=what, model=self.model, max_reasks=self.max_reasks)
        parsed, completion, usage, tries = await drive(
            exchange, lambda request: self.transport.complete(self.model, **request),
            lambda request: self.transport.forget(self.model, request))
        return parsed, split_thinking(completion.choices[0].message)[1], usage, tries

    def _request(self, content: list[dict], note: str | None, response_format: dict | None) -> dict:
        request = {"messages": [{"role": "user", "content": content + ([text_part(note)] if note else [])}]}
        if self.temperature is not None:
            request["temperature"] = self.temperature
        if self.max_tokens:
            request["max_tokens"] = self.max_tokens
        if response_format:
            request["response_format"] = response_format
        return request


class OpenAIWriter(_OpenAIBackend, InstructionWriter):
    """Round 1 from the task (and the source image when image_aware); later rounds from the original image and
    every earlier instruction with its verdict (the Gemini writer's prompts)."""

    prompts = WRITER_PROMPTS

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

    prompts = ("judge",)

    def __init__(self, *, structured_output: str = "json_schema", **options):
        super().__init__(**options)
        formats = {"json_schema": VERDICT_FORMAT, "json_object": {"type": "json_object"}, "none": None}
        if structured_output not in formats:
            raise UsageError(f"structured_output must be one of {', '.join(formats)}, not {structured_output!r}")
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
