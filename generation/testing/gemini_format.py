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


_STANDARD_B64 = bytes.maketrans(b"-_", b"+/")


def read_contents(request: dict) -> tuple[list[str], list[bytes]]:
    """The request's texts and inline images, in order; ValueError for inline data that is not base64."""
    texts, images = [], []
    for content in request.get("contents") or []:
        for part in content.get("parts") or []:
            if "text" in part:
                texts.append(part["text"])
            blob = get(part, "inlineData", "inline_data")
            if blob:
                data = blob.get("data", "")
                try:  # the client sends URL-safe base64; one pass maps either alphabet to the standard one
                    images.append(binascii.a2b_base64(data.encode("ascii").translate(_STANDARD_B64)))
                except (binascii.Error, ValueError) as exc:  # UnicodeEncodeError is a ValueError
                    raise ValueError(f"inline data is not base64: {exc}") from None
    return texts, images


def response(parts: list[dict], finish: str, texts: list[str], images: list[bytes]) -> dict:
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
