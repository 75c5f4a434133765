"""Where things are: robust landmark estimates and region masks for chest X-ray, brain MRI and fundus images.

Landmarks are estimated from the image itself at ANAT² resolution (lungs as dark fields either side of the bright
mediastinum, head as the largest bright blob, the optic disc as the brightest blob of the fundus) with fallbacks to
typical geometry when an estimate is implausible, so any image of any size gets usable regions. Coordinates are
fractions of the image side; `Anatomy.regions(size)` rasterises every taxonomy region key at a grid size.
Chest images are assumed in the radiological convention (patient's right on the image left).
"""

from __future__ import annotations

from dataclasses import dataclass, field
import numpy as np
from scipy import ndimage

from .raster import (SourceCache, blur, disc, ellipse_radius, fill_holes, grid, largest_component, otsu, padded_box,
                     resize_mask)

ANAT = 256  # the side of the square grid landmarks are estimated on

# Pixels at 512² (the simulator's working grid) a task's region is grown by: the soft margins of a finding placed
# at the region's edge stay inside. The judge's spill margin and `grown_region` (the dataset's region_mask, the
# attention IoU's region) use it.
REGION_MARGIN = 12
MARGIN_GRID = 512


@dataclass
class Anatomy:
    modality: str
    points: dict[str, tuple[float, ...]]  # named landmarks / boxes as fractions of the side
    masks: dict[str, np.ndarray] = field(default_factory=dict)  # data-driven masks at ANAT²
    estimated: bool = True  # False when the fallback geometry was used

    def regions(self, size: int) -> dict[str, np.ndarray]:
        """Region key -> boolean mask at size², plus "envelope" (where this modality's lesions may lie) and, for
        chest X-rays, "lungs" and "<region>_core" (normal anatomy inside a region)."""
        return _RASTERISERS[self.modality](self, size)


# ---------------------------------------------------------------- chest X-ray
def _find_lungs(g: np.ndarray, mid: float) -> dict | None:
    """Two dark fields either side of the midline, not connected to the air outside the body.

    The threshold starts at Otsu's and is lowered until the lungs separate from the outside air."""
    n = g.shape[0]
    smooth = blur(g, 2)
    base = otsu(g[int(0.1 * n):int(0.92 * n), int(0.05 * n):int(0.95 * n)])
    for factor in (1.0, 0.9, 0.8, 0.7, 0.6):
        dark = ndimage.binary_opening(smooth < base * factor, iterations=2)
        labels, _ = ndimage.label(dark)
        edge = np.unique(np.concatenate([labels[0], labels[-1], labels[:, 0], labels[:, -1]]))
        lungs = {}
        for side, (x_lo, x_hi) in (("R", (0.05, mid - 0.03)), ("L", (mid + 0.03, 0.95))):
            best = None
            for idx, sl in enumerate(ndimage.find_objects(labels), start=1):
                if sl is None or idx in edge:
                    continue
                comp = labels[sl] == idx
                area = comp.sum() / n**2
                ys, xs = np.nonzero(comp)
                cx, cy = (xs.mean() + sl[1].start) / n, (ys.mean() + sl[0].start) / n
                height = (sl[0].stop - sl[0].start) / n
                if x_lo < cx < x_hi and 0.02 < area < 0.3 and height > 0.25 and 0.25 < cy < 0.75:
                    if best is None or area > best[0]:
                        best = (area, idx, sl)
            if best is None:
                break
            _, idx, sl = best
            # closed, filled and grown within its box and a margin of zeros wider than the closing and growth
            # reach: the same as on the whole grid, for a fraction of the pixels
            box = padded_box(sl, 6, labels.shape)
            mask = np.zeros(labels.shape, bool)
            mask[box] = ndimage.binary_dilation(fill_holes(ndimage.binary_closing(labels[box] == idx, iterations=3)),
                                                iterations=2)
            ys, xs = np.nonzero(mask)
            lungs[side] = (mask, (xs.min() / n, (xs.max() + 1) / n, ys.min() / n, (ys.max() + 1) / n))
        if len(lungs) == 2:
            return lungs
    return None


def _chest_points(g: np.ndarray) -> tuple[dict, dict, bool]:
    n = g.shape[0]
    band = g[int(0.35 * n):int(0.65 * n)].mean(axis=0)
    lo, hi = int(0.38 * n), int(0.62 * n)
    mid = (lo + int(np.argmax(blur(band, 3)[lo:hi]))) / n
    lungs = _find_lungs(g, mid)
    ok = lungs is not None
    if not ok:
        lungs, mid = _typical_lungs(n), 0.5
    return _chest_layout(mid, lungs) + (ok,)


def _typical_lungs(n: int) -> dict:
    """Two elliptic lung fields of typical size and place, at n²."""
    lungs = {}
    for side, (x0, x1) in (("R", (0.14, 0.45)), ("L", (0.55, 0.86))):
        mask = ellipse_radius(n, (x0 + x1) / 2 * n, 0.46 * n, (x1 - x0) / 2 * n, 0.3 * n) <= 1
        lungs[side] = (mask, (x0, x1, 0.16, 0.76))
    return lungs


def _chest_layout(mid: float, lungs: dict) -> tuple[dict, dict]:
    points = {"midline": (mid,), "lung_R": lungs["R"][1], "lung_L": lungs["L"][1]}
    masks = {"lung_R": lungs["R"][0], "lung_L": lungs["L"][0]}
    base = max(lungs["R"][1][3], lungs["L"][1][3])
    top = min(lungs["R"][1][2], lungs["L"][1][2])
    height = base - top
    # The heart sits low between the lungs, bulging toward the patient's left (image right).
    points["heart"] = (mid + 0.05, base - 0.22 * height, 0.13, 0.11 * height / 0.6)
    points["thorax"] = (top, base)
    return points, masks


def _chest_regions(anat: Anatomy, size: int) -> dict[str, np.ndarray]:
    x, y = grid(size)
    x, y = x / size, y / size
    p = anat.points
    lungs = {s: resize_mask(anat.masks[f"lung_{s}"], size) for s in ("R", "L")}
    regions: dict[str, list[np.ndarray]] = {}
    for side, lung in lungs.items():
        x0, x1, y0, y1 = p[f"lung_{side}"]
        h, w = y1 - y0, x1 - x0
        lateral = (x - x0) / w if side == "R" else (x1 - x) / w  # 0 at the chest wall, 1 at the mediastinum
        rel_y = (y - y0) / h
        near = ndimage.binary_dilation(lung, iterations=max(1, size // 128))
        regions.setdefault("lung_lower", []).append(lung & (rel_y > 0.55))
        regions.setdefault("lung_mid", []).append(lung & (rel_y > 0.22) & (rel_y < 0.72))
        regions.setdefault("lung_apex", []).append(near & ((rel_y < 0.4) | ((lateral < 0.3) & (rel_y < 0.8))))
        regions.setdefault("costophrenic_angle", []).append(
            (rel_y > 0.55) & (rel_y < 1.12) & (lateral > -0.1) & (lateral < 0.72))
        hilum_x = x1 - 0.12 * w if side == "R" else x0 + 0.12 * w
        regions.setdefault("perihilar", []).append(
            near & (ellipse_radius(size, hilum_x * size, (y0 + 0.5 * h) * size, 0.5 * w * size, 0.3 * h * size) <= 1))
        regions.setdefault("ribs_lateral", []).append(
            (lateral > -0.1) & (lateral < 0.35) & (rel_y > 0.15) & (rel_y < 0.85))
        if side == "R":
            regions["right_lower_lung"] = [lung & (rel_y > 0.5)]
    hx, hy, hax, hay = p["heart"]
    heart = ellipse_radius(size, hx * size, hy * size, hax * size, hay * size)
    regions["cardiac_silhouette"] = [heart <= 1.55]
    mid = p["midline"][0]
    top, base = p["thorax"]
    regions["mediastinum"] = [(np.abs(x - mid) < 0.17) & (y > top + 0.02) & (y < hy - 0.4 * hay)]
    out = {key: np.logical_or.reduce(parts) for key, parts in regions.items()}
    thorax = ((x > p["lung_R"][0] - 0.05) & (x < p["lung_L"][1] + 0.05) & (y > top - 0.06) & (y < base + 0.08))
    out["envelope"] = thorax
    # Normal anatomy inside a region that a removal must leave alone: the normal-sized heart, the central
    # mediastinum. And the aerated lungs, whose mirror image is the healthy reference of one-sided findings.
    out["cardiac_silhouette_core"] = (heart <= 1.0) | (y < hy - 0.6 * hay)  # and the great vessels above it
    out["mediastinum_core"] = out["mediastinum"] & (np.abs(x - mid) < 0.075)
    out["lungs"] = lungs["R"] | lungs["L"]
    return out


# ---------------------------------------------------------------- brain MRI
_TYPICAL_HEAD = (0.5, 0.5, 0.36, 0.44)  # centre and semi-axes, fractions of the side


def _brain_points(g: np.ndarray) -> tuple[dict, dict, bool]:
    n = g.shape[0]
    head = blur(g, 2) > max(0.5 * otsu(g), 8)
    head = largest_component(fill_holes(head))
    area = head.sum() / n**2
    ok = 0.08 < area < 0.95
    if ok:
        ys, xs = np.nonzero(head)
        cx, cy = xs.mean() / n, ys.mean() / n
        ax, ay = 2 * xs.std() / n, 2 * ys.std() / n
    else:
        cx, cy, ax, ay = _TYPICAL_HEAD
        head = ellipse_radius(n, cx * n, cy * n, ax * n, ay * n) <= 1
    # The brain lies inside the scalp and skull: about 86 % of the head's semi-axes.
    return {"brain": (cx, cy, 0.86 * ax, 0.86 * ay)}, {"head": head}, ok


def _brain_regions(anat: Anatomy, size: int) -> dict[str, np.ndarray]:
    cx, cy, ax, ay = anat.points["brain"]
    r = ellipse_radius(size, cx * size, cy * size, ax * size, ay * size)
    x, _ = grid(size)
    off_midline = np.abs(x / size - cx) > 0.08 * ax
    return {"cerebral_hemisphere": (r < 0.8) & off_midline,
            "convexity_dura": (r > 0.68) & (r < 1.06),
            "sella": disc(size, cx * size, (cy - 0.08 * ay) * size, 0.2 * ax * size),
            "whole_brain": r <= 1.0,
            "envelope": r <= 1.08}


# ---------------------------------------------------------------- fundus
def _fundus_points(rgb: np.ndarray) -> tuple[dict, dict, bool]:
    n = rgb.shape[0]
    g = rgb.mean(axis=2)
    fundus = largest_component(fill_holes(blur(g, 1.5) > max(12.0, 0.35 * otsu(g))))
    area = fundus.sum() / n**2
    ok = area > 0.2
    if ok:
        ys, xs = np.nonzero(fundus)
        fcx, fcy, radius = xs.mean() / n, ys.mean() / n, np.sqrt(area / np.pi)
    else:
        fcx, fcy, radius = 0.5, 0.5, 0.47
        fundus = disc(n, 0.5 * n, 0.5 * n, 0.47 * n)
    inner = ellipse_radius(n, fcx * n, fcy * n, radius * n, radius * n) < 0.85
    lum = blur(rgb[..., 0] * 0.5 + rgb[..., 1] * 0.5, radius * n / 25)
    dy, dx = np.unravel_index(int(np.argmax(np.where(inner, lum, -1))), lum.shape)
    dcx, dcy = dx / n, dy / n
    # Disc radius from the blob brighter than halfway between its peak and the surrounding fundus.
    ring = (ellipse_radius(n, dx, dy, 0.25 * radius * n, 0.25 * radius * n) < 1) & inner
    level = 0.5 * (lum[dy, dx] + np.median(lum[ring])) if ring.any() else lum[dy, dx]
    blob = largest_component((lum >= level) & ring) if ring.any() else ring
    disc_r = float(np.clip(np.sqrt(blob.sum() / np.pi) / n, 0.06 * radius, 0.13 * radius))
    # Fovea: the darkest smooth spot 2-3.5 disc diameters from the disc, on the side of the fundus centre.
    dist = np.hypot(*(np.subtract(grid(n), [[[dx]], [[dy]]]))) / n
    darkest = blur(g, radius * n / 12)
    x, y = grid(n)
    level = np.abs(y / n - dcy) < 3 * disc_r  # the fovea lies roughly level with the disc
    annulus = inner & level & (dist > 4 * disc_r) & (dist < 7 * disc_r)
    to_centre = np.array([fcx - dcx, fcy - dcy])
    if np.linalg.norm(to_centre) > 0.05 * radius and annulus.any():
        ahead = ((x / n - dcx) * to_centre[0] + (y / n - dcy) * to_centre[1]) > 0.5 * dist * np.linalg.norm(to_centre)
        annulus &= ahead
    if annulus.any():
        fy, fx = np.unravel_index(int(np.argmin(np.where(annulus, darkest, np.inf))), darkest.shape)
        fov = (fx / n, fy / n)
    else:
        fov = (fcx, fcy)
    points = {"fundus": (fcx, fcy, radius), "disc": (dcx, dcy, disc_r), "fovea": fov}
    return points, {"fundus": fundus}, ok


def _fundus_regions(anat: Anatomy, size: int) -> dict[str, np.ndarray]:
    fundus = resize_mask(anat.masks["fundus"], size)
    inside = ndimage.binary_erosion(fundus, iterations=max(1, size // 100))
    fcx, fcy, radius = anat.points["fundus"]
    dcx, dcy, dr = anat.points["disc"]
    fx, fy = anat.points["fovea"]
    mx, my = (dcx + fx) / 2, (dcy + fy) / 2
    half = np.hypot(fx - dcx, fy - dcy) / 2
    s = size
    return {"optic_disc": disc(s, dcx * s, dcy * s, 1.6 * dr * s) & inside,
            "macula": disc(s, fx * s, fy * s, 2.4 * dr * s) & inside,
            "posterior_pole": disc(s, mx * s, my * s, (half + 3.5 * dr) * s) & inside,
            "vessels": disc(s, mx * s, my * s, (half + 5 * dr) * s) & inside,
            "peripapillary": disc(s, dcx * s, dcy * s, 4.5 * dr * s) & inside,
            "whole_fundus": inside,
            "envelope": fundus}


_RASTERISERS = {"chest_xray": _chest_regions, "brain_mri": _brain_regions, "fundus": _fundus_regions}


def _estimate(small: np.ndarray, modality: str) -> Anatomy:
    if modality == "fundus":
        points, masks, ok = _fundus_points(small)
    elif modality == "brain_mri":
        points, masks, ok = _brain_points(small.mean(axis=2))
    elif modality == "chest_xray":
        points, masks, ok = _chest_points(small.mean(axis=2))
    else:
        raise ValueError(f"unknown modality {modality!r}")
    return Anatomy(modality=modality, points=points, masks=masks, estimated=ok)


def typical_anatomy(modality: str, n: int = 256) -> Anatomy:
    """The fallback geometry of a modality, with no image to locate it on: centred lungs and heart, a centred
    head, a centred fundus with the disc right of centre and the fovea left (a right eye)."""
    if modality == "chest_xray":
        points, masks = _chest_layout(0.5, _typical_lungs(n))
    elif modality == "brain_mri":
        cx, cy, ax, ay = _TYPICAL_HEAD
        points = {"brain": (cx, cy, 0.86 * ax, 0.86 * ay)}
        masks = {"head": ellipse_radius(n, cx * n, cy * n, ax * n, ay * n) <= 1}
    elif modality == "fundus":
        points = {"fundus": (0.5, 0.5, 0.47), "disc": (0.66, 0.5, 0.05), "fovea": (0.42, 0.51)}
        masks = {"fundus": disc(n, 0.5 * n, 0.5 * n, 0.47 * n)}
    else:
        raise ValueError(f"unknown modality {modality!r}")
    return Anatomy(modality=modality, points=points, masks=masks, estimated=False)


_ANATOMIES: SourceCache[Anatomy] = SourceCache(128)


def estimate_anatomy(small_rgb: np.ndarray, modality: str, key: str = "") -> Anatomy:
    """Landmarks of an ANAT² float RGB image. With a `key` (the source's sha256) the result is cached, because
    the editor and the judge of every round of a task ask about the same original image."""
    return _ANATOMIES.get(key, modality, lambda: _estimate(np.asarray(small_rgb, dtype=np.float32), modality))


def grown_region(anatomy: Anatomy, region: str, size: int) -> np.ndarray:
    """A task's region: the taxonomy `region` at size², grown by REGION_MARGIN (scaled to the grid). KeyError for a
    region this modality has no mask for."""
    mask = anatomy.regions(size)[region]
    margin = max(1, round(REGION_MARGIN * size / MARGIN_GRID))
    return ndimage.binary_dilation(mask, iterations=margin)
