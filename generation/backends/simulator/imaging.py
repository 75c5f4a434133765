"""Small image helpers of the simulator: luminance, grain, noise fields, soft edges, polylines (resampling, blurs and
shapes are generation/raster.py's, shared with the anatomy locator).

The simulator works on a square grid of WORK pixels (fields, masks, metrics) and returns to the source size
only to apply an edit, so that one edit and one judgement of a 1024² image stay well under a second.
"""

from __future__ import annotations

import numpy as np
from PIL import Image, ImageDraw

from ...raster import blur

WORK = 512  # lesion fields and judge metrics
LUMA = np.array([0.299, 0.587, 0.114], dtype=np.float32)


def luminance(rgb: np.ndarray) -> np.ndarray:
    return np.asarray(rgb, dtype=np.float32) @ LUMA


def highpass(lum: np.ndarray, sigma: float = 1.0) -> np.ndarray:
    """Fine grain and noise: the image minus a light blur."""
    return lum - blur(lum, sigma)


def robust_std(values: np.ndarray) -> float:
    """Standard deviation estimated from the median absolute deviation (insensitive to edges and lesions)."""
    values = np.asarray(values, dtype=np.float32).ravel()
    if values.size < 8:
        return 0.0
    if values.size > 65536:  # a regular subsample estimates the MAD just as well, and much faster
        values = values[:: values.size // 32768]
    return float(1.4826 * np.median(np.abs(values - np.median(values))))


def grain_level(lum: np.ndarray, mask: np.ndarray | None = None) -> float:
    """Grain/noise amplitude: robust std of the high-pass residual, inside `mask` when given."""
    hp = highpass(lum)
    return robust_std(hp[mask] if mask is not None and mask.any() else hp)


def smooth_noise(rng: np.random.Generator, size: int, sigma: float) -> np.ndarray:
    """Zero-mean, unit-std smooth random field (for irregular outlines and patchy textures)."""
    field = blur(rng.standard_normal((size, size)).astype(np.float32), sigma)
    return (field - field.mean()) / max(float(field.std()), 1e-6)


def soft_edge(mask: np.ndarray, sigma: float) -> np.ndarray:
    """A 0..1 field from a boolean mask with a Gaussian edge of `sigma` pixels (0 keeps it hard)."""
    return np.clip(blur(mask.astype(np.float32), sigma), 0.0, 1.0)


def polylines(size: int, segments: list[tuple], fill: float = 1.0) -> np.ndarray:
    """Rasterise [(points, width)] polylines (pixel coordinates) into a 0..fill float field."""
    im = Image.new("L", (size, size), 0)
    draw = ImageDraw.Draw(im)
    for points, width in segments:
        draw.line([(float(px), float(py)) for px, py in points], fill=255, width=max(1, int(round(width))),
                  joint="curve")
    return np.asarray(im, dtype=np.float32) / 255.0 * fill
