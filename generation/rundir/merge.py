"""Combine run directories (shards of one job) into one. Two runs that finished the same task is an error; rerunning
an interrupted merge goes on where it stopped.

Shards may come from other machines, so every path a journal names is data: each image is read only from inside
its shard and written only inside --out (`layout.inside`, symlinks resolved), and a record's dataset and task must
name a `{D}-edit` / `{D}-remove` folder directly in --out. Every record of every shard is checked before anything
is written. --out is locked as any run directory being written (RunStore.open), the shards shared (lock.py).
"""

from __future__ import annotations

import json
import os
import shutil
from contextlib import ExitStack
from pathlib import Path

from . import layout
from ..files import same_bytes
from .lock import hold_lock
from .store import IDENTITY_KEYS, RunStore


class MergeConflict(RuntimeError):
    pass


def _link_or_copy(src: Path, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    if dst.exists():
        if not same_bytes(dst, src):
            raise MergeConflict(f"{dst} exists with other content than {src}")
        return
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def _finished_tasks(run_dir: Path) -> dict[str, tuple[int, dict]]:
    """uid -> (journal line, record) of the last `task` line per uid; unreadable (torn) lines are skipped, as
    `store.read_journal` does."""
    path = run_dir / layout.JOURNAL
    latest: dict[str, tuple[int, dict]] = {}
    if not path.exists():
        return latest
    with open(layout.inside(run_dir, layout.JOURNAL, named_by=f"the shard {run_dir}"), "rb") as fh:
        for line_no, raw in enumerate(fh, 1):
            try:
                entry = json.loads(raw)
            except json.JSONDecodeError:
                continue
            if isinstance(entry, dict) and entry.get("type") == "task":
                latest[str(entry.get("uid"))] = (line_no, entry.get("record"))
    return latest


def _checked_copies(run_dir: Path, out: Path, line_no: int, record) -> list[tuple[Path, Path]]:
    """(source in the shard, destination in --out) of a record's images; UnsafePath or ValueError naming the shard,
    the journal line and the path for anything that leads elsewhere."""
    where = f"shard {run_dir}, {layout.JOURNAL} line {line_no}"
    if not isinstance(record, dict) or not isinstance(record.get("uid"), str):
        raise ValueError(f"{where}: a task line without a record and its uid")
    if record.get("task") not in ("add", "remove"):
        raise ValueError(f"{where}: task {record.get('task')!r} is neither 'add' nor 'remove'")
    dataset = record.get("dataset")
    # store.materialize writes {D}-edit/*.json from this name: it must be one folder name, inside --out
    folder = layout.output_dir(Path(), str(dataset), record["task"])
    if not isinstance(dataset, str) or len(folder.parts) != 1:
        raise layout.UnsafePath(f"{where}: dataset {dataset!r} is not one folder name")
    layout.inside(out, folder, named_by=f"{where} (dataset)")
    rounds = record.get("rounds")
    if not isinstance(rounds, list) or not all(isinstance(r, dict) for r in rounds):
        raise ValueError(f"{where}: `rounds` is not a list of objects")
    copies = []
    for rnd in rounds:
        image = rnd.get("image")
        if image:
            if not isinstance(image, str):
                raise ValueError(f"{where}: image {image!r} is not a path")
            named = f"{where} (image of round {rnd.get('round')})"
            copies.append((layout.inside(run_dir, image, named_by=named), layout.inside(out, image, named_by=named)))
    final = record.get("final_image")
    if final:
        if not isinstance(final, str):
            raise ValueError(f"{where}: final_image {final!r} is not a path")
        layout.inside(out, final, named_by=f"{where} (final_image)")
    return copies


def merge_runs(inputs: list[Path], out: Path) -> dict:
    """Merge the finished tasks of `inputs` into `out` (a new or compatible run directory); returns counts.

    `out` is locked like any run directory being written; the inputs are locked shared, so that a shard still
    being generated is refused (LockHeld) rather than merged half-done, and none starts while it is read."""
    inputs, out = [Path(p) for p in inputs], Path(out)
    with ExitStack() as locks:
        for run_dir in inputs:
            if run_dir.is_dir():
                locks.enter_context(hold_lock(run_dir, "run directory merged from", shared=True))
        return _merge(inputs, out)


def _merge(inputs: list[Path], out: Path) -> dict:
    configs = []
    for run_dir in inputs:
        cfg_path = run_dir / layout.RUN_CONFIG
        if not cfg_path.exists():
            raise FileNotFoundError(f"{run_dir} is not a medbanana run directory (no {layout.RUN_CONFIG})")
        configs.append(json.loads(layout.inside(run_dir, layout.RUN_CONFIG, named_by=str(run_dir)).read_text()))
    for run_dir, cfg in zip(inputs[1:], configs[1:]):
        diffs = [k for k in IDENTITY_KEYS if cfg.get(k) != configs[0].get(k)]
        if diffs:
            raise MergeConflict(f"{run_dir} was made with other options than {inputs[0]}: {', '.join(diffs)}")
    owner: dict[str, Path] = {}
    finished: list[tuple[dict, list[tuple[Path, Path]]]] = []
    for run_dir in inputs:
        for uid, (line_no, record) in _finished_tasks(run_dir).items():
            copies = _checked_copies(run_dir, out, line_no, record)
            if uid in owner:
                raise MergeConflict(f"task {uid} is finished in both {owner[uid]} and {run_dir}")
            owner[uid] = run_dir
            finished.append((record, copies))
    config = {k: v for k, v in configs[0].items() if k not in ("created",)}
    config["merged_from"] = [str(p.resolve()) for p in inputs]
    if isinstance(config.get("selection"), dict):  # the merged run is every shard's: `--retry-failed` retries all
        config["selection"] = {**config["selection"], "shard": None}
    incoming = {dst: src for _, copies in finished for src, dst in copies}
    store = RunStore(out, config, incoming=incoming).open()
    try:
        # A task --out has finished already is one an interrupted merge got to (the rerun goes on after it), if it
        # came from this very record; any other is a conflict, found before anything is written.
        for record, _ in finished:
            earlier = store.finished.get(record["uid"])
            if earlier is not None and _as_merged(earlier) != _as_merged(record):
                raise MergeConflict(f"task {record['uid']} is already finished in {out}, with another record")
        todo = [(record, copies) for record, copies in finished if record["uid"] not in store.finished]
        for record, copies in todo:
            for src, dst in copies:
                _link_or_copy(src, dst)
            if record.get("final_image"):
                record["final_image_path"] = str((out / record["final_image"]).resolve())
            store.add_finished(record)
    finally:
        store.close()
    return {"inputs": len(inputs), "tasks": len(todo), "merged_before": len(finished) - len(todo)}


def _as_merged(record: dict) -> dict:
    """A task record without the one field merge rewrites (`final_image_path`, absolute, in --out)."""
    return {k: v for k, v in record.items() if k != "final_image_path"}
