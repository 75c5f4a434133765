"""One scrubber for every text medbanana writes or prints that can carry an endpoint's answer or error.

An endpoint (or a proxy in front of it) may echo the request's headers, the API key with them, into a 200 answer,
an error body or a refusal's text. Those texts end up in records, the journal, the request caches, the JSON files
and the dataset's parquet, so each is passed through `scrub` where it is created or cached: the values of the
secrets this process holds (API keys and the HF token, from their variables or handed to `hold`) and anything in
a header form (`Authorization: Bearer ...`, `x-goog-api-key: ...`, `?key=...`, `hf_...`) become `[redacted]`.
"""

from __future__ import annotations

import os
import re

MARK = "[redacted]"
SECRET_VARIABLES = ("GEMINI_API_KEY", "GOOGLE_API_KEY", "OPENAI_API_KEY", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN")
# Shorter values are not keys (local servers take "x" or "not-needed"): replacing them would blank ordinary words.
MIN_LENGTH = 8
NOT_SECRETS = {"not-needed"}

_held: set[str] = set()  # values handed over as options or read from a token file, not from the variables

# a value stops before a quote or backslash, so that scrubbed JSON text stays JSON; a scrubbed value is kept whole
_VALUE = r"(?:\[redacted\]|[^\s\"',;&<>(){}\[\]\\]+)"
_PATTERNS = (
    # a header echoed as HTTP text, JSON (escaped or not) or a Python dict: the name stays, the value goes
    re.compile(r"(?i)(\b(?:proxy-)?authorization|\bx-goog-api-key|\bx-api-key|\bapi-key)"
               r"((?:\\?[\"'])?\s*[:=]\s*(?:\\?[\"'])?)(?:(?:bearer|basic|token)\s+)?" + _VALUE),
    # a key in a URL's query
    re.compile(r"(?i)([?&](?:key|api_key|apikey|access_token|token))(=)[^&\s\"'#<>\\]+"),
)
# Token shapes, whoever they belong to; the look-arounds keep them off runs of base64 (an image's bytes).
_TOKENS = re.compile(r"(?<![A-Za-z0-9+/=_-])(?:hf_[A-Za-z0-9]{30,}|AIza[0-9A-Za-z_-]{35}|sk-[A-Za-z0-9_-]{20,})"
                     r"(?![A-Za-z0-9+/=_-])")


def hold(*values: str | None) -> None:
    """Remember secret values that did not come from SECRET_VARIABLES (an `api_key=` option, a stored token)."""
    _held.update(v.strip() for v in values if v and v.strip())


def held_secrets(extra=()) -> list[str]:
    """The secret values this process holds, longest first (a key that contains another is replaced whole)."""
    values = {os.environ.get(name, "").strip() for name in SECRET_VARIABLES} | _held | {
        v.strip() for v in extra if v}
    return sorted((v for v in values if len(v) >= MIN_LENGTH and v not in NOT_SECRETS), key=len, reverse=True)


def holds_secret(text: str, extra=()) -> bool:
    """Whether `text` contains a held secret's value (a plain substring search, cheap on large bodies)."""
    return any(value in text for value in held_secrets(extra))


def scrub(text: str, secrets=()) -> str:
    """`text` without the held secrets (plus `secrets`) and without header-form credentials; the same object when
    there was nothing to remove, so callers can tell cheaply whether anything changed.

    >>> scrub("401: headers {'Authorization': 'Bearer abc.def', 'x-goog-api-key': 'k1'} at /v1?key=zz&alt=sse")
    "401: headers {'Authorization': '[redacted]', 'x-goog-api-key': '[redacted]'} at /v1?key=[redacted]&alt=sse"
    """
    if not isinstance(text, str) or not text:
        return text
    out = text
    for value in held_secrets(secrets):
        if value in out:
            out = out.replace(value, MARK)
    for pattern in _PATTERNS:
        out = pattern.sub(lambda m: m.group(1) + m.group(2) + MARK, out)
    out = _TOKENS.sub(MARK, out)
    return text if out == text else out


def scrub_strings(obj, secrets=()):
    """A JSON-like value (dicts, lists, strings, others) with every string scrubbed, keys included; the same
    object when nothing changed. Bytes are left alone: image data is not text."""
    if isinstance(obj, str):
        return scrub(obj, secrets)
    if isinstance(obj, dict):
        items = [(scrub_strings(k, secrets), scrub_strings(v, secrets)) for k, v in obj.items()]
        changed = any(k2 is not k or v2 is not v for (k2, v2), (k, v) in zip(items, obj.items()))
        return dict(items) if changed else obj
    if isinstance(obj, (list, tuple)):
        items = [scrub_strings(v, secrets) for v in obj]
        return type(obj)(items) if any(a is not b for a, b in zip(items, obj)) else obj
    return obj


def scrub_model(model, **dump_options):
    """A pydantic model (a parsed answer) with every string field scrubbed; the same object when it was clean."""
    data = model.model_dump(**dump_options)
    clean = scrub_strings(data)
    return model if clean is data else type(model).model_validate(clean)
