"""Failure reasons of rejected attempts as countable phrases: normalised clauses of the judge's verdict text.

Counted by `builder.stats` while it builds (for the card) and reported by `medbanana stats`.
"""

from __future__ import annotations

import re
from collections import Counter
from itertools import islice


_SENTENCE_END = re.compile(r"(?<=[a-z)\]])\.(?:\s+|$)")
_BRACKETED = re.compile(r"\([^)]*\)|\[[^\]]*\]")
_NUMBER = re.compile(r"[-+]?\d+(?:[.,]\d+)?%?")
_ASCII_DIGITS = "0123456789"
# printable ASCII but the characters that make a text more than one plain clause (or that a clause loses), and '?',
# which `count_phrases` puts for every non-ASCII character
_PLAIN = bytes(c for c in range(0x20, 0x7F) if chr(c) not in ";.([?" + _ASCII_DIGITS)
_SEPARATOR = "\x00"
_TEXTS_AT_ONCE = 4096


def reason_phrases(reason: str) -> list[str]:
    """A verdict text as normalised clauses: split at ';' and sentence ends, parenthesised details and numbers
    dropped, lower case; each clause once.

    >>> reason_phrases("Change too subtle in the sella (contrast-to-noise 1.2); hard edges at the lesion border.")
    ['change too subtle in the sella', 'hard edges at the lesion border']
    """
    # A card counts the clauses of every rejected attempt (~200,000 at release scale): each regular expression
    # runs only where its character occurs, since scanning every text with each costs seconds. (Texts that are one
    # plain clause take `count_phrases`'s bulk path and never come here.)
    phrases = []
    for part in reason.replace("\n", ";").split(";"):
        for clause in _SENTENCE_END.split(part) if "." in part else (part,):
            if "(" in clause or "[" in clause:
                clause = _BRACKETED.sub(" ", clause)
            text = clause.lower()
            if not text.isascii() or _has_digit(text):
                text = _NUMBER.sub("N", text)
            if "  " in text or not text.isprintable():  # printable: no whitespace but the ASCII space
                text = " ".join(text.split())
            text = text.strip(" .,:;-")
            if len(text) >= 3 and text not in phrases:
                phrases.append(text)
    return phrases


def _has_digit(text: str) -> bool:
    return ("0" in text or "1" in text or "2" in text or "3" in text or "4" in text or "5" in text or "6" in text
            or "7" in text or "8" in text or "9" in text)  # written out: a generator over the digits costs 3x


def count_phrases(texts: dict[str, int], counts: Counter) -> None:
    """Add `n` to `counts` for every clause of every text (text -> n), as `reason_phrases` splits them.

    A release has ~200,000 distinct verdict texts: those that are one plain clause are found a few thousand at a
    time, over their concatenation in bytes, and only lower-cased; the rest are split one by one."""
    items = iter(texts.items())
    get = counts.get  # a Counter's += calls its Python __missing__ for every new clause
    while chunk := list(islice(items, _TEXTS_AT_ONCE)):
        joined = _SEPARATOR.join(text for text, _ in chunk)
        if joined.count(_SEPARATOR) != len(chunk) - 1:  # a text holding the separator: one at a time
            _count_each(chunk, counts)
            continue
        data = joined.encode("ascii", "replace")  # one byte per character, '?' for a non-ASCII one
        if b"  " in data:
            data = data.replace(b"  ", b"\x01")  # a double space, kept as a character that is not plain
        # each text without its plain characters: nothing is left of a plain one
        leftovers = data.translate(None, _PLAIN).split(_SEPARATOR.encode())
        for (text, n), leftover in zip(chunk, leftovers):
            if leftover:
                _count_each([(text, n)], counts)
            else:
                phrase = text.lower().strip(" .,:;-")
                if len(phrase) >= 3:
                    counts[phrase] = get(phrase, 0) + n


def _count_each(items, counts: Counter) -> None:
    for text, n in items:
        for phrase in reason_phrases(text):
            counts[phrase] += n
