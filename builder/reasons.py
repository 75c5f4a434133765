"""Failure reasons of rejected attempts as countable phrases: normalised clauses of the judge's verdict text.

Counted by `builder.stats` while it builds (for the card) and reported by `medbanana stats`.
"""

from __future__ import annotations

import re


def reason_phrases(reason: str) -> list[str]:
    """A verdict text as normalised clauses: split at ';' and sentence ends, parenthesised details and numbers
    dropped, lower case; each clause once.

    >>> reason_phrases("Change too subtle in the sella (contrast-to-noise 1.2); hard edges at the lesion border.")
    ['change too subtle in the sella', 'hard edges at the lesion border']
    """
    phrases = []
    for clause in re.split(r";|\n|(?<=[a-z)\]])\.(?:\s+|$)", reason):
        text = re.sub(r"\([^)]*\)|\[[^\]]*\]", " ", clause)
        text = re.sub(r"[-+]?\d+(?:[.,]\d+)?%?", "N", text.lower())
        text = re.sub(r"\s+", " ", text).strip(" .,:;-")
        if len(text) >= 3 and text not in phrases:
            phrases.append(text)
    return phrases
