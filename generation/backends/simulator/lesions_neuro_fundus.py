"""Brain MRI findings (T2-like: masses bright) and fundus findings (colour) on the working grid."""

from __future__ import annotations

import numpy as np
from scipy import ndimage

from ...raster import blur, disc, ellipse_radius, grid
from .imaging import smooth_noise, soft_edge
from .lesions import Canvas, EditOps, dots, irregular_blob, normalised_blur, place, scatter


def _record(ops: EditOps, canvas: Canvas, **facts) -> None:
    ops.facts.update({k: (round(v / canvas.n, 4) if isinstance(v, float) else v) for k, v in facts.items()})


def _brain(canvas: Canvas) -> tuple[float, float, float, float]:
    return canvas.point("brain")


def glioma(canvas, ops, spec, realised, rng):
    r = spec.scale * realised["size"]
    side = realised.get("side") or "right"
    brain = canvas.regions["whole_brain"]
    tissue = blur(canvas.lum, 3) < (np.percentile(canvas.lum[brain], 75) if brain.any() else 255)  # not CSF
    cx, cy = place(canvas, canvas.regions[spec.region] & tissue, 1.5 * r, rng, side=side, inward=realised["inward"])
    core = irregular_blob(canvas, cx, cy, r, 0.85 * r, rng, irregularity=0.25, softness=realised["softness"])
    texture = np.clip(0.8 + 0.25 * smooth_noise(rng, canvas.n, 3), 0.4, 1.1)
    necrosis = 0.35 * np.exp(-ellipse_radius(canvas.n, cx, cy, 0.4 * r, 0.4 * r) ** 2)
    oedema = irregular_blob(canvas, cx, cy, 1.7 * r, 1.5 * r, rng, irregularity=0.35,
                            softness=realised["softness"] + 4)
    field = np.maximum(core * (texture - necrosis), 0.45 * oedema) * soft_edge(brain & tissue, 2)
    ops.paint(field, spec.amplitude * realised["intensity"])
    _record(ops, canvas, side=side, centre_x=cx, centre_y=cy, radius=r)


def meningioma(canvas, ops, spec, realised, rng):
    bx, by, bax, bay = _brain(canvas)
    side = realised.get("side") or "right"
    theta = np.deg2rad((180 if side == "right" else 0) + rng.uniform(-55, 55) * (0.4 if realised["inward"] else 1))
    rm = spec.scale * realised["size"]
    ex, ey = bx + 0.97 * bax * np.cos(theta), by + 0.97 * bay * np.sin(theta)
    cx, cy = ex - 0.55 * rm * np.cos(theta), ey - 0.55 * rm * np.sin(theta)
    inside = ellipse_radius(canvas.n, bx, by, 0.97 * bax, 0.97 * bay) <= 1  # flattened against the inner table
    mass = ellipse_radius(canvas.n, cx, cy, rm, rm) <= 1
    field = soft_edge(mass & inside, realised["softness"]) * (0.92 + 0.08 * smooth_noise(rng, canvas.n, 4))
    ops.paint(field, spec.amplitude * realised["intensity"])
    _record(ops, canvas, side=side, centre_x=cx, centre_y=cy, radius=rm)


def pituitary(canvas, ops, spec, realised, rng):
    region = canvas.regions[spec.region]
    ys, xs = np.nonzero(region)
    cx, cy = (xs.mean(), ys.mean()) if len(xs) else (canvas.n / 2, canvas.n / 2)
    r = spec.scale * realised["size"]
    cy -= 0.2 * r  # extends upward toward the chiasm
    field = irregular_blob(canvas, cx + rng.normal(0, 1), cy, r, 1.25 * r, rng, irregularity=0.08,
                           softness=realised["softness"])
    ops.paint(field * (0.92 + 0.08 * smooth_noise(rng, canvas.n, 3)), spec.amplitude * realised["intensity"])
    _record(ops, canvas, centre_x=float(cx), centre_y=float(cy), radius=r)


# ---------------------------------------------------------------- fundus
def _dark_red(canvas: Canvas) -> np.ndarray:
    return canvas.rgb * np.array([0.62, 0.32, 0.36], np.float32)


def _lighter(canvas: Canvas, lift: tuple[float, float, float]) -> np.ndarray:
    return np.clip(canvas.rgb + np.array(lift, np.float32), 0, 255)


def _disc(canvas: Canvas) -> tuple[float, float, float]:
    return canvas.point("disc")


def diabetic_retinopathy(canvas, ops, spec, realised, rng):
    size = realised["size"]
    region = canvas.regions[spec.region] & ~canvas.regions["optic_disc"]
    dot_soft = 0.35 + 0.3 * realised["softness"]
    frac = min(1.0, spec.amplitude * realised["intensity"])
    aneurysms = [(x, y, rng.uniform(1.0, 1.8)) for x, y in scatter(region, int(round(12 * size)), rng)]
    haemorrhages = [(x, y, rng.uniform(2.5, 5.0)) for x, y in scatter(region, int(round(4 * size)), rng)]
    red = np.maximum(dots(canvas, aneurysms, dot_soft), dots(canvas, haemorrhages, dot_soft + 0.5))
    ops.blend(red, frac, _dark_red(canvas))
    exudates = []
    for cx, cy in scatter(region, max(1, int(round(2 * size))), rng):
        exudates += [(x, y, rng.uniform(1.0, 2.2)) for x, y in scatter(region, 6, rng, near=(cx, cy), spread=8)]
    ops.blend(dots(canvas, exudates, dot_soft), frac, _lighter(canvas, (70, 100, 15)))
    ops.facts.update(microaneurysms=len(aneurysms), haemorrhages=len(haemorrhages), exudates=len(exudates))


def _vessels(canvas: Canvas) -> np.ndarray:
    """0..1 map of retinal vessels: thin structures darker than their surroundings in the green channel."""
    green = canvas.rgb[..., 1]
    return np.clip((blur(green, 4) - green) / max(6.0, 0.08 * float(np.median(green))), 0, 1)


def glaucoma(canvas, ops, spec, realised, rng):
    dcx, dcy, dr = _disc(canvas)
    cup = dr * (0.7 + 0.25 * realised["size"])  # a cup-to-disc ratio of about 0.9 at medium size
    field = soft_edge(ellipse_radius(canvas.n, dcx, dcy, cup, 1.12 * cup) <= 1, realised["softness"])
    inner = disc(canvas.n, dcx, dcy, dr)
    pale = np.percentile(canvas.rgb[inner], 99, axis=0) if inner.any() else np.array([250, 200, 150])
    pale = 0.6 * pale + 0.4 * np.array([250, 240, 215])  # the pale, whitish floor of the cup
    # The cup pales the tissue; vessels crossing the disc stay (they bend at its rim).
    keep_vessels = 1 - 0.85 * blur(_vessels(canvas), 1.5)
    ops.blend(field * keep_vessels, min(0.97, spec.amplitude * realised["intensity"]), pale)
    _record(ops, canvas, cup_to_disc=round(cup / dr, 3) if dr else 0)


def amd(canvas, ops, spec, realised, rng):
    fx, fy = canvas.point("fovea")
    _, _, dr = _disc(canvas)
    region = canvas.regions[spec.region]
    spread = 0.9 * dr * realised["size"]
    drusen = [(x, y, rng.uniform(1.5, 4.5)) for x, y in
              scatter(region, int(round(16 * realised["size"])), rng, near=(fx, fy), spread=spread)]
    frac = min(1.0, spec.amplitude * realised["intensity"])
    ops.blend(dots(canvas, drusen, 0.4 + 0.4 * realised["softness"]), frac, _lighter(canvas, (60, 80, 10)))
    clumps = [(x, y, rng.uniform(1.2, 2.2)) for x, y in scatter(region, 3, rng, near=(fx, fy), spread=spread)]
    ops.blend(dots(canvas, clumps, 0.6), 0.7 * frac, canvas.rgb * 0.55)
    ops.facts.update(drusen=len(drusen))


def cataract(canvas, ops, spec, realised, rng):
    fundus = canvas.regions["whole_fundus"]
    feather = 6 + realised["softness"]
    field = soft_edge(ndimage.binary_erosion(fundus, iterations=int(2 * feather)), feather)  # fades before the rim
    veil = canvas.rgb[fundus].mean(axis=0) * 1.1 + [25, 30, 30] if fundus.any() else np.array([200, 120, 100])
    smooth = np.stack([blur(canvas.rgb[..., c], 6) for c in range(3)], axis=-1)
    reach = min(1.0, 0.75 + 0.2 * realised["size"])  # a larger cataract veils the periphery as much as the centre
    x, y = grid(canvas.n)
    fcx, fcy, radius = canvas.point("fundus")
    falloff = 1 - (1 - reach) * np.clip(np.hypot(x - fcx, y - fcy) / max(radius, 1), 0, 1)
    ops.blend(field * falloff, min(0.95, spec.amplitude * realised["intensity"]),
              np.clip(0.55 * smooth + 0.45 * np.asarray(veil, np.float32), 0, 255))
    ops.facts.update(haze=round(float(spec.amplitude * realised["intensity"]), 3))


def hypertension(canvas, ops, spec, realised, rng):
    region = canvas.regions[spec.region]
    vessels = _vessels(canvas) * region
    background = normalised_blur(canvas.rgb, (vessels < 0.15).astype(np.float32), 4)
    walls = np.clip(4 * vessels * (1 - vessels), 0, 1)  # vessel margins: filling them narrows the lumen
    frac = min(1.0, spec.amplitude * realised["intensity"])
    ops.blend(walls, frac, background)
    dcx, dcy, dr = _disc(canvas)
    flames = []
    for _ in range(int(round(4 * realised["size"]))):
        theta = rng.uniform(0, 2 * np.pi)
        dist = dr * rng.uniform(2.5, 5.5)
        cx, cy = dcx + dist * np.cos(theta), dcy + dist * np.sin(theta)
        if 0 <= int(cy) < canvas.n and 0 <= int(cx) < canvas.n and region[int(cy), int(cx)]:
            flames.append(soft_edge(ellipse_radius(canvas.n, cx, cy, 7 * realised["size"], 2.0,
                                                   np.rad2deg(theta)) <= 1, 0.6 + 0.2 * realised["softness"]))
    if flames:
        ops.blend(np.max(flames, axis=0), frac, _dark_red(canvas))
    ops.facts.update(flame_haemorrhages=len(flames))


def myopia(canvas, ops, spec, realised, rng):
    dcx, dcy, dr = _disc(canvas)
    fx, fy = canvas.point("fovea")
    x, y = grid(canvas.n)
    rho = np.hypot(x - dcx, y - dcy)
    toward = np.cos(np.arctan2(y - dcy, x - dcx) - np.arctan2(fy - dcy, fx - dcx))
    outer = dr * (1.3 + 0.35 * realised["size"])
    crescent = (rho > 0.95 * dr) & (rho < outer * (0.6 + 0.4 * np.clip(toward, 0, 1))) & (toward > 0.2)
    inner = disc(canvas.n, dcx, dcy, dr)
    pale = np.percentile(canvas.rgb[inner], 90, axis=0) if inner.any() else np.array([235, 200, 160])
    frac = min(0.97, spec.amplitude * realised["intensity"])
    ops.blend(soft_edge(crescent, realised["softness"] * 0.6), frac, pale * 0.97)
    zone = soft_edge(canvas.regions[spec.region], 10) * canvas.regions["whole_fundus"]
    stripes = np.clip(1 - np.abs(np.sin(4 * smooth_noise(rng, canvas.n, 9))) / 0.35, 0, 1)  # choroidal vessels
    ops.paint(blur(stripes, 0.8) * zone * (rho > outer), -35 * realised["intensity"], (0.35, 0.8, 0.7))
    _record(ops, canvas, crescent_width=float(outer - dr))


NEURO_FUNDUS_BUILDERS = {
    "glioma": glioma, "meningioma": meningioma, "pituitary": pituitary,
    "Diabetes": diabetic_retinopathy, "Glaucoma": glaucoma, "AMD": amd, "Cataract": cataract,
    "Hypertension": hypertension, "Myopia": myopia,
}
