"""`medbanana eval`: score any editing model's outputs, one JSON line per sample, tables per group.

Output folder:
    samples.jsonl       one record per sample, appended as each finishes (status ok | error, the error's text);
                        rerunning into the same folder with the same settings scores only the missing samples
    eval-settings.json  input, CP mode, ROI policy, judge backend, model, prompts' versions and templates, and how
                        EA / VQ were obtained (judging.judge_description)
    summary.json        overall means, counts, notes, and every table as data
    report.md           the notes and the tables below, in markdown
    by_modality.{md,csv}, by_disease.{md,csv}, by_direction.{md,csv}

A sample's ROI follows the ROI policy (`roi_mask`): by default its mask when given (any encoding:
metrics.read_mask; the record says how it was read in `mask_read`; at most MAX_MASK_PIXELS); for a dataset or run,
the task's edit mask (the row's `edit_mask`, an error for its sample unless a binary mask of the edit's size:
generation/mask_check.py; or computed by generation.masks from the source and the reference edit); else the task's
target region located on the source (generation.masks.region_array); or none, and CP is the full-image SSIM. Each
record says which (`roi`), the report counts them. A sample whose CP is undefined records why
(`cp_excluded`); the report and summary.json say how many the CP mean leaves out. In `medebench` CP mode every
image is read as MedEBench reads it (metrics.decode_medebench: 16-bit clipped), else 16-bit is min-max scaled.

Samples are spread over `EvalOptions.workers` processes (generation/pools.py; 1: this process, in worker threads):
each decodes its sample's images once and scores them there, with the judge too when the judge sends no request (a
local judge such as the simulator, made again by name in each process); an API judge's calls stay on this
process's event loop. `concurrency` samples are in flight at once.
"""

from __future__ import annotations

import asyncio
import io
import json
import os
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np
from PIL import Image

from ..generation.tables import Table, mean
from ..generation.files import atomic_write_text, open_append, read_jsonl
from ..generation.geometry import estimate_geometry, registered
from ..generation.mask_check import MAX_MASK_PIXELS, header_size, read_checked_mask
from ..generation.masks import edit_mask_array, region_array
from ..generation.pools import ImagePool, PoolBroken, pool_size, refuse_in_a_starting_child
from .failures import eval_reasons
from .inputs import Sample, image_bytes, read_image
from .judging import judge_record, make_judge, scores_note
from .metrics import (CP_UNDEFINED, LPIPSMetric, LPIPSUnavailable, decode_medebench, pixel_metrics, read_mask,
                      to_size)
from ..generation.failures import UsageError

SAMPLES = "samples.jsonl"
SETTINGS = "eval-settings.json"
SUMMARY = "summary.json"
REPORT = "report.md"
ROI_POLICIES = ("auto", "edit", "region", "none")
GROUPINGS = {"modality": ("modality",), "disease": ("modality", "disease"), "direction": ("direction",)}


@dataclass
class EvalOptions:
    cp_mode: str = "correct"  # correct | medebench (metrics.py)
    roi: str = "auto"  # ROI_POLICIES: auto | edit | region | none (roi_mask)
    lpips: bool = True  # compute LPIPS when its weights are on this machine
    concurrency: int = 2  # samples in flight
    workers: int | str = 1  # processes scoring them (1: this one; auto: pools.pool_size)
    quiet: bool = False
    total: int | None = None  # samples the input holds, the progress bar's total (None: unknown)


def evaluate(samples: Iterable[Sample], out: Path, *, settings: dict, options: EvalOptions | None = None,
             judge=None) -> dict:
    """Score every sample into `out`; returns the summary. `settings` describe the run (written once, checked on
    resume); `judge` is a judge backend or None (no EA / VQ)."""
    refuse_in_a_starting_child("medbanana's evaluate")  # before a file is touched: the scoring processes spawn
    options = options or EvalOptions()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    _check_settings(out / SETTINGS, settings)
    lpips, lpips_note = _lpips() if options.lpips else (None, None)
    # finished samples are kept; errors and failed judge calls are tried again
    done = {i for i, r in read_records(out / SAMPLES).items() if r["status"] == "ok" and "judge_error" not in r}
    workers = pool_size() if options.workers == "auto" else options.workers
    pool = ImagePool(workers, initializer=_start_worker, initargs=(
        lpips is not None, judge.name if is_local(judge) else None)) if workers > 1 else None
    try:
        asyncio.run(_score_all(samples, done, out / SAMPLES, options, judge, lpips, pool))
    finally:
        if pool is not None:
            pool.close()
    return write_report(read_records(out / SAMPLES), out, settings, [lpips_note] if lpips_note else [])


def _check_settings(path: Path, settings: dict) -> None:
    if path.is_file():
        before = json.loads(path.read_text(encoding="utf-8"))
        differ = sorted(k for k in set(before) | set(settings) if before.get(k) != settings.get(k))
        if differ:
            raise UsageError(f"{path.parent} holds an evaluation made with other settings ({', '.join(differ)}); "
                             "use another --out")
    else:
        atomic_write_text(path, json.dumps(settings, indent=2, ensure_ascii=False))


def _lpips() -> tuple[LPIPSMetric | None, str | None]:
    try:
        return LPIPSMetric(), None
    except LPIPSUnavailable as exc:
        return None, str(exc)


def read_records(path: Path) -> dict[str, dict]:
    """id -> record (the last line for an id wins); a torn last line is ignored."""
    return {record["id"]: record for record in read_jsonl(path)}


async def _score_all(samples: Iterable[Sample], done: set, path: Path, options: EvalOptions, judge, lpips,
                     pool: ImagePool | None = None) -> None:
    from tqdm import tqdm

    # a pool's processes each have a sample waiting: its pickling and reading overlap the one scored
    slots = asyncio.Semaphore(max(1, options.concurrency, 2 * pool.size if pool is not None else 0))
    running: set[asyncio.Task] = set()
    # appended to, never through a link, a hard link or a FIFO (files.open_append: one line refusing it)
    with io.TextIOWrapper(open_append(path), encoding="utf-8") as sink, tqdm(disable=options.quiet, unit="sample",
                                                                            total=options.total) as bar:
        if sink.tell() and os.pread(sink.fileno(), 1, sink.tell() - 1) != b"\n":
            sink.write("\n")  # an interrupted write: end its line so the next record stands alone
        async def one(sample: Sample) -> None:
            try:
                record = await score_sample(sample, options, judge, lpips, pool)
            finally:
                slots.release()
            sink.write(json.dumps(record, ensure_ascii=False) + "\n")
            sink.flush()
            bar.update()

        for sample in samples:
            if sample.id in done:
                bar.update()  # scored before: counted, so that a resumed bar ends at its total
                continue
            done.add(sample.id)
            await slots.acquire()
            running.add(task := asyncio.create_task(one(sample)))
            task.add_done_callback(running.discard)
        await asyncio.gather(*running)


async def score_sample(sample: Sample, options: EvalOptions, judge=None, lpips=None,
                       pool: ImagePool | None = None) -> dict:
    """One sample's record: pixel metrics and, with a judge, EA / VQ / CP (judge) (judging.py); a local judge
    scores in the same call as the pixels, on the same decoded images (in `pool`'s processes, else a worker
    thread), an API judge's calls are made here."""
    record = {"id": sample.id, "dataset": sample.dataset, "modality": sample.modality, "disease": sample.disease,
              "direction": sample.direction, "instruction": sample.instruction}
    if sample.problem:
        return {**record, "status": "error", "error": sample.problem}
    local = judge if is_local(judge) else None
    try:
        if pool is not None:
            record.update(await pool.run(_scored_in_worker, sample, options))
        else:
            record.update(await asyncio.to_thread(_scored, sample, options, lpips, local))
    except PoolBroken as exc:
        return {**record, "status": "error", "error": f"{exc} (while scoring this sample: out of memory?)"}
    except Exception as exc:  # noqa: BLE001 — an unreadable image or odd mask: this sample's error, others go on
        return {**record, "status": "error", "error": f"{type(exc).__name__}: {exc}"}
    if judge is not None and local is None:
        record.update(await judge_record(judge, sample, image_bytes(sample.source), image_bytes(sample.edited)))
    return {**record, "status": "ok"}


def is_local(judge) -> bool:
    """A judge that sends no request (the simulator): it scores where the pixels are, made again by name in each
    scoring process."""
    return judge is not None and not getattr(judge, "prompts", ())


_WORKER: dict = {}  # a scoring process's own LPIPS and local judge (`_start_worker`)


def _start_worker(lpips: bool, judge: str | None) -> None:
    """A scoring process's start: its own LPIPS (when this machine has it) and local judge (by name)."""
    _WORKER.update(lpips=_lpips()[0] if lpips else None, judge=make_judge(judge) if judge else None)


def _scored_in_worker(sample: Sample, options: EvalOptions) -> dict:
    return _scored(sample, options, _WORKER.get("lpips"), _WORKER.get("judge"))


def _scored(sample: Sample, options: EvalOptions, lpips, judge) -> dict:
    """A sample's pixel metrics, and with a local `judge` its judge fields, its images decoded once for both."""
    source_data, edited_data = image_bytes(sample.source), image_bytes(sample.edited)
    # MedEBench's numbers need MedEBench's decoding (16-bit clipped); ours keeps a 16-bit image's contrast
    decode = decode_medebench if options.cp_mode == "medebench" else read_image
    source, edited = decode(source_data), decode(edited_data)
    scored = _pixels(sample, source, edited, options, lpips)
    if judge is not None:  # the judge's decoding is read_image's (SourceImage.array), not MedEBench's
        arrays = (source, edited) if decode is read_image else None
        scored.update(asyncio.run(judge_record(judge, sample, source_data, edited_data, arrays)))
    return scored


def _pixels(sample: Sample, source: np.ndarray, edited: np.ndarray, options: EvalOptions, lpips) -> dict:
    resized = edited.shape != source.shape
    edited, alignment = registered_pair(source, edited, register=options.cp_mode == "correct")
    mask, roi, mask_read, _ = roi_mask(sample, source, options.roi, edited if alignment.get("registered") else None)
    decode = decode_medebench if options.cp_mode == "medebench" else read_image
    truth = decode(image_bytes(sample.ground_truth)) if sample.ground_truth is not None else None
    metrics = pixel_metrics(source, edited, mask, cp_mode=options.cp_mode, ground_truth=truth, lpips=lpips)
    extra = {"mask_read": mask_read} if mask_read else {}
    if metrics["cp"] is None:
        extra["cp_excluded"] = CP_UNDEFINED
    return {"roi": roi, "roi_fraction": round(float((mask > 127).mean()), 5),
            "resized": resized, **alignment, **metrics, **extra}


def registered_pair(source: np.ndarray, edited: np.ndarray, *, register: bool) -> tuple[np.ndarray, dict]:
    """The edit to score, and what the record says of its frame (generation/geometry.py): measured against the
    source, and with `register` warped back onto the source's grid when it moved within the registrable limits.
    Unmeasurable pairs are scored as they came (`aligned` null)."""
    geometry = estimate_geometry(source, edited)
    if geometry is None:
        return edited, {"aligned": None}
    fields = {"aligned": geometry.aligned, "shift_px": round(geometry.shift_px, 3),
              "scale": round(geometry.scale, 5), "rotation_deg": round(geometry.rotation_deg, 3)}
    if geometry.aligned or not register or not geometry.registrable:
        return edited, fields
    return registered(edited, geometry), {**fields, "registered": True}


def registration_note(ok: list[dict], cp_mode: str) -> str:
    """What the pixel metrics were computed on, when some edits' frames moved ('' when none did)."""
    moved = [r for r in ok if r.get("aligned") is False]
    if not moved:
        return ""
    done = sum(bool(r.get("registered")) for r in moved)
    if cp_mode != "correct":
        return (f"{len(moved):,} of {len(ok):,} edits are misaligned with their source (the frame moved: "
                "generation/geometry.py); in `medebench` mode they are scored as they came, as MedEBench's code does.")
    return (f"CP, SSIM and PSNR on registered pairs: {done:,} of {len(ok):,} edits whose frame moved (shifted, "
            "zoomed, turned or re-cropped beyond 1 px / 1 % / 0.5 degrees at 1024 px) were warped back onto the "
            "source's grid before scoring (generation/geometry.py; `registered` in samples.jsonl)"
            + (f"; {len(moved) - done:,} moved too far to be warped back and were scored as they came"
               if len(moved) > done else "") + ".")


class Roi(NamedTuple):
    levels: np.ndarray  # grey-level mask at the source's size (> 127: inside)
    how: str  # how it was obtained, as a record says it
    mask_read: str | None  # how a given mask's values were read
    kind: str | None  # given | edit_mask | region; None: no ROI (the full image)


def roi_mask(sample: Sample, source: np.ndarray, roi: str, edited: np.ndarray | None = None) -> Roi:
    """The sample's ROI at the source's size, how it was obtained, and its kind (`edited`: the edit as scored, when
    it is not the sample's own image: registered onto the source's grid).

    `roi` (ROI_POLICIES): auto: an evaluation folder's own mask (`given`); for dataset and run samples the task's
    edit mask (`edit_mask`: the row's column, or `edit_mask:computed` from the source and the reference edit);
    else the target region (`derived:<region>`). edit / region / none: that one alone (`full_image` where it
    cannot be had)."""
    empty = np.zeros(source.shape[:2], np.uint8)
    if roi == "auto" and sample.mask is not None:
        with Image.open(io.BytesIO(image_bytes(sample.mask))) as im:
            if im.size[0] * im.size[1] > MAX_MASK_PIXELS:  # on its header: a bomb is never decoded
                raise UsageError(f"mask of {im.size[0]}x{im.size[1]} pixels, more than {MAX_MASK_PIXELS:,}")
            levels, how = read_mask(im, source.shape)
        return Roi(levels, "given", how, "given")
    if roi == "none":
        return Roi(empty, "full_image", None, None)
    if roi == "edit" or (roi == "auto" and (sample.edit_mask is not None or sample.task_edit)):
        return Roi(*_edit_roi(sample, source, edited), None, "edit_mask")
    try:
        region, name = region_array(sample.modality, sample.disease, source.shape[1::-1], source)
    except (ValueError, KeyError) as exc:
        return Roi(empty, f"full_image (no region: {exc})", None, None)
    return Roi(region.astype(np.uint8) * 255, f"derived:{name}", None, "region")


def _edit_roi(sample: Sample, source: np.ndarray, edited: np.ndarray | None = None) -> tuple[np.ndarray, str]:
    """The task's edit mask: the dataset row's, else computed (generation.masks) from the source and the reference
    edit: the ground truth when there is one (a model's output is scored inside the dataset's or run's edit), else
    the edit scored itself. An edit registered for scoring (`edited`) gets its mask from the registered pair: the
    row's was computed from the edit as it came."""
    if edited is not None and sample.ground_truth is None:
        return edit_mask_array(source, edited).astype(np.uint8) * 255, "edit_mask:computed"
    reference = sample.ground_truth if sample.ground_truth is not None else sample.edited
    if sample.edit_mask is not None:  # a mask of the dataset's edit, checked before it is decoded (mask_check)
        size = header_size(image_bytes(reference)) if reference is not None else None
        mask = read_checked_mask(image_bytes(sample.edit_mask), size, "the dataset's edit_mask")
        return read_mask(mask, source.shape)[0], "edit_mask"
    reference = read_image(reference)
    mask = edit_mask_array(source, to_size(reference, source.shape)[0])
    return mask.astype(np.uint8) * 255, "edit_mask:computed"


# ---------------------------------------------------------------- tables and report

def group_table(records: list[dict], keys: tuple[str, ...]) -> Table:
    ok = [r for r in records if r["status"] == "ok"]
    has = {name: any(r.get(name) is not None for r in ok) for name in ("lpips", "ssim_gt", "lpips_gt", "ea")}
    columns = [*keys, "samples", "errors", "CP", "SSIM", "PSNR"]
    metrics = [("cp", 1), ("ssim", 1), ("psnr", 1)]
    for name, label, shown in (("lpips", "LPIPS", has["lpips"]), ("ssim_gt", "SSIM vs GT", has["ssim_gt"]),
                               ("psnr_gt", "PSNR vs GT", has["ssim_gt"]), ("lpips_gt", "LPIPS vs GT", has["lpips_gt"]),
                               ("ea", "EA", has["ea"]), ("vq", "VQ", has["ea"]), ("cp_judge", "CP (judge)", has["ea"])):
        if shown:
            columns.append(label)
            metrics.append((name, 10.0 if name in ("ea", "vq", "cp_judge") else 1))
    if has["ea"]:
        columns += ["qualified", "judge errors"]
    cp_gaps = any(r.get("cp") is None for r in ok)  # only then: which means leave samples out
    columns += ["CP excluded"] * cp_gaps + ["ROI"]
    groups: dict[tuple, list[dict]] = {}
    for record in sorted(records, key=lambda r: tuple(str(r.get(k)) for k in keys)):
        groups.setdefault(tuple(record.get(k) for k in keys), []).append(record)
    groups[tuple("all" for _ in keys)] = records
    table = Table(columns, formats={c: ".3f" for c in columns if c not in (*keys, "samples", "errors", "ROI",
                                                                              "judge errors", "qualified",
                                                                              "CP excluded")})
    table.formats.update({"PSNR": ".2f", "PSNR vs GT": ".2f", "qualified": ".1%"})
    for group, members in groups.items():
        good = [r for r in members if r["status"] == "ok"]
        row = [*group, len(good), len(members) - len(good)]
        row += [_scaled_mean(good, name, scale) for name, scale in metrics]
        if has["ea"]:
            judged = [r for r in good if "qualified" in r]
            row += [mean(float(r["qualified"]) for r in judged), sum("judge_error" in r for r in good)]
        row += [sum(r.get("cp") is None for r in good)] * cp_gaps + [_roi_summary(good)]
        table.rows.append(row)
    return table


def _scaled_mean(records: list[dict], name: str, scale: float) -> float | None:
    value = mean(r.get(name) for r in records)
    return None if value is None else value / scale


def _roi_summary(records: list[dict]) -> str:
    kinds = Counter(r["roi"].split(":")[0].split(" ")[0] for r in records)
    return ", ".join(f"{kind} {n}" for kind, n in sorted(kinds.items())) or "–"


def cp_exclusions(ok: list[dict]) -> dict:
    """How many scored samples the CP mean leaves out (CP undefined), why, and a sentence saying so."""
    reasons = Counter(r.get("cp_excluded") or CP_UNDEFINED for r in ok if r.get("cp") is None)
    n = sum(reasons.values())
    why = "; ".join(f"{count:,} where {reason}" for reason, count in reasons.most_common())
    note = f"CP mean over {len(ok) - n:,} of {len(ok):,} scored samples, {n:,} excluded as undefined: {why}."
    return {"samples": n, "of": len(ok), "reasons": dict(reasons), "note": note if n else ""}


def write_report(records: dict[str, dict], out: Path, settings: dict, notes: list[str]) -> dict:
    rows = [records[key] for key in sorted(records)]  # in id order: the figures do not depend on which finished first
    ok = [r for r in rows if r["status"] == "ok"]
    cp_mode = settings.get("cp_mode", "correct")
    notes = [f"CP: SSIM outside the ROI, mode `{cp_mode}` "
             + ("(mean SSIM map outside the ROI dilated by half the 7x7 window)." if cp_mode == "correct" else
                "(MedEBench's code: ROI zeroed in both images, SSIM over the whole image; inflated by large ROIs)."),
             f"ROI policy `{settings.get('roi', 'auto')}`; per sample: `given` mask, the task's `edit_mask` (the "
             "dataset's, or `edit_mask:computed` from source and reference edit: computed, not annotated), "
             "`derived:<region>` from the target region, or `full_image` SSIM.",
             "SSIM: grayscale, range 255; PSNR: RGB, identical images = 100 (MedGEN-Bench).", *notes]
    if any("ea" in r for r in ok):
        notes.append(scores_note(settings.get("judge") or {}))
    cp_excluded = cp_exclusions(ok)
    if cp_excluded["samples"]:
        notes.append(cp_excluded["note"])
    if moved := registration_note(ok, cp_mode):
        notes.append(moved)
    tables = {name: group_table(rows, keys) for name, keys in GROUPINGS.items()}
    for name, table in tables.items():
        table.write(out, f"by_{name}")
    judge = settings.get("judge") or {}
    summary = {"settings": settings, "samples": len(rows), "ok": len(ok), "errors": len(rows) - len(ok),
               "judge_errors": sum("judge_error" in r for r in ok), "notes": notes, "cp_excluded": cp_excluded,
               "failure_reasons": eval_reasons(rows), "overall": tables["direction"].as_dicts()[-1],
               "tables": {name: table.as_dicts() for name, table in tables.items()}}
    atomic_write_text(out / SUMMARY, json.dumps(summary, indent=2, ensure_ascii=False))
    lines = ["# Edit evaluation", "", f"{len(rows):,} samples ({len(ok):,} scored, {len(rows) - len(ok):,} with "
             f"errors; see {SAMPLES}). Judge: {judge.get('backend') or 'none'}"
             + (f" ({judge.get('model')}, prompt {judge.get('prompt')})" if judge.get("prompt") else "") + ".", "",
             *(f"- {note}" for note in notes), ""]
    for name, table in tables.items():
        lines += [f"## By {name}", "", table.markdown(), ""]
    for key, title in (("errors", "Samples not scored"), ("judge_errors", "Failed judge calls")):
        if summary["failure_reasons"][key]:
            lines += [f"## {title}: top reasons", "", *(f"- {r['samples']:,} × {r['reason']}"
                                                        + (f" (e.g. {r['example']})" if r.get("example") else "")
                                                        for r in summary["failure_reasons"][key]), ""]
    atomic_write_text(out / REPORT, "\n".join(lines))
    return summary
