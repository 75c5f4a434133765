"""A task's masks for its rows (`edit_mask`, `region_mask`): the ones its run stored when it wrote each attempt
image (`layout.mask_relpaths`, generation/masks.py), else computed here from the source when the build has it (a
released run, or a run from before masks were stored), else none (null columns).

A stored mask is used only when it is a PNG of mode L and, for an edit mask, of the edit's size; anything else
(truncated, another image, another size) is treated as missing. The masks folder is read like the images: paths stay
inside the run (and inside the named output folder's mirror when the build was given one folder), and the folder
itself must not lead out of the run.
"""

from __future__ import annotations

import io
import threading
from collections import Counter
from pathlib import Path

from PIL import Image

from ..generation.records import TaskMasks
from ..generation.rundir import layout
from .runs import TaskRecord
from .safety import PNG_MAGIC, Confined, Refused, inside

STORED, COMPUTED, MISSING = "stored", "computed", "missing"  # where an attempt image's edit mask came from


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


def _size(data: bytes) -> tuple[int, int] | None:
    try:
        with Image.open(io.BytesIO(data)) as image:  # the header only
            return image.size
    except Exception:  # noqa: BLE001 - an unreadable edit has no size to match (its row says so elsewhere)
        return None


def _mask_value(data: bytes | None, size: tuple[int, int] | None) -> dict | None:
    """`data` as an Image value when it is a mask PNG (mode L; of `size` when given), else None."""
    if not data or not data.startswith(PNG_MAGIC):
        return None
    try:
        with Image.open(io.BytesIO(data), formats=["PNG"]) as image:
            if image.mode != "L" or (size is not None and image.size != size):
                return None
    except Exception:  # noqa: BLE001 - Pillow raises many kinds on bad input; each means "not a mask"
        return None
    return {"bytes": data, "path": None}


def stored_masks(task: TaskRecord, images: dict[str, dict | None], confined: Confined, root: Path | None):
    """The masks the run stored (in its masks folder `root`, None: it has none) beside each of the task's attempt
    images, as a TaskMasks (None where there is none usable)."""
    masks = TaskMasks()
    for relpath, value in images.items():
        masks.edits[relpath] = None
        if root is None or value is None:
            continue
        edit_rel, region_rel = (p.removeprefix(layout.MASKS + "/") for p in layout.mask_relpaths(relpath))
        named = f"{task.origin} (the stored masks of {relpath})"
        masks.edits[relpath] = _mask_value(confined.read(root, edit_rel, named, task.scope), _size(value["bytes"]))
        if masks.region is None:
            masks.region = _mask_value(confined.read(root, region_rel, named, task.scope), None)
    return masks


def row_masks(task: TaskRecord, images: dict[str, dict | None], source: dict | None, confined: Confined,
              folders: MaskFolders, origins: Counter | None = None):
    """The task's masks (a TaskMasks): stored ones, the rest computed from `source` when there is
    one; None when there are neither (null columns). `origins` counts each attempt image's edit mask by STORED /
    COMPUTED / MISSING. A run without masks built without sources imports no scipy (a spawned worker starts
    faster)."""
    root = folders.root(task.run_dir)
    if root is None and source is None:
        if origins is not None:
            origins[MISSING] += sum(value is not None for value in images.values())
        return None
    masks = stored_masks(task, images, confined, root)
    wanted = [relpath for relpath, value in masks.edits.items() if value is None and images[relpath] is not None]
    if source is not None and (wanted or masks.region is None):
        from ..generation.masks import task_masks  # only here: a build of stored masks never imports scipy

        computed = task_masks({relpath: images[relpath] for relpath in wanted}, source, task.modality, task.disease)
        if computed is not None:
            masks.region = masks.region or computed.region
            for relpath in wanted:
                masks.edits[relpath] = computed.edits.get(relpath)
                if origins is not None and masks.edits[relpath] is not None:
                    origins[COMPUTED] += 1
    if origins is not None:
        for relpath, value in masks.edits.items():
            if value is None:
                origins[MISSING] += images[relpath] is not None
            elif relpath not in wanted:
                origins[STORED] += 1
    if source is None and masks.region is None and not any(masks.edits.values()):
        return None
    return masks
