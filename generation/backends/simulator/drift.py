"""Frame drift as real image editors show it: the output shifted by a few pixels, zoomed a few percent, or returned
on a canvas of another aspect with the content cropped to fill it (Pico-Banana-400K's "pixel shift" and unasked
zoom, Gemini's own canvas sizes). The simulated editor applies it to a share of its edits (`drift_rate`, `generate
--simulator-drift`), so the geometry guard's paths (generation/geometry.py) run offline; the bench applies it with
chosen magnitudes. Magnitudes are stated at 1024 px and scale with the image.

`drifted(rgb, change)` returns the image as the editor would: the anatomy at source pixel p (about the centre) is
found at A p + t once the output is resized to the source's canvas (the model generation/geometry.py measures).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np
from scipy import ndimage
from ...failures import UsageError

KINDS = ("shift", "zoom", "aspect")
SHIFT_PX = (2.0, 12.0)  # px at 1024: the range a drifting edit is shifted by
ZOOM = (0.02, 0.08)  # zoom in or out by this much
ASPECT = (0.03, 0.10)  # one side of the canvas longer by this much, the content cropped to fill it


@dataclass(frozen=True)
class Drift:
    """A frame change: translation (px at the source's resolution), per-axis scale, rotation (degrees, clockwise
    as seen), mirror, and the output canvas (width, height; None: the source's)."""

    kind: str
    dx: float = 0.0
    dy: float = 0.0
    scale_x: float = 1.0
    scale_y: float = 1.0
    rotation_deg: float = 0.0
    flip: str = ""
    canvas: tuple[int, int] | None = None

    def as_dict(self) -> dict:
        raw = asdict(self)
        raw["canvas"] = list(self.canvas) if self.canvas else None
        return {k: round(v, 4) if isinstance(v, float) else v for k, v in raw.items()}


def random_drift(rng: np.random.Generator, size: tuple[int, int], kind: str | None = None) -> Drift:
    """A drift of `kind` (default: one of KINDS at random) for an image of `size` (width, height)."""
    kind = kind or KINDS[int(rng.integers(len(KINDS)))]
    unit = max(size) / 1024
    if kind == "shift":
        length, angle = rng.uniform(*SHIFT_PX) * unit, rng.uniform(0, 2 * math.pi)
        return Drift(kind, dx=length * math.cos(angle), dy=length * math.sin(angle))
    if kind == "zoom":
        scale = 1 + rng.uniform(*ZOOM) * (1 if rng.random() < 0.5 else -1)
        return Drift(kind, scale_x=scale, scale_y=scale)
    if kind == "aspect":
        grow = 1 + rng.uniform(*ASPECT)
        wider = rng.random() < 0.5
        width, height = size
        canvas = (round(width * grow), height) if wider else (width, round(height * grow))
        # the content keeps its proportions and fills the new canvas: scaled by `grow`, the other side cropped;
        # resized back to the source's canvas, the cropped side shows as a zoom along it
        return Drift(kind, scale_x=1.0 if wider else grow, scale_y=grow if wider else 1.0, canvas=canvas)
    raise UsageError(f"unknown drift kind {kind!r}; use one of {', '.join(KINDS)}")


def drifted(rgb: np.ndarray, change: Drift) -> np.ndarray:
    """`rgb` (uint8, H x W x 3) as an editor that made `change` returns it (edge pixels repeated where the frame
    shows what the source does not)."""
    height, width = rgb.shape[:2]
    out_w, out_h = change.canvas or (width, height)
    c, s = math.cos(math.radians(change.rotation_deg)), math.sin(math.radians(change.rotation_deg))
    mirror = np.diag([-1.0 if change.flip == "horizontal" else 1.0, -1.0 if change.flip == "vertical" else 1.0])
    matrix = np.array([[c, -s], [s, c]]) @ np.diag([change.scale_x, change.scale_y]) @ mirror
    inverse = np.linalg.inv(matrix)
    centre = np.array([(width - 1) / 2, (height - 1) / 2])
    # output pixel e -> source-canvas position q = (e + 0.5) * ratio - 0.5 -> source p = A^-1 (q - c - t) + c
    ratio = np.diag([width / out_w, height / out_h])
    to_source = inverse @ ratio
    offset = inverse @ (0.5 * np.diag(ratio) - 0.5 - centre - np.array([change.dx, change.dy])) + centre
    swap = np.array([[0, 1], [1, 0]])  # (x, y) <-> (row, column)
    rowcol, rowcol_offset = swap @ to_source @ swap, swap @ offset
    planes = [ndimage.affine_transform(rgb[..., k].astype(np.float32), rowcol, offset=rowcol_offset,
                                       output_shape=(out_h, out_w), order=1, mode="nearest") for k in range(3)]
    return np.clip(np.stack(planes, axis=-1) + 0.5, 0, 255).astype(np.uint8)
