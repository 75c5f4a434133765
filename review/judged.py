"""What `medbanana calibrate` reads: every task's judged attempts (verdicts only, no image) from a run or a built
dataset, and the expert labels of a review export with how they were sampled.

A run is read through the builder's readers; a dataset through its `conversations` config (every task, every
round), else its `judge` config (every judged attempt), reading no image column. Attempt ids are `<uid>#<round>`,
as in the labels.
"""

from __future__ import annotations

import csv
import io
import math
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from ..generation.dataset.review_folder import CALIBRATION
from ..generation.rundir.runs import discover_units, read_tasks
from ..evaluation.agreement import read_human_labels
from ..evaluation.inputs import sample_id
from ..generation.dataset.inputs import input_kind
from ..generation.records import VERDICT_FIELDS, verdict_values
from ..generation.failures import NotFound, UsageError
from ..generation.files import read_user_text



@dataclass(frozen=True)
class JudgedAttempt:
    id: str  # <uid>#<round>
    round: int
    values: dict  # VERDICT_FIELDS, normalised (records.verdict_values)


@dataclass
class JudgedTask:
    uid: str
    modality: str
    direction: str
    attempts: list[JudgedAttempt] = field(default_factory=list)  # in round order

    @property
    def stratum(self) -> str:
        return f"{self.modality}/{self.direction}"


@dataclass(frozen=True)
class ExpertLabel:
    id: str
    qualified: bool
    sample: str = ""  # CALIBRATION, ESCALATION, IN_TURNS; "" when the CSV does not say
    inclusion_probability: float | None = None
    stratum_size: int | None = None


def judged_tasks(source: Path) -> list[JudgedTask]:
    """Every task of a run or built dataset with its judged attempts (a task with none is kept: it counts in the
    yield). ValueError for anything else, or when nothing is judged."""
    source = Path(source)
    if not source.exists():
        raise NotFound(f"{source}: no such dataset or run directory")
    kind = input_kind(source)
    if kind == "manifest":
        raise UsageError(f"{source} is an evaluation samples file: calibrate reads the judge's verdicts of a run "
                         "(--run) or of a dataset made by `medbanana build` (--dataset)")
    tasks = _dataset_tasks(source) if kind == "dataset" else _run_tasks(source)
    if not any(task.attempts for task in tasks):
        raise UsageError(f"{source}: no judged attempt (no verdict recorded): nothing to calibrate against")
    return sorted(tasks, key=lambda t: t.uid)


def _run_tasks(run: Path) -> list[JudgedTask]:
    tasks = []
    for unit in discover_units(run):
        for record in read_tasks(unit):
            task = JudgedTask(record.uid, record.modality or "unknown", record.direction)
            for attempt in record.attempts:
                if attempt.verdict is not None and attempt.round is not None:
                    task.attempts.append(JudgedAttempt(sample_id(record.uid, attempt.round), attempt.round,
                                                       verdict_values(attempt.verdict)))
            task.attempts.sort(key=lambda a: a.round)
            tasks.append(task)
    return tasks


def _dataset_tasks(folder: Path) -> list[JudgedTask]:
    import pyarrow.parquet as pq

    files = sorted(folder.glob("conversations/*.parquet"))
    if files:
        tasks = []
        for file in files:
            for row in pq.read_table(file, columns=["uid", "modality", "task", "rounds"]).to_pylist():
                task = JudgedTask(row["uid"], row["modality"] or "unknown", row["task"])
                task.attempts = [JudgedAttempt(sample_id(row["uid"], r["round"]), r["round"], _values(r))
                                 for r in sorted(row["rounds"] or [], key=lambda r: r["round"] or 0)
                                 if r.get("qualified") is not None and r.get("round") is not None]
                tasks.append(task)
        return tasks
    files = sorted(folder.glob("judge/*.parquet"))
    if not files:
        raise UsageError(f"{folder}: a dataset without the conversations or judge config holds no verdicts to "
                         "calibrate against; build it with one of them, or give the run (--run)")
    by_uid: dict[str, JudgedTask] = {}
    for file in files:
        columns = ["uid", "modality", "task", "round", *VERDICT_FIELDS]
        for row in pq.read_table(file, columns=columns).to_pylist():
            task = by_uid.setdefault(row["uid"], JudgedTask(row["uid"], row["modality"] or "unknown", row["task"]))
            if row["round"] is not None and row["qualified"] is not None:
                task.attempts.append(JudgedAttempt(sample_id(row["uid"], row["round"]), row["round"], _values(row)))
    for task in by_uid.values():
        task.attempts.sort(key=lambda a: a.round)
    return list(by_uid.values())


def _values(row: dict) -> dict:
    """A dataset row's verdict; its score (float32 in parquet) back to the value the run recorded (4 decimals)."""
    values = {name: row.get(name) for name in VERDICT_FIELDS}
    if values["score"] is not None:
        values["score"] = round(float(values["score"]), 6)
    return values


def read_labels(path: Path) -> list[ExpertLabel]:
    """The labels of a review export (judge-agreement's reader: an `id` or `uid` and `round`, `qualified`), with
    the sampling columns `sample`, `inclusion_probability` and `stratum_size` where the export has them."""
    path = Path(path)
    if not path.is_file():
        raise NotFound(f"labels not found: {path} (write them with `medbanana review export`)")
    labels = read_human_labels(path)
    design: dict[str, dict] = {}
    with io.StringIO(read_user_text(path), newline="") as fh:
        for line_no, row in enumerate(csv.DictReader(fh), start=2):
            edit = row["id"] if row.get("id") else f"{row['uid']}#{row['round']}"
            design[edit] = {"sample": (row.get("sample") or "").strip(),
                            "inclusion_probability": _number(row.get("inclusion_probability"), float,
                                                             f"{path}:{line_no}"),
                            "stratum_size": _number(row.get("stratum_size"), int, f"{path}:{line_no}")}
    return [ExpertLabel(edit, bool(values["qualified"]), **design[edit]) for edit, values in labels.items()]


def _number(text: str | None, kind, where: str):
    if not (text or "").strip():
        return None
    try:
        value = kind(text)
    except ValueError:
        raise UsageError(f"{where}: {text!r} is not a number") from None
    if not (isinstance(value, int) or math.isfinite(value)) or value <= 0 or (kind is float and value > 1):
        raise UsageError(f"{where}: {text!r} is out of range")
    return value


def sample_check(labels: list[ExpertLabel], tasks: list[JudgedTask]) -> tuple[bool, str]:
    """(whether the labels are a calibration sample of these judged attempts, a sentence saying so or why not):
    every label drawn by `medbanana review --calibration`, with its inclusion probability, and each stratum's size
    as the labels recorded it equal to the judged attempts counted here."""
    if not labels:
        return False, "no labels"
    kinds = Counter(label.sample or "unknown" for label in labels)
    if kinds.get(CALIBRATION, 0) < len(labels) or any(label.inclusion_probability is None for label in labels):
        described = ", ".join(f"{n} {kind}" for kind, n in sorted(kinds.items()))
        return False, (f"the labels are not a calibration sample ({described}): the guarantee assumes the labelled "
                       "edits are a random sample of the judged attempts; draw one with `medbanana review SOURCE "
                       "--out DIR --calibration`")
    counted = Counter(task.stratum for task in tasks for _ in task.attempts)
    stratum_of = {a.id: t.stratum for t in tasks for a in t.attempts}
    recorded = {stratum_of[label.id]: label.stratum_size for label in labels if label.id in stratum_of}
    differ = sorted(s for s, n in recorded.items() if n != counted[s])
    if differ:
        return False, (f"the labels were sampled from another set of judged attempts (stratum {differ[0]}: "
                       f"{recorded[differ[0]]} then, {counted[differ[0]]} here): the guarantee holds for the set "
                       "they were drawn from")
    return True, ("a calibration sample: seeded random, stratified by modality and direction, each label's "
                  "inclusion probability recorded")
