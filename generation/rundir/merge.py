"""Combine run directories (shards of one job) into one. Two runs that finished the same task is an error; rerunning
an interrupted merge goes on where it stopped.

Shards may come from other machines, so every journal line is data: each `round` and `task` line is parsed by the
one schema and checked as the store writes it (journal.py: plain names the builder reads back, uid and key following
from them, rounds 1..n, each image the path the layout gives for its round), as a resumed run checks its own, and
each shard's medbanana-run.json is parsed as a `schema.RunConfig`; each image is read only from inside its shard,
must be a regular file there, and is written only inside --out (`layout.inside`, symlinks resolved). An image's
masks and original (layout.companion_relpaths) come along, before it, where the shard has them as regular files
inside it; any other is left behind (a build recomputes a missing mask). Every record of every shard is checked
before anything is written: a refusal is one line naming the shard, the journal line and the field, and --out is
left as it was (not created, if it did not exist). --out is locked as any run directory being written
(RunStore.open), the shards shared (lock.py). Records are merged as
they are, rounds included, so that `--retry-failed` on the merged run continues an api_failed task after them."""

from __future__ import annotations

import os
import shutil
from contextlib import ExitStack
from pathlib import Path

from . import layout, schema
from ..destinations import record_destinations
from ..files import MISSING, not_regular, same_bytes
from .journal import journal_lines
from .lock import hold_lock
from .store import IDENTITY_KEYS, RunStore
from ..failures import NotFound, UsageError


class MergeConflict(UsageError, RuntimeError):
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


def _regular_file(path: Path, named: str) -> bool:
    """Whether `path` (resolved) is a regular file: False when it does not exist; ValueError for a folder, a FIFO,
    a device or a name that cannot be looked up (too long), which merge must never open or link."""
    problem = not_regular(path)
    if problem is not None and problem != MISSING:
        raise UsageError(f"{named}: {problem}")
    return problem is None


def _finished_tasks(run_dir: Path) -> dict[str, tuple[str, schema.JournalRecord, dict]]:
    """uid -> (where, parsed record, record as written) of the last `task` line per uid, every line of the shard's
    journal parsed and checked first (journal.journal_lines)."""
    path = layout.inside(run_dir, layout.JOURNAL, named_by=f"the shard {run_dir}")
    latest: dict[str, tuple[str, schema.JournalRecord, dict]] = {}
    if not _regular_file(path, f"shard {run_dir}: {layout.JOURNAL}"):
        return latest
    for line in journal_lines(path, f"shard {run_dir}"):
        if line.task is not None:
            latest[line.task.uid] = (line.where, line.task.record, line.entry["record"])
    return latest


def _checked_copies(run_dir: Path, out: Path, where: str, record: schema.JournalRecord) -> list[tuple[Path, Path]]:
    """(source in the shard, destination in --out) of a checked record's images, each after its masks
    (`_mask_copies`): each inside its root (`layout.inside`), the source a regular file, the destination absent or
    a regular file; ValueError (or UnsafePath) naming the shard, the journal line and the round otherwise."""
    copies = []
    for n, rnd in enumerate(record.rounds, 1):
        if rnd.image:
            field = f"{where}: field 'record.rounds[{n - 1}].image'"
            src = layout.inside(run_dir, rnd.image, named_by=field)
            dst = layout.inside(out, rnd.image, named_by=field)
            if not _regular_file(src, f"{field} ({rnd.image} in the shard)"):
                raise UsageError(f"{field} ({rnd.image}): no such file in the shard")
            _regular_file(dst, f"{field} ({rnd.image} in {out})")
            copies += _mask_copies(run_dir, out, field, rnd.image)
            copies.append((src, dst))
    return copies


def _mask_copies(run_dir: Path, out: Path, field: str, image: str) -> list[tuple[Path, Path]]:
    """(source in the shard, destination in --out) of an image's masks and original (layout.companion_relpaths)
    that the shard holds as regular files inside it; one missing, irregular or linked outside the shard is not carried (never followed or opened). The
    destination is checked as an image's is."""
    copies = []
    for relpath in layout.companion_relpaths(image):
        try:
            src = layout.inside(run_dir, relpath, named_by=field)
        except layout.UnsafePath:
            continue
        if not_regular(src) is None:
            dst = layout.inside(out, relpath, named_by=field)
            _regular_file(dst, f"{field} ({relpath} in {out})")
            copies.append((src, dst))
    return copies


def merge_runs(inputs: list[Path], out: Path, *, partial: bool = False) -> dict:
    """Merge the finished tasks of `inputs` into `out` (a new or compatible run directory); returns counts.

    Shards made with `generate --shard i/N` must be all N, counting those merged into `out` before (its
    `shards` record), unless `partial`: the merged run then records `partial: true`, which a build's card says.
    `out` is locked like any run directory being written; the inputs are locked shared, so that a shard still
    being generated is refused (LockHeld) rather than merged half-done, and none starts while it is read."""
    inputs, out = [Path(p) for p in inputs], Path(out)
    with ExitStack() as locks:
        for run_dir in inputs:
            if run_dir.is_dir():
                locks.enter_context(hold_lock(run_dir, "run directory merged from", shared=True))
        return _merge(inputs, out, partial)


def shard_coverage(inputs: list[Path], configs: list[dict], out: Path, partial: bool) -> dict | None:
    """`{"of": N, "merged": [i, ...]}`: the shards of one `--shard i/N` split the inputs and `out`'s own record
    (an earlier merge into it) cover, None when no input is a shard. ValueError for shards of different splits, or
    for an incomplete set unless `partial`: naming the missing shards and both ways on."""
    parts: dict[int, set[int]] = {}  # N -> indices covered
    earlier = schema.read_run_config(out) if out.is_dir() else None
    for where, config in [*zip(map(str, inputs), configs), (str(out), earlier or {})]:
        shard = (config.get("selection") or {}).get("shard") if isinstance(config.get("selection"), dict) else None
        merged = config.get("shards")
        if isinstance(shard, list) and len(shard) == 2 and all(isinstance(v, int) for v in shard):
            parts.setdefault(shard[1], set()).add(shard[0])
        elif isinstance(merged, dict) and isinstance(merged.get("of"), int) and isinstance(merged.get("merged"), list):
            parts.setdefault(merged["of"], set()).update(i for i in merged["merged"] if isinstance(i, int))
    if not parts:
        return None
    if len(parts) > 1:
        raise MergeConflict(f"the runs are shards of different splits ({' and '.join(f'of {n}' for n in sorted(parts))}"
                            "); merge the shards of one `--shard i/N` split")
    (count, covered), = parts.items()
    missing = [i for i in range(count) if i not in covered]
    if missing and not partial:
        names = ", ".join(f"{i}/{count}" for i in missing)
        raise MergeConflict(f"incomplete shard set: {len(missing)} of {count} shards missing ({names}); give every "
                            f"run made with --shard i/{count}, or pass --partial to merge these alone (the merged "
                            "run, and a dataset built from it, then say that it is partial)")
    return {"of": count, "merged": sorted(covered & set(range(count)))}


def _run_config(run_dir: Path) -> dict:
    if (config := schema.read_run_config(run_dir, strict=True)) is None:
        raise NotFound(f"{run_dir} is not a medbanana run directory (no {layout.RUN_CONFIG})")
    return config


def _merge(inputs: list[Path], out: Path, partial: bool) -> dict:
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out} exists and is not a folder")
    configs = [_run_config(run_dir) for run_dir in inputs]
    for run_dir, cfg in zip(inputs[1:], configs[1:]):
        diffs = [k for k in IDENTITY_KEYS if cfg.get(k) != configs[0].get(k)]
        if diffs:
            raise MergeConflict(f"{run_dir} was made with other options than {inputs[0]}: {', '.join(diffs)}")
    shards = shard_coverage(inputs, configs, out, partial)
    # Every record of every shard is checked before anything is written: a refusal leaves --out as it was.
    owner: dict[str, Path] = {}
    finished: list[tuple[dict, list[tuple[Path, Path]]]] = []
    for run_dir in inputs:
        for uid, (where, parsed, record) in _finished_tasks(run_dir).items():
            copies = _checked_copies(run_dir, out, where, parsed)
            if uid in owner:
                raise MergeConflict(f"task {uid} is finished in both {owner[uid]} and {run_dir}")
            owner[uid] = run_dir
            finished.append((record, copies))
    config = {k: v for k, v in configs[0].items() if k not in ("created",)}
    config["merged_from"] = [str(p.resolve()) for p in inputs]
    # every shard's destinations with the data-use classes it sent there (shards of other datasets send others)
    config["destinations"] = record_destinations([], (), [d for c in configs if isinstance(c.get("destinations"), list)
                                                          for d in c["destinations"]])
    if isinstance(config.get("selection"), dict):  # the merged run is every shard's: `--retry-failed` retries all
        config["selection"] = {**config["selection"], "shard": None}
    if shards is not None:  # which shards it holds; `partial` when not all (merge --partial), for the card
        config.update(shards=shards, partial=len(shards["merged"]) < shards["of"])
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
            final = record.get("final_image")
            record["final_image_path"] = str((out / final).resolve()) if final else ""
            store.add_finished(record)
    finally:
        store.close()
    return {"inputs": len(inputs), "tasks": len(todo), "merged_before": len(finished) - len(todo), "shards": shards}


def _as_merged(record: dict) -> dict:
    """A task record without the one field merge rewrites (`final_image_path`, absolute, in --out)."""
    return {k: v for k, v in record.items() if k != "final_image_path"}
