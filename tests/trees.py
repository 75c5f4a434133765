"""What a command left on disk, to compare before and after it: every path under a folder with its bytes."""

from __future__ import annotations

import os
from pathlib import Path


def snapshot(root: Path) -> dict[str, bytes | str]:
    """Every path under `root` with its bytes (a folder: "dir", a symlink: where it points)."""
    found: dict[str, bytes | str] = {}
    for folder, dirs, files in os.walk(root):
        for name in dirs + files:
            path = Path(folder) / name
            found[str(path)] = os.readlink(path) if path.is_symlink() else "dir" if path.is_dir() else \
                path.read_bytes()
    return found
