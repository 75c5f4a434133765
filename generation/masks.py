"""Per-edit region-of-interest masks, computed from the images (never annotated): the dataset's `edit_mask` and
`region_mask` columns, `eval`'s ROI, the MedEBench export's masks.

`edit_mask(source, edited)`: where the edit differs from its source beyond this image pair's own noise.
  1. Both images at a working size (longest side WORK_SIDE), the source resized to the edit's shape; the
     per-channel difference, minus its median (a global brightness drift is not an edit), smoothed by a Gaussian of
     SMOOTH_SIGMA working pixels; the largest channel's magnitude per pixel.
  2. The noise of that difference estimated on the pair itself: sigma = 1.4826 x its median absolute deviation
     (robust: the edit covers a minority of the image). Offset and noise are measured where the source is more
     than CLIPPED grey levels from black and white (a fundus photograph's black surround hides both). Pixels above
     max(HIGH_SIGMAS x sigma, MIN_LEVEL grey levels) seed the mask; it grows through the connected pixels above
     LOW_SIGMAS x sigma (hysteresis), so a finding's soft margin is kept without the noise around it.
     A sub-pixel shift or a re-encoded edge differs in proportion to the source's local gradient: EDGE_SHARE x
     that gradient is subtracted first, so vessel and rib borders do not light up.
  3. Cleanup: an opening and a closing of OPEN_RADIUS / CLOSE_RADIUS working pixels, holes filled, and components
     smaller than MIN_COMPONENT of the image dropped. Back to the edit's size (bilinear, cut at half way).
`region_mask(modality, disease, size, source=None)`: the task's coarse anatomical region (the taxonomy's `region`
  of the target, e.g. costophrenic_angle for Pleural_Effusion), located on `source` by the anatomy estimate
  (generation/anatomy.py), or at the modality's typical place without one, grown by its REGION_MARGIN, on a
  REGION_SIDE² grid. ValueError for a label that is not an edit target.

Both return PIL images of mode "L" with values 0 and 255 (255 = region of interest). Pure functions of their
inputs: `task_masks` (what a build worker runs per task) imports no `datasets`. It decodes JPEGs reduced (DCT
scaling to the working size: a fraction of a full decode) and works out what depends on the source alone (its
working image, its anatomy, its regions) once per source, which the tasks of a source share.
"""

from __future__ import annotations

import hashlib
import io
import math

import numpy as np
from PIL import Image
from scipy import ndimage

from .anatomy import ANAT, MARGIN_GRID, REGION_MARGIN, estimate_anatomy, grown_region, typical_anatomy
from .raster import SourceCache, fill_holes, padded_box, resize_rgb
from .records import TaskMasks, open_image, rgb_array
from .taxonomy import load_taxonomy
from .failures import UsageError

WORK_SIDE = 160  # working size: cost independent of the image's, fine enough for a finding's outline
REGION_SIDE = 128  # the grid a region is rasterised on (a coarse region: finer costs time and says no more)
SMOOTH_SIGMA = 0.6  # working pixels (a JPEG decoded at a reduced scale is already smooth)
HIGH_SIGMAS = 5.0  # seeds: this many noise sigmas above the pair's noise
LOW_SIGMAS = 2.5  # growth: connected pixels above this many sigmas
MIN_LEVEL = 3.0  # grey levels: a seed is at least this strong, even on a noiseless pair
OPEN_RADIUS = 1  # working pixels
CLOSE_RADIUS = 2
EDGE_SHARE = 0.3  # pixels of misregistration tolerated: a difference up to this x the local gradient is no edit
CLIPPED = 10  # grey levels from black or white: pixels left out of the offset and noise estimates
MIN_COMPONENT = 0.0002  # of the image's area
MASK_METHOD = (f"edit_mask: |edit - source| per channel at {WORK_SIDE} px (longest side; a JPEG decoded at the "
               "smallest DCT scale at least that size), median-centred, "
               f"Gaussian sigma {SMOOTH_SIGMA} px, less {EDGE_SHARE} x the source's local gradient; offset and "
               "noise sigma (median, median absolute deviation) "
               f"over pixels more than {CLIPPED} grey levels from black and white; "
               f"hysteresis from {HIGH_SIGMAS} sigma (and >= {MIN_LEVEL:g} grey levels) down to {LOW_SIGMAS} sigma; "
               f"opening r{OPEN_RADIUS}, closing r{CLOSE_RADIUS}, holes filled, components < {MIN_COMPONENT:.2%} "
               "of the image dropped; back to the edit's size bilinear, cut at half way. region_mask: the target's taxonomy region located on the source by "
               f"medbanana's anatomy estimate at {REGION_SIDE}², grown by {REGION_MARGIN} px per {MARGIN_GRID} px.")
RECOMPUTE = "medbanana.generation.masks.edit_mask(source, edited) and region_mask(modality, disease, size, source)"


def decode_reduced(data: bytes, side: int) -> tuple[np.ndarray, tuple[int, int]]:
    """uint8 RGB of image bytes, a JPEG decoded at the smallest DCT scale whose longest side is still >= `side`
    (other formats whole), and the image's own (width, height). ValueError for an unreadable image."""
    with open_image(data) as image:
        size = image.size
        if image.format == "JPEG" and max(size) > side:
            scale = side / max(size)
            image.draft("RGB", (math.ceil(size[0] * scale), math.ceil(size[1] * scale)))
        try:
            image.load()
            return rgb_array(image), size
        except (OSError, SyntaxError) as exc:
            raise UsageError(f"not a readable image: {exc}") from exc


def working_size(size: tuple[int, int]) -> tuple[int, int]:
    """(width, height) of an image of `size` at the working size (never enlarged)."""
    scale = min(1.0, WORK_SIDE / max(size))
    return max(1, round(size[0] * scale)), max(1, round(size[1] * scale))


def _working(rgb: np.ndarray, wh: tuple[int, int]) -> np.ndarray:
    im = Image.fromarray(rgb)
    return np.asarray(im if im.size == wh else im.resize(wh, Image.BILINEAR, reducing_gap=2.0), dtype=np.float32)


def _gradient(lum: np.ndarray) -> np.ndarray:
    """The largest absolute step to a neighbour within the smoothing footprint (grey levels per pixel)."""
    smooth = ndimage.gaussian_filter(lum, SMOOTH_SIGMA / 2, truncate=3.0)
    magnitude = np.hypot(ndimage.sobel(smooth, 0), ndimage.sobel(smooth, 1)) / 8
    return ndimage.maximum_filter(magnitude, size=2 * max(1, round(SMOOTH_SIGMA)) + 1)


def _sample(values: np.ndarray, most: int = 65536) -> np.ndarray:
    """A regular subsample: a median over 65k values is as good as over millions, and much faster."""
    return values[:: max(1, len(values) // most)]


def _disk(radius: int) -> np.ndarray:
    y, x = np.mgrid[-radius:radius + 1, -radius:radius + 1]
    return x * x + y * y <= radius * radius + radius


_OPEN, _CLOSE = _disk(OPEN_RADIUS), _disk(CLOSE_RADIUS)


def planes(rgb: np.ndarray) -> list[np.ndarray]:
    """The channels of a float32 RGB array as contiguous planes; one for a grey image (its three are equal)."""
    if np.array_equal(rgb[..., 0], rgb[..., 1]) and np.array_equal(rgb[..., 1], rgb[..., 2]):
        return [np.ascontiguousarray(rgb[..., 0])]
    return [np.ascontiguousarray(rgb[..., c]) for c in range(3)]


class Reference:
    """What `changed` needs of the source at one working shape, worked out once for all its edits: its planes,
    the pixels that can show an offset or noise, those clipped to black or white, and the edge allowance."""

    def __init__(self, before: np.ndarray):
        self.planes = planes(before)
        self.lum = sum(self.planes) / len(self.planes)
        # offset and noise from the pixels that can show either: not the black surround of a fundus photograph or
        # a saturated white, where a drift or noise is clipped to nothing
        self.valid = (self.lum > CLIPPED) & (self.lum < 255 - CLIPPED)
        if self.valid.sum() < 0.05 * self.valid.size:
            self.valid = np.ones_like(self.valid)
        self.dark, self.bright = self.lum <= CLIPPED, self.lum >= 255 - CLIPPED
        # a resampled or re-encoded edge (vessels, a fundus rim, ribs) differs in proportion to its contrast: up to
        # EDGE_SHARE x the local gradient is a sub-pixel shift, not an edit
        self.edges = EDGE_SHARE * _gradient(self.lum)


def changed(reference: Reference, after: np.ndarray) -> np.ndarray:
    """Steps 1-3 of `edit_mask`: the edit as a float32 RGB array of the reference's working shape -> a boolean
    mask of that shape."""
    edited = planes(after)
    if len(edited) != len(reference.planes):  # one grey, the other not: compare all three channels
        edited, before = planes(after) * (3 // len(edited)), reference.planes * (3 // len(reference.planes))
    else:
        before = reference.planes
    lum_after = sum(edited) / len(edited)
    # black stayed black (white stayed white): no change whatever the offset says
    unchanged = (reference.dark & (lum_after <= CLIPPED)) | (reference.bright & (lum_after >= 255 - CLIPPED))
    valid = reference.valid
    smooth = None
    for plane_after, plane_before in zip(edited, before):
        diff = plane_after - plane_before
        diff -= np.median(_sample(diff[valid]))
        diff[unchanged] = 0
        diff = np.abs(ndimage.gaussian_filter(diff, SMOOTH_SIGMA, truncate=3.0))
        smooth = diff if smooth is None else np.maximum(smooth, diff, out=smooth)
    values = _sample(smooth[valid])
    sigma = 1.4826 * float(np.median(np.abs(values - np.median(values))))
    smooth -= reference.edges
    seeds = smooth > max(HIGH_SIGMAS * sigma, MIN_LEVEL)
    if not seeds.any():
        return np.zeros(smooth.shape, bool)
    labels, count = ndimage.label(smooth > max(LOW_SIGMAS * sigma, MIN_LEVEL / 2))
    seeded = np.zeros(count + 1, bool)
    seeded[labels[seeds]] = True
    seeded[0] = False
    mask = seeded[labels]
    # the cleanup within the found pixels' bounding box and a margin of zeros wider than the structuring
    # elements reach: the same result as on the whole image, for a fraction of the pixels
    rows, cols = np.flatnonzero(mask.any(axis=1)), np.flatnonzero(mask.any(axis=0))
    box = padded_box((slice(rows[0], rows[-1] + 1), slice(cols[0], cols[-1] + 1)), OPEN_RADIUS + 2 * CLOSE_RADIUS + 2,
                     mask.shape)
    part = ndimage.binary_opening(mask[box], structure=_OPEN)
    part = fill_holes(ndimage.binary_closing(part, structure=_CLOSE, border_value=0))
    labels, count = ndimage.label(part)
    mask[:] = False
    if count:
        big = np.bincount(labels.ravel()) >= MIN_COMPONENT * mask.size
        big[0] = False
        mask[box] = big[labels]
    return mask


def edit_mask_array(source: np.ndarray, edited: np.ndarray) -> np.ndarray:
    """`edit_mask` on uint8 RGB arrays: a boolean mask at the edit's height and width."""
    height, width = edited.shape[:2]
    wh = working_size((width, height))
    return _resized(changed(Reference(_working(source, wh)), _working(edited, wh)), (width, height))


def _resized(mask: np.ndarray, wh: tuple[int, int]) -> np.ndarray:
    return np.asarray(_upsampled(_png_mode(mask), wh)) > 127


_HALF = [0] * 128 + [255] * 128


def _upsampled(image: Image.Image, wh: tuple[int, int]) -> Image.Image:
    """A 0/255 mask at `wh`: bilinear, then cut at half way, so an outline drawn on the coarse grid comes out
    smooth instead of in steps of the grid."""
    if image.size == tuple(wh):
        return image
    return image.resize(tuple(wh), Image.BILINEAR).point(_HALF)


def edit_mask(source: Image.Image, edited: Image.Image) -> Image.Image:
    """Where `edited` differs from `source` beyond the pair's noise (module docstring): mode "L", 0/255, the
    edit's size."""
    return _png_mode(edit_mask_array(rgb_array(source), rgb_array(edited)))


def _region_grid(modality: str | None, disease: str, anatomy_of) -> tuple[np.ndarray, str]:
    """The task's grown region on the REGION_SIDE² grid and its taxonomy name; `anatomy_of(modality)` locates it
    (None: the typical place)."""
    label = load_taxonomy().target(disease, modality)
    anatomy = anatomy_of(label.modality) or typical_anatomy(label.modality)
    try:
        return grown_region(anatomy, label.region, REGION_SIDE), label.region
    except KeyError:
        raise ValueError(f"the anatomy model has no mask for region {label.region!r} of {label.modality}") from None


def region_array(modality: str | None, disease: str, size: tuple[int, int],
                 source: np.ndarray | None = None) -> tuple[np.ndarray, str]:
    """The task's region as a boolean mask of `size` (width, height), and the region's taxonomy name."""
    grid, name = _region_grid(modality, disease, lambda modality: None if source is None
                              else estimate_anatomy(resize_rgb(source, ANAT), modality))
    return _resized(grid, tuple(size)), name


def region_mask(modality: str, disease: str, size: tuple[int, int], source: Image.Image | None = None) -> Image.Image:
    """The task's coarse anatomical region (module docstring) at `size` = (width, height): mode "L", 0/255."""
    return _png_mode(region_array(modality, disease, size, None if source is None else rgb_array(source))[0])


def _png_mode(mask: np.ndarray) -> Image.Image:
    return Image.fromarray(mask.astype(np.uint8) * 255, mode="L")


def png_value(mask: np.ndarray, size: tuple[int, int] | None = None) -> dict:
    """A boolean mask, resized to `size` (width, height; bilinear, cut at half way) when given, as a datasets Image value:
    `{"bytes": <PNG, mode L, 0/255>, "path": None}` (a few KB; decoded it equals what `edit_mask` returns)."""
    image = _png_mode(mask) if size is None else _upsampled(_png_mode(mask), size)
    buffer = io.BytesIO()
    image.save(buffer, format="PNG", compress_level=1)  # a third of the default's time; a mask is a few KB either way
    return {"bytes": buffer.getvalue(), "path": None}


class _Source:
    """What the masks of every task of one source share: the source decoded reduced, its references by working
    shape, its anatomy by modality and its region values by (modality, taxonomy region)."""

    def __init__(self, data: bytes):
        self.data = data
        self.rgb, self.size = decode_reduced(data, WORK_SIDE)
        self._references: dict[tuple[int, int], Reference] = {}
        self._regions: dict[tuple[str, str], dict | None] = {}  # (modality, taxonomy region) -> its mask
        self._anatomy: dict[str, object] = {}

    def reference(self, wh: tuple[int, int]) -> Reference:
        if wh not in self._references:
            self._references[wh] = Reference(_working(self.rgb, wh))
        return self._references[wh]

    def anatomy(self, modality: str):
        # the landmarks want ANAT²: decoded again at that size, once per source and modality
        if modality not in self._anatomy:
            self._anatomy[modality] = estimate_anatomy(resize_rgb(decode_reduced(self.data, ANAT)[0], ANAT), modality)
        return self._anatomy[modality]

    def region(self, modality: str | None, disease: str) -> dict | None:
        # keyed by the region itself: findings in the same place (3 of chest X-ray's 11) share its mask
        key = region_key(modality, disease)
        if key is None:  # not an edit target: no mask
            return None
        if key not in self._regions:
            try:
                self._regions[key] = png_value(_region_grid(modality, disease, self.anatomy)[0], self.size)
            except (ValueError, KeyError):  # a label or modality the anatomy model has no region for: no mask
                self._regions[key] = None
        return self._regions[key]


_SOURCES: SourceCache[_Source] = SourceCache(64)  # a worker's recent sources (about 100 KB each)


def task_masks(images: dict[str, dict | None], source: dict | None, modality: str | None,
               disease: str, *, region: bool = True) -> TaskMasks | None:
    """The masks of a task from its source's and attempts' image values; None without a source (nothing to
    compare with). An unreadable image gets no mask (its row says nothing it cannot back). Without `region` the
    task's region mask is not made (its caller has it)."""
    if source is None:
        return None
    data = source["bytes"]
    try:
        shared = _SOURCES.get(hashlib.sha256(data).hexdigest(), "", lambda: _Source(data))
    except ValueError:
        return TaskMasks()
    masks = TaskMasks(region=shared.region(modality, disease) if region else None)
    for path, value in images.items():
        try:
            masks.edits[path] = None if value is None else _edit_value(shared, value["bytes"])
        except ValueError:
            masks.edits[path] = None
    return masks


def _edit_value(shared: _Source, data: bytes) -> dict:
    rgb, size = decode_reduced(data, WORK_SIDE)
    wh = working_size(size)
    return png_value(changed(shared.reference(wh), _working(rgb, wh)), size)


def attempt_mask_files(source: bytes, edited: bytes, modality: str | None, disease: str,
                       region: bytes | None = None) -> tuple[bytes | None, bytes | None]:
    """(edit mask, region mask) of one attempt image as PNG bytes, what the run stores beside the image
    (layout.mask_relpaths): `task_masks` on the source's and the edit's bytes, so a build that copies them gets
    what it would compute. A `region` given (the region mask of this source and the task's taxonomy region, made
    for an earlier attempt: `region_key`) is returned as it is instead of made again. None for a mask that cannot
    be made (an unreadable image, a label without a region); bad image data never raises."""
    try:
        masks = task_masks({"": {"bytes": edited, "path": None}}, {"bytes": source, "path": None}, modality, disease,
                           region=region is None)
    except (ValueError, OSError, Image.DecompressionBombError):  # a decoder's surprise on hostile bytes: no mask
        return None, region
    if region is None and masks.region:
        region = masks.region["bytes"]
    edit = masks.edits.get("")
    return (edit["bytes"] if edit else None), region


def region_key(modality: str | None, disease: str) -> tuple[str, str] | None:
    """What a task's region mask depends on besides its source: (modality, taxonomy region); None for a label
    that is not an edit target (no region mask)."""
    try:
        label = load_taxonomy().target(disease, modality)
    except ValueError:
        return None
    return label.modality, label.region
