"""Blinding the instruction a rater reads, and measuring what it still gives away about the round.

A refined instruction is written after earlier attempts failed; if its wording says so ("This time …", "Round 3:",
"The judge said …", "unlike the previous attempt …"), a rater knows the edit is a later round, and later rounds are
more often accepted. Writers are asked for self-contained instructions (the refine prompt, the simulator's writer);
`blind_instruction` drops what still speaks of history, and `round_leakage` measures what is left: how well a text
classifier tells round-1 instructions from later ones among the review's items (0.5 = not at all).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from ..generation.extras import require

LEAKAGE_WARNING = 0.65  # an AUROC above this: the instructions tell raters the round
# A sentence that speaks of earlier attempts, of the judge or of a change since: it tells the rater the round.
_HISTORY = re.compile(
    r"\b(?:previous|earlier|prior|last|former|first|preceding|original)\s+(?:attempts?|rounds?|edits?|tries|try|"
    r"instructions?|versions?|times?|ones?|results?|outputs?|iterations?|passes?)\b"
    r"|\b(?:this|next|that)\s+time\b|\bround\s*#?\s*\d+\b|\b(?:another|new|second|third|fourth|fifth|final|next)\s+"
    r"(?:round|attempt|try|pass|iteration)\b|\battempt(?:s|ed)?\b|\bre-?tr(?:y|ied)\b|\btry(?:ing)?\s+again\b"
    r"|\bagain\b|\bstill\b|\banymore\b|\bno\s+longer\b|\b(?:than|as)\s+before\b|\bunlike\b|\bcompared\s+(?:with|to)\b"
    r"|\binstead\b|\b(?:judge[ds]?|judging|grader|reviewers?|evaluators?|critic|feedback|verdicts?|rejected|failed|"
    r"failures?)\b|\b(?:was|were)\s+(?:too|not|barely|hardly|only|far|much|still|missing|invisible|visible)\b"
    r"|^\s*now\b",
    re.IGNORECASE)
# A label before the instruction proper ("Round 3: …", "Revised instruction: …"): dropped, the rest kept
_LABEL = re.compile(r"^\s*(?:(?:round|attempt|try|iteration|version|revision|step)\s*#?\s*\d+|(?:revised|refined|"
                    r"new|updated|improved|corrected|final)\s+(?:instruction|prompt|version))\s*[:.)\-–—]\s*",
                    re.IGNORECASE)


def blind_instruction(text: str, fallback: str = "") -> str:
    """The instruction without the sentences that speak of earlier attempts, the judge or what changed (they would
    tell a rater the round); `fallback` (the task in one sentence) when nothing is left.

    >>> blind_instruction("Round 3: Add an effusion. Unlike the last attempt, keep the ribs. This time make it "
    ...                   "larger. The judge said the lesion was too faint. Keep the rest.")
    'Add an effusion. Keep the rest.'
    >>> blind_instruction("Try again with a stronger edit.", fallback="Add pulmonary edema to this chest X-ray.")
    'Add pulmonary edema to this chest X-ray.'
    """
    text = _LABEL.sub("", text.strip())
    sentences = [_LABEL.sub("", s) for s in re.split(r"(?<=[.!?;])\s+|\n+", text) if s.strip()]
    kept = " ".join(s for s in sentences if s and not _HISTORY.search(s))
    return kept or fallback


def round_of(sample_id: str) -> int | None:
    """The round in `<uid>#<round>`, or None (a bare uid)."""
    _uid, sep, number = sample_id.rpartition("#")
    return int(number) if sep and number.isdigit() else None


def round_leakage(instructions: Sequence[str], rounds: Sequence[int | None], groups: Sequence[str],
                  folds: int = 5) -> tuple[float | None, str]:
    """(AUROC, how it was measured) of a TF-IDF + logistic-regression classifier telling round-1 instructions from
    later ones, from out-of-fold predictions of a cross-validation grouped by source (one source's items never in
    both the training and the test folds); (None, why) when it cannot be measured."""
    rows = [(text, r > 1, group) for text, r, group in zip(instructions, rounds, groups) if r is not None and text]
    later = sum(label for _, label, _ in rows)
    if later < 2 or len(rows) - later < 2:
        return None, (f"not measured: {len(rows) - later} round-1 and {later} later-round instructions "
                      "(2 of each needed)")
    n_groups = len({group for _, _, group in rows})
    if n_groups < 2:
        return None, "not measured: every item shows one source"
    sklearn = require("sklearn", needed_for="measuring the review's blinding", extra="review")
    import numpy as np
    from sklearn.feature_extraction.text import TfidfVectorizer
    from sklearn.linear_model import LogisticRegression
    from sklearn.model_selection import GroupKFold

    from ..evaluation.probe_statistics import auroc

    texts = [text for text, _, _ in rows]
    labels = [int(label) for _, label, _ in rows]
    group_ids = [group for _, _, group in rows]
    scores = [0.5] * len(rows)
    splits = min(folds, n_groups)
    for train, test in GroupKFold(n_splits=splits).split(texts, labels, group_ids):
        train_labels = [labels[i] for i in train]
        if len(set(train_labels)) < 2:  # a fold that saw one class only: no information, a neutral score
            continue
        vectors = TfidfVectorizer(ngram_range=(1, 2), sublinear_tf=True)
        model = LogisticRegression(max_iter=1000).fit(vectors.fit_transform([texts[i] for i in train]), train_labels)
        for i, p in zip(test, model.predict_proba(vectors.transform([texts[i] for i in test]))[:, 1]):
            scores[i] = float(p)
    value = auroc(np.asarray(scores), np.asarray(labels))  # both classes present: checked above
    return round(value, 3), (f"TF-IDF (1-2 grams) + logistic regression, {splits}-fold cross-validation grouped by "
                             f"source, {len(rows) - later} round-1 vs {later} later-round instructions "
                             f"(scikit-learn {sklearn.__version__})")


def leakage_warning(auroc: float | None) -> str:
    """A line for the user when the instructions shown tell the round, else ''."""
    if auroc is None or auroc <= LEAKAGE_WARNING:
        return ""
    return (f"warning: the instructions shown still tell round 1 from later rounds (AUROC {auroc:.2f} > "
            f"{LEAKAGE_WARNING}): raters may guess which edits were refined")
