"""A built dataset's `sft` rows in MedEBench's own layout, so that its evaluation scripts run on them unmodified.

MedEBench (Liu et al., EMNLP 2025 Findings; github.com/mliuby/MedEBench) keeps its benchmark under `editing/` of
its repository: `editing_metadata.json` = `{"samples": [{id, Organ, Task, prompt, rephrased_prompt,
detailed_prompt, previous_image, changed_image, previous_mask, url}]}`, image paths relative to the repository
root (`editing/previous/<id>.png`), and the images `previous/<id>.png` (input), `changed/<id>.png` (target) and
`previous_mask/<id>.png` (ROI, white = region of interest). Its `src/eval_metrics/traditional_metrics_eval.py`
rebuilds each path from the metadata file's folder and the sample's `id`; `evaluate_gpt4o.py` joins the
repository root with the sample's `*_image` fields; both read a model's output as `<model_dir>/<id>_0.png`.

Mapping: previous = `source_image`, changed = `edited_image` (the accepted edit), previous_mask = the row's
`edit_mask` (resized to the source's size, nearest, where the edit's size differs), else its `region_mask`, each
sample saying which in `roi`. A mask that is not a binary mask of its own image's size (generation/mask_check.py:
the edit's for an edit_mask, the source's for a region_mask) skips the row: a 1x1 mask is never stretched.
`id` is a number in export order (MedEBench's ids are integers; no data text becomes a path), the row's `uid` is
kept beside it. A row without a source, an edit or a mask is skipped and counted under its reason, never dropped
silently. Images are re-encoded losslessly as PNG (MedEBench's extension): 8-bit grey and RGB as they decode,
16-bit and other modes as `generate` reads them (`decode_rgb`).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections import Counter, deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from ..generation.dataset.output import (BuildError, check_placement, finish_interrupted_swap, move_into_place, output_lock,
                              remove_stale_staging)
from ..generation.taxonomy import canonical_instruction  # the one-sentence task, as dpo_pairs' `prompt`
from ..generation.files import atomic_write_text
from ..generation.mask_check import check_mask
from ..generation.records import decode_rgb, open_image
from ..generation.rundir.layout import inside
from ..generation.failures import UsageError

FOLDER = "editing"  # MedEBench's folder under its repository root; --out plays that root
METADATA = "editing_metadata.json"
REPORT = "medbanana-export.json"  # what was exported and what was skipped, and why
IMAGE_DIRS = ("previous", "changed", "previous_mask")
MASK_COLUMNS = ("edit_mask", "region_mask")  # in order of preference
# MedEBench's `Organ` names body parts ("Teeth", "Eyes", "Skin"); its scripts never read it
ORGAN = {"chest_xray": "Chest", "brain_mri": "Brain", "fundus": "Eyes"}
NO_SOURCE = "no source image (built without --source-images; pass --source-images DIR)"
NO_EDIT = "no edited image"
NO_MASK = "no edit_mask or region_mask (a build without sources, or made before masks)"
PNG_LEVEL = 1  # lossless either way; level 1 encodes several times faster than the default 6


@dataclass
class ExportSummary:
    folder: Path  # OUT/editing
    exported: int = 0
    rows: int = 0
    roi: Counter = field(default_factory=Counter)  # mask column -> samples using it
    skipped: dict[str, list[str]] = field(default_factory=dict)  # reason -> uids

    def skip(self, reason: str, uid: str) -> None:
        self.skipped.setdefault(reason, []).append(uid)


def export_medebench(dataset: Path, out: Path, *, split: str | None = "test", source_images: Path | None = None,
                     force: bool = False, workers: int = 2, progress=None) -> ExportSummary:
    """Write OUT/editing/ (the metadata, three image folders and `medbanana-export.json`) from DATASET's sft rows
    of `split` (a benchmark scores held-out rows: `test` by default, refused with the fix when DATASET has none;
    None: every split).

    OUT must be new or empty; with `force` its `editing/` folder is replaced (built beside it, swapped in by one
    rename) and anything else in it is kept, so OUT may be a MedEBench checkout. `workers` threads encode the
    PNGs. Refusals (BuildError, ValueError, FileNotFoundError) come before anything is written; `progress()` is
    called once per row read."""
    from .hub import load_medbanana

    dataset, out = Path(dataset), Path(out)
    target = out / FOLDER
    check_split(dataset, split)
    check_out(out, force)
    check_placement(out, [dataset] + ([source_images] if source_images else []))
    rows = _rows(_open_splits(load_medbanana, dataset, split, source_images))
    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    try:
        with output_lock(target):
            remove_stale_staging(target)  # what a killed export left, `.editing.building-PID`, under this lock
            finish_interrupted_swap(target, remove=shutil.rmtree)  # and `.editing.previous-PID` (killed mid-swap)
            summary = _write_and_publish(rows, out, target, dataset, progress, workers)
    except BaseException:
        if created:  # a failed export into a new folder leaves no folder (the lock file is gone by now)
            with contextlib.suppress(OSError):
                out.rmdir()
        raise
    return summary


def _write_and_publish(rows, out: Path, target: Path, dataset: Path, progress, workers: int) -> ExportSummary:
    staging = out / f".{FOLDER}.building-{os.getpid()}"
    try:
        summary = _write(rows, staging, progress, workers)
        summary.folder = target
        if not summary.exported:
            reasons = "; ".join(f"{len(uids)} {reason}" for reason, uids in summary.skipped.items())
            raise UsageError(f"nothing to export: all {summary.rows} sft rows of {dataset} were skipped "
                             f"({reasons or 'the dataset has none'})")
        move_into_place(staging, target, remove=shutil.rmtree)  # editing/ is the export's alone: removed whole
    finally:
        if staging.exists():
            shutil.rmtree(staging)
    return summary


def check_split(dataset: Path, split: str | None) -> None:
    """A split DATASET's sft config does not have is refused here, with what it has and how to get a test split."""
    from ..generation.dataset.folder import shard_files
    from ..generation.dataset.features import CONFIG_FEATURES

    have = sorted(shard_files(dataset, "sft", CONFIG_FEATURES["sft"])) if dataset.is_dir() else []
    if split is None or not have or split in have:
        return
    if split == "test":
        raise BuildError(f"{dataset} has no test split (its sft rows are all in {', '.join(have)}), and a benchmark "
                         "is scored on held-out rows: build it again with `medbanana build RUN_DIR --out DATASET "
                         "--test-fraction 0.1`, or pass --split train to export the training rows")
    raise BuildError(f"{dataset} has no {split} split; its sft splits: {', '.join(have)} (--split)")


def check_out(out: Path, force: bool) -> None:
    if out.is_symlink() or (out.exists() and not out.is_dir()):
        raise BuildError(f"--out {out} is not a folder")
    target = out / FOLDER
    if target.is_symlink() or (target.exists() and not target.is_dir()):
        raise BuildError(f"{target} is not a folder; move it away")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise BuildError(f"--out {out} is not empty; choose a new folder, or pass --force to replace its "
                         f"{FOLDER}/ folder (anything else in it is kept)")


def _open_splits(load_medbanana, dataset: Path, split: str | None, source_images: Path | None) -> dict:
    """split -> its sft rows, streamed (no cache copy is made), images undecoded (bytes as stored). Opening is
    eager, so that a wrong dataset or split is refused before anything is written."""
    import datasets

    parts = load_medbanana(dataset, "sft", split=split, streaming=True, decode_images=False)
    parts = {split: parts} if split is not None else dict(parts)
    for name, part in parts.items():
        for column in MASK_COLUMNS:  # undecoded too, whatever CONFIG_FEATURES says (before any map decodes them)
            if column in (part.features or {}):
                parts[name] = part = part.cast_column(column, datasets.Image(decode=False))
    if source_images is not None:
        from . import attach_sources

        parts = {name: attach_sources(part, source_images) for name, part in parts.items()}
    return parts


def _rows(parts: dict):
    for name, part in parts.items():
        for row in part:
            yield name, row


def _write(rows, staging: Path, progress, workers: int) -> ExportSummary:
    """Decode each row here (an unreadable image is the row's reason to be skipped, so ids stay contiguous) and
    encode its PNGs on `workers` threads (Pillow's encoder releases the GIL: the export's main cost)."""
    for name in IMAGE_DIRS:
        (staging / name).mkdir(parents=True)
    summary, samples, pending = ExportSummary(folder=staging), [], deque()
    with ThreadPoolExecutor(max(1, workers), thread_name_prefix="medebench-png") as pool:
        for split, row in rows:
            summary.rows += 1
            if progress is not None:
                progress()
            uid = row["uid"]
            reason, images = _images(row)
            if reason is None:
                try:
                    decoded = _decoded(*images)
                except ValueError as exc:  # an undecodable image: this row's reason (one per image, so they count)
                    reason = str(exc)
            if reason is not None:
                summary.skip(reason, uid)
                continue
            summary.exported += 1
            summary.roi[images[3]] += 1
            samples.append(_sample(summary.exported, row, split, images[3]))
            pending.append(pool.submit(_save_images, staging, summary.exported, decoded))
            while len(pending) > 2 * workers:  # decoded images wait in memory: a few rows' worth at most
                pending.popleft().result()
        for saved in pending:
            saved.result()  # an encoder's or the disk's error ends the export here (nothing is published)
    # ASCII JSON (json's default escapes): MedEBench opens it without an encoding, i.e. in the locale's
    atomic_write_text(staging / METADATA, json.dumps({"samples": samples}, indent=2))
    atomic_write_text(staging / REPORT, json.dumps(
        {"config": "sft", "rows": summary.rows, "exported": summary.exported, "roi": dict(summary.roi),
         "skipped": summary.skipped}, indent=2))
    return summary


def _images(row: dict) -> tuple[str | None, tuple]:
    """The reason to skip the row, or its (source, edit, mask) bytes and the mask's column."""
    source, edited = _bytes(row.get("source_image")), _bytes(row.get("edited_image"))
    if source is None:
        return NO_SOURCE, ()
    if edited is None:
        return NO_EDIT, ()
    for column in MASK_COLUMNS:
        mask = _bytes(row.get(column))
        if mask is not None:
            return None, (source, edited, mask, column)
    return NO_MASK, ()


def _bytes(value) -> bytes | None:
    return value.get("bytes") if isinstance(value, dict) else None


def _decoded(source: bytes, edited: bytes, mask: bytes, column: str) -> tuple:
    """(previous, changed, previous_mask) as PIL images, all three decoded before any file is written, so that a
    row skipped for an unreadable image leaves none behind; ValueError naming the unreadable one. The mask must be
    a mask (generation/mask_check.py: binary 0/255, bounded, no text) of its image's size: an edit_mask the edit's,
    then resized to the source's (nearest) when the edit's differs; a region_mask the source's."""
    from PIL import Image

    previous, changed = _pixels(source, "source image"), _pixels(edited, "edited image")
    problem, levels = check_mask(mask, changed.size if column == "edit_mask" else previous.size)
    if problem is not None:  # by kind: the reasons rows are counted under
        raise UsageError(f"unusable {column}: {problem.kind}")
    roi = Image.fromarray(levels, mode="L")
    if roi.size != previous.size:  # an edit mask is the edit's size; MedEBench's previous_mask is the input's
        roi = roi.resize(previous.size, Image.NEAREST)
    return previous, changed, roi


def _save_images(staging: Path, sample_id: int, images: tuple) -> None:
    name = f"{sample_id}.png"
    for folder, image in zip(IMAGE_DIRS, images):
        image.save(inside(staging, f"{folder}/{name}"), compress_level=PNG_LEVEL)


def _pixels(data: bytes, what: str):
    """The image as an 8-bit grey or RGB PIL image; ValueError naming `what` when it does not decode."""
    from PIL import Image

    try:
        with open_image(data) as im:
            if im.mode in ("L", "RGB"):
                im.load()
                return im.copy()
        return Image.fromarray(decode_rgb(data))
    except (ValueError, OSError, SyntaxError):
        raise UsageError(f"unreadable {what}") from None


def _sample(sample_id: int, row: dict, split: str, roi: str) -> dict:
    name = f"{sample_id}.png"
    modality, disease, direction = row.get("modality"), row.get("disease") or "", row.get("task") or ""
    canonical = canonical_instruction(disease, modality, direction)
    return {"id": sample_id, "Organ": ORGAN.get(modality, modality or ""), "Task": canonical,
            "prompt": row.get("instruction") or canonical, "rephrased_prompt": canonical,
            "detailed_prompt": row.get("instruction") or canonical,
            **{key: f"{FOLDER}/{folder}/{name}" for key, folder in
               (("previous_image", "previous"), ("changed_image", "changed"), ("previous_mask", "previous_mask"))},
            "url": None, "uid": row["uid"], "split": split, "roi": roi}
