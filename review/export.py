"""`medbanana review export`: a rubric review's answers as the human labels `medbanana judge-agreement --human` reads.

One row per answered edit: `id` (the edit's sample id, `<uid>#<round>`), the five rubric booleans (true / false),
`raters` (how many answers the row summarises) and, per dimension, `<dimension>_yes` (how many of them said yes).
By default a dimension's label is the majority of the raters, empty on a tie; an edit whose `qualified` ties has
no usable label and is left out (counted in the summary). With `rater=NAME` the rows are that rater's own answers,
with their reason. `sample`, `inclusion_probability` and `stratum_size` say how the item was drawn (what
`medbanana calibrate` weighs the labels by). A realism review is refused: its answers (real or edited?) are not verdicts of the judge's
rubric; `medbanana review report` summarises them.
"""

from __future__ import annotations

import csv
import io
from collections import defaultdict
from pathlib import Path

from ..generation.files import atomic_write_text
from ..generation.records import VERDICT_BOOLEANS
from ..generation.dataset.review_folder import IN_TURNS, StoredAnswer
from .reliability import majority
from .store import ReviewStore, check_rater_name
from ..generation.failures import UsageError

# `sample` and after: how the item was drawn (calibrate's inputs: its inclusion probability and stratum size in a
# calibration sample, empty otherwise)
COLUMNS = ["id", *VERDICT_BOOLEANS, "raters", *(f"{d}_yes" for d in VERDICT_BOOLEANS), "dataset", "modality",
           "disease", "direction", "item", "sample", "inclusion_probability", "stratum_size"]


def _blank(value) -> str:
    return "" if value is None else repr(value)


def _cell(value: bool | None) -> str:
    return "" if value is None else str(bool(value)).lower()


def export_labels(folder: Path, out_csv: Path, rater: str | None = None) -> dict:
    """Write the labels CSV (atomically) and return a summary: rows, answers used, raters, items left out."""
    store = ReviewStore.open(folder)
    settings = store.settings
    if settings.mode != "rubric":
        raise UsageError(f"{folder} is a {settings.mode} review: its answers (real or edited?) are not judge labels, "
                         "so there is nothing for judge-agreement --human; `medbanana review report` summarises them")
    answers = store.answers()
    if not answers:
        raise UsageError(f"{folder}: no answers yet, nothing to export (raters answer at `medbanana review {folder}`)")
    if rater is not None:
        rater = check_rater_name(rater)
        everyone = sorted({a.rater for a in answers})
        answers = [a for a in answers if a.rater == rater]
        if not answers:
            raise UsageError(f"{folder}: rater {rater!r} answered nothing here; raters: {', '.join(everyone)}")
    by_item: dict[str, list[StoredAnswer]] = defaultdict(list)
    for answer in answers:
        by_item[answer.item_id].append(answer)

    columns = COLUMNS + (["reason"] if rater else [])
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, columns, lineterminator="\n")
    writer.writeheader()
    rows = tied_qualified = 0
    ties = dict.fromkeys(VERDICT_BOOLEANS, 0)
    for item in store.items():  # the review's order
        given = by_item.get(item.item_id)
        if not given:
            continue
        row = {"id": item.sample_id, "raters": len(given), "dataset": item.dataset, "modality": item.modality or "",
               "disease": item.disease, "direction": item.direction, "item": item.item_id,
               "sample": settings.design or IN_TURNS, "inclusion_probability": _blank(item.inclusion_probability),
               "stratum_size": _blank(item.stratum_size)}
        for dim in VERDICT_BOOLEANS:
            votes = [getattr(a.answer, dim) for a in given if getattr(a.answer, dim) is not None]
            label = majority(votes)
            ties[dim] += bool(votes) and label is None
            row[dim] = _cell(label)
            row[f"{dim}_yes"] = sum(votes)
        if rater:
            row["reason"] = given[0].answer.reason
        if row["qualified"] == "":
            tied_qualified += 1
            continue
        writer.writerow(row)
        rows += 1
    atomic_write_text(Path(out_csv), buffer.getvalue())
    return {"csv": str(out_csv), "rater": rater, "rows": rows, "answers": len(answers),
            "raters": len({a.rater for a in answers}), "items_answered": len(by_item), "items": len(store.items()),
            "left_out_qualified_tie": tied_qualified, "ties": ties}
