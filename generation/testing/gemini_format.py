"""The Gemini REST API's JSON as the fake Gemini (fake_gemini.py) reads and writes it: the parts of a
generateContent request, the role its generation config implies, the response with its usage metadata, and the
error body. Its batch jobs (fake_batches.py) reach these through `FakeGemini.error` and `FakeGemini.role_of`.
"""

from __future__ import annotations

import binascii

STATUS = {429: "RESOURCE_EXHAUSTED", 400: "INVALID_ARGUMENT", 500: "INTERNAL", 503: "UNAVAILABLE",
          404: "NOT_FOUND", 504: "DEADLINE_EXCEEDED"}


def get(obj: dict, *keys):
    """The first present key: the client mixes camelCase and snake_case (inlineData.mime_type)."""
    return next((obj[k] for k in keys if k in obj), None)


def role_of(config: dict) -> str:
    """The role a generation config asks for: image output -> editor, JSON output -> judge, otherwise writer."""
    if "IMAGE" in [m.upper() for m in get(config, "responseModalities", "response_modalities") or []]:
        return "editor"
    if get(config, "responseMimeType", "response_mime_type") == "application/json":
        return "judge"
    return "writer"


def is_score_request(request: dict) -> bool:
    """Whether the request carries the scoring prompt (its answer fields are named in it)."""
    return any("editing_accuracy" in part.get("text", "") for content in request.get("contents") or []
               for part in content.get("parts") or [])


def count_images(request: dict) -> int:
    return sum(1 for content in request.get("contents") or [] for part in content.get("parts") or []
               if get(part, "inlineData", "inline_data"))


_LETTERS = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/="
# a bytes.translate table: the URL-safe letters to the standard ones, a byte of neither alphabet to "=", then found
# before the padding
_STANDARD_B64 = bytes(c if c in _LETTERS else {ord("-"): ord("+"), ord("_"): ord("/")}.get(c, ord("="))
                      for c in range(256))


class InlineImage:
    """An inline image of a request: its base64 text (URL-safe from google-genai, standard from plain REST
    clients), decoded the first time `data` is asked for. Decoding a 1024^2 JPEG costs about a millisecond, and the
    echo engine answers without the bytes. The text's shape (ASCII, padded to a multiple of four) is checked when
    read, its letters when it is decoded or sent back (`standard_base64`): each a ValueError, a 400 answer."""

    __slots__ = ("_data", "mime_type", "text")

    def __init__(self, text: str, mime_type: str = "image/jpeg"):
        if not isinstance(text, str) or not text.isascii() or len(text) % 4 or text.endswith("==="):
            raise ValueError("inline data is not base64: not ASCII, or not padded to a multiple of 4")
        self.mime_type, self.text = mime_type, text  # the text as sent
        self._data: bytes | None = None

    @property
    def base64(self) -> bytes:
        """The text as sent, as ASCII bytes."""
        return self.text.encode("ascii")

    @property
    def data(self) -> bytes:
        if self._data is None:
            self._data = binascii.a2b_base64(self._standard(), strict_mode=True)
        return self._data

    def standard_base64(self) -> str:
        """The text in the standard alphabet, as the API answers with images; ValueError for a letter of neither
        alphabet."""
        return self._standard().decode("ascii")

    def _standard(self) -> bytes:
        standard = self.base64.translate(_STANDARD_B64)
        padding = 2 if self.text.endswith("==") else 1 if self.text.endswith("=") else 0
        if standard.find(b"=", 0, len(standard) - padding) >= 0:
            raise ValueError("inline data is not base64: a letter outside the alphabet, or '=' before the end")
        return standard


def read_contents(request: dict) -> tuple[list[str], list[InlineImage]]:
    """The request's texts and inline images, in order; ValueError for inline data that is not base64."""
    texts, images = [], []
    for content in request.get("contents") or []:
        for part in content.get("parts") or []:
            if "text" in part:
                texts.append(part["text"])
            blob = get(part, "inlineData", "inline_data")
            if blob:
                images.append(InlineImage(blob.get("data", ""), get(blob, "mimeType", "mime_type") or "image/jpeg"))
    return texts, images


def response(parts: list[dict], finish: str, texts: list[str], images: list) -> dict:
    """A generateContent response of one candidate, with token counts estimated from the sizes."""
    prompt_tokens = sum(len(t) for t in texts) // 4 + 258 * len(images)
    out = [p for p in parts if not p.get("thought")]
    thought = [p for p in parts if p.get("thought")]
    usage = {"promptTokenCount": prompt_tokens,
             "candidatesTokenCount": sum(len(p.get("text", "")) // 4 + (1290 if "inlineData" in p else 0) for p in out),
             "thoughtsTokenCount": sum(len(p["text"]) // 4 for p in thought)}
    usage["totalTokenCount"] = sum(usage.values())
    candidate = {"content": {"role": "model", "parts": parts}, "finishReason": finish, "index": 0}
    return {"candidates": [candidate], "usageMetadata": usage, "modelVersion": "fake-gemini"}


def with_new_fields(answer: dict) -> dict:
    """`answer` as a newer API version might send it: unknown fields at the top, in a candidate, in a part, in the
    usage metadata (a client that refuses unknown fields breaks the day the API adds one)."""
    candidate = answer["candidates"][0]
    return {**answer, "futureSurface": {"name": "standard"},
            "candidates": [{**candidate, "futureCandidateNote": {"sources": []},
                            "content": {**candidate["content"],
                                        "parts": [{**part, "futurePartNote": {"n": i}}
                                                  for i, part in enumerate(candidate["content"]["parts"])]}}],
            "usageMetadata": {**answer["usageMetadata"], "futureTokenCount": 0}}


def error(code: int, message: str) -> tuple[int, dict]:
    """(HTTP status, body) of an API error."""
    return code, {"error": {"code": code, "message": message, "status": STATUS.get(code, "UNKNOWN")}}
