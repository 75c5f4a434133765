"""`eval --attention`: how well a diffusers editor placed its edits, from the attention masks a run recorded
(`generate --diffusers-attention`; generation/backends/attention.py measures them).

Each recorded mask (details["attention"]["mask"], at the source's size) is scored against the eval's ROI of the same
sample (evaluate.roi_mask, the policy `--roi` sets): by default the dataset row's `edit_mask` (or the edit mask
computed from source and edit, for a run), else the task's region (generation.masks.region_array: the grown region of
generation/anatomy.py). Every figure says which (`roi`: edit_mask | region | given); a run recorded before masks
were stored gives only its generation-time IoU against the region (`roi`: region_at_generation). Per disease: n,
mean IoU, the share of mislocalised edits (IoU < MISLOCALISED_BELOW) and how many figures used each ROI.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from ..generation.backends.attention import MASK_KEY, MISLOCALISED_BELOW, iou
from ..generation.raster import decode_mask
from ..generation.records import task_uid
from ..generation.rundir import layout
from .evaluate import roi_mask
from .inputs import Sample, read_image, sample_id

GENERATION_ROI = "region_at_generation"  # a run without recorded masks: the IoU it measured, against the region


def summarise(records: Iterable[dict], below: float = MISLOCALISED_BELOW) -> dict[str, dict]:
    """Records with `disease`, `iou` (None: not scored) and `roi` -> per disease: n, mean IoU, the share of
    samples with IoU < `below`, and the count of figures per ROI kind."""
    by_disease: dict[str, list[dict]] = defaultdict(list)
    for record in records:
        if record.get("iou") is not None:
            by_disease[record["disease"]].append(record)
    return {d: {"n": len(rows), "mean_iou": round(float(np.mean([r["iou"] for r in rows])), 4),
                "mislocalisation_rate": round(sum(r["iou"] < below for r in rows) / len(rows), 4),
                "roi": dict(sorted(Counter(r["roi"] for r in rows).items()))}
            for d, rows in sorted(by_disease.items())}


def recorded_attention(run_dirs: Iterable[Path]) -> dict[str, dict]:
    """Sample id (`uid#round`) -> {disease, details["attention"]} of every edit of the runs that recorded attention."""
    found: dict[str, dict] = {}
    for run_dir in run_dirs:
        run_dir = Path(run_dir)
        for dataset, direction, folder in layout.find_output_dirs(run_dir):
            path = layout.inside(run_dir, f"{folder.name}/{layout.ALL_CONVERSATIONS}")
            for key, conversation in (json.loads(path.read_text()) if path.is_file() else {}).items():
                disease = conversation.get("disease") or ""
                uid = conversation.get("uid") or task_uid(
                    dataset, direction, conversation.get("source_id") or key.removesuffix(f"-{disease}"), disease)
                for i, round_ in enumerate(conversation.get("rounds") or []):
                    grounding = ((round_.get("edit_result") or {}).get("details") or {}).get("attention") or {}
                    if grounding.get("iou") is not None:
                        found[sample_id(uid, round_.get("round") or i + 1)] = {"disease": disease, **grounding}
    return found


def score(sample: Sample, grounding: dict, roi: str = "auto") -> dict:
    """One sample's attention figure: IoU of its recorded attention mask with its ROI, saying which ROI."""
    record = {"id": sample.id, "disease": sample.disease, "roi": None, "iou": None}
    if not grounding.get(MASK_KEY):
        return {**record, "roi": GENERATION_ROI, "iou": float(grounding["iou"])}
    if sample.problem or sample.source is None:
        return {**record, "reason": sample.problem or "no source image"}
    source = read_image(sample.source)
    found = roi_mask(sample, source, roi)
    if found.kind is None:
        return {**record, "reason": f"no region of interest ({found.how})"}
    try:
        attention = decode_mask(grounding[MASK_KEY], source.shape[1::-1])
    except ValueError as exc:
        return {**record, "reason": f"recorded attention mask unreadable: {exc}"}
    return {**record, "roi": found.kind, "iou": round(iou(attention, found.levels > 127), 4)}


def attention_report(samples: Iterable[Sample], run_dirs: Iterable[Path], roi: str = "auto") -> dict:
    """{"by_disease": summarise(...), "samples": one record per sample whose edit recorded attention}."""
    recorded = recorded_attention(run_dirs)
    records = [score(s, recorded[s.id], roi) for s in samples if s.id in recorded]
    return {"by_disease": summarise(records), "samples": records}
