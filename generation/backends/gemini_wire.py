"""Gemini requests as REST JSON and as request-cache keys, made without pydantic's per-call dumps.

A task sends its source image in every call (writer, editor and judge, each round), so the sha256 of inline image
bytes (the request cache's key stands in for them with it) and their base64 text (a batch file's request line) are
made once per bytes object (`InlineData`) and reused; batch lines are encoded with msgspec. Parts and contents of
the shapes the backends make (text, or inline bytes with a MIME type) are written by hand; any other part goes
through pydantic, so both give the same JSON as the SDK sends (tests/generation/backends/test_gemini_wire.py).
Sync calls do not use these bodies: they go through the SDK's public `generate_content` (gemini_transport.py).
"""

from __future__ import annotations

import base64
import hashlib
from collections import OrderedDict

import msgspec
from google.genai import types

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
        self._items: OrderedDict[int, list] = OrderedDict()  # id -> [data, base64 text, sha256 hex]
        self._held = 0

    def _entry(self, data: bytes) -> list:
        entry = self._items.get(id(data))
        if entry is not None and entry[0] is data:
            self._items.move_to_end(id(data))
            return entry
        entry = [data, None, None]
        self._items[id(data)] = entry
        self._made(len(data))
        return entry

    def _made(self, size: int) -> None:
        """Count `size` bytes more held; drop the least recently used entries while over `max_bytes`."""
        self._held += size
        while self._held > self.max_bytes and len(self._items) > 1:
            _, (old, text, _) = self._items.popitem(last=False)
            self._held -= len(old) + len(text or "")

    def base64(self, data: bytes) -> str:
        entry = self._entry(data)
        if entry[1] is None:
            entry[1] = base64.urlsafe_b64encode(data).decode("ascii")
            self._made(len(entry[1]))
        return entry[1]

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


def rest_part(part: types.Part, inline: InlineData) -> dict:
    """A part as REST JSON (camelCase, bytes as base64), as `part.model_dump(mode="json", by_alias=True,
    exclude_none=True)` writes it."""
    blob = _simple_blob(part)
    if blob is None:
        return {"text": part.text}
    if blob is False:
        return part.model_dump(mode="json", by_alias=True, exclude_none=True)
    return {"inlineData": {"data": inline.base64(blob.data), "mimeType": blob.mime_type}}


def rest_contents(contents: list[types.Content], inline: InlineData) -> list[dict]:
    out = []
    for content in contents:
        if any(getattr(content, name) is not None for name in _OTHER_CONTENT_FIELDS) or content.parts is None:
            out.append(content.model_dump(mode="json", by_alias=True, exclude_none=True))
            continue
        rest = {"parts": [rest_part(part, inline) for part in content.parts]}
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
