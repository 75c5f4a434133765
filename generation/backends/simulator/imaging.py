"""Small image helpers shared by the simulator: working-resolution resampling, smoothing, noise and shapes, and
the cache of what is computed once per source image.

The simulator works on a square grid of WORK pixels (fields, masks, metrics) and returns to the source size
only to apply an edit, so that one edit and one judgement of a 1024² image stay well under a second.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from functools import lru_cache
from typing import Generic, TypeVar

import numpy as np
from PIL import Image, ImageDraw
from scipy import ndimage

WORK = 512  # lesion fields and judge metrics
ANAT = 256  # anatomy estimation
LUMA = np.array([0.299, 0.587, 0.114], dtype=np.float32)
T = TypeVar("T")


class SourceCache(Generic[T]):
    """What is computed from one source image, kept by (the source's sha256, modality) because the editor and the
    judge of every round of a task ask about the same original. Thread-safe (the work itself runs outside the
    lock); past `size` entries the oldest goes; a call without a key is not cached."""

    def __init__(self, size: int):
        self.size = size
        self._items: dict[tuple[str, str], T] = {}
        self._lock = threading.Lock()

    def get(self, key: str, modality: str, compute: Callable[[], T]) -> T:
        with self._lock:
            if key and (key, modality) in self._items:
                return self._items[(key, modality)]
        value = compute()
        if key:
            with self._lock:
                if len(self._items) >= self.size:
                    self._items.pop(next(iter(self._items)))
                self._items[(key, modality)] = value
        return value


def luminance(rgb: np.ndarray) -> np.ndarray:
    return np.asarray(rgb, dtype=np.float32) @ LUMA


def resize_rgb(rgb: np.ndarray, size: int | tuple[int, int]) -> np.ndarray:
    """uint8 RGB -> float32 RGB of `size` (an int is a square), area-averaged when shrinking."""
    wh = (size, size) if isinstance(size, int) else size
    im = Image.fromarray(np.asarray(rgb, dtype=np.uint8))
    if im.size != wh:
        im = im.resize(wh, Image.BILINEAR, reducing_gap=2.0)
    return np.asarray(im, dtype=np.float32)


def resize_field(field: np.ndarray, wh: tuple[int, int]) -> np.ndarray:
    """float 2-D field -> float32 of size wh=(width, height), bilinear (PIL's float mode is fast)."""
    field = np.asarray(field, dtype=np.float32)
    if field.shape[::-1] == tuple(wh):
        return field
    return np.asarray(Image.fromarray(field, mode="F").resize(wh, Image.BILINEAR), dtype=np.float32)


def resize_mask(mask: np.ndarray, size: int) -> np.ndarray:
    if mask.shape == (size, size):
        return mask
    im = Image.fromarray(mask.astype(np.uint8) * 255).resize((size, size), Image.NEAREST)
    return np.asarray(im) > 127


def blur(field: np.ndarray, sigma: float) -> np.ndarray:
    """Gaussian blur; wide blurs run on a shrunken copy (a wide Gaussian is smooth, so nothing is lost)."""
    field = np.asarray(field, dtype=np.float32)
    if sigma <= 0:
        return field
    factor = int(sigma // 3)
    if factor < 2 or min(field.shape) < 8 * factor:
        return ndimage.gaussian_filter(field, sigma, mode="nearest", truncate=3.0)
    h, w = field.shape
    small = np.asarray(Image.fromarray(field, mode="F").resize((max(1, w // factor), max(1, h // factor)), Image.BOX))
    small = ndimage.gaussian_filter(small, sigma / factor, mode="nearest", truncate=3.0)
    return resize_field(small, (w, h))


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


@lru_cache(maxsize=8)
def grid(size: int) -> tuple[np.ndarray, np.ndarray]:
    """Pixel-centre coordinates (x, y) of a square grid, read-only."""
    y, x = np.mgrid[0:size, 0:size].astype(np.float32)
    x.setflags(write=False)
    y.setflags(write=False)
    return x, y


def ellipse_radius(size: int, cx: float, cy: float, ax: float, ay: float, angle_deg: float = 0.0) -> np.ndarray:
    """Normalised elliptical radius (1 on the ellipse) over a size x size grid; coordinates in pixels."""
    x, y = grid(size)
    dx, dy = x - cx, y - cy
    if angle_deg:
        t = np.deg2rad(angle_deg)
        dx, dy = dx * np.cos(t) + dy * np.sin(t), -dx * np.sin(t) + dy * np.cos(t)
    return np.sqrt((dx / max(ax, 1e-3)) ** 2 + (dy / max(ay, 1e-3)) ** 2)


def disc(size: int, cx: float, cy: float, r: float) -> np.ndarray:
    return ellipse_radius(size, cx, cy, r, r) <= 1.0


def smooth_noise(rng: np.random.Generator, size: int, sigma: float) -> np.ndarray:
    """Zero-mean, unit-std smooth random field (for irregular outlines and patchy textures)."""
    field = blur(rng.standard_normal((size, size)).astype(np.float32), sigma)
    return (field - field.mean()) / max(float(field.std()), 1e-6)


def soft_edge(mask: np.ndarray, sigma: float) -> np.ndarray:
    """A 0..1 field from a boolean mask with a Gaussian edge of `sigma` pixels (0 keeps it hard)."""
    return np.clip(blur(mask.astype(np.float32), sigma), 0.0, 1.0)


def largest_component(mask: np.ndarray) -> np.ndarray:
    labels, n = ndimage.label(mask)
    if n == 0:
        return mask
    sizes = ndimage.sum_labels(mask, labels, index=np.arange(1, n + 1))
    return labels == (int(np.argmax(sizes)) + 1)


def otsu(values: np.ndarray) -> float:
    """Otsu's threshold of 0..255 values (empty input -> 128)."""
    values = np.asarray(values).ravel()
    if values.size == 0:
        return 128.0
    hist, edges = np.histogram(values, bins=128, range=(0, 256))
    hist = hist.astype(np.float64)
    centers = (edges[:-1] + edges[1:]) / 2
    w0 = np.cumsum(hist)
    w1 = w0[-1] - w0
    m0 = np.cumsum(hist * centers)
    mu0 = m0 / np.maximum(w0, 1)
    mu1 = (m0[-1] - m0) / np.maximum(w1, 1)
    between = w0 * w1 * (mu0 - mu1) ** 2
    return float(centers[int(np.argmax(between))])


def polylines(size: int, segments: list[tuple], fill: float = 1.0) -> np.ndarray:
    """Rasterise [(points, width)] polylines (pixel coordinates) into a 0..fill float field."""
    im = Image.new("L", (size, size), 0)
    draw = ImageDraw.Draw(im)
    for points, width in segments:
        draw.line([(float(px), float(py)) for px, py in points], fill=255, width=max(1, int(round(width))),
                  joint="curve")
    return np.asarray(im, dtype=np.float32) / 255.0 * fill
