"""A task's masks for its rows (`edit_mask`, `region_mask`): the ones its run stored when it wrote each attempt
image (`layout.mask_relpaths`, generation/masks.py), else computed here from the source when the build has it (a
released run, or a run from before masks were stored), else none (null columns).

A stored mask is used only when generation/mask_check.py finds it a mask: a binary 0/255 PNG of 8-bit grey with no
chunk but IHDR/IDAT/IEND, of the edit's size (an edit mask) or the source's (a region mask; without the source, of
an edit's shape), bounded in bytes (checked on the file's size, before it is read) and pixels (on its header, before
it is decoded). Anything else, a folder or a special file at its path included, is rejected: counted with its path
and reason (`rejections`), then computed from the source when the build has it, else left null, never embedded.
The masks folder is read like the images: paths stay inside the run (and inside the named output folder's mirror
when the build was given one folder), and the folder itself must not lead out of the run. No mask is computed for
an image (or from a source) of more than mask_check.MAX_MASK_PIXELS pixels.
"""

from __future__ import annotations

import threading
from collections import Counter
from pathlib import Path

from ..mask_check import (LIKE_PIXELS, MAX_MASK_PIXELS, TOO_LARGE, MaskProblem, header_size,
                                     mask_problem, max_mask_bytes)
from ..records import TaskMasks
from . import layout
from .task_records import TaskRecord
from .confined import Confined, NotRegular, Refused, inside

STORED, COMPUTED, MISSING = "stored", "computed", "missing"  # where an attempt image's edit mask came from
REJECTED, REGION_REJECTED = "rejected", "region_rejected"  # stored masks refused on read (of the images above)
NOT_A_FILE = "a folder or special file"  # a rejection's kind, beside mask_check's


class MaskFolders:
    """Each run's masks folder, checked once: None when the run has none (a released run: no file is looked for).

    A masks folder that is a link out of the run is refused, as an image folder is; with `skip` (`--unsafe skip`)
    the run's stored masks are left out instead (its masks are computed or null) and the refusal kept in
    `refusals`, for the build's statistics."""

    def __init__(self, skip: bool = False):
        self.skip, self.refusals = skip, []
        self._roots: dict[Path, Path | None] = {}
        self._lock = threading.Lock()  # the build's reader threads share one

    def root(self, run_dir: Path) -> Path | None:
        with self._lock:
            if run_dir not in self._roots:
                folder = run_dir / layout.MASKS
                self._roots[run_dir] = folder if folder.is_dir() else None
                if folder.is_dir():
                    try:
                        inside(run_dir, layout.MASKS, f"{run_dir}'s masks folder")
                    except Refused as exc:
                        if not self.skip:
                            del self._roots[run_dir]
                            raise
                        self.refusals.append(exc)
                        self._roots[run_dir] = None
            return self._roots[run_dir]


class Rejections:
    """The stored masks rejected on read: counts by kind (mask_check's, NOT_A_FILE) and each one's path and why."""

    def __init__(self):
        self.kinds: Counter = Counter()
        self.items: list[str] = []
        self.regions = 0  # of the items, region masks

    def add(self, where: str, problem: MaskProblem, region: bool) -> None:
        self.kinds[problem.kind] += 1
        self.items.append(f"{where}: {problem}")
        self.regions += region

    def update(self, other: Rejections) -> None:
        self.kinds.update(other.kinds)
        self.items.extend(other.items)
        self.regions += other.regions


def _stored(confined: Confined, task: TaskRecord, root: Path, relative: str, named: str, rejections: Rejections,
            size: tuple[int, int] | None = None, like: list | None = None, region: bool = False) -> dict | None:
    """The stored mask at `relative` in `root` as an Image value when it is a mask of `size` (or `like`); None when
    there is none, or it is rejected (and then counted in `rejections`)."""
    if size is None and not like:  # nothing to check it against: not read
        return None
    largest = size or max(like, key=lambda wh: wh[0] * wh[1])
    most = max_mask_bytes((largest[0] * (1 if size else LIKE_PIXELS), largest[1]))
    where = f"{task.run_dir.name}/{layout.MASKS}/{relative}"
    try:
        data = confined.read_at_most(root, relative, named, task.scope, most)
    except NotRegular as exc:
        rejections.add(where, MaskProblem(TOO_LARGE, f"more than {most:,} bytes") if exc.too_large
                       else MaskProblem(NOT_A_FILE, ""), region)
        return None
    if data is None:
        return None
    problem = mask_problem(data, size, like=like)
    if problem is not None:
        rejections.add(where, problem, region)
        return None
    return {"bytes": data, "path": None}


def stored_masks(task: TaskRecord, images: dict[str, dict | None], confined: Confined, root: Path | None,
                 source_size: tuple[int, int] | None = None, rejections: Rejections | None = None) -> TaskMasks:
    """The masks the run stored (in its masks folder `root`, None: it has none) beside each of the task's attempt
    images, as a TaskMasks (None where there is none usable); each rejected one counted in `rejections`. A region
    mask must be `source_size` when the source is known, else of an attempt image's shape."""
    rejections = rejections if rejections is not None else Rejections()
    masks = TaskMasks()
    sizes = {relpath: header_size(value["bytes"]) for relpath, value in images.items() if value is not None}
    shapes = [wh for wh in sizes.values() if wh is not None]
    for relpath, value in images.items():
        masks.edits[relpath] = None
        if root is None or value is None or sizes[relpath] is None:
            continue
        edit_rel, region_rel = (p.removeprefix(layout.MASKS + "/") for p in layout.mask_relpaths(relpath))
        named = f"{task.origin} (the stored masks of {relpath})"
        masks.edits[relpath] = _stored(confined, task, root, edit_rel, named, rejections, size=sizes[relpath])
        if masks.region is None:
            masks.region = _stored(confined, task, root, region_rel, named, rejections, size=source_size,
                                   like=None if source_size else shapes, region=True)
    return masks


def row_masks(task: TaskRecord, images: dict[str, dict | None], source: dict | None, confined: Confined,
              folders: MaskFolders, origins: Counter | None = None, rejections: Rejections | None = None):
    """The task's masks (a TaskMasks): stored ones, the rest computed from `source` when there is
    one; None when there are neither (null columns). `origins` counts each attempt image's edit mask by STORED /
    COMPUTED / MISSING, and the stored masks rejected (REJECTED, REGION_REJECTED), which `rejections` lists. A run
    without masks built without sources imports no scipy (a spawned worker starts faster)."""
    root = folders.root(task.run_dir)
    if root is None and source is None:
        if origins is not None:
            origins[MISSING] += sum(value is not None for value in images.values())
        return None
    source_size = header_size(source["bytes"]) if source is not None else None
    mine = Rejections()
    masks = stored_masks(task, images, confined, root, source_size, mine)
    wanted = [relpath for relpath, value in masks.edits.items() if value is None and images[relpath] is not None]
    if source_size is not None and source_size[0] * source_size[1] <= MAX_MASK_PIXELS and \
            (wanted or masks.region is None):
        from ..masks import task_masks  # only here: a build of stored masks never imports scipy

        bounded = [relpath for relpath in wanted if _bounded(images[relpath])]
        computed = task_masks({relpath: images[relpath] for relpath in bounded}, source, task.modality, task.disease)
        if computed is not None:
            masks.region = masks.region or computed.region
            for relpath in bounded:
                masks.edits[relpath] = computed.edits.get(relpath)
                if origins is not None and masks.edits[relpath] is not None:
                    origins[COMPUTED] += 1
    if origins is not None:
        for relpath, value in masks.edits.items():
            if value is None:
                origins[MISSING] += images[relpath] is not None
            elif relpath not in wanted:
                origins[STORED] += 1
        for key, n in ((REJECTED, len(mine.items) - mine.regions), (REGION_REJECTED, mine.regions)):
            if n:
                origins[key] += n
    if rejections is not None:
        rejections.update(mine)
    if source is None and masks.region is None and not any(masks.edits.values()):
        return None
    return masks


def _bounded(value: dict) -> bool:
    size = header_size(value["bytes"])
    return size is not None and size[0] * size[1] <= MAX_MASK_PIXELS
