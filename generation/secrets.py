"""One scrubber for every text medbanana writes or prints that can carry an endpoint's answer or error.

An endpoint (or a proxy in front of it) may echo the request's headers, the API key with them, into a 200 answer,
an error body or a refusal's text, as they are or encoded. Those texts end up in records, the journal, the request
caches, the JSON files and the dataset's parquet, so each is passed through `scrub` where it is created or cached:
the values of the secrets this process holds (API keys and the HF token, from their variables or handed to `hold`;
a password in a base URL; Vertex AI access tokens, held as they are fetched) in every form an echo may take them (as they are; base64, standard and URL-safe, at each
of the three byte offsets inside a longer base64 text; base32, upper and lower case, at each of its five byte
offsets; hex, lower and upper case; percent-encoded; any of those broken into lines, as MIME wraps base64 at 76
characters, with CR LF, LF or their JSON escapes; HTML character references, `&#97;`, `&#x61;` or named, for some or
all of its characters) and anything in a credential shape (`Authorization: Bearer ...`, `x-goog-api-key: ...`,
`?key=...`, `hf_...`, a URL's `user:password@`) become `[redacted]`; a wrapped or entity-encoded run that holds one
is replaced whole. What is not caught: a secret encoded twice (HTML entities of its base64, ...), or in another
encoding (gzip, JSON's \\u escapes of every character, quoted-printable, ...); bytes that are not text (an image's
pixels) are never searched.
"""

from __future__ import annotations

import base64
import functools
import html
import os
import re
from urllib.parse import quote, quote_plus, unquote, urlsplit

MARK = "[redacted]"
SECRET_VARIABLES = ("GEMINI_API_KEY", "GOOGLE_API_KEY", "OPENAI_API_KEY", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN")
URL_VARIABLES = ("OPENAI_BASE_URL", "GOOGLE_GEMINI_BASE_URL", "HF_ENDPOINT")  # a password in their user-info
# Shorter values are not keys (local servers take "x" or "not-needed"): replacing them would blank ordinary words.
MIN_LENGTH = 8
NOT_SECRETS = {"not-needed"}
# holds_secret looks for the encoded forms only outside quoted runs this long (an image's base64): see there
LONG_RUN = 4096

_held: set[str] = set()  # values handed over as options or read from a token file, not from the variables

# a value stops before a quote or backslash, so that scrubbed JSON text stays JSON; a scrubbed value is kept whole
_VALUE = r"(?:\[redacted\]|[^\s\"',;&<>(){}\[\]\\]+)"
_PATTERNS = (
    # a header echoed as HTTP text, JSON (escaped or not) or a Python dict: the name stays, the value goes
    re.compile(r"(?i)(\b(?:proxy-)?authorization|\bx-goog-api-key|\bx-api-key|\bapi-key)"
               r"((?:\\?[\"'])?\s*[:=]\s*(?:\\?[\"'])?)(?:(?:bearer|basic|token)\s+)?" + _VALUE),
    # a key in a URL's query
    re.compile(r"(?i)([?&](?:key|api_key|apikey|access_token|token))(=)[^&\s\"'#<>\\]+"),
    # a URL's user-info (`http://user:password@host`): "://" first, a literal the regex engine searches for fast
    re.compile(r"(://)()[^\s/?#@\"'\\<>\[\]{}]+(?=@)"),
)
# Token shapes, whoever they belong to; the look-arounds keep them off runs of base64 (an image's bytes).
_TOKENS = re.compile(r"(?<![A-Za-z0-9+/=_-])(?:hf_[A-Za-z0-9]{30,}|AIza[0-9A-Za-z_-]{35}|sk-[A-Za-z0-9_-]{20,})"
                     r"(?![A-Za-z0-9+/=_-])")
_URLSAFE = str.maketrans("+/", "-_")


def hold(*values: str | None) -> None:
    """Remember secret values that did not come from SECRET_VARIABLES (an `api_key=` option, a stored token)."""
    _held.update(v.strip() for v in values if v and v.strip())


def url_credentials(url: str | None) -> tuple[str, ...]:
    """The secrets in a URL's user-info: its password, and `user:password` (what HTTP Basic auth encodes), each
    as written and percent-decoded; () when it has none. Pass them to `hold` where a base URL is an option."""
    try:
        parts = urlsplit(url or "")
        user, password = parts.username, parts.password
    except ValueError:  # not a URL (a port that is not a number, ...): it names no password either
        return ()
    if not password:
        return ()
    written = (password, f"{user or ''}:{password}")
    return written + tuple(unquote(v) for v in written)


def held_secrets(extra=()) -> list[str]:
    """The secret values this process holds, longest first (a key that contains another is replaced whole)."""
    values = {os.environ.get(name, "").strip() for name in SECRET_VARIABLES} | _held | {
        v.strip() for v in extra if v}
    for name in URL_VARIABLES:
        if "@" in (url := os.environ.get(name, "")):
            values.update(url_credentials(url))
    return sorted((v for v in values if len(v) >= MIN_LENGTH and v not in NOT_SECRETS), key=len, reverse=True)


@functools.lru_cache(maxsize=256)
def encodings(value: str) -> tuple[str, ...]:
    """The forms in which `value` can stand in a text, itself first, then the encoded ones: base64 (standard and
    URL-safe) of its UTF-8 bytes at byte offsets 0, 1 and 2 inside a longer base64 text (only the characters that
    depend on its bytes alone: a neighbour shares the edge ones), hex (lower and upper case), percent-encoded (by
    `quote` and `quote_plus`, and every byte as %XX; upper- and lower-case hex digits).

    >>> [f for f in encodings("secret-0123") if f.startswith(("c2Vj", "ONSW"))]  # base64 and base32 at offset 0
    ['ONSWG4TFOQWTAMJSG', 'c2VjcmV0LTAxMj']
    """
    data = value.encode("utf-8")
    forms = {data.hex(), data.hex().upper()}
    for offset in range(3):  # the characters wholly made of the value's bits: from ceil(8*offset/6) to the last
        b64 = base64.b64encode(bytes(offset) + data).decode("ascii")[-(-8 * offset // 6):8 * (offset + len(data)) // 6]
        forms |= {b64, b64.translate(_URLSAFE)}
    for offset in range(5):  # base32: 5 bits a character, so five byte offsets
        b32 = base64.b32encode(bytes(offset) + data).decode("ascii")[-(-8 * offset // 5):8 * (offset + len(data)) // 5]
        forms |= {b32, b32.lower()}
    every_byte = "".join(f"%{b:02X}" for b in data)
    for percent in (quote(value, safe=""), quote(value), quote_plus(value), every_byte):
        forms |= {percent, re.sub(r"%[0-9A-F]{2}", lambda m: m[0].lower(), percent)}
    forms.discard(value)
    return (value, *sorted(forms, key=lambda f: (-len(f), f)))


@functools.lru_cache(maxsize=64)
def _forms(values: tuple[str, ...]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(raw values, encoded forms) of held secrets, each longest first."""
    encoded = {form for value in values for form in encodings(value)[1:]} - set(values)
    return values, tuple(sorted(encoded, key=lambda f: (-len(f), f)))


def holds_secret(text: str, extra=()) -> bool:
    """Whether `text` contains a held secret, as it is or encoded: plain substring searches, cheap on large bodies.

    The values as they are are looked for everywhere, the encoded forms not inside a quoted run of more than
    LONG_RUN characters: in a Gemini answer that is the base64 of an image or a thought signature (bytes, which are
    never scrubbed), or a long text part (its caller scrubs every text part whole). Searching megabytes of base64
    for a dozen forms per secret would cost milliseconds per call."""
    raw, encoded = _forms(tuple(held_secrets(extra)))
    if any(value in text for value in raw):
        return True
    if len(text) < LONG_RUN:
        return any(form in text for form in encoded)
    spans = _outside_long_runs(text)
    return any(text.find(form, start, end) >= 0 for form in encoded for start, end in spans)


def _outside_long_runs(text: str) -> list[tuple[int, int]]:
    """The (start, end) spans of `text` that are not inside a quoted run of LONG_RUN or more characters."""
    spans, start, quote_at = [], 0, text.find('"')
    while quote_at >= 0:
        close = text.find('"', quote_at + 1)
        if close < 0:
            break
        if close - quote_at > LONG_RUN:
            spans.append((start, quote_at + 1))
            start = close
        quote_at = text.find('"', close + 1)
    return [*spans, (start, len(text))]


def scrub(text: str, secrets=()) -> str:
    """`text` without the held secrets (plus `secrets`) in any of their `encodings` and without credential shapes;
    the same object when there was nothing to remove, so callers can tell cheaply whether anything changed.

    >>> scrub("401: headers {'Authorization': 'Bearer abc.def', 'x-goog-api-key': 'k1'} at /v1?key=zz&alt=sse")
    "401: headers {'Authorization': '[redacted]', 'x-goog-api-key': '[redacted]'} at /v1?key=[redacted]&alt=sse"
    >>> scrub("cannot reach http://me:pa55@127.0.0.1:8000/v1")
    'cannot reach http://[redacted]@127.0.0.1:8000/v1'
    """
    if not isinstance(text, str) or not text:
        return text
    return _scrub(text, *_forms(tuple(held_secrets(secrets))))


def all_clean(texts, secrets=()) -> bool:
    """Whether `scrub` leaves every one of `texts` as it is; the held secrets are looked up once for all of them
    (an answer holds a few dozen strings, and each look-up reads the environment)."""
    raw, encoded = _forms(tuple(held_secrets(secrets)))
    return all(_scrub(text, raw, encoded) is text for text in texts)


def _scrub(text: str, raw: tuple[str, ...], encoded: tuple[str, ...]) -> str:
    if not isinstance(text, str) or not text:
        return text
    out = text
    for forms in (raw, encoded):  # the values first: an encoded form may lie inside a value's text
        for form in forms:
            if form in out:
                out = out.replace(form, MARK)
    for pattern in _PATTERNS:
        out = pattern.sub(lambda m: m.group(1) + m.group(2) + MARK, out)
    out = _TOKENS.sub(MARK, out)
    out = _scrub_runs(out, raw, encoded)
    return text if out == text else out


# A run of base64/base32/hex characters broken into lines (MIME wraps base64 at 76 characters), the breaks as they
# are or JSON-escaped; anchored at the start of a run and possessive, so that a long run (an image's base64) is
# scanned once.
_WRAPPED = re.compile(r"(?<![A-Za-z0-9+/=_-])[A-Za-z0-9+/=_-]++(?:(?:\r?\n|\\r\\n|\\n)[A-Za-z0-9+/=_-]++)+")
_LINE_BREAKS = re.compile(r"\r?\n|\\r\\n|\\n")
# A run of text up to whitespace, markup or a quote that holds a `&...;` (HTML character references: `&#97;`,
# `&#x61;`, `&amp;`); anchored at the start of a run so that each run is scanned once.
_ENTITIES = re.compile(r"(?<![^\s<>\"'])(?=[^\s<>\"']*?&#?[0-9A-Za-z]{1,32};)[^\s<>\"']++")


def _scrub_runs(text: str, raw: tuple[str, ...], encoded: tuple[str, ...]) -> str:
    """`text` with each line-wrapped run and each run of HTML character references that holds a held secret (in
    any of its forms, once joined or decoded) replaced whole by MARK."""
    if not raw:
        return text

    def holds(joined: str) -> bool:
        return any(value in joined for value in raw) or any(form in joined for form in encoded)

    if "\n" in text or "\\n" in text:
        text = _WRAPPED.sub(lambda m: MARK if holds(_LINE_BREAKS.sub("", m[0])) else m[0], text)
    if "&" in text and ";" in text:
        text = _ENTITIES.sub(lambda m: MARK if holds(html.unescape(m[0])) else m[0], text)
    return text


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
