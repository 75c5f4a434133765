"""Calls to the Gemini API (or Vertex AI): the google-genai client, its errors' classification and its request cache.

One `GeminiTransport.generate()` call is one logical request: it is answered from the cache when an identical
request already completed, otherwise sent through the google-genai async client's public `generate_content` (made
by gemini_client.py) with what http.Transport adds
(a per-model rate limit owned by the transport, a per-call timeout, and bounded retries with back-off and jitter,
Retry-After honoured, on 408/429/5xx, timeouts and transport errors). What cannot be retried raises
`backends.APIError` with a kind. The API key never appears in a message or in anything written: answers are
scrubbed (secrets.py) before they are parsed for use or cached, so an endpoint that echoes the request's headers
leaves no key behind.

The Batch API (used by `batch.py`) goes through the same client: `create_batch` sends requests inline or, over
the inline limit, as an uploaded JSONL file; `get_batch` polls; `batch_results` reads what a finished job returned.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from google import genai
from google.auth import exceptions as auth_errors
from google.genai import errors as genai_errors
from google.genai import types
from pydantic import ValidationError

from .gemini_client import Clients, VertexTarget, client_options, environment_routes_requests, resolve_api_key
from .gemini_wire import InlineData, encode, part_for_key, rest_contents
from .guard import MAX_ANSWER_BYTES, AnswerRefused, check_text, strings_in
from .http import CallFailure, RateLimiter, Transport, classify_common, failure_for_status, parse_retry_after
from .response_cache import ResponseCache
from ..files import open_owned
from ..secrets import all_clean, hold, holds_secret, scrub, scrub_model, url_credentials

def parse_response(body: str | dict) -> types.GenerateContentResponse:
    """A generateContent answer (its JSON text, or as `json.loads` made it) as the SDK's type.

    The SDK's types forbid fields they do not know, so the day the API adds one every answer would fail to parse
    (and be retried as a bad response). Fields the installed SDK does not know are dropped instead, where pydantic
    names them; any other validation error stands."""
    return _parse(body)[0]


def _parse(body: str | dict) -> tuple[types.GenerateContentResponse, bool]:
    """(parse_response's answer, whether fields it does not know were dropped)."""
    try:
        if isinstance(body, dict):
            return types.GenerateContentResponse.model_validate(body), False
        return types.GenerateContentResponse.model_validate_json(body), False
    except ValidationError as exc:
        unknown = [error["loc"] for error in exc.errors() if error["type"] == "extra_forbidden"]
        if not unknown or len(unknown) < len(exc.errors()):
            raise
    data = json.loads(body) if isinstance(body, str) else json.loads(json.dumps(body))
    for loc in unknown:
        parent = data
        for step in loc[:-1]:
            parent = parent[step]
        parent.pop(loc[-1], None)
    return types.GenerateContentResponse.model_validate(data), True


def answer_texts(response: types.GenerateContentResponse) -> list[str]:
    """Every string an answer holds (text and thought parts, finish messages, model version, ids, function call
    arguments, ...); image bytes and thought signatures are bytes, not text, and are not among them."""
    return strings_in(response.model_dump(exclude_none=True, exclude={"sdk_http_response"}))


class RequestCache(ResponseCache):
    """Gemini answers by request (model, contents, config), kept as the JSON the API sent."""

    @staticmethod
    def key(model: str, contents: list[types.Content], config: types.GenerateContentConfig,
            inline: InlineData | None = None) -> str:
        """sha256 of the payload, inline data stood in for by its own sha256 (made once per bytes object by
        `inline`, the transport's): far cheaper than base64 and JSON of the bytes on every call."""
        inline = inline or InlineData()
        return ResponseCache.hash({"model": model, "contents": [_content_for_key(c, inline) for c in contents],
                                   "config": config.model_dump(mode="json", exclude_none=True)})

    def get(self, key: str) -> types.GenerateContentResponse | None:
        text = self.read(key)
        try:
            return None if text is None else parse_response(text)
        except ValueError:  # a torn or foreign file: ignore it, the call is made again and the file replaced
            return None

    def put(self, key: str, response: types.GenerateContentResponse) -> None:
        body = response.model_dump_json(exclude_none=True, exclude={"sdk_http_response"})
        self.put_json(key, scrub_response(response, body)[1])


def scrub_response(response: types.GenerateContentResponse, body: str,
                   texts: list[str] | None = None) -> tuple[types.GenerateContentResponse, str]:
    """The answer and its JSON body without secrets (an endpoint may echo the request's headers into any field).
    Bodies are large and nearly always clean: a substring search of the body and a scrub of every string field
    (`texts`: answer_texts(response), when already made) decide; a dirty answer is scrubbed field by field and
    re-serialised (image bytes are not text, and are left alone)."""
    texts = answer_texts(response) if texts is None else texts
    if not holds_secret(body) and all_clean(texts):
        return response, body
    clean = scrub_model(response, exclude_none=True, exclude={"sdk_http_response"})
    return clean, clean.model_dump_json(exclude_none=True, exclude={"sdk_http_response"})


def _content_for_key(content: types.Content, inline: InlineData) -> dict:
    return {"role": content.role, "parts": [part_for_key(part, inline) for part in content.parts or []]}


def _retry_info_delay(details) -> float | None:
    """Gemini puts its wait in the error body: details[{"@type": ...RetryInfo, "retryDelay": "37s"}]."""
    try:
        items = details.get("error", details).get("details", [])
    except AttributeError:
        return None
    for item in items if isinstance(items, list) else []:
        delay = item.get("retryDelay") if isinstance(item, dict) else None
        if isinstance(delay, str) and re.fullmatch(r"\d+(\.\d+)?s", delay):
            return float(delay[:-1])
    return None


def classify(exc: BaseException) -> CallFailure:
    """Map an exception from one call to a kind; unknown exceptions are programming errors and re-raised."""
    if isinstance(exc, genai_errors.APIError):
        code = exc.code or 0
        message = f"HTTP {code} {exc.status or ''}: {exc.message or exc.details}"
        headers = getattr(getattr(exc, "response", None), "headers", None) or {}
        retry_after = parse_retry_after(headers.get("retry-after")) if hasattr(headers, "get") else None
        if retry_after is None:
            retry_after = _retry_info_delay(exc.details)
        return failure_for_status(code, message, retry_after)
    if isinstance(exc, auth_errors.TransportError):  # fetching a Vertex AI access token met network trouble
        return CallFailure("transport", f"{type(exc).__name__}: {exc}", True)
    if isinstance(exc, auth_errors.GoogleAuthError):  # no credentials, or refused ones: asking again will not help
        return CallFailure("unauthenticated", f"{type(exc).__name__}: {exc}", False)
    return classify_common(exc)


INLINE_LIMIT = 19_000_000  # bytes; the API takes inline batches up to 20 MB
TRANSFER_TIMEOUT = 900.0  # seconds for uploading or downloading a batch file
# GenerateContentConfig fields that the REST API reads from generationConfig; others live elsewhere in a request.
GENERATION_CONFIG_FIELDS = {
    "temperature", "topP", "topK", "candidateCount", "maxOutputTokens", "stopSequences", "responseLogprobs",
    "logprobs", "presencePenalty", "frequencyPenalty", "seed", "responseMimeType", "responseSchema",
    "responseJsonSchema", "responseModalities", "mediaResolution", "speechConfig", "thinkingConfig", "imageConfig"}


@dataclass(frozen=True)
class Request:
    """One generateContent call, as the sync path sends it and the batch path collects it into a job."""

    model: str
    contents: list[types.Content]
    config: types.GenerateContentConfig


def rest_request(request: Request, inline: InlineData | None = None) -> dict:
    """The REST JSON body of a generateContent request (a batch JSONL line's "request"), as the SDK sends it;
    inline bytes as base64 made once per bytes object by `inline` (gemini_wire)."""
    config = request.config.model_dump(mode="json", by_alias=True, exclude_none=True)
    if unsupported := sorted(set(config) - GENERATION_CONFIG_FIELDS):
        raise ValueError(f"batch requests carry generationConfig fields only, not {', '.join(unsupported)}")
    body = {"contents": rest_contents(request.contents, inline or InlineData())}
    if config:
        body["generationConfig"] = config
    return body


def request_size(request: Request) -> int:
    """About the bytes a request takes in a batch (inline data as base64)."""
    size = 0
    for content in request.contents:
        for part in content.parts or []:
            size += len(part.text or "") + (len(part.inline_data.data or b"") * 4 // 3 if part.inline_data else 0)
    return size + 500


BatchItem = types.GenerateContentResponse | CallFailure  # what a batch job returned for one request


def item_failure(error: dict) -> CallFailure:
    """A per-request error of a batch job ({"code", "message", "status"}), classified like an HTTP error."""
    code = int(error.get("code") or 500)
    return classify(genai_errors.APIError(code, {"error": {**error, "code": code}}))


def _total_tokens(response: types.GenerateContentResponse) -> int:
    return (response.usage_metadata.total_token_count or 0) if response.usage_metadata is not None else 0


class ResultsFile:
    """The (key, response or CallFailure) items of a downloaded results file, read a line at a time. A results file
    can be gigabytes and is of no use once read (its answers are in the request cache then): it is removed when
    reading ends, whether it reached the end, raised, or was closed early (close(), or `contextlib.closing`)."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self._items = self._read()

    def _read(self) -> Iterator[tuple[str, BatchItem]]:
        with open(self.path, encoding="utf-8") as fh:
            while line := fh.readline(MAX_ANSWER_BYTES + 1):
                if len(line) > MAX_ANSWER_BYTES:  # an answer over the limit: skipped unread (its request is
                    while not line.endswith("\n") and line:  # then missing from the results, and asked again)
                        line = fh.readline(MAX_ANSWER_BYTES)
                    continue
                if not line.strip():
                    continue
                item = json.loads(line)
                error = item.get("error") or item.get("status")
                if error:
                    yield str(item.get("key", "")), item_failure(error)
                    continue
                response = parse_response(item.get("response"))
                try:
                    check_text(answer_texts(response))
                except AnswerRefused as exc:
                    yield str(item.get("key", "")), CallFailure(exc.kind, str(exc), False)
                    continue
                yield str(item.get("key", "")), response

    def __iter__(self) -> ResultsFile:
        return self

    def __next__(self) -> tuple[str, BatchItem]:
        try:
            return next(self._items)
        except BaseException:  # the end (StopIteration), a line that does not parse, or Ctrl-C
            self.close()
            raise

    def close(self) -> None:
        self._items.close()
        self.path.unlink(missing_ok=True)


class GeminiTransport(Transport):
    """The google-genai async client plus everything around a call (http.Transport: timeout, retries, limits per
    model, the request cache). One instance may serve several backends; options as http.Transport's, plus api_key,
    base_url and `vertex` (a VertexTarget: Vertex AI instead of the Gemini API, through the same client)."""

    cache_type = RequestCache

    def __init__(self, *, api_key: str | None = None, base_url: str | None = None,
                 vertex: VertexTarget | None = None, **options):
        vertex = vertex if vertex is not None else VertexTarget.from_environment()
        vertex = vertex.signed_in() if vertex is not None else None
        self._secret = resolve_api_key(api_key, required=vertex is None)  # Vertex AI: client_options decides
        hold(self._secret, *url_credentials(base_url))  # not in the environment: scrub must know them
        super().__init__(secrets=tuple(filter(None, (self._secret,))), **options)
        self._clients = Clients(client_options(self._secret, base_url, vertex, self.timeout),
                                plain=vertex is None and not environment_routes_requests())
        self.inline = InlineData()  # sha256 of the images in flight (the cache key), made once each
        self.vertex = vertex
        self._token = None  # the Vertex AI access token last held
        self._hold_token()

    async def _genai(self) -> genai.Client:
        return await self._clients.client()

    def _hold_token(self) -> None:
        """Hold the credentials' current access token as a secret: the SDK fetches a new one (refresh) inside a
        call, and an endpoint may echo it back without the `Authorization:` that scrub recognises."""
        token = getattr(self.vertex.credentials, "token", None) if self.vertex is not None else None
        if token and token != self._token:
            hold(token)
            self._token = token

    async def call(self, what: str, make_call, *, timeout: float | None = None, limiter: RateLimiter | None = None):
        """`await make_call()` with retries (http.Transport.call_with_retries), google-genai's errors classified."""
        return await self.call_with_retries(what, make_call, classify, timeout=timeout, limiter=limiter)

    async def generate(self, model: str, contents: list[types.Content],
                       config: types.GenerateContentConfig) -> types.GenerateContentResponse:
        """One request, from the cache when it already completed once; raises APIError(kind, message)."""
        key = self.cache.key(model, contents, config, self.inline) if self.cache else ""
        if self.cache and (cached := self.cache.get(key)) is not None:
            self.cache_hits += 1
            return cached
        # The HTTP body as it came: parsed once here, and the cache stores that text as is (the SDK's conversion of
        # the answer plus re-serialising it for the cache cost ~15 % of throughput at 100 calls/s). Written here,
        # not by a worker thread: handing a write of this size to a thread costs the process more CPU than the write.
        response, body = await self.limited_call(model, lambda: self._answer(model, contents, config), classify,
                                                 lambda answer: _total_tokens(answer[0]))
        if self.cache:
            self.cache.put_json(key, body)
        return response

    async def _answer(self, model: str, contents: list[types.Content],
                      config: types.GenerateContentConfig) -> tuple[types.GenerateContentResponse, str]:
        """One generateContent call through the SDK's public method: the parsed answer and its body, both scrubbed
        (a body that does not parse is retried). `should_return_http_response` (a public config field) hands back
        the HTTP body unconverted, which is parsed once here and cached as it came."""
        config = config.model_copy(update={"should_return_http_response": True})
        try:
            client = await self._genai()
            answer = await client.aio.models.generate_content(model=model, contents=contents, config=config)
        finally:  # before anything scrubs the answer or the error: it may quote a token fetched for this call
            self._hold_token()
        body = (answer.sdk_http_response.body if answer.sdk_http_response else None) or ""
        body = scrub(body) if holds_secret(body) else body  # first: a parse error quotes the body, cut short
        response, dropped = _parse(body)
        if dropped:  # fields this SDK does not know are not kept in the cache either (nor anything in them)
            body = response.model_dump_json(exclude_none=True, exclude={"sdk_http_response"})
        texts = answer_texts(response)
        check_text(texts)  # an answer of 300 MB of text never becomes an instruction (guard.py)
        return scrub_response(response, body, texts)

    def forget(self, model: str, contents: list[types.Content], config: types.GenerateContentConfig) -> None:
        """Drop a completed request's answer from the cache (it proved unusable), so it is asked again."""
        if self.cache:
            self.cache.forget(self.cache.key(model, contents, config, self.inline))

    async def aopen(self) -> None:
        """Make the client of the running event loop now rather than at its first call (optional)."""
        await self._genai()

    async def aclose(self) -> None:
        """Close the client's connection pools (call once at the end of a run, inside its event loop)."""
        await self._clients.aclose()
        if self.cache:
            self.cache.close()

    # ------------------------------------------------------------ the Batch API

    async def create_batch(self, model: str, items: list[tuple[str, Request]], *, display_name: str,
                           work_dir: Path, inline_limit: int = INLINE_LIMIT) -> str:
        """Submit one batch job of keyed requests (the key comes back with each result); returns the job's name.

        Up to `inline_limit` bytes the requests go inline; above it as a JSONL file of {"key", "request"} lines
        through the Files API (the file is written under `work_dir` and removed once uploaded).
        """
        if sum(request_size(r) for _, r in items) <= inline_limit:
            src = [types.InlinedRequest(contents=r.contents, config=r.config, metadata={"key": k}) for k, r in items]
        else:
            path = Path(work_dir) / f"{display_name}.jsonl"
            path.parent.mkdir(parents=True, exist_ok=True)
            with os.fdopen(open_owned(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), "wb") as fh:  # no link, no FIFO
                for key, request in items:
                    fh.write(encode({"key": key, "request": rest_request(request, self.inline)}) + b"\n")
            upload = types.UploadFileConfig(mime_type="jsonl", display_name=display_name)
            client = await self._genai()
            uploaded = await self.call(f"upload of {path.name}", lambda: client.aio.files.upload(
                file=path, config=upload), timeout=max(self.timeout, TRANSFER_TIMEOUT))
            path.unlink()
            src = uploaded.name
        client = await self._genai()
        job = await self.call(f"{model} batch", lambda: client.aio.batches.create(
            model=model, src=src, config=types.CreateBatchJobConfig(display_name=display_name)))
        return job.name

    async def get_batch(self, name: str) -> types.BatchJob:
        client = await self._genai()
        return await self.call(name, lambda: client.aio.batches.get(name=name))

    async def batch_results(self, job: types.BatchJob, work_dir: Path) -> Iterator[tuple[str, BatchItem]]:
        """(key, response or CallFailure) for each request of a succeeded job; a results file is downloaded
        under `work_dir` and read line by line (a ResultsFile: removed when reading ends; close it if you stop
        early). A download that fails or is interrupted leaves no partial file behind."""
        dest = job.dest
        if dest is not None and dest.inlined_responses is not None:
            return ((str((item.metadata or {}).get("key", "")),
                     item.response if item.error is None else item_failure(item.error.model_dump(exclude_none=True)))
                    for item in dest.inlined_responses)
        if dest is None or not dest.file_name:
            raise self.error(CallFailure("bad_response", f"{job.name} succeeded without results", False), job.name)
        path = Path(work_dir) / f"{job.name.replace('/', '-')}.results.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        client = await self._genai()
        try:
            await self.call(f"download of {dest.file_name}", lambda: client.aio.files.download(
                file=dest.file_name, destination=path), timeout=max(self.timeout, TRANSFER_TIMEOUT))
        except BaseException:  # an APIError, or a cancelled run (Ctrl-C) mid-download
            path.unlink(missing_ok=True)
            raise
        return ResultsFile(path)

