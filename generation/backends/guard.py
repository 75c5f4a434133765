"""What every API answer must pass before it is read: no redirect to another host, and a size limit.

* Redirects: a 3xx whose Location is on another origin (scheme, host or port) is refused, never followed: the
  client would re-send the request's credential (the Gemini `x-goog-api-key`, a Vertex AI bearer token, an OpenAI
  key) and, for a 307/308, its body (the source scan) to a host the user did not name. Redirects within the same
  origin are followed as the HTTP stack does. Gemini's aiohttp transport gets `aiohttp_middlewares()` through the
  SDK's public `HttpOptions(async_client_args=...)`; httpx clients (the openai backend, and google-genai without
  aiohttp) get `httpx_event_hooks()` and, for the size, `CappedTransport`.
* Size: an answer of more than MAX_ANSWER_BYTES bytes (a declared Content-Length is refused before the body is
  read; a streamed body is cut as soon as it passes the limit) or whose text fields hold more than
  MAX_ANSWER_TEXT characters together is refused. Either is `AnswerRefused`, a permanent failure of that call
  (kinds REDIRECT and TOO_LARGE): the task ends `api_failed` with the kind, and nothing of the answer is kept.
"""

from __future__ import annotations

from typing import Iterable
from urllib.parse import urljoin, urlsplit

MAX_ANSWER_BYTES = 64 * 1024 * 1024  # an edited image of 4096² as PNG in base64 stays well below this
MAX_ANSWER_TEXT = 200_000  # characters of text in one answer (instruction, thoughts, verdict, messages together)
REDIRECT, TOO_LARGE = "redirect_refused", "answer_too_large"
_REDIRECTS = (301, 302, 303, 307, 308)


class AnswerRefused(Exception):
    """An answer that is not read: `kind` REDIRECT or TOO_LARGE, and why."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


def refused_in(exc: BaseException | None) -> AnswerRefused | None:
    """The AnswerRefused that `exc` is or wraps (a client library may wrap what a transport hook raised)."""
    seen = 0
    while exc is not None and seen < 8:
        if isinstance(exc, AnswerRefused):
            return exc
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return None


def _origin(url: str) -> tuple[str, str, int | None]:
    parts = urlsplit(url)
    default = {"https": 443, "http": 80}.get(parts.scheme)
    return parts.scheme, (parts.hostname or "").lower(), parts.port or default


def check_redirect(status: int, url: str, location: str | None) -> None:
    """AnswerRefused when an answer of `status` to a request for `url` redirects to another origin."""
    if status in _REDIRECTS and location:
        target = urljoin(url, location)
        if _origin(target) != _origin(url):
            raise AnswerRefused(REDIRECT, f"HTTP {status} redirect from {_origin(url)[1]} to another host "
                                          f"({_origin(target)[1] or 'unknown'}): not followed, so that neither the "
                                          "credential nor the request body goes there")


def check_length(content_length: str | None, limit: int = MAX_ANSWER_BYTES) -> None:
    """AnswerRefused when a declared Content-Length passes `limit`."""
    try:
        declared = int(content_length) if content_length else None
    except ValueError:
        declared = None
    if declared is not None and declared > limit:
        raise AnswerRefused(TOO_LARGE, f"the answer declares {declared:,} bytes, over the {limit:,}-byte limit")


def check_text(texts: Iterable[str], limit: int = MAX_ANSWER_TEXT) -> None:
    """AnswerRefused when the answer's text fields hold more than `limit` characters together."""
    total = sum(len(t) for t in texts)
    if total > limit:
        raise AnswerRefused(TOO_LARGE, f"the answer holds {total:,} characters of text, over the {limit:,} limit")


def strings_in(value) -> list[str]:
    """Every string in a JSON-like value (dicts, lists, strings; keys too); bytes and numbers are not text."""
    found: list[str] = []
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            found.append(item)
        elif isinstance(item, dict):
            stack += [*item.keys(), *item.values()]
        elif isinstance(item, (list, tuple)):
            stack += item
    return found


def too_many_bytes(limit: int) -> AnswerRefused:
    return AnswerRefused(TOO_LARGE, f"the answer passed the {limit:,}-byte limit; the rest was not read")


# ---------------------------------------------------------------- aiohttp (google-genai's async transport)

class _CappedStream:
    """An aiohttp StreamReader whose `read()` stops with AnswerTooLarge past the limit; the rest as it is."""

    def __init__(self, inner, limit: int):
        self._inner, self._limit = inner, limit

    async def read(self, n: int = -1) -> bytes:
        if n >= 0:
            return await self._inner.read(n)
        chunks, total = [], 0
        while chunk := await self._inner.readany():
            total += len(chunk)
            if total > self._limit:
                raise too_many_bytes(self._limit)
            chunks.append(chunk)
        return b"".join(chunks)

    def __getattr__(self, name: str):
        return getattr(self._inner, name)


def aiohttp_middlewares(limit: int = MAX_ANSWER_BYTES) -> tuple:
    """aiohttp client middlewares (a request argument since aiohttp 3.12): each hop's answer is checked before
    aiohttp follows a redirect or anyone reads the body. File downloads (`...:download`, written to disk in chunks
    and read line by line) keep no size limit here."""
    async def guard(request, handler):
        response = await handler(request)
        try:
            check_redirect(response.status, str(response.url), response.headers.get("Location"))
            if not request.url.path.endswith(":download"):
                check_length(response.headers.get("Content-Length"), limit)
                response.content = _CappedStream(response.content, limit)
        except AnswerRefused:
            response.close()
            raise
        return response

    return (guard,)


# ---------------------------------------------------------------- httpx (the openai client)

def httpx_event_hooks() -> dict:
    """httpx `event_hooks` for an async client: every hop's answer is checked before httpx follows a redirect."""
    async def response_hook(response) -> None:
        try:
            check_redirect(response.status_code, str(response.request.url), response.headers.get("location"))
        except AnswerRefused:
            await response.aclose()
            raise

    return {"response": [response_hook]}


def http_library(client_class: type):
    """The httpx-like module (httpx or httpx2) a client class is built on, from its bases."""
    import importlib

    for cls in client_class.__mro__:
        root = (cls.__module__ or "").split(".")[0]
        if root in ("httpx", "httpx2"):
            return importlib.import_module(root)
    raise TypeError(f"{client_class.__name__} is no httpx client")


def capped_transport(httpx, limit: int = MAX_ANSWER_BYTES):
    """An async transport of `httpx` (the module: httpx or httpx2, http_library) wrapping its own, whose answers
    stop at `limit` bytes as received."""

    class CappedBody(httpx.AsyncByteStream):
        def __init__(self, inner):
            self._inner = inner

        async def __aiter__(self):
            total = 0
            async for chunk in self._inner:
                total += len(chunk)
                if total > limit:
                    raise too_many_bytes(limit)
                yield chunk

        async def aclose(self) -> None:
            await self._inner.aclose()

    class CappedTransport(httpx.AsyncBaseTransport):
        def __init__(self):
            # the connection limits the openai client sets for its own transport
            self._inner = httpx.AsyncHTTPTransport(limits=httpx.Limits(max_connections=1000,
                                                                       max_keepalive_connections=100))

        async def handle_async_request(self, request):
            response = await self._inner.handle_async_request(request)
            try:
                check_length(response.headers.get("content-length"), limit)
            except AnswerRefused:
                await response.aclose()
                raise
            return httpx.Response(response.status_code, headers=response.headers, stream=CappedBody(response.stream),
                                  extensions=response.extensions)

        async def aclose(self) -> None:
            await self._inner.aclose()

    return CappedTransport()
