"""`eval --attention`: how well a diffusers editor placed its edits, from the cross-attention IoUs a run recorded
(`generate --diffusers-attention`; generation/backends/attention.py measures them): per disease, the mean IoU and the
share of mislocalised edits."""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from ..generation.backends.attention import MISLOCALISED_BELOW
from ..generation.rundir import layout


def summarise(samples: Iterable[tuple[str, float]], below: float = MISLOCALISED_BELOW) -> dict[str, dict]:
    """(disease, IoU) pairs -> per disease: n, mean IoU and the share of samples with IoU < `below`."""
    by_disease: dict[str, list[float]] = defaultdict(list)
    for disease, value in samples:
        by_disease[disease].append(float(value))
    return {d: {"n": len(v), "mean_iou": round(float(np.mean(v)), 4),
                "mislocalisation_rate": round(sum(x < below for x in v) / len(v), 4)}
            for d, v in sorted(by_disease.items())}


def run_samples(run_dir: Path) -> list[tuple[str, float]]:
    """(disease, IoU) of every edit of a run that recorded attention (`generate --diffusers-attention`)."""
    samples = []
    for _, _, folder in layout.find_output_dirs(Path(run_dir)):
        path = folder / layout.ALL_CONVERSATIONS
        for conversation in (json.loads(path.read_text()) if path.exists() else {}).values():
            for round_ in conversation.get("rounds") or []:
                grounding = ((round_.get("edit_result") or {}).get("details") or {}).get("attention") or {}
                if grounding.get("iou") is not None:
                    samples.append((conversation.get("disease", ""), float(grounding["iou"])))
    return samples
