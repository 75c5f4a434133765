"""A finished run's tasks as they are read back, whatever wrote them (runs.py finds them, readers.py reads them):
`TaskRecord` and its `AttemptRecord`s, and the `Unit` they are read from.

These are the read-back layer of a task and an attempt: `generation.records.Task`, `Attempt` and `TaskOutcome` are
what the loop makes while a run runs; these hold what any of the four inputs of `runs.discover_units` recorded (a
field one of them lacks is None), the judge's thinking left as raw JSON until used.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import msgspec

from ..outcomes import TaskStatus
from ..taxonomy import load_taxonomy
from . import layout, schema

# msgspec Structs rather than dataclasses: made several times faster (a release has ~280,000 attempts), and gc=False
# keeps them out of the cyclic collector's sight (they hold no cycles)
class AttemptRecord(msgspec.Struct, gc=False):
    round: int | None  # None for image-only releases, where the round is not known
    instruction: str | None
    writer_thinking_json: msgspec.Raw | None = None  # decoded on use (see generation/rundir/schema.py)
    edit_error: str | None = None  # set when the editor produced no image this round
    verdict: schema.Verification | None = None  # as the judge answered; `records.verdict_values` normalises it
    judge_thinking_json: msgspec.Raw | None = None
    judge_model: str | None = None
    accepted: bool = False
    image: str | None = None  # path relative to the run directory; None when no image was produced
    seconds: float | None = None
    usage_json: msgspec.Raw | None = None  # tokens per role (ours), decoded only to count them (stats.py)
    geometry: schema.GeometryRecord | None = None  # the geometry guard's record, or measured by the build

    @property
    def writer_thinking(self) -> str | None:
        return schema.text(self.writer_thinking_json)

    @property
    def judge_thinking(self) -> str | None:
        return schema.text(self.judge_thinking_json)


class TaskRecord(msgspec.Struct, gc=False):
    uid: str
    run_dir: Path
    dataset: str
    modality: str | None
    disease: str
    direction: str  # add | remove (the `task` column and JSON field)
    source_id: str
    status: TaskStatus
    attempts: list[AttemptRecord] = msgspec.field(default_factory=list)
    success_round: int | None = None
    source_path: str | None = None
    source_sha256: str | None = None
    final_prompt: str | None = None
    final_image: str | None = None
    api_failure: dict | None = None  # {step, round, error, kind}
    models: dict | None = None  # {writer, editor, judge}
    seed: int | None = None
    origin_file: Path | None = None  # the file that named the task, for messages: JSON, records or image folder
    origin_entry: str | int | None = None  # its task key, or line number in a records file
    scope: str | None = None  # the output folder the user named, when not the whole run (see the module's note)

    accepted: AttemptRecord | None = None  # the accepted attempt, also in `attempts`

    def add_attempt(self, attempt: AttemptRecord) -> None:
        self.attempts.append(attempt)
        if attempt.accepted:
            self.accepted = attempt

    @property
    def origin(self) -> str:
        """Where the task comes from, e.g. `RUN/X-edit/all_conversations.json, entry 'n0001-Effusion'`."""
        if self.origin_entry is None:
            return str(self.origin_file or self.run_dir)
        if isinstance(self.origin_entry, int):
            return f"{self.origin_file}, line {self.origin_entry}"
        return f"{self.origin_file}, entry {self.origin_entry!r}"


@dataclass(frozen=True, slots=True)
class Unit:
    """One thing to read: an output folder with JSON, a records file, or an image-only output folder."""

    kind: str  # json | records | images
    run_dir: Path  # image paths are relative to it
    path: Path
    dataset: str | None = None
    direction: str | None = None
    classes: tuple[str, ...] = ()  # image-only units: the class folders that passed the containment rule
    scope: str | None = None  # the output folder the user named, when not the whole run: paths must stay in it

    @property
    def label(self) -> str:
        return f"{self.run_dir.name}/{self.path.name}"


def block_of(items: list, part: int, parts: int) -> list:
    return items[len(items) * part // parts: len(items) * (part + 1) // parts]


def image_files(unit: Unit):
    """Run-relative paths of the image files (or symlinks: checked when read) of an image-only unit's class
    folders, those that passed the containment rule when the unit was found."""
    folder = unit.path.relative_to(unit.run_dir).as_posix()
    for class_name in unit.classes:
        with os.scandir(unit.path / class_name) as found:
            names = sorted(e.name for e in found if e.is_file(follow_symlinks=False) or e.is_symlink())
        for name in names:
            if os.path.splitext(name)[1].lower() in layout.IMAGE_SUFFIXES:
                yield f"{folder}/{class_name}/{name}"


@lru_cache(maxsize=4096)
def infer_modality(dataset: str | None, disease: str | None) -> str | None:
    """From the dataset folder name (mimic -> chest_xray, Brain-MRI -> brain_mri, ...), else from the disease."""
    taxonomy = load_taxonomy()
    found = taxonomy.infer_modality(dataset) if dataset else None
    if found:
        return found
    label = taxonomy.find(disease) if disease and disease.lower() != "normal" else None
    return label.modality if label else None
