"""Per-edit region-of-interest masks, computed from the images (never annotated): the dataset's `edit_mask` and
`region_mask` columns, `eval`'s ROI, the MedEBench export's masks.

`edit_mask(source, edited)`: where the edit differs from its source beyond this image pair's own noise.
  1. Both images at a working size (longest side WORK_SIDE), the source resized to the edit's shape; the
     per-channel difference, minus its median (a global brightness drift is not an edit), smoothed by a Gaussian of
     SMOOTH_SIGMA working pixels; the largest channel's magnitude per pixel.
  2. The noise of that difference estimated on the pair itself: sigma = 1.4826 x its median absolute deviation
     (robust: the edit covers a minority of the image). Offset and noise are measured where the source is more
     than CLIPPED grey levels from black and white (a fundus photograph's black surround hides both). Pixels above
     max(HIGH_SIGMAS x sigma, MIN_LEVEL grey levels) seed the mask; it grows through the connected pixels above LOW_SIGMAS x sigma (hysteresis), so a
     finding's soft margin is kept without the noise around it.
     A sub-pixel shift or a re-encoded edge differs in proportion to the source's local gradient: EDGE_SHARE x
     that gradient is subtracted first, so vessel and rib borders do not light up.
  3. Cleanup: an opening and a closing of OPEN_RADIUS / CLOSE_RADIUS working pixels, holes filled, and components
     smaller than MIN_COMPONENT of the image dropped. Back to the edit's size (nearest).
`region_mask(modality, disease, size, source=None)`: the task's coarse anatomical region (the taxonomy's `region`
  of the target, e.g. costophrenic_angle for Pleural_Effusion), located on `source` by the simulator's anatomy
  estimate, or at the modality's typical place without one, grown by REGION_MARGIN working pixels (a finding's
  soft margin at the region's edge stays inside). ValueError for a label that is not an edit target.

Both return PIL images of mode "L" with values 0 and 255 (255 = region of interest). Pure functions of their
inputs: `task_masks` (what a build worker runs per task) imports no `datasets`.
"""

from __future__ import annotations

import io
from dataclasses import dataclass, field

import numpy as np
from PIL import Image
from scipy import ndimage

from ..generation.backends.simulator.anatomy import REGION_MARGIN, estimate_anatomy, typical_anatomy
from ..generation.backends.simulator.imaging import ANAT, WORK, resize_rgb
from ..generation.records import decode_rgb
from ..generation.taxonomy import load_taxonomy

WORK_SIDE = 256  # working size: cost independent of the image's, fine enough for a finding's outline
SMOOTH_SIGMA = 1.0  # working pixels
HIGH_SIGMAS = 5.0  # seeds: this many noise sigmas above the pair's noise
LOW_SIGMAS = 2.5  # growth: connected pixels above this many sigmas
MIN_LEVEL = 3.0  # grey levels: a seed is at least this strong, even on a noiseless pair
OPEN_RADIUS = 1  # working pixels
CLOSE_RADIUS = 2
EDGE_SHARE = 0.3  # pixels of misregistration tolerated: a difference up to this x the local gradient is no edit
CLIPPED = 10  # grey levels from black or white: pixels left out of the offset and noise estimates
MIN_COMPONENT = 0.0002  # of the image's area (about 50 working pixels at 512²)
MASK_METHOD = (f"edit_mask: |edit - source| per channel at {WORK_SIDE} px (longest side), median-centred, "
               f"Gaussian sigma {SMOOTH_SIGMA} px, less {EDGE_SHARE} x the source's local gradient; offset and "
               "noise sigma (median, median absolute deviation) "
               f"over pixels more than {CLIPPED} grey levels from black and white; "
               f"hysteresis from {HIGH_SIGMAS} sigma (and >= {MIN_LEVEL:g} grey levels) down to {LOW_SIGMAS} sigma; "
               f"opening r{OPEN_RADIUS}, closing r{CLOSE_RADIUS}, holes filled, components < {MIN_COMPONENT:.2%} "
               "of the image dropped. region_mask: the target's taxonomy region located on the source by the "
               f"simulator's anatomy estimate, grown by {REGION_MARGIN} px at {WORK}.")
RECOMPUTE = "medbanana.builder.masks.edit_mask(source, edited) and region_mask(modality, disease, size, source)"


def as_rgb(image: Image.Image) -> np.ndarray:
    """uint8 RGB of any PIL image; 16-bit min-max scaled as the generator reads sources (records.decode_rgb)."""
    if image.mode in ("I;16", "I;16B", "I;16L", "I"):
        values = np.asarray(image, dtype=np.float64)
        values = (values - values.min()) / max(values.max() - values.min(), 1) * 255
        return np.repeat(values.astype(np.uint8)[..., None], 3, axis=-1)
    return np.asarray(image.convert("RGB"))


def _working(rgb: np.ndarray, wh: tuple[int, int]) -> np.ndarray:
    im = Image.fromarray(rgb)
    return np.asarray(im if im.size == wh else im.resize(wh, Image.BILINEAR, reducing_gap=2.0), dtype=np.float32)


def _gradient(lum: np.ndarray) -> np.ndarray:
    """The largest absolute step to a neighbour within the smoothing footprint (grey levels per pixel)."""
    smooth = ndimage.gaussian_filter(lum, SMOOTH_SIGMA / 2, truncate=3.0)
    magnitude = np.hypot(ndimage.sobel(smooth, 0), ndimage.sobel(smooth, 1)) / 8
    return ndimage.maximum_filter(magnitude, size=2 * int(SMOOTH_SIGMA) + 1)


def _sample(values: np.ndarray, most: int = 65536) -> np.ndarray:
    """A regular subsample: a median over 65k values is as good as over millions, and much faster."""
    return values[:: max(1, len(values) // most)]


def _disk(radius: int) -> np.ndarray:
    y, x = np.mgrid[-radius:radius + 1, -radius:radius + 1]
    return x * x + y * y <= radius * radius + radius


def edit_mask_array(source: np.ndarray, edited: np.ndarray) -> np.ndarray:
    """`edit_mask` on uint8 RGB arrays: a boolean mask at the edit's height and width."""
    height, width = edited.shape[:2]
    scale = min(1.0, WORK_SIDE / max(height, width))
    wh = (max(1, round(width * scale)), max(1, round(height * scale)))
    before, after = _working(source, wh), _working(edited, wh)
    diff = after - before
    # offset and noise from the pixels that can show either: not the black surround of a fundus photograph or a
    # saturated white, where a drift or noise is clipped to nothing
    lum, lum_after = before.mean(axis=-1), after.mean(axis=-1)
    valid = (lum > CLIPPED) & (lum < 255 - CLIPPED)
    if valid.sum() < 0.05 * valid.size:
        valid = np.ones_like(valid)
    diff -= np.median(_sample(diff[valid]), axis=0)
    # black stayed black (white stayed white): no change whatever the offset says
    diff[((lum <= CLIPPED) & (lum_after <= CLIPPED)) | ((lum >= 255 - CLIPPED) & (lum_after >= 255 - CLIPPED))] = 0
    smooth = np.abs(ndimage.gaussian_filter(diff, (SMOOTH_SIGMA, SMOOTH_SIGMA, 0), truncate=3.0)).max(axis=-1)
    values = _sample(smooth[valid])
    sigma = 1.4826 * float(np.median(np.abs(values - np.median(values))))
    # a resampled or re-encoded edge (vessels, a fundus rim, ribs) differs in proportion to its contrast: up to
    # EDGE_SHARE x the local gradient is a sub-pixel shift, not an edit
    edges = EDGE_SHARE * _gradient(lum)
    smooth = smooth - edges
    seeds = smooth > max(HIGH_SIGMAS * sigma, MIN_LEVEL)
    if not seeds.any():
        return np.zeros((height, width), bool)
    labels, _ = ndimage.label(smooth > max(LOW_SIGMAS * sigma, MIN_LEVEL / 2))
    mask = np.isin(labels, np.unique(labels[seeds]))
    mask = ndimage.binary_opening(mask, structure=_disk(OPEN_RADIUS))
    mask = ndimage.binary_fill_holes(ndimage.binary_closing(mask, structure=_disk(CLOSE_RADIUS), border_value=0))
    labels, count = ndimage.label(mask)
    if count:
        sizes = np.bincount(labels.ravel())
        keep = np.nonzero(sizes >= MIN_COMPONENT * mask.size)[0]
        mask = np.isin(labels, keep[keep > 0])
    return _resized(mask, (width, height))


def _resized(mask: np.ndarray, wh: tuple[int, int]) -> np.ndarray:
    if mask.shape[::-1] == tuple(wh):
        return mask
    return np.asarray(Image.fromarray(mask.astype(np.uint8) * 255).resize(wh, Image.NEAREST)) > 127


def edit_mask(source: Image.Image, edited: Image.Image) -> Image.Image:
    """Where `edited` differs from `source` beyond the pair's noise (module docstring): mode "L", 0/255, the
    edit's size."""
    return _png_mode(edit_mask_array(as_rgb(source), as_rgb(edited)))


def region_array(modality: str | None, disease: str, size: tuple[int, int],
                 source: np.ndarray | None = None) -> tuple[np.ndarray, str]:
    """The task's region as a boolean mask of `size` (width, height), and the region's taxonomy name."""
    label = load_taxonomy().target(disease, modality)
    anatomy = (typical_anatomy(label.modality) if source is None
               else estimate_anatomy(resize_rgb(source, ANAT), label.modality))
    regions = anatomy.regions(WORK)
    if label.region not in regions:
        raise ValueError(f"the anatomy model has no mask for region {label.region!r} of {label.modality}")
    grown = ndimage.binary_dilation(regions[label.region], iterations=REGION_MARGIN)
    return _resized(grown, tuple(size)), label.region


def region_mask(modality: str, disease: str, size: tuple[int, int], source: Image.Image | None = None) -> Image.Image:
    """The task's coarse anatomical region (module docstring) at `size` = (width, height): mode "L", 0/255."""
    return _png_mode(region_array(modality, disease, size, None if source is None else as_rgb(source))[0])


def _png_mode(mask: np.ndarray) -> Image.Image:
    return Image.fromarray(mask.astype(np.uint8) * 255, mode="L")


def png_value(mask: np.ndarray) -> dict:
    """A boolean mask as a datasets Image value: `{"bytes": <PNG, mode L, 0/255>, "path": None}` (a few KB;
    decoded it equals what `edit_mask` returns)."""
    buffer = io.BytesIO()
    _png_mode(mask).save(buffer, format="PNG")
    return {"bytes": buffer.getvalue(), "path": None}


@dataclass
class TaskMasks:
    """One task's masks as Image values: its region, and each attempt image's edit mask (by run-relative path;
    None where the image could not be read)."""

    region: dict | None = None
    edits: dict[str, dict | None] = field(default_factory=dict)


def task_masks(images: dict[str, dict | None], source: dict | None, modality: str | None,
               disease: str) -> TaskMasks | None:
    """The masks of a task from its source's and attempts' image values; None without a source (nothing to
    compare with). An unreadable image gets no mask (its row says nothing it cannot back)."""
    if source is None:
        return None
    try:
        rgb = decode_rgb(source["bytes"])
    except ValueError:
        return TaskMasks()
    masks = TaskMasks()
    try:
        masks.region = png_value(region_array(modality, disease, rgb.shape[1::-1], rgb)[0])
    except (ValueError, KeyError):  # a label or modality the anatomy model has no region for: no region mask
        pass
    for path, value in images.items():
        try:
            masks.edits[path] = None if value is None else png_value(edit_mask_array(rgb, decode_rgb(value["bytes"])))
        except ValueError:
            masks.edits[path] = None
    return masks
