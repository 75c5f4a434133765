"""Region-aware lesion synthesis and removal on the 512² working grid, for all 20 edit targets.

A builder turns (canvas, parameters, rng) into `EditOps`: an additive RGB delta, a blend weight toward a target
image, and a density map of where the lesion is. `apply_ops` applies them to the full-resolution source, where the
image's own fine grain is partly lost inside the lesion (how much depends on the grain parameter and the lesion's
strength, as with generative editors) and re-synthesised by shifting the image's own high-pass residual.

Removal finds the lesion evidence in the target region (`evidence_map`: the deviation of the image, in the
finding's polarity, from a healthy reference: the mirrored other side for one-sided brain and lung findings, else
a smooth background that ignores the lesion), then blends the lesion toward that reference. The judge uses the
same evidence measure to decide whether a removed finding is still present, and separate checks (edge density,
change beyond the lesion, normal anatomy) to catch repairs that wipe or smear anatomy.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from scipy import ndimage

from ...anatomy import ANAT, Anatomy, estimate_anatomy
from ...raster import SourceCache, blur, ellipse_radius, resize_field, resize_rgb
from .imaging import WORK, grain_level, highpass, luminance, robust_std, smooth_noise, soft_edge
from ...failures import UsageError


@dataclass(frozen=True)
class LesionSpec:
    region: str  # taxonomy region key
    polarity: int  # +1 the finding is brighter than the tissue, -1 darker, 0 either (mixed signs)
    amplitude: float  # contrast in grey levels at intensity 1.0, or the blend fraction of findings that replace
    # tissue with a denser one (their intensity sets how far they extend instead)
    scale: float  # typical lesion radius in working pixels: sets the background scale of the evidence map
    min_area: int  # working pixels a visible finding covers at least (dots and lines are small)
    body: bool = True  # an extended lesion body whose border sharpness can be judged
    max_share: float = 0.6  # the largest fraction of its region the finding plausibly covers
    mirror: bool = True  # one-sided: the other side is its healthy reference (not with a bright line in a
    # dark rim, whose mirror image would look like a finding on the healthy side)


@dataclass
class Canvas:
    """The source at working resolution with its anatomy."""

    rgb: np.ndarray  # WORK² x 3 float
    lum: np.ndarray
    anatomy: Anatomy
    regions: dict[str, np.ndarray]
    grain: float  # fine-grain noise level of the image inside its anatomy (grey levels)

    @property
    def n(self) -> int:
        return self.lum.shape[0]

    def point(self, name: str) -> tuple[float, ...]:
        """A landmark in working pixels (fractions times n)."""
        return tuple(v * self.n for v in self.anatomy.points[name])


@dataclass
class EditOps:
    add: np.ndarray  # WORK² x 3 additive delta in grey levels
    mix: np.ndarray  # WORK² blend weight toward `target`
    target: np.ndarray  # WORK² x 3
    density: np.ndarray  # WORK² 0..1: where the lesion is (grain loss)
    facts: dict = field(default_factory=dict)

    @classmethod
    def empty(cls, canvas: Canvas) -> "EditOps":
        n = canvas.n
        return cls(np.zeros((n, n, 3), np.float32), np.zeros((n, n), np.float32), canvas.rgb.copy(),
                   np.zeros((n, n), np.float32))

    def paint(self, field: np.ndarray, amount: float, tint=(1.0, 1.0, 1.0)) -> None:
        """Add `amount` grey levels (per-channel `tint`) where `field` is 1."""
        self.add += (amount * field)[..., None] * np.asarray(tint, np.float32)
        self.density = np.maximum(self.density, np.clip(np.abs(field), 0, 1))

    def blend(self, field: np.ndarray, fraction: float, target: np.ndarray) -> None:
        """Blend toward `target` (WORK² x 3 or an RGB triple) by `fraction` where `field` is 1."""
        weight = np.clip(field * fraction, 0, 1)
        target = np.broadcast_to(np.asarray(target, np.float32), self.target.shape)
        share = np.where(weight > 1e-4, weight / np.maximum(self.mix + weight, 1e-6), 0)[..., None]
        self.target = self.target * (1 - share) + target * share
        self.mix = 1 - (1 - self.mix) * (1 - weight)
        self.density = np.maximum(self.density, np.clip(field, 0, 1))


SPECS: dict[str, LesionSpec] = {
    "Atelectasis": LesionSpec("right_lower_lung", +1, 55, 18, 150),
    "Cardiomegaly": LesionSpec("cardiac_silhouette", +1, 0.85, 30, 4000, max_share=0.9),
    "Consolidation": LesionSpec("right_lower_lung", +1, 65, 30, 400),
    "Edema": LesionSpec("perihilar", +1, 65, 50, 600, max_share=0.95),
    "Enlarged_Cardiomediastinum": LesionSpec("mediastinum", +1, 0.85, 20, 5000, max_share=0.9),
    "Fracture": LesionSpec("ribs_lateral", -1, 70, 5, 25, body=False),
    "Lung_Lesion": LesionSpec("lung_mid", +1, 62, 16, 120),
    "Lung_Opacity": LesionSpec("lung_mid", +1, 70, 28, 300),
    "Pleural_Effusion": LesionSpec("costophrenic_angle", +1, 0.85, 30, 1600, max_share=0.9),
    "Pneumonia": LesionSpec("right_lower_lung", +1, 80, 24, 300),
    "Pneumothorax": LesionSpec("lung_apex", 0, 0.85, 16, 150, body=False, max_share=0.8, mirror=False),
    "glioma": LesionSpec("cerebral_hemisphere", +1, 42, 28, 400),
    "meningioma": LesionSpec("convexity_dura", +1, 60, 24, 300),
    "pituitary": LesionSpec("sella", +1, 30, 18, 200),
    "Diabetes": LesionSpec("posterior_pole", 0, 0.6, 4, 40, body=False),
    "Glaucoma": LesionSpec("optic_disc", +1, 0.8, 10, 80, max_share=0.9),
    "AMD": LesionSpec("macula", +1, 0.45, 5, 60, body=False),
    "Cataract": LesionSpec("whole_fundus", 0, 0.55, 60, 2000, max_share=1.0),
    "Hypertension": LesionSpec("vessels", 0, 0.8, 4, 60, body=False),
    "Myopia": LesionSpec("peripapillary", 0, 0.7, 14, 150, max_share=0.9),
}


def spec_for(disease: str) -> LesionSpec:
    try:
        return SPECS[disease]
    except KeyError:
        raise UsageError(f"the simulator has no lesion model for {disease!r}; known: {', '.join(SPECS)}") from None


_CANVASES: SourceCache[Canvas] = SourceCache(16)


def make_canvas(rgb: np.ndarray, modality: str, key: str = "") -> Canvas:
    """The source on the working grid with its anatomy. With a `key` (the source's sha256) it is cached: every
    round's edit and judgement of a task start from the same original. Treat the result as read-only."""
    return _CANVASES.get(key, modality, lambda: _canvas(rgb, modality, key))


def _canvas(rgb: np.ndarray, modality: str, key: str) -> Canvas:
    work = resize_rgb(rgb, WORK)
    anatomy = estimate_anatomy(resize_rgb(rgb, ANAT), modality, key)
    lum = luminance(work)
    regions = anatomy.regions(WORK)
    return Canvas(work, lum, anatomy, regions, max(grain_level(lum, regions["envelope"]), 0.5))


# ---------------------------------------------------------------- shared shape helpers
def place(canvas: Canvas, region: np.ndarray, radius: float, rng: np.random.Generator, *, side: str = "",
          inward: bool = False) -> tuple[float, float]:
    """A lesion centre inside `region` (on the patient's `side`: right = image left), kept `radius` from its edge.

    Placement varies with the seed like a real editor's; `inward` asks for a point near the region's core."""
    n = canvas.n
    mask = region.copy()
    if side:
        points = canvas.anatomy.points
        mid = (points["brain"][0] if "brain" in points else points.get("midline", (0.5,))[0]) * n
        half = np.arange(n)[None, :] < mid if side == "right" else np.arange(n)[None, :] >= mid
        if (mask & half).any():
            mask &= half
    if not mask.any():
        return n / 2, n / 2
    depth = ndimage.distance_transform_edt(mask)
    keep = depth >= min(radius * (1.0 if inward else 0.6), depth.max() * (0.8 if inward else 0.6))
    ys, xs = np.nonzero(keep)
    if inward:
        weights = depth[ys, xs] ** 2
        pick = int(rng.choice(len(xs), p=weights / weights.sum()))
    else:
        pick = int(rng.integers(len(xs)))
    return float(xs[pick]), float(ys[pick])


def irregular_blob(canvas: Canvas, cx: float, cy: float, rx: float, ry: float, rng: np.random.Generator, *,
                   irregularity: float = 0.15, angle: float = 0.0, softness: float = 2.0) -> np.ndarray:
    """0..1 field of an ellipse with a lobulated outline and a Gaussian margin of `softness` pixels."""
    r = ellipse_radius(canvas.n, cx, cy, rx, ry, angle)
    outline = 1 + irregularity * smooth_noise(rng, canvas.n, max(2.0, 0.35 * min(rx, ry)))
    return soft_edge(r <= outline, softness)


def dots(canvas: Canvas, centres: list[tuple[float, float, float]], softness: float) -> np.ndarray:
    """Sum of round dots (cx, cy, radius), each with a soft margin, capped at 1."""
    n = canvas.n
    field = np.zeros((n, n), np.float32)
    for cx, cy, r in centres:
        pad = int(r * 2 + 3 * softness + 2)
        x0, x1 = max(0, int(cx) - pad), min(n, int(cx) + pad + 1)
        y0, y1 = max(0, int(cy) - pad), min(n, int(cy) + pad + 1)
        if x0 >= x1 or y0 >= y1:
            continue
        yy, xx = np.mgrid[y0:y1, x0:x1]
        dist = np.hypot(xx - cx, yy - cy)
        edge = 1 / (1 + np.exp((dist - r) / max(softness * 0.6, 0.3)))
        field[y0:y1, x0:x1] = np.maximum(field[y0:y1, x0:x1], edge)
    return field


def scatter(region: np.ndarray, count: int, rng: np.random.Generator, near: tuple[float, float] | None = None,
            spread: float = 0.0) -> list[tuple[float, float]]:
    """`count` random points in `region`, optionally clustered around `near` with a Gaussian `spread`."""
    ys, xs = np.nonzero(region)
    if len(xs) == 0:
        return []
    if near is None:
        idx = rng.integers(len(xs), size=count)
        return [(float(xs[i]), float(ys[i])) for i in idx]
    out = []
    for _ in range(count * 6):
        px, py = rng.normal(near[0], spread), rng.normal(near[1], spread)
        ix, iy = int(round(px)), int(round(py))
        if 0 <= ix < region.shape[1] and 0 <= iy < region.shape[0] and region[iy, ix]:
            out.append((px, py))
            if len(out) == count:
                break
    return out


# ---------------------------------------------------------------- evidence (shared with the judge)
ONE_SIDED_CHEST = {"right_lower_lung", "lung_mid", "lung_apex", "costophrenic_angle", "ribs_lateral"}
LUNG_REFERENCE = {"cardiac_silhouette", "mediastinum", "perihilar", "lung_apex"}


def normalised_blur(values: np.ndarray, weight: np.ndarray, sigma: float) -> np.ndarray:
    """Gaussian average of `values` (2-D or RGB) counting only pixels with weight."""
    norm = np.maximum(blur(weight, sigma), 1e-3)
    if values.ndim == 2:
        return blur(values * weight, sigma) / norm
    return np.stack([blur(values[..., c] * weight, sigma) / norm for c in range(values.shape[2])], axis=-1)


def mirrored(values: np.ndarray, axis: float) -> np.ndarray:
    """The image flipped left-right about column `axis`."""
    n = values.shape[1]
    return values[:, np.clip(np.round(2 * axis - np.arange(n)), 0, n - 1).astype(int)]


def _mirror(canvas: Canvas, spec: LesionSpec) -> tuple[float, np.ndarray] | None:
    """(midline column, where the mirror image is valid) for one-sided findings, whose healthy reference is the
    same place on the other side: the other hemisphere, the other lung (normal anatomy such as ventricles and
    ribs is near-symmetric, a lesion is not). None for midline and bilateral findings and for the fundus."""
    points, n = canvas.anatomy.points, canvas.n
    if spec.polarity == 0 or not spec.mirror:  # a difference of either sign cannot tell which side is diseased
        return None
    if canvas.anatomy.modality == "brain_mri" and spec.region != "sella":
        axis = points["brain"][0] * n
        organ = canvas.regions["whole_brain"]
        return axis, soft_edge(organ & mirrored(organ, axis), 3.0)
    if canvas.anatomy.modality == "chest_xray" and spec.region in ONE_SIDED_CHEST:
        axis = points["midline"][0] * n
        lungs = canvas.regions["lungs"]  # a dense finding may hide its own lung: either side aerated will do
        return axis, soft_edge(lungs | mirrored(lungs, axis), 3.0)
    return None


def healthy_rgb(canvas: Canvas, spec: LesionSpec, exclude: np.ndarray | None = None) -> np.ndarray:
    """What the area would look like without the finding (RGB, working grid): the mirrored other side where
    there is one (see `_mirror`), else a smooth average of the surrounding tissue that ignores `exclude` and
    pixels far from their neighbourhood either way (lesions, but equally ribs and interspaces: no bias)."""
    tissue = canvas.regions["envelope"]
    if spec.region in LUNG_REFERENCE:  # what a dense finding in the chest displaces is aerated lung
        tissue = canvas.regions["lungs"]
    first = normalised_blur(canvas.lum, tissue.astype(np.float32), 1.5 * spec.scale)
    weight = ((np.abs(canvas.lum - first) < 2.5 * max(canvas.grain, 2.0)) & tissue).astype(np.float32)
    if exclude is not None:
        weight[exclude] = 0
    smooth = normalised_blur(canvas.rgb, weight, 1.5 * spec.scale)
    mirror = _mirror(canvas, spec)
    if mirror is None:
        return smooth
    axis, valid = mirror
    other = np.stack([blur(mirrored(canvas.rgb[..., c], axis), 1.0) for c in range(3)], axis=-1)
    return valid[..., None] * other + (1 - valid[..., None]) * smooth


def evidence_map(lum: np.ndarray, spec: LesionSpec, background: np.ndarray) -> np.ndarray:
    """How strongly each pixel shows the finding: its deviation from the healthy background, signed by polarity."""
    dev = blur(lum, 1.0) - background
    return dev * spec.polarity if spec.polarity else np.abs(dev)


def search_area(canvas: Canvas, spec: LesionSpec) -> np.ndarray:
    """Where a removal looks for the finding: its region less the normal anatomy inside it (the heart itself),
    and for lung findings only the lung fields."""
    core = canvas.regions.get(f"{spec.region}_core")
    region = canvas.regions[spec.region]
    if core is not None:
        region = region & ~core
    mirror = _mirror(canvas, spec)
    if mirror is not None and canvas.anatomy.modality == "chest_xray":  # lung findings stay in the lung fields
        region = region & (mirror[1] > 0.5)
    return region


def lesion_mask(evidence: np.ndarray, region: np.ndarray, spec: LesionSpec, noise: float) -> np.ndarray:
    """Connected areas of the region where the evidence stands out: above the noise and above 40 % of the
    region's strongest evidence (so normal tissue around a prominent lesion is left alone); the strongest area
    and any other holding at least half as much evidence (scattered findings such as drusen keep every dot)."""
    peak = float(np.percentile(evidence[region], 99.5)) if region.any() else 0.0
    strong = (evidence > max(3.0 * noise, 6.0, 0.4 * peak)) & region
    labels, count = ndimage.label(ndimage.binary_opening(strong) if spec.body else strong)
    if count == 0:
        return strong & False
    index = np.arange(1, count + 1)
    sums = ndimage.sum_labels(evidence, labels, index=index)
    sizes = ndimage.sum_labels(strong, labels, index=index)
    share = 0.5 if spec.body else 0.0
    keep = index[(sums >= share * sums.max()) & (sizes >= 4)]
    return np.isin(labels, keep)


def find_lesion(canvas: Canvas, spec: LesionSpec) -> np.ndarray:
    """The finding's pixels in the ORIGINAL: where its evidence against a first healthy estimate stands out."""
    background = luminance(healthy_rgb(canvas, spec))
    return lesion_mask(evidence_map(canvas.lum, spec, background), search_area(canvas, spec), spec, canvas.grain)


def repair_area(found: np.ndarray, spec: LesionSpec, grow: float = 1.0) -> np.ndarray:
    """The lesion grown by a margin: what a removal replaces, and what the healthy estimate must ignore."""
    return ndimage.binary_dilation(found, iterations=max(1, int(round(0.35 * spec.scale * grow))))


# ---------------------------------------------------------------- add / remove
def build_remove(canvas: Canvas, disease: str, realised: dict) -> EditOps:
    """Blend the detected lesion (grown by the size parameter) toward the healthy reference."""
    spec = spec_for(disease)
    found = find_lesion(canvas, spec)
    ops = EditOps.empty(canvas)
    if found.any():
        area = repair_area(found, spec, realised["size"])
        healthy = healthy_rgb(canvas, spec, exclude=area)
        if _mirror(canvas, spec) is None and canvas.anatomy.modality != "fundus":
            # Around the lesion, radiographs and MR keep their fine anatomy (ribs, vessels) through the repair;
            # fundus lesions are themselves fine detail, so there everything in the area is replaced.
            detail = canvas.rgb - np.stack([blur(canvas.rgb[..., c], 0.5 * spec.scale) for c in range(3)], axis=-1)
            keep = 1 - soft_edge(ndimage.binary_dilation(found, iterations=int(0.5 * spec.scale) + 2), 2.0)
            healthy = healthy + detail * keep[..., None]
        ops.blend(soft_edge(area, realised["softness"]), min(1.0, realised["intensity"]), healthy)
    ops.facts = {"lesion_pixels": int(found.sum())}
    return ops


def apply_ops(source: np.ndarray, ops: EditOps, grain_keep: float, loss_scale: float,
              shift: tuple[int, int]) -> np.ndarray:
    """Apply working-grid ops to the full-resolution uint8 RGB source; returns float RGB (unclipped)."""
    h, w = source.shape[:2]
    img = source.astype(np.float32)
    lum = luminance(img)
    fine = highpass(lum, max(0.6, w / 1024))
    # The high-pass of a high-pass is weaker than the grain it came from: calibrate the re-synthesised grain
    # so that it carries the same fine-grain amplitude as the image (measured on a central crop).
    crop = (slice(h // 4, 3 * h // 4 + 1), slice(w // 4, 3 * w // 4 + 1))
    gain = robust_std(highpass(lum[crop], max(0.6, w / 1024))) / max(
        robust_std(highpass(fine[crop], max(0.6, w / 1024))), 1e-3)
    mix = resize_field(ops.mix, (w, h))
    density = resize_field(ops.density, (w, h))
    out = img
    if mix.max() > 1e-4:
        target = np.stack([resize_field(ops.target[..., c], (w, h)) for c in range(3)], axis=-1)
        out = out + mix[..., None] * (target - img)
        # Blending keeps (1 - mix) of the grain; shifted grain of the image itself tops it up to `grain_keep`.
        top_up = np.sqrt(np.clip(grain_keep**2 - (1 - mix) ** 2, 0, None))
        out += (min(gain, 3.0) * top_up * np.roll(fine, shift, axis=(0, 1)))[..., None]
    if np.abs(ops.add).max() > 1e-4:
        out = out + np.stack([resize_field(ops.add[..., c], (w, h)) for c in range(3)], axis=-1)
    loss = (1 - grain_keep) * loss_scale * density * (1 - mix)
    return out - (loss * fine)[..., None]
