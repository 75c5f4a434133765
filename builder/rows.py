"""Rows of every config from one task record: the single place that decides what a row holds.

Both the parquet build (`builder.build`) and the loading builder (`medbanana_50k.py`) call `ROW_ITERATORS`.
Images are `{"bytes": <the file's bytes as they are>, "path": <path relative to the run>}` or None (missing);
masks (`edit_mask`, `region_mask`) come computed per task (`masks.task_masks`), or None without a source; the
alignment columns from each attempt's geometry (rundir/alignment.py).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from ..generation.records import verdict_values
from ..generation.taxonomy import canonical_prompt
from ..generation.rundir.alignment import alignment_columns
from ..generation.rundir.task_records import AttemptRecord, TaskRecord
from ..generation.rundir.confined import Confined

if TYPE_CHECKING:
    from ..generation.records import TaskMasks

Images = dict[str, dict | None]  # run-relative path -> image value (None: file missing)


def load_images(task: TaskRecord, confined: Confined | None = None) -> Images:
    """Every attempt image of a task, read once, as stored on disk (no decoding).

    Each is read only from inside the folder the user named (the run, or `task.scope`) and only when it is a JPEG
    or PNG image; otherwise `confined.Refused` is raised naming the file and the entry that named it. `confined`
    shares resolved folders between tasks."""
    confined = confined or Confined()
    images: Images = {}
    for attempt in task.attempts:
        if attempt.image and attempt.image not in images:
            images[attempt.image] = confined.read_image(task.run_dir, attempt.image, lambda a=attempt: _named(task, a),
                                                        task.scope)
    return images


def _named(task: TaskRecord, attempt: AttemptRecord) -> str:
    return task.origin if attempt.round is None else f"{task.origin}, round {attempt.round}"


def split_of(source_id: str, test_fraction: float) -> str:
    """`test` for a stable hash-chosen fraction of source ids, so no source image is in both splits."""
    if test_fraction <= 0:
        return "train"
    digest = hashlib.sha256(source_id.encode("utf-8")).digest()
    return "test" if int.from_bytes(digest[:8], "big") / 2**64 < test_fraction else "train"


def identity(task: TaskRecord) -> dict:
    return {"uid": task.uid, "source_id": task.source_id, "dataset": task.dataset, "modality": task.modality,
            "disease": task.disease, "task": task.direction, "source_path": task.source_path}


def verdict_columns(attempt: AttemptRecord) -> dict:
    return verdict_values(attempt.verdict)


def _image(images: Images, attempt: AttemptRecord) -> dict | None:
    return images.get(attempt.image) if attempt.image else None


def mask_columns(masks: TaskMasks | None, attempt: AttemptRecord) -> dict:
    """`edit_mask` and `region_mask` of an attempt (generation/masks.py); null without the task's source. An edit
    the geometry guard rejected because its frame moved has no edit mask: one would outline the moved anatomy."""
    if masks is None:
        return {"edit_mask": None, "region_mask": None}
    rejected = attempt.geometry is not None and attempt.geometry.action == "rejected"
    return {"edit_mask": masks.edits.get(attempt.image) if attempt.image and not rejected else None,
            "region_mask": masks.region}


def sft_rows(task: TaskRecord, images: Images, source: dict | None, masks: TaskMasks | None = None) -> Iterator[dict]:
    accepted = task.accepted
    if accepted is None:
        return
    yield {**identity(task), "instruction": accepted.instruction, "source_image": source,
           "edited_image": _image(images, accepted), **mask_columns(masks, accepted),
           **alignment_columns(accepted), "success_round": task.success_round, **verdict_columns(accepted)}


def failed_rows(task: TaskRecord, images: Images, source: dict | None,
                masks: TaskMasks | None = None) -> Iterator[dict]:
    """The rejected attempts: those of a task never accepted, and those before its accepted edit (attempts after it,
    which a rule re-decided at build time leaves, are judged attempts, not rejected ones)."""
    last = task.accepted.round if task.accepted is not None and task.accepted.round is not None else None
    for attempt in task.attempts:
        if not attempt.accepted and (last is None or attempt.round is None or attempt.round < last):
            yield {**identity(task), "round": attempt.round, "instruction": attempt.instruction,
                   "source_image": source, "edited_image": _image(images, attempt), **mask_columns(masks, attempt),
                   **alignment_columns(attempt), "edit_error": attempt.edit_error, **verdict_columns(attempt),
                   "task_status": task.status,
                   "success_round": task.success_round}


def dpo_rows(task: TaskRecord, images: Images, source: dict | None, masks: TaskMasks | None = None) -> Iterator[dict]:
    """A task accepted at round k gives one pair per earlier round: chosen = accepted, rejected = that round."""
    chosen = task.accepted
    if chosen is None or chosen.round is None:
        return
    earlier = [a for a in task.attempts if a.round is not None and a.round < chosen.round]
    if not earlier:
        return
    prompt = canonical_prompt(task)
    # each attempt's verdict read once per task (an attempt is in the history of every later pair); rows get copies
    columns = {id(a): verdict_columns(a) for a in (*earlier, chosen)}
    for rejected in earlier:
        history = [{"round": a.round, "instruction": a.instruction, "edit_error": a.edit_error, **columns[id(a)]}
                   for a in earlier if a.round < rejected.round]
        yield {**identity(task), "prompt": prompt, "history": history, "source_image": source,
               "chosen_image": _image(images, chosen), "rejected_image": _image(images, rejected),
               "chosen_instruction": chosen.instruction, "rejected_instruction": rejected.instruction,
               "chosen_round": chosen.round, "rejected_round": rejected.round,
               "rejected_edit_error": rejected.edit_error,
               "chosen_verdict": dict(columns[id(chosen)]), "rejected_verdict": dict(columns[id(rejected)])}


def conversation_rows(task: TaskRecord, images: Images, source: dict | None,
                      masks: TaskMasks | None = None) -> Iterator[dict]:
    rounds = [{"round": a.round, "instruction": a.instruction, "writer_thinking": a.writer_thinking,
               "edit_success": a.edit_error is None, "edit_error": a.edit_error, "image": a.image,
               "accepted": a.accepted, **verdict_columns(a), "judge_thinking": a.judge_thinking,
               "judge_model": a.judge_model, "seconds": a.seconds}
              for a in task.attempts]
    models = task.models or {}
    yield {**identity(task), "source_sha256": task.source_sha256, "run": Path(task.run_dir).name,
           "status": task.status, "success_round": task.success_round, "num_rounds": len(task.attempts),
           "final_prompt": task.final_prompt, "final_image": task.final_image, "api_failure": task.api_failure,
           "models": {role: models.get(role) for role in ("writer", "editor", "judge")}, "seed": task.seed,
           "rounds": rounds}


def judge_rows(task: TaskRecord, images: Images, source: dict | None, masks: TaskMasks | None = None) -> Iterator[dict]:
    """Every attempt a judge judged: not an edit the geometry guard rejected before the judge saw it."""
    for attempt in task.attempts:
        if attempt.verdict is not None and (attempt.geometry is None or attempt.geometry.action != "rejected"):
            yield {**identity(task), "round": attempt.round, "instruction": attempt.instruction,
                   "source_image": source, "edited_image": _image(images, attempt), **mask_columns(masks, attempt),
                   **alignment_columns(attempt), "accepted": attempt.accepted,
                   **verdict_columns(attempt), "judge_thinking": attempt.judge_thinking,
                   "judge_model": attempt.judge_model}


RowIterator = Callable[[TaskRecord, Images, "dict | None", "TaskMasks | None"], Iterator[dict]]
ROW_ITERATORS: dict[str, RowIterator] = {
    "sft": sft_rows, "failed": failed_rows, "dpo_pairs": dpo_rows, "conversations": conversation_rows,
    "judge": judge_rows,
}
# configs whose rows carry attempt images (conversations holds paths only), and those with their masks
IMAGE_CONFIGS = frozenset({"sft", "failed", "dpo_pairs", "judge"})
MASK_CONFIGS = frozenset({"sft", "failed", "judge"})


def row_key(config: str, row: dict) -> str:
    """A unique, deterministic key of a row within its config (used by medbanana_50k.py)."""
    if config == "dpo_pairs":
        return f"{row['uid']}#{row['chosen_round']}>{row['rejected_round']}"
    if config in ("failed", "judge"):
        return f"{row['uid']}#{row['round']}"
    return row["uid"]
