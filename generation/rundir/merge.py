"""Combine run directories (shards of one job) into one. Two runs that finished the same task is an error; rerunning
an interrupted merge goes on where it stopped.

Shards may come from other machines, so every journal line is data: each `task` line is parsed by the one schema
(`schema.TASK_LINE`) and checked as the store writes it (`_check_record`: plain names the builder reads back, uid
and key following from them, rounds 1..n, each image the path the layout gives for its round); each image is read
only from inside its shard, must be a regular file there, and is written only inside --out (`layout.inside`,
symlinks resolved). An image's masks and original (layout.companion_relpaths) come along, before it, where the shard has them as
regular files inside it; any other is left behind (a build recomputes a missing mask). Every record of every shard
is checked before anything is written: a refusal is one line naming
the shard, the journal line and the field, and --out is left as it was (not created, if it did not exist). --out
is locked as any run directory being written (RunStore.open), the shards shared (lock.py). Records are merged as
they are, rounds included, so that `--retry-failed` on the merged run continues an api_failed task after them."""

from __future__ import annotations

import json
import os
import reprlib
import shutil
from contextlib import ExitStack
from pathlib import Path

import msgspec

from . import layout, schema
from ..files import MISSING, not_regular, same_bytes
from ..records import json_bool, task_uid
from ..taxonomy import DIRECTIONS
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


_REPR = reprlib.Repr()  # a value from the data in a refusal: quoted and escaped (repr), cut short
_REPR.maxstring = 200
_show = _REPR.repr
NAME_MAX = 255  # bytes in one file or folder name (ext4, XFS, Btrfs, NFS): a longer dataset folder cannot be made


def _refusal(where: str, field: str, problem: str) -> ValueError:
    return ValueError(f"{where}: field '{field}' {problem}")


def _regular_file(path: Path, named: str) -> bool:
    """Whether `path` (resolved) is a regular file: False when it does not exist; ValueError for a folder, a FIFO,
    a device or a name that cannot be looked up (too long), which merge must never open or link."""
    problem = not_regular(path)
    if problem is not None and problem != MISSING:
        raise ValueError(f"{named}: {problem}")
    return problem is None


def _finished_tasks(run_dir: Path) -> dict[str, tuple[str, schema.JournalRecord, dict]]:
    """uid -> (where, parsed record, record as written) of the last `task` line per uid, every `task` line checked
    first (`_check_record`). Lines that are not JSON (a torn line) are skipped, as `store.read_journal` does."""
    path = layout.inside(run_dir, layout.JOURNAL, named_by=f"the shard {run_dir}")
    latest: dict[str, tuple[str, schema.JournalRecord, dict]] = {}
    if not _regular_file(path, f"shard {run_dir}: {layout.JOURNAL}"):
        return latest
    with open(path, "rb") as fh:
        for line_no, raw in enumerate(fh, 1):
            where = f"shard {run_dir}, {layout.JOURNAL} line {line_no}"
            try:
                entry = json.loads(raw)
            except UnicodeDecodeError:
                raise ValueError(f"{where}: not UTF-8 text") from None
            except json.JSONDecodeError:
                continue
            if isinstance(entry, dict) and entry.get("type") == "task":
                try:
                    line = schema.TASK_LINE.decode(raw)
                except msgspec.ValidationError as exc:  # "Expected `str | null`, got `int` - at `$.record.disease`"
                    problem, _, field = str(exc).partition(" - at `$.")
                    raise _refusal(where, field.rstrip("`") or "record", f"is malformed: {problem}") from None
                except msgspec.DecodeError as exc:
                    raise ValueError(f"{where}: not valid JSON text ({exc})") from None
                _check_record(where, line)
                latest[line.uid] = (where, line.record, entry["record"])
    return latest


def _plain_name(where: str, field: str, value: str | None) -> str:
    """A name that becomes one path component of the layout (a dataset, disease or source id)."""
    if not value:
        raise _refusal(where, field, "is missing or empty")
    if "/" in value or "\x00" in value or value in (".", ".."):
        raise _refusal(where, field, f"is {_show(value)}, not a plain file name")
    return value


def _check_record(where: str, line: schema.TaskLine) -> None:
    """A task record as the store writes it (`store.conversation_record`), or ValueError naming the field: its
    names are plain names the builder reads back from the folders, its uid and key follow from them, its rounds are
    1..n with `accepted` only on a success's last, and each image is the path the layout gives for its round."""
    rec = line.record
    dataset = _plain_name(where, "record.dataset", rec.dataset)
    disease = _plain_name(where, "record.disease", rec.disease)
    source_id = _plain_name(where, "record.source_id", rec.source_id)
    if rec.task not in DIRECTIONS:
        raise _refusal(where, "record.task", f"is {_show(rec.task)}, not one of {', '.join(DIRECTIONS)}")
    if rec.status not in schema.STATUSES:
        raise _refusal(where, "record.status", f"is {_show(rec.status)}, not one of "
                                               f"{', '.join(schema.STATUSES)}")
    # the builder finds a dataset by its folder {D}-edit / {D}-remove: that name must read back as this dataset
    folder = layout.output_dir(Path(), dataset, rec.task).name
    if layout.parse_output_dir(folder) != (dataset, rec.task):
        raise _refusal(where, "record.dataset", f"is {_show(dataset)}, which no run folder name can carry")
    if len(os.fsencode(layout.failed_dir(Path(), dataset, rec.task).name)) > NAME_MAX:
        raise _refusal(where, "record.dataset", f"is {len(dataset)} characters: its folders' names would be "
                                                f"longer than {NAME_MAX} bytes")
    uid = task_uid(dataset, rec.task, source_id, disease)
    if rec.uid != uid or line.uid != uid:
        raise _refusal(where, "uid", f"is {_show(line.uid)} (record: {_show(rec.uid)}), not "
                                     f"{_show(uid)} as its dataset, task, source_id and disease give")
    if rec.key != f"{source_id}-{disease}":
        raise _refusal(where, "record.key", f"is {'missing' if rec.key is None else _show(rec.key)}, not "
                                            f"{_show(f'{source_id}-{disease}')}")
    success = rec.status == "success"
    last = len(rec.rounds)
    for n, rnd in enumerate(rec.rounds, 1):
        at = f"record.rounds[{n - 1}]"
        if rnd.round != n:
            raise _refusal(where, f"{at}.round", f"is {rnd.round!r}, not {n}: rounds are numbered 1, 2, ...")
        if rnd.accepted is not (success and n == last):
            raise _refusal(where, f"{at}.accepted", f"is {rnd.accepted!r}, which a {rec.status} task's round "
                                                    f"{n} of {last} cannot be")
        success_field = rnd.edit_result.success if rnd.edit_result is not None else None
        edited = True if success_field is None else json_bool(success_field)  # None: edited, as the builder reads it
        if edited is None:
            raise _refusal(where, f"{at}.edit_result.success", "is neither true nor false")
        expected = layout.attempt_image_relpath(dataset, rec.task, source_id, disease, n, rnd.accepted)
        if (rnd.image or "") != (expected if edited else ""):
            should = f"the layout's {expected}" if edited else "empty (the edit gave no image)"
            raise _refusal(where, f"{at}.image", f"is {_show(rnd.image)}, not {should}")
    if success and rec.success_round not in (None, last):  # None: the builder takes the last round
        raise _refusal(where, "record.success_round", f"is {rec.success_round!r}, not its last round {last}")
    if not success and rec.success_round is not None:
        raise _refusal(where, "record.success_round", f"is {rec.success_round!r} in a {rec.status} task")
    final = (rec.rounds[-1].image or "") if rec.rounds else ""
    if (rec.final_image or "") != final:
        raise _refusal(where, "record.final_image", f"is {_show(rec.final_image)}, not its last round's "
                                                    f"image {final!r}")
    if (rec.api_failure is not None) != (rec.status == "api_failed"):
        raise _refusal(where, "record.api_failure", f"is {'missing' if rec.api_failure is None else 'present'} "
                                                    f"in a {rec.status} task")
    if rec.api_failure is not None and rec.api_failure.task != rec.key:
        raise _refusal(where, "record.api_failure.task", f"is {_show(rec.api_failure.task)}, not the "
                                                         f"record's key {rec.key}")


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
                raise ValueError(f"{field} ({rnd.image}): no such file in the shard")
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


def _run_config(run_dir: Path) -> dict:
    if (config := schema.read_run_config(run_dir)) is None:
        raise FileNotFoundError(f"{run_dir} is not a medbanana run directory (no {layout.RUN_CONFIG})")
    return config


def _merge(inputs: list[Path], out: Path) -> dict:
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} exists and is not a folder")
    configs = [_run_config(run_dir) for run_dir in inputs]
    for run_dir, cfg in zip(inputs[1:], configs[1:]):
        diffs = [k for k in IDENTITY_KEYS if cfg.get(k) != configs[0].get(k)]
        if diffs:
            raise MergeConflict(f"{run_dir} was made with other options than {inputs[0]}: {', '.join(diffs)}")
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
            final = record.get("final_image")
            record["final_image_path"] = str((out / final).resolve()) if final else ""
            store.add_finished(record)
    finally:
        store.close()
    return {"inputs": len(inputs), "tasks": len(todo), "merged_before": len(finished) - len(todo)}


def _as_merged(record: dict) -> dict:
    """A task record without the one field merge rewrites (`final_image_path`, absolute, in --out)."""
    return {k: v for k, v in record.items() if k != "final_image_path"}
