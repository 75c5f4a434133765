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

import base64
import io
import json
from collections import Counter, defaultdict
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from ..generation.backends.attention import MASK_KEY, MISLOCALISED_BELOW, iou
from ..generation.mask_check import MAX_MASK_PIXELS, PNG_MAGIC, max_mask_bytes
from ..generation.records import task_uid
from ..generation.rundir import layout
from .evaluate import roi_mask
from .inputs import Sample, read_image, sample_id
from ..generation.failures import UsageError

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


def recorded_attention(run_dirs: Iterable[Path]) -> tuple[dict[str, dict], list[str]]:
    """Sample id (`uid#round`) -> {disease, details["attention"]} of every edit of the runs that recorded attention,
    and the problems of what could not be read (a file that is no JSON object of conversations, an entry that is no
    object, rounds that are no list), each naming the file and entry. A round whose `attention` is there but no
    object is its sample's `problem`."""
    found: dict[str, dict] = {}
    problems: list[str] = []
    for run_dir in run_dirs:
        run_dir = Path(run_dir)
        for dataset, direction, folder in layout.find_output_dirs(run_dir):
            try:
                path = layout.inside(run_dir, f"{folder.name}/{layout.ALL_CONVERSATIONS}")
                conversations = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
            except (OSError, ValueError, RecursionError) as exc:  # UnsafePath and JSONDecodeError are ValueErrors
                problems.append(f"{folder / layout.ALL_CONVERSATIONS}: not read ({exc.__class__.__name__}: {exc})")
                continue
            if not isinstance(conversations, dict):
                problems.append(f"{path}: a JSON {type(conversations).__name__}, not an object of conversations")
                continue
            for key, conversation in conversations.items():
                problem = _conversation_problem(conversation)
                if problem:
                    problems.append(f"{path}, entry {key!r}: {problem}")
                    continue
                disease = conversation.get("disease") or ""
                uid = conversation.get("uid") or task_uid(
                    dataset, direction, conversation.get("source_id") or key.removesuffix(f"-{disease}"), disease)
                for i, round_ in enumerate(conversation.get("rounds") or []):
                    grounding = _grounding(round_)
                    if grounding is not None:
                        found[sample_id(uid, _round_number(round_, i))] = {"disease": disease, **grounding}
    return found, problems


def _conversation_problem(conversation) -> str | None:
    if not isinstance(conversation, dict):
        return f"a JSON {type(conversation).__name__}, not an object"
    if not isinstance(conversation.get("rounds") or [], list):
        return f"its rounds are a JSON {type(conversation['rounds']).__name__}, not a list"
    for name in ("disease", "uid", "source_id"):
        if not isinstance(conversation.get(name) or "", str):
            return f"its {name} is a JSON {type(conversation[name]).__name__}, not a string"
    return None


def _grounding(round_) -> dict | None:
    """A round's recorded attention (None: it recorded none), or {"problem": why it cannot be used}."""
    edit_result = round_.get("edit_result") if isinstance(round_, dict) else None
    details = edit_result.get("details") if isinstance(edit_result, dict) else None
    grounding = details.get("attention") if isinstance(details, dict) else None
    if grounding is None:
        return None
    if not isinstance(grounding, dict):
        return {"problem": f"its recorded attention is a JSON {type(grounding).__name__}, not an object"}
    return grounding if grounding.get("iou") is not None else None


def _round_number(round_, index: int):
    number = round_.get("round") if isinstance(round_, dict) else None
    return number if isinstance(number, int) and not isinstance(number, bool) else index + 1


def score(sample: Sample, grounding: dict, roi: str = "auto") -> dict:
    """One sample's attention figure: IoU of its recorded attention mask with its ROI, saying which ROI; a sample
    that cannot be scored (a recorded value out of range, an unusable mask or image) says why in `reason`."""
    record = {"id": sample.id, "disease": sample.disease, "roi": None, "iou": None}
    try:
        return {**record, **_scored(sample, grounding, roi)}
    except Exception as exc:  # noqa: BLE001 - this sample's error, recorded; the other samples go on
        return {**record, "reason": f"{exc.__class__.__name__}: {exc}"}


def _scored(sample: Sample, grounding: dict, roi: str) -> dict:
    if grounding.get("problem"):
        return {"reason": grounding["problem"]}
    if not grounding.get(MASK_KEY):
        value = grounding["iou"]
        if isinstance(value, bool) or not isinstance(value, int | float) or not 0.0 <= value <= 1.0:
            return {"reason": f"its recorded iou {str(value)[:40]!r} is not a number in [0, 1]"}
        return {"roi": GENERATION_ROI, "iou": float(value)}
    if sample.problem or sample.source is None:
        return {"reason": sample.problem or "no source image"}
    source = read_image(sample.source)
    found = roi_mask(sample, source, roi)
    if found.kind is None:
        return {"reason": f"no region of interest ({found.how})"}
    try:
        attention = recorded_mask(grounding[MASK_KEY], source.shape[1::-1])
    except ValueError as exc:
        return {"reason": f"recorded attention mask unusable: {exc}"}
    return {"roi": found.kind, "iou": round(iou(attention, found.levels > 127), 4)}


def recorded_mask(text, size: tuple[int, int]) -> np.ndarray:
    """A recorded attention mask (raster.encode_mask's base64 PNG) as a boolean array; ValueError unless it is a
    PNG of the source's `size` (width, height), at most MAX_MASK_PIXELS, checked on its header before it is decoded
    (a bomb is never decoded, a small mask never stretched)."""
    from PIL import Image

    if not isinstance(text, str):
        raise UsageError(f"a JSON {type(text).__name__}, not base64 text")
    if len(text) > 4 * max_mask_bytes(size) // 3 + 4:
        raise UsageError(f"{len(text):,} characters, more than a mask of {size[0]}x{size[1]} takes")
    try:
        data = base64.b64decode(text, validate=True)
    except ValueError as exc:
        raise UsageError(f"not base64 ({exc})") from None
    if not data.startswith(PNG_MAGIC):
        raise UsageError("not a PNG")
    try:
        with Image.open(io.BytesIO(data), formats=["PNG"]) as image:
            if image.size[0] * image.size[1] > MAX_MASK_PIXELS or image.size != tuple(size):
                raise UsageError(f"{image.size[0]}x{image.size[1]}, not the source's {size[0]}x{size[1]}")
            image.load()
            return np.asarray(image.convert("L")) > 127
    except (OSError, SyntaxError, Image.DecompressionBombError) as exc:
        raise UsageError(f"does not decode ({exc.__class__.__name__}: {exc})") from None


def attention_report(samples: Iterable[Sample], run_dirs: Iterable[Path], roi: str = "auto") -> dict:
    """{"by_disease": summarise(...), "samples": one record per sample whose edit recorded attention, "problems":
    what of the runs could not be read}."""
    recorded, problems = recorded_attention(run_dirs)
    records = [score(s, recorded[s.id], roi) for s in samples if s.id in recorded]
    return {"by_disease": summarise(records), "samples": records, "problems": problems}


def attention_warnings(report: dict, shown: int = 3) -> list[str]:
    """Lines for the terminal: what of the runs was left out (the first `shown`) and how many samples were not
    scored; text read from a run with its control characters escaped."""
    lines = [f"{_printable(problem)} (left out)" for problem in report["problems"][:shown]]
    if len(report["problems"]) > shown:
        lines.append(f"{len(report['problems']) - shown:,} more left out (attention.json lists all)")
    unscored = [r for r in report["samples"] if r.get("reason")]
    if unscored:
        lines.append(f"{len(unscored):,} of {len(report['samples']):,} samples not scored, e.g. "
                     f"{_printable(unscored[0]['reason'])} (each says why in attention.json)")
    return lines


def _printable(text: str, most: int = 300) -> str:
    text = "".join(c if c.isprintable() else ascii(c)[1:-1] for c in str(text))
    return text if len(text) <= most else text[:most] + "..."
