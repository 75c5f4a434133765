"""Chest X-ray findings on the working grid (bright = dense). Patient's right is the image left.

Each builder reads the realised parameters (intensity multiplier, size multiplier, margin softness in pixels,
side, inward) and paints or blends into `ops`; `facts` records where the finding went.
"""

from __future__ import annotations

import numpy as np
from scipy import ndimage

from ...raster import blur, ellipse_radius, grid, resize_mask
from .imaging import polylines, smooth_noise, soft_edge
from .lesions import Canvas, EditOps, irregular_blob, place


def _side(realised: dict, default: str = "right") -> str:
    return realised.get("side") or default


def _lung(canvas: Canvas, side: str) -> tuple[np.ndarray, tuple[float, float, float, float]]:
    key = "lung_R" if side == "right" else "lung_L"
    x0, x1, y0, y1 = (v * canvas.n for v in canvas.anatomy.points[key])
    return resize_mask(canvas.anatomy.masks[key], canvas.n), (x0, x1, y0, y1)


def _soft_tissue(canvas: Canvas, quantile: float = 80) -> float:
    """Grey level of dense soft tissue (mediastinum, abdomen) in this image."""
    envelope = canvas.regions["envelope"]
    lungs = resize_mask(canvas.anatomy.masks["lung_R"] | canvas.anatomy.masks["lung_L"], canvas.n)
    values = canvas.lum[envelope & ~ndimage.binary_dilation(lungs, iterations=4)]
    return float(np.percentile(values, quantile)) if values.size else float(np.percentile(canvas.lum, 90))


def _bronchograms(canvas: Canvas, cx: float, cy: float, r: float, rng: np.random.Generator) -> np.ndarray:
    """A few thin branching air-filled bronchi crossing an opacity."""
    segments = []
    for _ in range(3):
        angle, px, py = rng.uniform(0, 2 * np.pi), cx + rng.normal(0, r / 4), cy + rng.normal(0, r / 4)
        points = []
        for _ in range(5):
            points.append((px, py))
            angle += rng.normal(0, 0.35)
            px, py = px + 0.3 * r * np.cos(angle), py + 0.3 * r * np.sin(angle)
        segments.append((points, 2))
    return blur(polylines(canvas.n, segments), 0.7)


def _fill(canvas: Canvas, ops: EditOps, field: np.ndarray, level: float, spec, realised: dict) -> None:
    """Raise the density under `field` toward soft tissue at grey `level`: the smooth background is lifted, so
    the ribs, spine and grain seen through the new density stay visible (as they do on a real film)."""
    fraction = min(0.97, spec.amplitude * (0.8 + 0.2 * realised["intensity"]))
    ops.paint(field * np.clip(level - blur(canvas.lum, 2.5), 0, None), fraction)


def _above_diaphragm(canvas: Canvas) -> np.ndarray:
    """0..1: the chest above the hemidiaphragms (lowest lung pixel per column, bridged across the mediastinum)."""
    n = canvas.n
    lungs = resize_mask(canvas.anatomy.masks["lung_R"] | canvas.anatomy.masks["lung_L"], n)
    cols = np.nonzero(lungs.any(axis=0))[0]
    if len(cols) == 0:
        return np.ones((n, n), np.float32)
    lowest = n - 1 - np.argmax(lungs[::-1, cols], axis=0)
    floor = np.interp(np.arange(n), cols, lowest).astype(np.float32)
    floor = ndimage.gaussian_filter1d(floor, 6)
    _, y = grid(n)
    return np.clip((floor[None, :] + 0.01 * n - y) / (0.01 * n), 0, 1)


def _record(ops: EditOps, canvas: Canvas, **facts) -> None:
    ops.facts.update({k: (round(v / canvas.n, 4) if isinstance(v, float) else v) for k, v in facts.items()})


def lung_lesion(canvas, ops, spec, realised, rng):
    r = spec.scale * realised["size"]
    cx, cy = place(canvas, canvas.regions[spec.region], r, rng, side=_side(realised), inward=realised["inward"])
    field = irregular_blob(canvas, cx, cy, r, r * rng.uniform(0.85, 1.0), rng, irregularity=0.12,
                           softness=realised["softness"])
    ops.paint(field * (0.9 + 0.1 * smooth_noise(rng, canvas.n, 3)), spec.amplitude * realised["intensity"])
    _record(ops, canvas, centre_x=cx, centre_y=cy, radius=r)


def lung_opacity(canvas, ops, spec, realised, rng):
    r = spec.scale * realised["size"]
    cx, cy = place(canvas, canvas.regions[spec.region], r, rng, side=_side(realised), inward=realised["inward"])
    envelope = irregular_blob(canvas, cx, cy, r, 0.8 * r, rng, irregularity=0.25, softness=realised["softness"] + 2)
    texture = np.clip(0.6 + 0.4 * smooth_noise(rng, canvas.n, 5), 0.15, 1)
    ops.paint(envelope * texture, spec.amplitude * realised["intensity"])
    _record(ops, canvas, centre_x=cx, centre_y=cy, radius=r)


def consolidation(canvas, ops, spec, realised, rng):
    r = spec.scale * realised["size"]
    cx, cy = place(canvas, canvas.regions[spec.region], 0.8 * r, rng, side="right", inward=realised["inward"])
    body = irregular_blob(canvas, cx, cy, 1.1 * r, 0.85 * r, rng, irregularity=0.2, softness=realised["softness"])
    field = body * (0.92 + 0.08 * smooth_noise(rng, canvas.n, 4)) - 0.35 * _bronchograms(canvas, cx, cy, r, rng) * body
    ops.paint(np.clip(field, 0, 1), spec.amplitude * realised["intensity"])
    _record(ops, canvas, centre_x=cx, centre_y=cy, radius=r)


def pneumonia(canvas, ops, spec, realised, rng):
    r = spec.scale * realised["size"]
    cx, cy = place(canvas, canvas.regions[spec.region], 0.8 * r, rng, side="right", inward=realised["inward"])
    field = np.zeros_like(canvas.lum)
    for _ in range(int(rng.integers(3, 6))):
        bx, by = cx + rng.normal(0, 0.45 * r), cy + rng.normal(0, 0.35 * r)
        radius = r * rng.uniform(0.35, 0.6)
        field = np.maximum(field, irregular_blob(canvas, bx, by, radius, radius * 0.9, rng, irregularity=0.3,
                                                 softness=realised["softness"] + 1.5))
    field *= np.clip(0.65 + 0.35 * smooth_noise(rng, canvas.n, 4), 0.2, 1)
    field -= 0.25 * _bronchograms(canvas, cx, cy, r, rng) * field
    ops.paint(field * canvas.regions["envelope"], spec.amplitude * realised["intensity"])
    _record(ops, canvas, centre_x=cx, centre_y=cy, radius=r)


def atelectasis(canvas, ops, spec, realised, rng):
    r = spec.scale * realised["size"]
    region = canvas.regions[spec.region]
    cx, cy = place(canvas, region, 0.7 * r, rng, side="right", inward=realised["inward"])
    band = irregular_blob(canvas, cx, cy, 2.6 * r, 0.55 * r, rng, irregularity=0.1, angle=rng.uniform(-25, -8),
                          softness=realised["softness"])
    _, (x0, x1, _, y1) = _lung(canvas, "right")
    dome = soft_edge(ellipse_radius(canvas.n, (x0 + x1) / 2, y1 - 0.03 * canvas.n, 0.35 * (x1 - x0),
                                    0.4 * r) <= 1, realised["softness"] + 1)  # raised hemidiaphragm
    ops.paint(np.maximum(band, 0.7 * dome * region), spec.amplitude * realised["intensity"])
    _record(ops, canvas, centre_x=cx, centre_y=cy, radius=r)


def edema(canvas, ops, spec, realised, rng):
    field = np.zeros_like(canvas.lum)
    lines = []
    for side in ("right", "left"):
        lung, (x0, x1, y0, y1) = _lung(canvas, side)
        w, h = x1 - x0, y1 - y0
        hx = x1 - 0.3 * w if side == "right" else x0 + 0.3 * w
        r = ellipse_radius(canvas.n, hx, y0 + 0.5 * h, 0.36 * w * realised["size"], 0.28 * h * realised["size"])
        haze = np.exp(-1.6 * r**2) * np.clip(0.75 + 0.3 * smooth_noise(rng, canvas.n, 6), 0, 1)
        field = np.maximum(field, haze * soft_edge(ndimage.binary_dilation(lung, iterations=3), 3))
        edge_x = x0 if side == "right" else x1
        inward = 1 if side == "right" else -1
        for _ in range(5):
            ly = y0 + h * rng.uniform(0.65, 0.88)
            lines.append(([(edge_x + inward * 0.01 * canvas.n, ly), (edge_x + inward * 0.045 * canvas.n, ly)], 1))
    field = blur(field, max(0.0, realised["softness"] - 3)) * soft_edge(canvas.regions[spec.region], 4)
    field = np.maximum(field, 0.6 * blur(polylines(canvas.n, lines), 0.6))
    ops.paint(field, spec.amplitude * realised["intensity"])
    _record(ops, canvas, bilateral=True)


def pleural_effusion(canvas, ops, spec, realised, rng):
    side = _side(realised)
    lung, (x0, x1, y0, y1) = _lung(canvas, side)
    n = canvas.n
    x, y = grid(n)
    rows = np.where(lung.any(axis=0), n - 1 - np.argmax(lung[::-1], axis=0), int(y1))  # lowest lung pixel per column
    bottom = ndimage.gaussian_filter1d(rows.astype(np.float32), 4, mode="nearest")[None, :]
    lateral = np.clip(1 - ((x - x0) if side == "right" else (x1 - x)) / (0.65 * (x1 - x0)), 0, 1)
    amount = 0.25 * (y1 - y0) * realised["size"] * realised["intensity"]  # how much fluid
    height = amount * lateral**1.5  # the meniscus rises along the chest wall
    fluid = (height > 0.01 * n) & (y > bottom - height) & ndimage.binary_dilation(lung, iterations=int(0.03 * n))
    depth = np.clip((y - (bottom - height)) / np.maximum(height, 1), 0, 1)
    field = soft_edge(fluid, realised["softness"]) * (0.7 + 0.3 * depth)
    _fill(canvas, ops, field, _soft_tissue(canvas), spec, realised)
    _record(ops, canvas, side=side, height=float(amount))


def pneumothorax(canvas, ops, spec, realised, rng):
    side = _side(realised)
    lung, _ = _lung(canvas, side)
    depth = ndimage.distance_transform_edt(lung)
    gap = spec.scale * realised["size"]
    zone = soft_edge(canvas.regions[spec.region] & lung, 6)
    rim = soft_edge(lung & (depth < gap), realised["softness"] * 0.5) * zone
    # Beyond the pleural line: no vessel markings (the fine band goes) and more lucent; ribs stay.
    darken = max(0.2, 1 - 0.4 * realised["intensity"])
    lucent = np.stack([blur(canvas.rgb[..., c], 2.5) for c in range(3)], axis=-1) * darken
    ops.blend(rim, spec.amplitude, lucent)
    line = np.exp(-((depth - gap) ** 2) / 4.5) * zone * lung  # the visceral pleural line
    ops.paint(line, 70 * realised["intensity"])
    _record(ops, canvas, side=side, gap=float(gap))


def fracture(canvas, ops, spec, realised, rng):
    side = _side(realised)
    n = canvas.n
    region = canvas.regions[spec.region] & canvas.regions["envelope"]
    x = np.arange(n)[None, :]
    region &= (x < n * canvas.anatomy.points["midline"][0]) if side == "right" else (
        x >= n * canvas.anatomy.points["midline"][0])
    ribness = blur(canvas.lum - blur(canvas.lum, 6), 1.5) * region
    ys, xs = np.nonzero(ribness >= np.percentile(ribness[region], 97)) if region.any() else ([n // 2], [n // 4])
    pick = int(rng.integers(len(xs)))
    cx, cy = float(xs[pick]), float(ys[pick])
    half = 0.02 * n * realised["size"]
    angle = np.deg2rad(rng.uniform(70, 110))
    dx, dy = half * np.cos(angle), half * np.sin(angle)
    line = blur(polylines(n, [([(cx - dx, cy - dy), (cx + dx, cy + dy)], 3)]), 0.6)
    ops.paint(line, -spec.amplitude * realised["intensity"])  # lucent fracture line
    xg, yg = grid(n)
    beyond = ((xg - cx) * np.sin(angle) - (yg - cy) * np.cos(angle) > 0) & (np.hypot(xg - cx, yg - cy) < 1.5 * half)
    shifted = np.roll(canvas.rgb, 2, axis=0)
    ops.blend(soft_edge(beyond, 1.0), min(1.0, 0.9 * realised["intensity"]), shifted)  # cortical step-off
    _record(ops, canvas, side=side, centre_x=cx, centre_y=cy)


def cardiomegaly(canvas, ops, spec, realised, rng):
    hx, hy, hax, hay = canvas.point("heart")
    grow = 1 + 0.3 * realised["size"] * realised["intensity"]
    field = soft_edge(ellipse_radius(canvas.n, hx + 0.35 * hax * (grow - 1), hy, 1.05 * hax * grow,
                                     hay * (1 + 0.5 * (grow - 1))) <= 1, realised["softness"])
    field *= canvas.regions["envelope"] * _above_diaphragm(canvas)
    heart = ellipse_radius(canvas.n, hx, hy, 0.6 * hax, 0.6 * hay) <= 1
    level = float(np.percentile(canvas.lum[heart], 70)) if heart.any() else _soft_tissue(canvas)
    _fill(canvas, ops, field, level, spec, realised)
    _record(ops, canvas, enlargement=float(grow))


def enlarged_mediastinum(canvas, ops, spec, realised, rng):
    n = canvas.n
    mid = canvas.anatomy.points["midline"][0] * n
    top = canvas.anatomy.points["thorax"][0] * n
    hx, hy, hax, hay = canvas.point("heart")
    bottom = hy - 0.5 * hay
    x, y = grid(n)
    t = np.clip((y - top) / max(bottom - top, 1), 0, 1)
    widening = 0.9 * realised["size"] * realised["intensity"]
    half = 0.07 * n * (1 + widening * np.sin(np.pi * np.clip(0.15 + 0.85 * t, 0, 1)))
    band = (np.abs(x - mid) < half) & (y > top + 0.02 * n) & (y < bottom)
    core = (np.abs(np.abs(x - mid) - 0.06 * n) < 0.015 * n) & (y > top) & (y < bottom)  # beside the spine
    level = float(np.percentile(canvas.lum[core], 60)) if core.any() else _soft_tissue(canvas)
    _fill(canvas, ops, soft_edge(band, realised["softness"]), level, spec, realised)
    _record(ops, canvas, widening=round(float(widening), 3))


CHEST_BUILDERS = {
    "Atelectasis": atelectasis, "Cardiomegaly": cardiomegaly, "Consolidation": consolidation, "Edema": edema,
    "Enlarged_Cardiomediastinum": enlarged_mediastinum, "Fracture": fracture, "Lung_Lesion": lung_lesion,
    "Lung_Opacity": lung_opacity, "Pleural_Effusion": pleural_effusion, "Pneumonia": pneumonia,
    "Pneumothorax": pneumothorax,
}
