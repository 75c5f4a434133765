"""Paths of the original Med-Banana scripts' run layout. The one place that knows file and folder names.

Per source dataset folder {D} and direction (the add direction is called "edit" in names):

    {D}-edit/{Disease}/{stem}-{Disease}-edit.jpeg                        accepted add edit
    {D}-edit-failed/{Disease}/{stem}-{Disease}-edit-failed-{round}.jpeg  each rejected add attempt
    {D}-remove/normal/{stem}-{Disease}-remove.jpeg                       accepted remove edit
    {D}-remove-failed/normal/{stem}-{Disease}-remove-failed-{round}.jpeg each rejected remove attempt
    {D}-{edit|remove}/{progress,api_failures,final_prompts,all_conversations}.json
    {D}-{edit|remove}-failed/failed_summary.json

Ours beside them: medbanana-*.json(l) files, medbanana-masks/{image}.edit.png and .region.png per attempt image
(its edit mask and its task's region, generation/masks.py, computed when the image was written),
medbanana-originals/{image} (the editor's own image of an attempt that `--geometry register` warped back onto its
source's grid, generation/geometry.py) and medbanana-orphans/{image} (images of another origin set aside on
opening).
"""

from __future__ import annotations

import re
from pathlib import Path

from ..taxonomy import DIRECTION_FOLDER
from ..failures import UsageError

PROGRESS = "progress.json"
API_FAILURES = "api_failures.json"
FINAL_PROMPTS = "final_prompts.json"
ALL_CONVERSATIONS = "all_conversations.json"
FAILED_SUMMARY = "failed_summary.json"
RECORDS_JSONL = "records.jsonl"  # the paper's §5.2 records, at the top of a run directory (read, never written)
# Ours, at the run directory's top level.
JOURNAL = "medbanana-journal.jsonl"
RUN_CONFIG = "medbanana-run.json"
STATS = "medbanana-stats.json"
SOURCES_MANIFEST = "medbanana-sources.json"
MASKS = "medbanana-masks"  # an attempt image's masks (`mask_relpaths`), mirroring the images' paths
ORPHANS = "medbanana-orphans"  # images on opening that no journal line names and this run did not write
ORIGINALS = "medbanana-originals"  # the editor's image of a registered attempt (`original_relpath`)

IMAGE_SUFFIXES = (".jpeg", ".jpg", ".png")  # image files of a run (attempts, sources found by the builder)
# {D}-edit, {D}-remove, {D}-edit-failed, {D}-remove-failed
_LAYOUT_DIR = re.compile(r"^(?P<dataset>.+)-(?P<word>edit|remove)(?P<failed>-failed)?$")
_DIRECTION_OF_WORD = {word: direction for direction, word in DIRECTION_FOLDER.items()}


def direction_word(direction: str) -> str:
    return DIRECTION_FOLDER[direction]


def is_layout_dir(name: str) -> bool:
    """Whether a folder name is one of the layout's four per dataset and direction."""
    return _LAYOUT_DIR.match(name) is not None


def parse_output_dir(name: str) -> tuple[str, str] | None:
    """(dataset, direction) of an output folder name `{D}-edit` / `{D}-remove`; None for any other name."""
    m = _LAYOUT_DIR.match(name)
    if m is None or m["failed"]:
        return None
    return m["dataset"], _DIRECTION_OF_WORD[m["word"]]


def output_dir(run_dir: Path, dataset: str, direction: str) -> Path:
    """{D}-edit or {D}-remove: accepted images and the JSON files."""
    return Path(run_dir) / f"{dataset}-{direction_word(direction)}"


def failed_dir(run_dir: Path, dataset: str, direction: str) -> Path:
    return Path(run_dir) / f"{dataset}-{direction_word(direction)}-failed"


def class_folder(disease: str, direction: str) -> str:
    """Add edits are filed under the disease; remove edits under `normal`."""
    return disease if direction == "add" else "normal"


def accepted_image_relpath(dataset: str, direction: str, stem: str, disease: str) -> str:
    word = direction_word(direction)
    return f"{dataset}-{word}/{class_folder(disease, direction)}/{stem}-{disease}-{word}.jpeg"


def failed_image_relpath(dataset: str, direction: str, stem: str, disease: str, round_no: int) -> str:
    word = direction_word(direction)
    return f"{dataset}-{word}-failed/{class_folder(disease, direction)}/{stem}-{disease}-{word}-failed-{round_no}.jpeg"


def attempt_image_relpath(dataset: str, direction: str, stem: str, disease: str, round_no: int,
                          accepted: bool) -> str:
    if accepted:
        return accepted_image_relpath(dataset, direction, stem, disease)
    return failed_image_relpath(dataset, direction, stem, disease, round_no)


def mask_relpaths(image_relpath: str) -> tuple[str, str]:
    """(edit mask, region mask) of an attempt image at `image_relpath`: PNG files under MASKS, mode L, 0/255,
    the edit mask at the image's size and the region at its source's (generation/masks.py)."""
    return f"{MASKS}/{image_relpath}.edit.png", f"{MASKS}/{image_relpath}.region.png"


def original_relpath(image_relpath: str) -> str:
    """Where the editor's own image of the attempt image at `image_relpath` is kept when the image is that edit
    warped back onto the source's grid (`generate --geometry register`): under ORIGINALS, the same path."""
    return f"{ORIGINALS}/{image_relpath}"


def companion_relpaths(image_relpath: str) -> tuple[str, ...]:
    """Every file the run keeps beside an attempt image: its masks and, when it was registered, the original."""
    return (*mask_relpaths(image_relpath), original_relpath(image_relpath))


def split_task_key(key: str, disease: str) -> str:
    """The source stem of a task key `{stem}-{Disease}`."""
    suffix = f"-{disease}"
    if not key.endswith(suffix):
        raise UsageError(f"task key {key!r} does not end with -{disease}")
    return key[: -len(suffix)]


def find_output_dirs(run_dir: Path) -> list[tuple[str, str, Path]]:
    """(dataset, direction, path) for every {D}-edit / {D}-remove folder in a run directory."""
    found = []
    for path in sorted(Path(run_dir).iterdir()):
        parsed = parse_output_dir(path.name)
        if path.is_dir() and parsed:
            found.append((*parsed, path))
    return found


class UnsafePath(UsageError):
    """A path named by data (run JSON, a journal, a manifest, a source listing) that leads outside its root, or
    through a symlink that loops or dangles."""


def inside(root: Path, relative: str | Path, *, named_by: str = "") -> Path:
    """`root / relative` with symlinks resolved, required to stay inside `root` (resolved too): the one
    containment rule for every path that comes from data. A symlink that stays inside the root is followed.

    Raises UnsafePath naming the path, who named it (`named_by`, e.g. the JSON file and entry) and why: an absolute
    path, `..` leaving the root, a symlink pointing outside it, a symlink loop.
    """
    root = Path(root)
    where = f" (named by {named_by})" if named_by else ""
    text = str(relative)
    if not text or "\x00" in text:
        raise UnsafePath(f"{text!r}{where}: not a usable path")
    if Path(text).is_absolute():
        raise UnsafePath(f"{text}{where}: an absolute path; only paths relative to {root} are read")
    try:
        real_root = root.resolve(strict=False)
        target = (root / text).resolve(strict=False)
    except (RuntimeError, OSError) as exc:  # Python 3.11 raises RuntimeError on a symlink loop
        raise UnsafePath(f"{text}{where}: cannot be resolved inside {root} ({exc})") from None
    if target != real_root and real_root not in target.parents:
        link = " through a symlink" if ".." not in Path(text).parts else ""
        raise UnsafePath(f"{text}{where}: leads outside {root}{link} (to {target})")
    return target


def inside_named_folder(run_dir: Path, folder: str, relative: str | Path, *, named_by: str = "") -> Path:
    """`inside` for a build or evaluation given one output folder `run_dir/folder` ({D}-edit or {D}-remove) rather
    than its run: a path (relative to `run_dir`, as the layout writes them) must lie in that folder, or in its
    `-failed` sibling, each resolved as a root of its own; the sibling must not be a link out of `run_dir`. The
    sibling's name comes from the folder named, never from data: it holds the rejected attempts of the same tasks,
    whose JSON is in the folder named.
    """
    text = str(relative)
    top, _, rest = text.partition("/")
    if top not in (folder, f"{folder}-failed"):
        where = f" (named by {named_by})" if named_by else ""
        raise UnsafePath(f"{text}{where}: leads outside {Path(run_dir) / folder}, the folder named (only it and its "
                         f"-failed sibling are read)")
    if top != folder:
        inside(run_dir, top, named_by=named_by)
    return inside(Path(run_dir) / top, rest or ".", named_by=named_by)


_FILE_NAMES = frozenset({PROGRESS, API_FAILURES, FINAL_PROMPTS, ALL_CONVERSATIONS, FAILED_SUMMARY})


def folders_leading_out(run_dir: Path) -> list[str]:
    """The folders a run writes into that lead outside `run_dir` through a symlink (or one that dangles or loops):
    `{D}-edit`... and their class folders, MASKS, ORIGINALS and ORPHANS and their mirrors of those. Writing there would write
    outside the run. Run-relative paths, sorted; a link that stays inside is followed and the folders below it
    checked in turn; other names (a user's notes folder) are not looked at."""
    run_dir = Path(run_dir)
    found: list[str] = []

    def leads_out(path: Path) -> bool:
        if path.is_symlink():
            try:
                inside(run_dir, path.relative_to(run_dir))
            except UnsafePath:
                found.append(path.relative_to(run_dir).as_posix())
                return True
        return False

    def output_folders(parent: Path) -> None:  # {D}-edit... and their class folders
        for path in sorted(parent.iterdir()):
            if is_layout_dir(path.name) and not leads_out(path) and path.is_dir():
                for child in sorted(path.iterdir()):  # a link at a file's name is replaced, never written through
                    if child.name not in _FILE_NAMES and not child.is_file():
                        leads_out(child)

    if run_dir.is_dir():
        output_folders(run_dir)
        for mirror in (run_dir / MASKS, run_dir / ORIGINALS, run_dir / ORPHANS):
            if not leads_out(mirror) and mirror.is_dir():
                output_folders(mirror)
    return sorted(found)
