"""`medbanana stats`: the paper's Table 1, Table 2 and Figure 3, regenerated from run metadata alone.

Inputs are run directories (any layout `generation.rundir.runs` reads) or folders written by `medbanana build` (their
`conversations` config). Counting is `builder.stats.BuildStats`'s and the tables and figure are `builder.paper`'s,
the same numbers and the same markdown as the dataset card's.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from ..generation.dataset.folder import FIGURE
from ..generation.dataset.inputs import input_kind
from ..generation.extras import MissingExtra
from ..generation.files import atomic_write_text
from ..generation.records import VERDICT_FIELDS
from ..generation.outcomes import TaskStatus
from ..generation.rundir import schema
from ..generation.rundir.runs import discover_units, read_tasks
from ..generation.rundir.task_records import AttemptRecord, TaskRecord
from ..generation.tables import Table
from .paper import TOP_REASONS, card_section, failure_reasons_table, save_figure3, table1, table2
from .stats import BuildStats
from ..generation.failures import UsageError


@dataclass
class TaskCounts:
    """What `medbanana stats` counts: `BuildStats` over every task, failure reasons included (read them once
    every task is added: they are derived when first read)."""

    stats: BuildStats = field(default_factory=BuildStats)

    def add(self, task: TaskRecord) -> None:
        self.stats.add_task(task, {}, None)


def summarise(paths: Iterable[Path]) -> TaskCounts:
    counts = TaskCounts()
    for path in paths:
        for task in tasks_of(Path(path)):
            counts.add(task)
    return counts


def tasks_of(path: Path) -> Iterator[TaskRecord]:
    kind = input_kind(path)
    if kind == "manifest":
        raise UsageError(f"{path}: stats reads run directories and built datasets, not evaluation samples")
    if kind == "dataset":
        yield from read_built_conversations(path)
    else:
        for unit in discover_units(path):
            yield from read_tasks(unit)


def reasons_table(counts: TaskCounts, top: int = TOP_REASONS) -> Table:
    return failure_reasons_table(counts.stats, top)


def write_stats(summary: TaskCounts, out: Path) -> dict:
    """Tables (md + csv), figure3.png, stats.json and report.md in `out`; returns what stats.json holds. Without
    matplotlib the figure is left out (`figure3` is then the reason) and everything else is written."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tables = {"table1": table1(summary.stats), "table2": table2(summary.stats),
              "failure_reasons": reasons_table(summary)}
    for name, table in tables.items():
        table.write(out, name)
    data = {name: table.as_dicts() for name, table in tables.items()}
    try:
        save_figure3(summary.stats, out / FIGURE)
        data["figure3"] = FIGURE
    except MissingExtra as exc:
        data["figure3"] = f"not drawn: {exc}"
    data["counts"] = summary.stats.to_json()
    atomic_write_text(out / "stats.json", json.dumps(data, indent=2, ensure_ascii=False, default=str))
    figure = FIGURE if data["figure3"] == FIGURE else None
    atomic_write_text(out / "report.md", "# Run statistics\n\n" + card_section(summary.stats, figure))
    return data


def read_built_conversations(folder: Path) -> Iterator[TaskRecord]:
    """Task records rebuilt from a built dataset's `conversations` rows (no images needed), one at a time."""
    import pyarrow.parquet as pq

    files = sorted(Path(folder).glob("conversations/*.parquet"))
    if not files:
        raise UsageError(f"{folder}: no conversations/*.parquet; stats needs the conversations config "
                         "(build with --configs including conversations), or the run directories")
    columns = ["uid", "source_id", "dataset", "modality", "disease", "task", "run", "status", "success_round",
               "rounds"]
    for file in files:
        for batch in pq.ParquetFile(file).iter_batches(batch_size=1024, columns=columns):
            for row in batch.to_pylist():
                yield _task_from_row(row, Path(folder))


def _task_from_row(row: dict, folder: Path) -> TaskRecord:
    task = TaskRecord(uid=row["uid"], run_dir=Path(row["run"] or folder.name), dataset=row["dataset"],
                      modality=row["modality"], disease=row["disease"], direction=row["task"],
                      source_id=row["source_id"], status=TaskStatus(row["status"]),
                      success_round=row["success_round"])
    for r in row["rounds"] or []:
        judged = r["qualified"] is not None or r["has_disease"] is not None
        verdict = schema.Verification(**{k: r[k] for k in VERDICT_FIELDS}) if judged else None
        task.add_attempt(AttemptRecord(round=r["round"], instruction=r["instruction"], edit_error=r["edit_error"],
                                       verdict=verdict, accepted=bool(r["accepted"]), image=r["image"]))
    return task
