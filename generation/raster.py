"""Raster helpers of the anatomy locator (generation/anatomy.py) and the simulator: resampling, smoothing, shapes on
a square grid, Otsu's threshold, the cache of what is computed once per source image, and a mask as text for an
edit's details (`encode_mask` / `decode_mask`: the simulator's drawn mask, the diffusers editor's attention mask).

Shapes take pixel coordinates on a size x size grid; fields are float32, masks boolean.
"""

from __future__ import annotations

import base64
import io
import threading
from collections.abc import Callable
from functools import lru_cache
from typing import Generic, TypeVar

import numpy as np
from PIL import Image
from scipy import ndimage
from .failures import UsageError

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


def encode_mask(mask: np.ndarray) -> str:
    """A boolean mask as a 1-bit PNG in base64 (a few KB), for JSON such as an edit's details."""
    buffer = io.BytesIO()
    Image.fromarray(np.asarray(mask, bool)).convert("1").save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def decode_mask(text: str, size: tuple[int, int] | None = None) -> np.ndarray:
    """`encode_mask`'s text back to a boolean mask, at `size` = (width, height) when given (nearest). ValueError
    for text that is not a base64 image (it comes from a run's files)."""
    try:
        with Image.open(io.BytesIO(base64.b64decode(text, validate=True))) as im:
            grey = im.convert("L")
    except (ValueError, OSError) as exc:  # binascii.Error is a ValueError; PIL raises OSError subclasses
        raise UsageError(f"not a base64 mask image: {exc}") from None
    if size is not None and grey.size != tuple(size):
        grey = grey.resize(tuple(size), Image.NEAREST)
    return np.asarray(grey) > 127


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


def fill_holes(mask: np.ndarray) -> np.ndarray:
    """`ndimage.binary_fill_holes(mask)` in one labelling pass (it grows the background from the border one pixel
    per pass): the background components, 4-connected as there, that do not touch the border become foreground."""
    labels, count = ndimage.label(~mask)
    hole = np.ones(count + 1, bool)
    hole[np.concatenate([labels[0], labels[-1], labels[:, 0], labels[:, -1]])] = False
    hole[0] = False
    return mask | hole[labels]


def padded_box(box: tuple[slice, slice], margin: int, shape: tuple[int, int]) -> tuple[slice, slice]:
    """A 2-D bounding box (slices) grown by `margin` pixels each way, within `shape`."""
    return tuple(slice(max(0, s.start - margin), min(n, s.stop + margin)) for s, n in zip(box, shape))
