"""What a path the user names holds: a samples file (`eval`'s own list of edits), a dataset folder `medbanana build`
wrote, or a run; `eval`, `review` and `stats` tell them apart alike."""

from __future__ import annotations

import json
from pathlib import Path

from .configs import CONFIG_NAMES
from .folder import BUILD_INFO
from ..failures import UsageError

MANIFEST_NAMES = ("samples.jsonl", "samples.csv")  # a folder of samples: the file that lists them


def input_kind(path: Path) -> str:
    """manifest | dataset | run."""
    path = Path(path)
    if path.is_file():
        if path.suffix == ".csv":
            return "manifest"
        if path.suffix == ".jsonl":
            try:
                first = json.loads(next((line for line in path.open(encoding="utf-8") if line.strip()), "{}"))
            except ValueError as exc:  # not JSON, or not UTF-8 text
                raise UsageError(f"{path}: not JSON lines ({exc})") from None
            return "run" if isinstance(first, dict) and "image_id" in first else "manifest"  # §5.2 records name image_id
        raise UsageError(f"{path}: an input file is a samples .jsonl or .csv (or a run's records.jsonl)")
    if any((path / name).is_file() for name in MANIFEST_NAMES):
        return "manifest"
    if (path / BUILD_INFO).is_file() or any((path / c).is_dir() for c in CONFIG_NAMES):
        return "dataset"
    return "run"
