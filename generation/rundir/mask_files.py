"""The masks stored beside each attempt image (layout.MASKS, `layout.mask_relpaths`): computed when the run writes
the image (generation/masks.py, `attempt_mask_files`), so a build copies them instead of computing them. `compute`
is what the runners run in their process pool (runners/image_work.py), off their event loop.

A companion beside a journalled image is always from the write that wrote that image: the store writes both
companions (atomically) before the image and its journal line, and removes a companion it cannot make this time,
since a killed earlier write of the same round may have left one. Opening a run removes the temp files under
layout.MASKS and every companion whose image no journal line names.
"""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

from . import layout
from ..files import TEMP_NAME, atomic_write_bytes
from ..masks import attempt_mask_files
from ..records import Task

MaskFiles = tuple[bytes | None, bytes | None]  # (edit mask PNG, region mask PNG); None: none could be made
SUFFIXES = (".edit.png", ".region.png")  # what `layout.mask_relpaths` appends to the image's path


def compute(task: Task, edited: bytes, frame_rejected: bool = False, region: bytes | None = None) -> MaskFiles:
    """The masks of an attempt image of `task` from its bytes and the task's source file; (None, None) when the
    source cannot be read. Never raises for bad data: a mask is derived, and a missing one is recomputed by a build.
    An edit the geometry guard rejected because its frame moved gets no edit mask (it would outline the moved
    anatomy, not the edit), only its task's region. A `region` given is the task's region mask, made for an
    earlier attempt on the same source (masks.attempt_mask_files)."""
    try:
        source = Path(task.source_path).read_bytes()
    except OSError:
        return None, None
    try:
        edit, region = attempt_mask_files(source, edited, task.modality, task.disease, region)
    except Exception:  # a mask must never fail the round that stores its image; a build recomputes a missing one
        return None, None
    return (None if frame_rejected else edit), region


def write(run_dir: Path, image_relpath: str, masks: MaskFiles) -> None:
    """Both companions of the image at `image_relpath` in place (temp file + rename), or removed where `masks`
    has None; before the image itself is renamed into place."""
    for relpath, data in zip(layout.mask_relpaths(image_relpath), masks):
        path = Path(run_dir) / relpath
        try:
            if data is not None:
                atomic_write_bytes(path, data)
                continue
        except OSError:  # e.g. a folder where the file goes: this image has no mask, and its round goes on
            pass
        try:
            path.unlink()  # a link is removed, never followed
        except OSError:  # none there (or a folder, which no build reads as a mask)
            pass


def image_of(relpath: str) -> str | None:
    """The attempt image a companion's run-relative path belongs to; None for a path that is none."""
    prefix = layout.MASKS + "/"
    if not relpath.startswith(prefix):
        return None
    for suffix in SUFFIXES:
        if relpath.endswith(suffix) and len(relpath) > len(prefix) + len(suffix):
            return relpath[len(prefix):-len(suffix)]
    return None


def reconcile(run_dir: Path, named: set[str], counts: Counter) -> None:
    """Remove the temp files under layout.MASKS and the companions of images no journal line names (`named`).
    Nothing else there is touched, and no link is followed: a linked folder is not entered, a link is removed as
    itself."""
    root = Path(run_dir) / layout.MASKS
    if root.is_symlink() or not root.is_dir():
        return
    for folder, _, files in os.walk(root):  # followlinks=False: a linked folder is listed, never walked
        for name in files:
            path = Path(folder) / name
            if TEMP_NAME.match(name):
                path.unlink()
                counts["temp_files"] += 1
                continue
            image = image_of(path.relative_to(run_dir).as_posix())
            if image is not None and image not in named:
                path.unlink()
                counts["orphan_masks"] += 1
