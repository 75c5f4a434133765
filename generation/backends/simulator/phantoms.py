"""Demo sources that exist on a fresh clone: anatomical phantoms (chest X-ray, axial brain MRI) and variations of
the real fundus photograph shipped with scikit-image, written in the original scripts' input layout.

    {root}/MIMIC_demo_phantom/normal/*.jpeg         chest X-ray sources for add (crossed with every disease)
    {root}/MIMIC_demo_phantom/{Disease}/*.jpeg      chest X-ray sources for remove (lesion synthesised in place)
    {root}/BrainTumor_demo_phantom/{no_tumor|glioma|...}/*.jpeg
    {root}/ODIR_demo/{normal|AMD|...}/*.jpeg

Phantoms are drawn at 512² and resampled to `size`, then given film grain at full resolution. Sources differ in
noise, contrast and exposure on purpose (one clean, one noisy, ...), so that edits succeed at different rounds.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

from ...records import encode_jpeg
from ...taxonomy import load_taxonomy
from ...raster import blur, ellipse_radius, grid, resize_field
from .imaging import WORK, polylines, smooth_noise

DATASETS = {"chest_xray": "MIMIC_demo_phantom", "brain_mri": "BrainTumor_demo_phantom", "fundus": "ODIR_demo"}
NORMAL_FOLDER = {"chest_xray": "normal", "brain_mri": "no_tumor", "fundus": "normal"}
# Acquisition looks cycled through the sources: (noise in grey levels, contrast, exposure offset).
LOOKS = [(2.5, 1.0, 0.0), (14.0, 0.85, 0.05), (5.0, 1.1, -0.03), (9.0, 0.9, 0.03)]


def _polygon(size: int, points: list[tuple[float, float]]) -> np.ndarray:
    im = Image.new("L", (size, size), 0)
    ImageDraw.Draw(im).polygon([(px * size, py * size) for px, py in points], fill=255)
    return np.asarray(im, dtype=np.float32) / 255.0


# Right lung outline (image left), clockwise from the apex; the left lung mirrors it with room for the heart.
_RIGHT_LUNG = [(0.36, 0.13), (0.29, 0.15), (0.22, 0.21), (0.17, 0.3), (0.14, 0.42), (0.125, 0.55), (0.12, 0.66),
               (0.125, 0.77), (0.15, 0.74), (0.2, 0.69), (0.26, 0.665), (0.33, 0.655), (0.39, 0.67), (0.44, 0.7),
               (0.455, 0.62), (0.45, 0.5), (0.44, 0.38), (0.43, 0.26), (0.41, 0.17)]
_LEFT_LUNG = [(0.64, 0.13), (0.71, 0.15), (0.78, 0.21), (0.83, 0.3), (0.86, 0.42), (0.875, 0.55), (0.88, 0.66),
              (0.875, 0.79), (0.84, 0.76), (0.79, 0.725), (0.74, 0.71), (0.7, 0.7), (0.67, 0.64), (0.63, 0.55),
              (0.6, 0.47), (0.575, 0.4), (0.565, 0.28), (0.58, 0.17)]


def _chest(rng: np.random.Generator) -> np.ndarray:
    """PA chest radiograph (bright = dense): body, lungs with vessel markings, heart, spine, ribs, clavicles."""
    n = WORK
    x, y = grid(n)
    u, v = x / n, y / n
    img = np.full((n, n), 0.04, np.float32)
    torso = ellipse_radius(n, 0.5 * n, 0.68 * n, 0.46 * n, 0.62 * n) <= 1
    neck = (np.abs(u - 0.5) < 0.11) & (v < 0.2)
    shoulders = (ellipse_radius(n, 0.19 * n, 0.19 * n, 0.21 * n, 0.09 * n) <= 1) | (
        ellipse_radius(n, 0.81 * n, 0.19 * n, 0.21 * n, 0.09 * n) <= 1)
    body = blur((torso | neck | shoulders).astype(np.float32), 5)
    img += body * (0.44 + 0.12 * np.clip((np.abs(u - 0.5) - 0.3) / 0.15, 0, 1))  # flanks are thicker
    jitter = lambda pts: [(px + rng.normal(0, 0.004), py + rng.normal(0, 0.004)) for px, py in pts]  # noqa: E731
    lungs = blur(np.maximum(_polygon(n, jitter(_RIGHT_LUNG)), _polygon(n, jitter(_LEFT_LUNG))), 2.0)
    img -= lungs * (0.3 + 0.07 * (1 - v) + 0.04 * np.clip((np.abs(u - 0.5) - 0.2) / 0.2, 0, 1))
    vessels = []
    for side in (-1, 1):
        hx, hy = (0.5 + side * 0.085) * n, 0.45 * n
        for _ in range(26):
            ang = rng.uniform(-1.4, 1.4) + (0 if side > 0 else np.pi)
            pts, px, py, width = [], hx, hy, rng.uniform(2.5, 5.0)
            for _ in range(int(rng.integers(5, 11))):
                pts.append((px, py))
                ang += rng.normal(0, 0.3)
                step = rng.uniform(8, 16)
                px, py = px + step * np.cos(ang), py + step * np.sin(ang) * 0.9
            vessels.append((pts, width))
    tree = blur(polylines(n, vessels), 1.5)
    hilum = np.exp(-np.minimum(((u - 0.415) ** 2 + (v - 0.46) ** 2), ((u - 0.585) ** 2 + (v - 0.44) ** 2)) / 0.002)
    img += lungs * (0.14 * tree * (0.5 + 0.8 * hilum) + 0.1 * hilum)
    mediastinum = (np.abs(u - 0.5) < 0.22) * np.clip((0.8 - v) / 0.08, 0, 1) * (v > 0.1) * np.clip(1 - lungs, 0, 1)
    img += 0.16 * blur(mediastinum, 4)
    img += 0.06 * blur((ellipse_radius(n, 0.57 * n, 0.6 * n, 0.12 * n, 0.11 * n) <= 1).astype(np.float32), 6)
    img += 0.05 * blur((ellipse_radius(n, 0.555 * n, 0.3 * n, 0.035 * n, 0.03 * n) <= 1).astype(np.float32), 2)
    spine = blur(((np.abs(u - 0.5) < 0.034) & (v > 0.04)).astype(np.float32), 1.5)
    discs = 0.5 + 0.5 * np.cos(2 * np.pi * (v - 0.02) / 0.046)
    pedicles = np.exp(-((np.abs(u - 0.5) - 0.024) ** 2) / 0.00003) * (discs > 0.3)
    img += spine * (0.1 + 0.04 * discs) + 0.05 * pedicles * spine
    ribs, front = [], []
    for k in range(10):
        v0 = 0.1 + 0.052 * k + rng.normal(0, 0.003)
        for sign in (-1, 1):
            t = np.linspace(0, 1, 30)
            xs = 0.5 + sign * (0.035 + 0.38 * np.sin(t * np.pi / 2) ** 0.9)
            ys = v0 - 0.025 * np.sin(np.pi * t) + 0.2 * t**1.6
            ribs.append((list(zip(xs * n, ys * n)), (0.02 + 0.004 * k / 9) * n))
            xf = 0.5 + sign * (0.4 - 0.3 * t)
            yf = v0 + 0.09 + 0.12 * t
            front.append((list(zip(xf * n, yf * n)), 0.016 * n))
    rib = blur(polylines(n, ribs), 1.0)
    cortex = np.clip(rib - blur(rib, 2.5), 0, 1) * 1.5
    img += (0.085 * rib + 0.07 * cortex + 0.035 * blur(polylines(n, front[:14]), 2.0)) * np.clip(body, 0, 1)
    clav = [([(0.465 * n, 0.205 * n), (0.38 * n, 0.19 * n), (0.28 * n, 0.165 * n), (0.16 * n, 0.14 * n)], 0.026 * n),
            ([(0.535 * n, 0.205 * n), (0.62 * n, 0.19 * n), (0.72 * n, 0.165 * n), (0.84 * n, 0.14 * n)], 0.026 * n)]
    img += 0.2 * blur(polylines(n, clav), 1.5)
    abdomen = np.clip(body - lungs, 0, 1) * np.clip((v - 0.66) / 0.08, 0, 1)
    img += 0.1 * abdomen
    img -= 0.16 * blur((ellipse_radius(n, 0.69 * n, 0.83 * n, 0.05 * n, 0.028 * n) <= 1).astype(np.float32), 3)
    img += 0.025 * smooth_noise(rng, n, 20) * body
    return np.clip(img, 0, 1)


def _brain(rng: np.random.Generator) -> np.ndarray:
    """Axial T2-weighted slice at the level of the lateral ventricles (CSF bright, white matter darker)."""
    n = WORK
    x, y = grid(n)
    cx, cy = 0.5 * n + rng.normal(0, 4), 0.5 * n + rng.normal(0, 4)
    ax, ay = (0.35 + rng.normal(0, 0.01)) * n, (0.43 + rng.normal(0, 0.01)) * n
    theta = np.arctan2(y - cy, x - cx)
    wobble = 1 + 0.01 * np.sin(5 * theta + rng.uniform(0, 6))
    r = ellipse_radius(n, cx, cy, ax, ay) / wobble
    img = np.zeros((n, n), np.float32)
    img += 0.5 * ((r > 0.965) & (r <= 1.0))  # scalp fat
    img += 0.06 * ((r > 0.91) & (r <= 0.965))  # cortical bone is dark
    img += 0.75 * ((r > 0.885) & (r <= 0.91))  # CSF over the convexity
    gyri = 0.74 + 0.035 * np.sin(23 * theta + 2 * smooth_noise(rng, n, 30)) + 0.02 * smooth_noise(rng, n, 12)
    brain = r <= 0.885
    img += brain * np.where(r < gyri, 0.36, 0.52)  # white matter / cortical grey matter
    sulci = []
    for t in np.linspace(0, 2 * np.pi, 34, endpoint=False) + rng.uniform(0, 0.2):
        depth = rng.uniform(0.1, 0.2)
        pts = [(cx + ax * rr * np.cos(t + 0.05 * np.sin(9 * rr)), cy + ay * rr * np.sin(t + 0.05 * np.sin(9 * rr)))
               for rr in np.linspace(0.885, 0.885 - depth, 6)]
        sulci.append((pts, 2.0))
    img += 0.35 * blur(polylines(n, sulci), 0.8) * brain
    fissure = (np.abs(x - cx) < 2.0) & brain & (np.abs(y - cy) > 0.3 * ay)
    img += 0.4 * fissure
    horns = [(cx + s * 0.055 * ax / 0.35, cy - 0.12 * ay / 0.43 * n / n * 1.0, s) for s in (-1, 1)]
    vent = np.zeros((n, n), bool)
    for hx, hy, s in horns:
        vent |= ellipse_radius(n, hx, hy - 0.04 * n, 0.03 * n, 0.1 * n, angle_deg=-s * 18) <= 1
        vent |= ellipse_radius(n, hx + s * 0.02 * n, hy + 0.13 * n, 0.025 * n, 0.06 * n, angle_deg=s * 25) <= 1
    img = np.where(vent, 0.85, img)
    img += 0.04 * (ellipse_radius(n, cx - 0.1 * n, cy, 0.05 * n, 0.07 * n) <= 1)  # thalami
    img += 0.04 * (ellipse_radius(n, cx + 0.1 * n, cy, 0.05 * n, 0.07 * n) <= 1)
    img = blur(img, 1.2)
    bias = 1 + 0.08 * smooth_noise(rng, n, 60)
    return np.clip(img * bias, 0, 1)


def _fundus(rng: np.random.Generator, index: int, size: int) -> tuple[np.ndarray, dict]:
    """A variation of skimage.data.retina(): crop/zoom, eye side (flip), colour balance and exposure."""
    from skimage import data

    base = data.retina()
    side = base.shape[0]
    zoom = rng.uniform(0.94, 1.04)
    crop = int(side * zoom)
    off = (side - crop) // 2
    if crop <= side:
        im = Image.fromarray(base[off:off + crop, off:off + crop])
    else:
        canvas = np.zeros((crop, crop, 3), np.uint8)
        canvas[-off:-off + side, -off:-off + side] = base
        im = Image.fromarray(canvas)
    arr = np.asarray(im.resize((size, size), Image.BILINEAR), dtype=np.float32)
    flip = index % 2 == 1
    if flip:
        arr = arr[:, ::-1]
    gains = np.array([rng.uniform(0.85, 1.05), rng.uniform(0.8, 1.2), rng.uniform(0.8, 1.25)], np.float32)
    exposure = [1.0, 1.45, 0.9, 1.12][index % 4]  # the second look over-exposes the disc into saturation
    arr = arr * gains * exposure
    variation = {"zoom": round(zoom, 3), "flipped": flip, "gains": [round(float(g), 3) for g in gains],
                 "exposure": exposure}
    return arr, variation


def _finish(field01: np.ndarray, size: int, rng: np.random.Generator, noise: float, contrast: float,
            exposure: float) -> np.ndarray:
    """Resample a 0..1 phantom to size² grey levels, set contrast/exposure and add correlated film grain."""
    img = resize_field(field01, (size, size))
    img = np.clip((img - 0.5) * contrast + 0.5 + exposure, 0, 1) * 255
    grain = blur(rng.standard_normal((size, size)).astype(np.float32), 0.8 * size / 1024)
    grain /= max(float(grain.std()), 1e-6)
    img = img + noise * grain * (0.6 + 0.8 * img / 255)
    return np.clip(img, 0, 255)


def _marker(gray: np.ndarray, text: str = "L") -> np.ndarray:
    """A burned-in side marker in the top right corner, as on real films."""
    size = gray.shape[0]
    im = Image.fromarray(gray.astype(np.uint8))
    draw = ImageDraw.Draw(im)
    draw.text((0.86 * size, 0.04 * size), text, fill=235, font_size=max(8, size // 22))
    return np.asarray(im, dtype=np.float32)


def normal_source(modality: str, index: int, *, size: int = 1024, seed: int = 0) -> tuple[np.ndarray, dict]:
    """One normal source as uint8 RGB and its provenance facts (origin, look)."""
    rng = np.random.default_rng([seed, index, list(DATASETS).index(modality)])
    noise, contrast, exposure = LOOKS[index % len(LOOKS)]
    if modality == "fundus":
        arr, variation = _fundus(rng, index, size)
        grain = blur(rng.standard_normal((size, size)).astype(np.float32), 0.8 * size / 1024)
        arr = arr + (noise * 0.4) * (grain / max(float(grain.std()), 1e-6))[..., None]
        rgb = np.clip(arr, 0, 255).astype(np.uint8)
        return rgb, {"origin": "skimage.data.retina()", "variation": variation, "noise": noise * 0.4}
    field = _chest(rng) if modality == "chest_xray" else _brain(rng)
    gray = _finish(field, size, rng, noise, contrast, exposure)
    if modality == "chest_xray":
        gray = _marker(gray)
    rgb = np.repeat(np.clip(gray, 0, 255).astype(np.uint8)[..., None], 3, axis=2)
    return rgb, {"origin": "synthetic phantom", "noise": noise, "contrast": contrast, "exposure": exposure}


def write_demo_sources(root: Path, *, n_normal: int = 2, n_diseased: int = 1, size: int = 1024,
                       seed: int = 0) -> list[dict]:
    """Write normal and diseased demo sources for all three modalities; one provenance dict per file."""
    from .findings import synthesise_disease_source

    root = Path(root)
    taxonomy = load_taxonomy()
    records = []
    for modality, dataset in DATASETS.items():
        for i in range(n_normal):
            rgb, facts = normal_source(modality, i, size=size, seed=seed)
            rel = f"{dataset}/{NORMAL_FOLDER[modality]}/{_stem(modality, i)}.jpeg"
            records.append(_write(root, rel, rgb, dataset, NORMAL_FOLDER[modality], seed, facts))
        for t, target in enumerate(taxonomy.modality(modality).targets):
            for j in range(n_diseased):
                index = 100 + 10 * t + j
                rgb, facts = normal_source(modality, index, size=size, seed=seed)
                rgb, lesion = synthesise_disease_source(rgb, modality, target.folder, seed=seed + index)
                facts["lesion"] = lesion
                rel = f"{dataset}/{target.folder}/{_stem(modality, index)}.jpeg"
                records.append(_write(root, rel, rgb, dataset, target.folder, seed, facts))
    return records


def _stem(modality: str, index: int) -> str:
    return {"chest_xray": f"phantom_cxr_{index:03d}", "brain_mri": f"phantom_mri_{index:03d}",
            "fundus": f"{index}_{'left' if index % 2 else 'right'}"}[modality]


def _write(root: Path, rel: str, rgb: np.ndarray, dataset: str, label: str, seed: int, facts: dict) -> dict:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(encode_jpeg(rgb, quality=95))
    return {"path": rel, "dataset": dataset, "label": label, "seed": seed, **facts}
