"""The editor's own image of an attempt that the geometry guard warped back onto its source's grid
(`generate --geometry register`, generation/geometry.py): the attempt's image is the registered one (what the judge,
the masks and the metrics saw), and the editor's image is kept at `layout.original_relpath`, marked (and signed)
as every image the run writes, its encoded image data as the editor returned it.

Written before the attempt's image, like its masks; a stale original of an earlier, killed write of the same
round is removed when this write has none. Opening a run removes the temp files under layout.ORIGINALS and the
originals of images no journal line names.
"""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

from . import layout
from ..files import TEMP_NAME, atomic_write_bytes


def write(run_dir: Path, image_relpath: str, marked: bytes | None) -> None:
    """The original of the image at `image_relpath` in place (temp file + rename), or removed when None."""
    path = layout.inside(Path(run_dir), layout.original_relpath(image_relpath), named_by="the run's layout")
    if marked is not None:
        atomic_write_bytes(path, marked)
        return
    try:
        path.unlink()  # a link is removed, never followed
    except OSError:  # none there
        pass


def reconcile(run_dir: Path, named: set[str], counts: Counter) -> None:
    """Remove the temp files under layout.ORIGINALS and the originals of images no journal line names (`named`);
    no link is followed."""
    root = Path(run_dir) / layout.ORIGINALS
    if root.is_symlink() or not root.is_dir():
        return
    prefix = layout.ORIGINALS + "/"
    for folder, _, files in os.walk(root):  # followlinks=False
        for name in files:
            path = Path(folder) / name
            if TEMP_NAME.match(name):
                path.unlink()
                counts["temp_files"] += 1
            elif path.relative_to(run_dir).as_posix().removeprefix(prefix) not in named:
                path.unlink()
                counts["orphan_originals"] += 1
