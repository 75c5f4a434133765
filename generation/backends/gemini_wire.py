"""Gemini requests as REST JSON, made without the SDK's per-call conversions (the sync path's CPU per call).

A task sends its source image in every call (writer, editor and judge, each round), so the base64 text and the
sha256 of inline image bytes are made once per bytes object (`InlineData`) and reused; the body is encoded with
msgspec (the standard library's `json.dumps` of a 1024^2 JPEG's base64 text costs about 0.8 ms). Parts and contents
of the shapes the backends make (text, or inline bytes with a MIME type) are written by hand; any other part goes
through pydantic as before, so both give the same JSON (tests/generation/backends/test_gemini_wire.py).
`DirectPost` sends such a body with the SDK's URL and headers, over lean_http.py where it can.
"""

from __future__ import annotations

import base64
import hashlib
from collections import OrderedDict

import msgspec
from google import genai
from google.genai import errors as genai_errors
from google.genai import types

from .lean_http import LeanHTTP

# Part fields other than text and inline data: when all are None, a part is written by hand.
_OTHER_PART_FIELDS = tuple(name for name in types.Part.model_fields if name not in ("text", "inline_data"))
_OTHER_BLOB_FIELDS = tuple(name for name in types.Blob.model_fields if name not in ("data", "mime_type"))
_OTHER_CONTENT_FIELDS = tuple(name for name in types.Content.model_fields if name not in ("parts", "role"))
_encoder = msgspec.json.Encoder()


class InlineData:
    """The base64 text (URL-safe, as the SDK writes bytes in JSON) and sha256 of inline bytes, made on first use and
    kept for the most recently used bytes objects, up to `max_bytes` of them. Entries are found by identity and hold
    their bytes, so an id is never reused while its entry lives."""

    def __init__(self, max_bytes: int = 64 << 20):
        self.max_bytes = max_bytes
        self._items: OrderedDict[int, list] = OrderedDict()  # id -> [data, base64 text, sha256 hex, JSON string]
        self._held = 0

    def _entry(self, data: bytes) -> list:
        entry = self._items.get(id(data))
        if entry is not None and entry[0] is data:
            self._items.move_to_end(id(data))
            return entry
        entry = [data, None, None, None]
        self._items[id(data)] = entry
        self._made(len(data))
        return entry

    def _made(self, size: int) -> None:
        """Count `size` bytes more held; drop the least recently used entries while over `max_bytes`."""
        self._held += size
        while self._held > self.max_bytes and len(self._items) > 1:
            _, (old, text, _, raw) = self._items.popitem(last=False)
            self._held -= len(old) + len(text or "") + len(raw or b"")

    def base64(self, data: bytes) -> str:
        entry = self._entry(data)
        if entry[1] is None:
            entry[1] = base64.urlsafe_b64encode(data).decode("ascii")
            self._made(len(entry[1]))
        return entry[1]

    def base64_json(self, data: bytes) -> msgspec.Raw:
        """The base64 text as a JSON string that msgspec copies as it is: it holds nothing to escape, and scanning
        the text of a 1024^2 JPEG for characters to escape cost more than the rest of its encoding."""
        entry = self._entry(data)
        if entry[3] is None:
            entry[3] = msgspec.Raw(b'"%s"' % base64.urlsafe_b64encode(data))
            self._made(len(entry[3]))
        return entry[3]

    def sha256(self, data: bytes) -> str:
        entry = self._entry(data)
        if entry[2] is None:
            entry[2] = hashlib.sha256(data).hexdigest()
        return entry[2]


def _simple_blob(part: types.Part) -> types.Blob | None:
    """The part's inline data when the part is text or inline bytes with a MIME type and nothing else (the shapes
    the backends make); None for a text part; False for any other part (written through pydantic)."""
    if any(getattr(part, name) is not None for name in _OTHER_PART_FIELDS):
        return False
    blob = part.inline_data
    if blob is None:
        return None if part.text is not None else False
    if part.text is not None or blob.data is None or blob.mime_type is None:
        return False
    return blob if all(getattr(blob, name) is None for name in _OTHER_BLOB_FIELDS) else False


def rest_part(part: types.Part, inline: InlineData, raw: bool = False) -> dict:
    """A part as REST JSON (camelCase, bytes as base64), as `part.model_dump(mode="json", by_alias=True,
    exclude_none=True)` writes it; with `raw`, base64 as msgspec.Raw (for `encode` only)."""
    blob = _simple_blob(part)
    if blob is None:
        return {"text": part.text}
    if blob is False:
        return part.model_dump(mode="json", by_alias=True, exclude_none=True)
    data = inline.base64_json(blob.data) if raw else inline.base64(blob.data)
    return {"inlineData": {"data": data, "mimeType": blob.mime_type}}


def rest_contents(contents: list[types.Content], inline: InlineData, raw: bool = False) -> list[dict]:
    out = []
    for content in contents:
        if any(getattr(content, name) is not None for name in _OTHER_CONTENT_FIELDS) or content.parts is None:
            out.append(content.model_dump(mode="json", by_alias=True, exclude_none=True))
            continue
        rest = {"parts": [rest_part(part, inline, raw) for part in content.parts]}
        if content.role is not None:
            rest["role"] = content.role
        out.append(rest)
    return out


def part_for_key(part: types.Part, inline: InlineData) -> dict:
    """A part as the request cache's key holds it: snake_case JSON, inline bytes stood in for by their sha256."""
    blob = _simple_blob(part)
    if blob is None:
        return {"text": part.text}
    if blob is False:
        if part.inline_data is not None and part.inline_data.data is not None:
            rest = part.model_dump(mode="json", exclude_none=True, exclude={"inline_data": {"data"}})
            return {**rest, "inline_data_sha256": inline.sha256(part.inline_data.data)}
        return part.model_dump(mode="json", exclude_none=True)
    return {"inline_data": {"mime_type": blob.mime_type}, "inline_data_sha256": inline.sha256(blob.data)}


def encode(body: dict) -> bytes:
    """A request body as JSON bytes."""
    return _encoder.encode(body)


class DirectPost:
    """`await post(path, body) -> str`: a JSON body already encoded, POSTed with the SDK's URL and headers (its base
    URL, API version and key) by lean_http.py, or by the SDK's own async HTTP client where that cannot go (a proxy,
    a mutual-TLS endpoint). Errors are the SDK's (`errors.APIError` with the answer's headers, for Retry-After), so
    both ways are classified alike. `for_client` is None where the SDK lacks what this needs (not documented
    names, so looked up here); then every call takes the SDK's public method."""

    def __init__(self, api, build, send):
        self._api, self._build, self._send = api, build, send
        self.lean = LeanHTTP()

    @classmethod
    def for_client(cls, client: genai.Client) -> DirectPost | None:
        api = getattr(client.aio, "_api_client", None)
        build, send = getattr(api, "_build_request", None), getattr(api, "_async_request", None)
        if build is None or send is None:
            return None
        # Without retry options of its own, the SDK's retry wrapper never retries (ours does): one attempt direct.
        once = getattr(api, "_async_request_once", None)
        if once is not None and getattr(getattr(api, "_http_options", None), "retry_options", True) is None:
            send = lambda http_request, http_options, stream: once(http_request, stream)  # noqa: E731
        return cls(api, build, send)

    def lean_can_send(self, url: str) -> bool:
        to_mtls = getattr(self._api, "_httpx_url", None)  # a client certificate's endpoint: the SDK's to send
        return self.lean.usable(url) and (to_mtls is None or to_mtls(url, is_async=True) == url)

    async def __call__(self, path: str, body: bytes) -> str:
        request = self._build("post", path, {}, None)
        if not self.lean_can_send(request.url):
            request.data = body
            response = await self._send(http_request=request, http_options=None, stream=False)
            return (response.response_stream[0] if response.response_stream else "") or ""
        status, headers, data = await self.lean.post(request.url, request.headers, body)
        if status != 200:
            try:
                details = msgspec.json.decode(data)
            except (msgspec.DecodeError, UnicodeDecodeError):
                details = {"message": data.decode("utf-8", "replace"), "status": f"HTTP {status}"}
            genai_errors.APIError.raise_error(status, details, _Answer(headers))
        return data.decode("utf-8")

    def close(self) -> None:
        self.lean.close()


class _Answer:
    """What `errors.APIError.response` is read for here: the answer's headers (lower-case names)."""

    def __init__(self, headers: dict[str, str]):
        self.headers = headers
