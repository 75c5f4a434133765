"""Failure reasons of rejected attempts as countable phrases: normalised clauses of the judge's verdict text.

Counted by `builder.stats` while it builds (for the card) and reported by `medbanana stats`.
"""

from __future__ import annotations

import re


_SENTENCE_END = re.compile(r"(?<=[a-z)\]])\.(?:\s+|$)")
_BRACKETED = re.compile(r"\([^)]*\)|\[[^\]]*\]")
_NUMBER = re.compile(r"[-+]?\d+(?:[.,]\d+)?%?")
_ASCII_DIGITS = "0123456789"


def reason_phrases(reason: str) -> list[str]:
    """A verdict text as normalised clauses: split at ';' and sentence ends, parenthesised details and numbers
    dropped, lower case; each clause once.

    >>> reason_phrases("Change too subtle in the sella (contrast-to-noise 1.2); hard edges at the lesion border.")
    ['change too subtle in the sella', 'hard edges at the lesion border']
    """
    # A card counts the clauses of every rejected attempt (~200,000 at release scale): each regular expression
    # runs only where its character occurs, since scanning every text with each costs seconds.
    phrases = []
    for part in reason.replace("\n", ";").split(";"):
        for clause in _SENTENCE_END.split(part) if "." in part else (part,):
            if "(" in clause or "[" in clause:
                clause = _BRACKETED.sub(" ", clause)
            text = clause.lower()
            if not text.isascii() or any(digit in text for digit in _ASCII_DIGITS):
                text = _NUMBER.sub("N", text)
            if "  " in text or not text.isprintable():  # printable: no whitespace but the ASCII space
                text = " ".join(text.split())
            text = text.strip(" .,:;-")
            if len(text) >= 3 and text not in phrases:
                phrases.append(text)
    return phrases
