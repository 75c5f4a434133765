"""Read run directories into plain task records, whatever wrote them.

Four inputs give the same `TaskRecord`s:
  * the original scripts' layout: `{D}-edit/` and `{D}-remove/` folders holding `all_conversations.json`,
    `progress.json` and `api_failures.json` (released Med-Banana data, JSON written on another machine);
  * our runs: the same layout and files whose entries carry extra fields (uid, modality, task, source_path, ...);
  * the paper's §5.2 record schema: a JSON-lines file named `records.jsonl` at the top of the run directory
    (or any `*.jsonl` given directly), one record per task: `{image_id, dataset, modality, disease, task,
    rounds: [{round, instruction, verdict: {has_disease, structure_reasonable, looks_realistic, qualified,
    reason}}], outcome, success_round, output_path}`; images are found by the layout next to the file
    (`output_path`, a path on the machine that wrote it, is not used);
  * an image-only release folder (`<Prefix>-edit/<Disease>/<stem>-<Disease>-edit.jpeg`, no JSON): accepted
    edits only, without instructions or verdicts.

Images are always found by the layout (`generation.rundir.layout`), never by the absolute `final_image_path` of
the machine that made the run. JSON is decoded with msgspec into the Structs of `generation.rundir.schema` (about
five times faster than `json` on these files, and only the fields used are kept); `run_json` reads the files,
`readers` turns entries into records.

Nothing is read from outside the folder the user named: folders, JSON files and image-only listings found here,
and every image path an entry implies, go through `layout.inside` (via `confined`); an input that fails is a
`confined.Refused`, raised, or handed to the caller's `refused` function to be recorded (the build's `--unsafe skip`).
When the user names one output folder (`RUN/{D}-edit`) rather than its run, paths keep their run-relative form
(`{D}-edit/...`) but must stay in that folder or its `-failed` sibling (the unit's and task's `scope`); the run's
own files (medbanana-run.json) are then not read.
"""

from __future__ import annotations

import gc
import os
from pathlib import Path

from . import layout, readers, schema
from .confined import OUTSIDE, Confined, Refused, handle, inside
from .layout import RECORDS_JSONL
from .task_records import TaskRecord, Unit, image_files
from ..failures import NotFound, UsageError

def discover_units(run_path: Path, refused=None) -> list[Unit]:
    """Everything readable in a run directory (or a records file, or a single `{D}-edit` folder).

    A folder or JSON file that leads outside what was named (a symlink) is refused: raised, or passed to
    `refused`. Given one `{D}-edit` folder, its units' paths must stay in it (or its `-failed` sibling)."""
    run_path = Path(run_path)
    if run_path.is_file():
        if run_path.suffix != ".jsonl":
            raise UsageError(f"{run_path}: a run is a directory or a .jsonl file of §5.2 records")
        return [Unit("records", run_path.parent, run_path)]
    if not run_path.is_dir():
        raise NotFound(f"run directory not found: {run_path}")
    listing = f"the listing of {run_path}"
    if (run_path / RECORDS_JSONL).is_file():
        try:
            inside(run_path, RECORDS_JSONL, listing)
            return [Unit("records", run_path, run_path / RECORDS_JSONL)]
        except Refused as exc:
            handle(exc, refused)
    own = layout.parse_output_dir(run_path.name)
    if own and _has_json(run_path):  # pointed at one output folder: it is the root, not its run
        found = [(*own, run_path)]
        root, scope = run_path.parent, run_path.name
    else:
        found, root, scope = layout.find_output_dirs(run_path), run_path, None
    units = []
    for dataset, direction, path in found:
        try:
            unit = _unit(root, dataset, direction, path, refused, scope)
        except Refused as exc:
            handle(exc, refused)
            continue
        if unit is not None:
            units.append(unit)
    if not units:
        raise UsageError(f"{run_path}: no {{D}}-edit / {{D}}-remove folders with JSON or images, "
                         f"and no {RECORDS_JSONL}; is this a Med-Banana run directory?")
    return units


def _unit(root: Path, dataset: str, direction: str, path: Path, refused, scope: str | None = None) -> Unit | None:
    listing = f"the listing of {root}"
    if scope is None:  # a {D}-edit folder that is a symlink out of the run (one the user named is the root)
        inside(root, path.name, listing)
    if _has_json(path):
        for name in (layout.ALL_CONVERSATIONS, layout.PROGRESS, layout.API_FAILURES):
            if os.path.lexists(path / name):
                inside(root, f"{path.name}/{name}", listing, scope)
        return Unit("json", root, path, dataset, direction, scope=scope)
    classes = []
    for class_dir in sorted(p for p in path.iterdir() if p.is_dir()):
        try:  # checked before it is listed: a class folder linked elsewhere would name outside files
            inside(root, f"{path.name}/{class_dir.name}", f"the listing of {path}", scope)
            classes.append(class_dir.name)
        except Refused as exc:
            handle(exc, refused)
    unit = Unit("images", root, path, dataset, direction, tuple(classes), scope)
    return unit if any(image_files(unit)) else None


def read_tasks(unit: Unit, part: int = 0, parts: int = 1, refused=None) -> list[TaskRecord]:
    """The unit's tasks, or only the `part`-th of `parts` contiguous blocks of them (for parallel builds).

    A malformed entry, or one whose image paths lead outside the run, is refused (`confined.Refused`): raised when
    `refused` is None, else passed to it and left out. A file that cannot be read at all is a ValueError."""
    reader = {"json": readers.read_json_unit, "records": readers.read_records_unit,
              "images": readers.read_image_unit}[unit.kind]
    # Bulk loading makes ~10 objects per attempt and no reference cycles: the cyclic collector would rescan
    # the growing heap again and again (a third of the time at release scale) for nothing.
    enabled = gc.isenabled()
    gc.disable()
    try:
        return reader(unit, part, parts, Confined(), refused)
    finally:
        if enabled:
            gc.enable()


def unit_size(unit: Unit) -> int:
    """Bytes the unit's reading depends on (JSON, or images for image-only folders): to balance partitions."""
    if unit.kind == "json":
        return sum(p.stat().st_size for p in (unit.path / layout.ALL_CONVERSATIONS, unit.path / layout.PROGRESS)
                   if p.is_file())
    if unit.kind == "records":
        return unit.path.stat().st_size
    return sum(os.lstat(unit.run_dir / relative).st_size for relative in image_files(unit))


def task_keys(unit: Unit, refused=None) -> list[str]:
    """The uids of a unit (for duplicate checks across runs)."""
    return [t.uid for t in read_tasks(unit, refused=refused)]


def recorded_max_rounds(run_dir: Path, refused=None) -> int | None:
    """The round limit a run of ours recorded in medbanana-run.json, None without one. Read only from inside
    the run (else refused); a file that does not hold a number of rounds is a ValueError naming it."""
    config = Path(run_dir) / layout.RUN_CONFIG
    try:
        value = (schema.read_run_config(run_dir) or {}).get("max_rounds")
    except layout.UnsafePath as exc:
        handle(Refused(str(exc), OUTSIDE), refused)
        return None
    if value is not None and (value.__class__ is not int or not 0 < value < 1000):
        raise UsageError(f"{config}: field 'max_rounds' is {value!r:.40}, not a number of rounds")
    return value


def recorded_signing(run_dir: Path) -> str | None:
    """The SHA-256 fingerprint of the certificate a run of ours signed its images with (medbanana-run.json's
    `c2pa`), None when it did not sign or records nothing readable (the card then says nothing of signing)."""
    try:
        value = ((schema.read_run_config(run_dir) or {}).get("c2pa") or {}).get("certificate_sha256")
    except (ValueError, AttributeError, OSError):  # linked out, not a run configuration, unreadable
        return None
    return value if isinstance(value, str) and len(value) == 64 and all(c in "0123456789abcdef" for c in value) \
        else None


def recorded_destinations(run_dir: Path) -> list[dict] | None:
    """Where a run of ours sent its images and the data-use classes it sent there (medbanana-run.json's
    `destinations`, generation/destinations.py), None when it records none or nothing readable."""
    try:
        value = (schema.read_run_config(run_dir) or {}).get("destinations")
    except (ValueError, AttributeError, OSError):  # linked out, not a run configuration, unreadable
        return None
    return [entry for entry in value if isinstance(entry, dict)] if isinstance(value, list) else None


def recorded_partial(run_dir: Path) -> dict | None:
    """`{"of": N, "merged": [i, ...]}` when the run is a `merge --partial` of some of the shards of a `--shard i/N`
    split (medbanana-run.json's `partial` and `shards`), None otherwise or when it records nothing readable."""
    try:
        config = schema.read_run_config(run_dir) or {}
    except (ValueError, OSError):  # linked out, not a run configuration, unreadable: nothing to say
        return None
    shards = config.get("shards")
    if config.get("partial") is not True or not isinstance(shards, dict) or not isinstance(shards.get("of"), int):
        return None
    merged = [i for i in shards.get("merged") or () if isinstance(i, int)]
    return {"of": shards["of"], "merged": merged}


def _has_json(folder: Path) -> bool:
    return (folder / layout.ALL_CONVERSATIONS).is_file() or (folder / layout.PROGRESS).is_file()
