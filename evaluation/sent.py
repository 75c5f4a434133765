"""Before `eval` or `judge-agreement` sends images to a judge: generation/destinations.py's gate.

The judge's destination comes from its backend (and `--base-url`); the images' data-use classes from what the input
records (a run's medbanana-run.json or a dataset's medbanana-build.json: the classes its runs sent anywhere) and
from the `--source-images` folder's manifest. Nothing recorded: `unknown`. Credentialed images to a `cloud` judge
are refused before anything is read or sent (one line, exit 2); unknown ones get one warning line.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from types import SimpleNamespace

from ..generation.dataset.folder import BUILD_INFO
from ..generation.destinations import DATA_USE_CLASSES, UNKNOWN, destinations, gate, sources_data_use
from ..generation.files import not_regular
from ..generation.rundir import schema


def check_judge_destination(args) -> None:
    """DestinationRefused (a UsageError: one line, exit 2) when the input's images may not go to the judge; a
    warning per line the gate has for them."""
    if args.judge == "none":
        return
    places = destinations({"judge": args.judge}, gemini=SimpleNamespace(base_url=getattr(args, "base_url", None)))
    found = recorded_classes(Path(args.input))
    if args.source_images is not None:
        found |= {use.kind for use in sources_data_use(args.source_images).values()}
    name = Path(args.input).name or str(args.input)
    for line in gate(places, {kind: {name} for kind in found or {UNKNOWN}}, "eval"):
        warnings.warn(line, stacklevel=2)


def recorded_classes(path: Path) -> set[str]:
    """The data-use classes a run (its medbanana-run.json) or a built dataset (its medbanana-build.json) records
    having sent anywhere; empty when it records none."""
    entries: list = []
    try:
        if (path / BUILD_INFO).is_file() and not_regular(path / BUILD_INFO) is None:
            info = json.loads((path / BUILD_INFO).read_text(encoding="utf-8"))
            by_run = info.get("destinations") if isinstance(info, dict) else None
            entries = [e for run in (by_run or {}).values() if isinstance(run, list) for e in run] \
                if isinstance(by_run, dict) else []
        elif path.is_dir():
            entries = (schema.read_run_config(path) or {}).get("destinations") or []
    except (OSError, ValueError):
        return set()
    return {c for e in entries if isinstance(e, dict) for c in e.get("data_use") or () if c in DATA_USE_CLASSES}
