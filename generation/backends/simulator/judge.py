"""The pixel judge: a deterministic verdict computed from the original and edited pixels, nothing else.

Both images are compared on a 512² luminance grid (grain on full-resolution crops) inside the task's target
region, which is estimated from the ORIGINAL image (anatomy.py). A uniform drift of the whole image is taken out
of the change maps and judged once, as a global shift. "Clutter" is what a finding must stand out from: the
original's fine anatomy in the region (ribs, vessels, gyri; band-pass 1-6 working pixels) combined with its
full-resolution grain (root sum of squares). Thresholds (class Thresholds):

has_disease (instruction compliance, 40 %)
  add     the change in the region (grey levels; for fundus photographs the RMS colour change signed by its
          brightness) taken in the finding's direction (brighter for opacities and masses, either way for mixed
          findings), over its core (pixels at least half its 95th percentile): the core covers at least the
          target's `min_area` working pixels, its mean is >= 4 grey levels and >= CNR_MIN = 2.5 x clutter, and
          >= 60 % of the change in the region goes the finding's way.
  remove  the lesion evidence (deviation from the healthy reference: the mirrored other side for one-sided
          brain and lung findings, else a smooth background that ignores the lesion; lesions.healthy_rgb) over
          the lesion found in the ORIGINAL, measured in the original and in the edit. A removal is confirmed
          only for a lesion the judge can see in the original (found, evidence >= EVIDENCE_MIN = 2.0 x
          clutter); otherwise has_disease stays true ("could not be found in the source"). has_disease stays
          true while the edit's evidence is >= EVIDENCE_MIN or more than REDUCTION_MAX = 0.5 of the original's.
structure_reasonable (25 %)
  - >= 85 % of the change energy inside the anatomy where the finding occurs (thorax, skull, fundus);
  - the change covers at most the target's `max_share` of its region (+ 0.05);
  - the changed pixels keep >= 35 % of their edge energy (for remove: those around the lesion);
  - at most 4 % of the changed pixels newly saturated (>= 254 or <= 1);
  - add, grey-scale: the lesion no brighter than the original's brightest tissue (99.9th percentile) + 12;
  - remove: the repair matches its healthy reference (mean |deviation| <= 2.5 x clutter); its edge density is
    0.3x (not for the fundus, whose lesions are all edges) to 2.5x that of the tissue around it (no anatomy
    wiped flat, no seams); normal anatomy inside the region (normal heart, central mediastinum) changes by
    <= 15 grey levels (95th percentile).
looks_realistic (20 %), for findings with an extended body
  - grain: high-pass amplitude inside the edit / the original's (same place for add, the healthy ring around
    the repair for remove) in [0.7, 1.45];
  - edges: border transition width (body contrast / 90th percentile gradient of the change along its border,
    read where the original has no edge of its own) >= EDGE_WIDTH_MIN = 3.5 working pixels.
fidelity_preserved (15 %)
  - <= 15 % of the change energy outside the region grown by 12 working pixels;
  - remove: the rest of the region (beyond the lesion and a margin) changes by <= 12 grey levels (99th pct);
  - SSIM (7x7, grey) over the tissue outside the grown region >= 0.92;
  - the outside grey-level histogram moves by <= 2.0 grey levels (Wasserstein-1); the image size is unchanged.

qualified = all four pass for the task's direction; score = records.rubric_score. The reason names what failed
in words the refiner reads ("too subtle", "still visible", "hard edges", "grain mismatch", "spills outside",
"global intensity shift", "saturates", "implausible density", "outside the anatomy", "erased", "could not be
found", ...).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import numpy as np
from scipy import ndimage
from skimage.metrics import structural_similarity

from ..base import Judge
from ...records import EditedImage, EditScores, SourceImage, Task, Verdict, rubric_score
from ...taxonomy import load_taxonomy
from . import scores
from ...anatomy import REGION_MARGIN
from ...raster import blur, resize_mask, resize_rgb
from .imaging import WORK, highpass, luminance, robust_std
from .recent import RecentMeasures
from .lesions import evidence_map, find_lesion, healthy_rgb, make_canvas, repair_area, spec_for


@dataclass(frozen=True)
class Thresholds:
    cnr_min: float = 2.5
    change_floor: float = 4.0
    direction_share: float = 0.6
    evidence_min: float = 2.0
    reduction_max: float = 0.5
    envelope_share: float = 0.85
    structure_kept_min: float = 0.35
    core_change_max: float = 15.0
    mismatch_max: float = 2.5
    repair_edges_min: float = 0.3
    repair_edges_max: float = 2.5
    beyond_max: float = 12.0
    saturation_max: float = 0.04
    brightness_margin: float = 12.0
    grain_low: float = 0.7
    grain_high: float = 1.45
    edge_width_min: float = 3.5
    spill_max: float = 0.15
    spill_margin: int = REGION_MARGIN
    ssim_min: float = 0.92
    shift_max: float = 2.0


_PLACES = {"right_lower_lung": "right lower lung zone", "lung_mid": "mid lung zone", "lung_apex": "lung apex",
           "ribs_lateral": "lateral rib arcs", "convexity_dura": "dural convexity", "whole_fundus": "fundus",
           "vessels": "retinal arcades", "peripapillary": "peripapillary area", "perihilar": "perihilar regions"}


def _place_name(region: str) -> str:
    return _PLACES.get(region, region.replace("_", " "))


def _wasserstein(a: np.ndarray, b: np.ndarray) -> float:
    """Earth mover's distance between two grey-level histograms (0..255), in grey levels."""
    if a.size == 0:
        return 0.0
    ha = np.histogram(a, bins=256, range=(0, 256))[0] / a.size
    hb = np.histogram(b, bins=256, range=(0, 256))[0] / b.size
    return float(np.abs(np.cumsum(ha) - np.cumsum(hb)).sum())


def _grain_ratio(orig: np.ndarray, edited: np.ndarray, mask: np.ndarray, reference: np.ndarray | None = None
                 ) -> float | None:
    """Fine-grain (high-pass) amplitude of the edited image inside `mask` over the original's inside `reference`
    (default: the same mask); both WORK² masks, measured on full-resolution crops (None: too little area)."""
    if mask.sum() < 150:
        return None
    reference = mask if reference is None else reference
    h, w = orig.shape[:2]
    if h == w:
        both = resize_mask(mask | reference, h)
        ys, xs = np.nonzero(both)
        box = (slice(ys.min(), ys.max() + 1), slice(xs.min(), xs.max() + 1))
        lo, le = luminance(orig[box]), luminance(edited[box])
        inside, ref = resize_mask(mask, h)[box], resize_mask(reference, h)[box]
    else:  # non-square sources: compare at working resolution
        lo, le = luminance(resize_rgb(orig, WORK)), luminance(resize_rgb(edited, WORK))
        inside, ref = mask, reference
    inside = ndimage.binary_erosion(inside, iterations=2)  # inside the edit, away from its border
    if inside.sum() < 150 or ref.sum() < 150:  # dots and lines: too little area to judge grain
        return None
    sigma = max(0.6, max(h, w) / 1024)
    before = robust_std(highpass(lo, sigma)[ref])
    return robust_std(highpass(le, sigma)[inside]) / before if before > 0.3 else None


def _fine_noise(orig: np.ndarray, mask: np.ndarray) -> float:
    """Fine grain (high-pass) amplitude of the full-resolution original inside a WORK² mask."""
    h, w = orig.shape[:2]
    if not mask.any() or h != w:
        return 0.0
    full = resize_mask(mask, h)
    ys, xs = np.nonzero(full)
    box = (slice(ys.min(), ys.max() + 1), slice(xs.min(), xs.max() + 1))
    return robust_std(highpass(luminance(orig[box]), max(0.6, h / 1024))[full[box]])


def _edge_width(delta: np.ndarray, changed: np.ndarray, original: np.ndarray) -> float | None:
    """Contrast / steepest border gradient of the change's extended body, in working pixels (None: no body).

    The border is read where the original image is quiet: where the change merely follows an edge that was
    already there (a vessel under a haze), its steepness says nothing about how the edit was blended."""
    body = ndimage.binary_opening(changed, structure=np.ones((7, 7), bool))
    if body.sum() < 100:
        return None
    inner = ndimage.binary_erosion(body, iterations=2)
    band = ndimage.binary_dilation(body, iterations=2) & ~inner
    gy, gx = np.gradient(blur(original, 0.8))
    edges = np.hypot(gx, gy)
    quiet = band & (edges <= np.percentile(edges[band], 60))
    band = quiet if quiet.sum() >= 30 else band
    contrast = float(np.percentile(np.abs(delta[inner if inner.any() else body]), 75))
    gy, gx = np.gradient(delta)
    steepest = float(np.percentile(np.hypot(gx, gy)[band], 90))
    return contrast / max(steepest, 1e-3)


class PixelJudge(Judge):
    """Deterministic rubric verdicts from pixels; `thresholds` may be tuned (documented in the module)."""

    name = "simulator"
    scoring_mapping = "pixel measurements to 0-10, medbanana/generation/backends/simulator/scores.py"

    def __init__(self, *, thresholds: Thresholds | None = None, model: str = "medbanana-pixel-judge-1"):
        self.thresholds = thresholds or Thresholds()
        self.model = model
        self._recent = RecentMeasures()  # a verdict and scores of one edit: measured once

    async def judge(self, task: Task, source: SourceImage, edited: EditedImage, instruction: str) -> Verdict:
        return await asyncio.to_thread(self.judge_sync, task, source, edited, instruction)

    def judge_sync(self, task: Task, source: SourceImage, edited: EditedImage, instruction: str = "") -> Verdict:
        m = self._measured(task, source, edited)
        return self.verdict(task, m)

    async def score(self, task: Task, source: SourceImage, edited: EditedImage, instruction: str,
                    ground_truth: SourceImage | None = None) -> EditScores:
        """0-10 editing accuracy and visual quality from the same measurements (scores.py); ground truth unused."""
        return await asyncio.to_thread(self.score_sync, task, source, edited)

    def score_sync(self, task: Task, source: SourceImage, edited: EditedImage) -> EditScores:
        m = self._measured(task, source, edited)
        values = scores.scores(m, task.direction, task.modality, self.thresholds)
        return EditScores(editing_accuracy=values["editing_accuracy"], visual_quality=values["visual_quality"],
                          reason=self.verdict(task, m).reason, model=self.model, details={**m, **values})

    # ------------------------------------------------------------ measurements
    def _measured(self, task: Task, source: SourceImage, edited: EditedImage) -> dict:
        key = (task, source.sha256, edited.data, self.thresholds)
        return self._recent.get(key, lambda: self.measure(task, source, edited))

    def measure(self, task: Task, source: SourceImage, edited: EditedImage) -> dict:
        t = self.thresholds
        spec = spec_for(task.disease)
        orig = source.array
        edit = edited.array
        same_size = edit.shape == orig.shape
        if not same_size:
            edit = np.asarray(resize_rgb(edit, (orig.shape[1], orig.shape[0])) + 0.5, np.uint8)
        canvas = make_canvas(orig, task.modality, key=source.sha256)
        region, envelope = canvas.regions[spec.region], canvas.regions["envelope"]
        ework, owork = resize_rgb(edit, WORK), canvas.rgb
        lo, le = canvas.lum, luminance(ework)
        delta = le - lo
        if task.modality == "fundus":  # colour photographs: a colour change counts, signed by its brightness
            rms = np.sqrt(((ework - owork) ** 2).mean(axis=2))
            delta = np.where(delta >= 0, 1.0, -1.0) * np.maximum(rms, np.abs(delta))
        near = ndimage.binary_dilation(region, iterations=t.spill_margin)
        far = ~near
        # A uniform drift of the whole image is judged once, as a global shift (fidelity); the change maps
        # below are read without it, so that it does not pass for spill or a lesion.
        offset = float(np.median(delta[far & envelope])) if (far & envelope).sum() > 100 else 0.0
        smooth = blur(delta - offset, 0.8)
        noise_delta = robust_std(smooth[far]) if far.any() else robust_std(smooth)
        threshold = max(t.change_floor - 1.0, 3.0 * noise_delta)
        # Noise plus fine anatomical clutter (ribs, vessels, gyri): what a finding must stand out from to be seen.
        clutter = blur(lo, 1.0) - blur(lo, 6.0)
        anatomical = robust_std(clutter[region]) if region.any() else 0.0
        fine = _fine_noise(orig, region)  # the grain a reader sees at full resolution, finer than this grid
        level = max(float(np.hypot(anatomical, fine)), 1.5)
        signed = smooth * spec.polarity if spec.polarity else np.abs(smooth)
        changed = region & (signed > threshold)
        moved = np.abs(smooth) > threshold
        m = {"region": spec.region, "region_pixels": int(region.sum()), "clutter": round(level, 2),
             "fine_noise": round(fine, 2),
             "change_threshold": round(float(threshold), 2), "same_size": same_size}
        # compliance
        if task.direction == "add":
            # The lesion's core: changed pixels at least half as strong as its peak (its full width at half
            # maximum), so that soft margins do not dilute the measured contrast.
            peak = float(np.percentile(signed[changed], 95)) if changed.any() else 0.0
            core = changed & (signed >= 0.5 * peak)
            area = int(core.sum())
            mean = float(signed[core].mean()) if area else 0.0
            towards = float(np.clip(signed, 0, None)[region & moved].sum())
            total = float(np.abs(smooth)[region & moved].sum())
            m.update(changed_pixels=area, min_area=spec.min_area, mean_change=round(mean, 2),
                     cnr=round(mean / level, 2), direction_share=round(towards / total, 3) if total else 0.0)
            lesion = changed
        else:
            found = find_lesion(canvas, spec)
            background = luminance(healthy_rgb(canvas, spec, exclude=repair_area(found, spec)))
            before = evidence_map(lo, spec, background)
            after = evidence_map(le, spec, background)
            remainder = np.abs(blur(le, 1.0) - background)  # either way: leftovers and overshoots alike
            beyond = region & ~repair_area(found, spec, 1.6)
            evidence_before = round(float(before[found].mean()) / level, 2) if found.any() else 0.0
            m.update(lesion_pixels=int(found.sum()), evidence_before=evidence_before,
                     # No removal can be confirmed for a lesion the judge cannot see in the original.
                     lesion_in_source=bool(found.any()) and evidence_before >= t.evidence_min,
                     evidence_after=round(float(after[found].mean()) / level, 2) if found.any() else 0.0,
                     mismatch_after=round(float(remainder[found].mean()) / level, 2) if found.any() else 0.0,
                     change_beyond_lesion=round(float(np.percentile(np.abs(smooth[beyond]), 99)), 2)
                     if beyond.sum() > 100 else 0.0)
            lesion = ndimage.binary_dilation(found, iterations=2) & moved if found.any() else changed
        # structure
        core = canvas.regions.get(f"{spec.region}_core")
        m["core_change"] = (round(float(np.percentile(np.abs(smooth[core]), 95)), 2)
                            if core is not None and core.sum() > 100 else 0.0)
        m["changed_share"] = round(float((region & moved).sum()) / max(int(region.sum()), 1), 3)
        m["max_share"] = spec.max_share
        # Edge energy kept where the image changed; a removal is read around the lesion (its own edges go).
        kept_area = moved if task.direction == "add" else moved & ~ndimage.binary_dilation(found, iterations=3)
        if kept_area.sum() < 100:
            kept_area = np.zeros_like(moved)
        edges_before, edges_after = np.hypot(*np.gradient(blur(lo, 0.7))), np.hypot(*np.gradient(blur(le, 0.7)))
        before_edges = float(edges_before[kept_area].sum())
        m["structure_kept"] = round(float(edges_after[kept_area].sum()) / before_edges, 3) if before_edges else 1.0
        if task.direction == "remove":  # the repair as textured as the healthy tissue around it: no seams, no wipe
            repaired = ndimage.binary_dilation(found, iterations=3) & moved
            ring = (ndimage.binary_dilation(found, iterations=12) & ~ndimage.binary_dilation(found, iterations=5)
                    & envelope)
            around = float(edges_before[ring].mean()) if ring.sum() > 50 else 0.0
            m["repair_edges"] = (round(float(edges_after[repaired].mean()) / around, 3)
                                 if repaired.sum() > 50 and around > 0 else 1.0)
        energy = np.abs(smooth) * moved
        total_energy = float(energy.sum())
        m["envelope_share"] = round(float(energy[envelope].sum()) / total_energy, 3) if total_energy else 1.0
        new_sat = (((ework >= 254) & (owork < 250)) | ((ework <= 1) & (owork > 5))).any(axis=2) & moved
        m["saturated_share"] = round(float(new_sat.sum()) / max(int(moved.sum()), 1), 3)
        ceiling = float(np.percentile(lo[envelope], 99.9)) if envelope.any() else 255.0
        m["lesion_peak"] = round(float(np.percentile(le[lesion], 98)), 1) if lesion.sum() > 10 else 0.0
        m["tissue_ceiling"] = round(ceiling, 1)
        # realism
        # A repair is compared with the healthy tissue around it (the lesion's own texture is meant to go).
        reference = None if task.direction == "add" else (
            ndimage.binary_dilation(lesion, iterations=10) & ~ndimage.binary_dilation(lesion, iterations=3) & envelope)
        ratio = _grain_ratio(orig, edit, lesion, reference) if spec.body else None  # dots and lines carry no grain
        m["grain_ratio"] = round(ratio, 3) if ratio is not None else None
        width = _edge_width(smooth, changed if task.direction == "add" else lesion, lo) if spec.body else None
        m["edge_width"] = round(width, 2) if width is not None else None
        # fidelity
        m["spill_share"] = round(float(energy[far].sum()) / total_energy, 3) if total_energy else 0.0
        outside = ndimage.binary_erosion(far, iterations=3)
        if outside.sum() > 100:
            # SSIM over tissue only: on the black background a grey level of drift swings it wildly.
            tissue = outside & ndimage.binary_dilation(envelope, iterations=8)
            _, ssim_map = structural_similarity(lo, le, data_range=255.0, full=True)
            m["ssim_outside"] = round(float(ssim_map[tissue].mean()), 4) if tissue.sum() > 100 else 1.0
            m["histogram_shift"] = round(_wasserstein(lo[outside], le[outside]), 2)
            m["mean_shift_outside"] = round(float(delta[outside].mean()), 2)
        else:
            m.update(ssim_outside=1.0, histogram_shift=0.0, mean_shift_outside=0.0)
        return m

    # ------------------------------------------------------------ verdict
    def verdict(self, task: Task, m: dict) -> Verdict:
        t = self.thresholds
        place = _place_name(m["region"])
        name = load_taxonomy().target(task.disease, task.modality).name
        finding = name if name.isupper() else name.lower()
        problems: dict[str, list[str]] = {"compliance": [], "structure": [], "realism": [], "fidelity": []}
        if task.direction == "add":
            if m["changed_pixels"] == 0:
                problems["compliance"].append(f"no visible change in the {place}; change too subtle")
            elif m["direction_share"] < t.direction_share:
                problems["compliance"].append(f"the change in the {place} goes the wrong way for {finding}")
            elif m["changed_pixels"] < m["min_area"]:
                problems["compliance"].append(f"change too subtle in the {place}: it covers too little "
                                              f"({m['changed_pixels']} of at least {m['min_area']} px)")
            elif m["cnr"] < t.cnr_min or m["mean_change"] < t.change_floor:
                problems["compliance"].append(f"change too subtle in the {place} (contrast-to-noise {m['cnr']})")
            has_disease = not problems["compliance"]
        else:
            has_disease = scores.lesion_left(m, t)
            if not m["lesion_in_source"]:
                problems["compliance"].append(f"{finding} could not be found in the {place} of the source, so "
                                              "its removal cannot be confirmed (evidence "
                                              f"{m['evidence_before']})")
            elif has_disease:
                problems["compliance"].append(f"{finding} still visible in the {place} "
                                              f"(evidence {m['evidence_after']} of {m['evidence_before']})")
        if m["envelope_share"] < t.envelope_share:
            problems["structure"].append("the change lies outside the anatomy where this finding occurs")
        if task.direction == "remove" and not has_disease and m["mismatch_after"] > t.mismatch_max:
            problems["structure"].append(f"the repaired area does not match the surrounding tissue of the {place}")
        if task.direction == "remove" and m["core_change"] > t.core_change_max:
            problems["structure"].append(f"the normal anatomy of the {place} itself was altered")
        if m["changed_share"] > m["max_share"] + 0.05:
            problems["structure"].append(f"the change covers more of the {place} than this finding would "
                                         "(implausible extent)")
        if m["structure_kept"] < t.structure_kept_min:
            problems["structure"].append("normal anatomy in the edited area was erased")
        if task.direction == "remove" and m["repair_edges"] > t.repair_edges_max:
            problems["structure"].append(f"the repair left new edges (seams) in the {place}")
        if (task.direction == "remove" and task.modality != "fundus" and m["lesion_pixels"]
                and m["repair_edges"] < t.repair_edges_min):
            problems["structure"].append(f"normal anatomy under the repair in the {place} was erased")
        if m["saturated_share"] > t.saturation_max:
            problems["structure"].append("the lesion saturates to pure white or black (implausible density)")
        if (task.direction == "add" and task.modality != "fundus"
                and m["lesion_peak"] > m["tissue_ceiling"] + t.brightness_margin):
            problems["structure"].append("the lesion is denser than any tissue in the image (implausible density)")
        ratio = m["grain_ratio"]
        if ratio is not None and ratio < t.grain_low:
            problems["realism"].append("grain mismatch: the edited area is smoother than the surrounding grain")
        elif ratio is not None and ratio > t.grain_high:
            problems["realism"].append("grain mismatch: the edited area is noisier than the surrounding grain")
        if m["edge_width"] is not None and m["edge_width"] < t.edge_width_min:
            problems["realism"].append("hard edges at the lesion border")
        if task.direction == "remove" and m["change_beyond_lesion"] > t.beyond_max:
            problems["fidelity"].append(f"change spills beyond the lesion into the rest of the {place}")
        if m["spill_share"] > t.spill_max:
            problems["fidelity"].append(f"change spills outside the {place}")
        if m["ssim_outside"] < t.ssim_min:
            problems["fidelity"].append(f"structures outside the {place} changed (SSIM {m['ssim_outside']})")
        if m["histogram_shift"] > t.shift_max:
            problems["fidelity"].append(f"global intensity shift ({m['mean_shift_outside']:+.1f} grey levels)")
        if not m["same_size"]:
            problems["fidelity"].append("the image size changed")
        compliant = has_disease if task.direction == "add" else not has_disease
        ok = {k: not v for k, v in problems.items()}
        qualified = compliant and ok["structure"] and ok["realism"] and ok["fidelity"]
        failed = [p for group in problems.values() for p in group]
        if qualified:
            done = "visible" if task.direction == "add" else "removed"
            reason = (f"{finding[0].upper() + finding[1:]} {done} in the {place}; anatomy, texture and the rest "
                      "of the image are preserved.")
        else:
            reason = "; ".join(failed)
            reason = reason[0].upper() + reason[1:] + "."
        return Verdict(has_disease=has_disease, structure_reasonable=ok["structure"], looks_realistic=ok["realism"],
                       fidelity_preserved=ok["fidelity"], qualified=qualified, reason=reason,
                       score=rubric_score(compliant, ok["structure"], ok["realism"], ok["fidelity"]),
                       model=self.model, details=m)
