"""The fit behind generation/geometry.py: two images' working greys, block phase correlation with a robust affine
fit, the Fourier-Mellin start, and the warps (the working images' and the full-resolution registration). The steps
and their constants are described in generation/geometry.py's docstring; `fit_pair` is the entry point.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import numpy as np
from PIL import Image
from scipy import fft

from .raster import SourceCache
from .records import open_image, rgb_array
from .failures import UsageError

WORK_SIDE = 256  # px, the longest side of the working images
FM_SIDE = 128  # px, the Fourier-Mellin stage's grid
BLOCKS = 3  # per axis: 9 blocks of half the working size, overlapping by half
PEAK_SIGMA = 1.0  # working px: the Gaussian the correlation peak is shaped into, for its sub-pixel fit
MIN_PEAK = 0.12  # a block's normalised correlation peak below this says nothing
MIN_BLOCKS = 6  # agreeing blocks needed to trust a fit (of 9, for its 6 parameters)
MIN_MATCH = 0.25  # a fit whose agreeing blocks peak lower than this on average is chance: nothing matches; on
# small blocks chance peaks higher (unrelated images: about 0.23 on 32-px blocks, 0.14 on 64-px ones), so the bar
# there is `chance_bar`
GOOD_MATCH = 0.6  # a fit whose agreeing blocks peak this high on average needs no Fourier-Mellin start...
MODEST_TURN, MODEST_ZOOM = 3.0, 0.1  # ... when it turns less than this (degrees) and zooms less than this
REFINE_STEPS = 4  # fits on the edit warped back so far, at most
REFINE_BELOW = 0.004  # a step that changes A by less than this ends the refinement
AGREE = 0.35  # working px: a block further than this from the fit (and 2.5 x the median) is left out
FLAT = 0.5  # grey levels: an image whose working grey varies less than this is blank
MIRRORS = {"": np.eye(2), "horizontal": np.diag([-1.0, 1.0]), "vertical": np.diag([1.0, -1.0])}


def _grey(data: bytes | np.ndarray, wh: tuple[int, int] | None = None) -> tuple[np.ndarray, tuple[int, int]]:
    """float32 grey at `wh` (default: WORK_SIDE on the longest side, never enlarged) and the image's own size.
    Bytes of a JPEG are decoded at the smallest DCT scale still at least that size."""
    box = None
    if isinstance(data, np.ndarray):
        image = Image.fromarray(np.asarray(data, dtype=np.uint8))
        size = image.size
    else:
        image = open_image(data)
        size = image.size
        side = max(wh) if wh else WORK_SIDE
        if image.format == "JPEG" and max(size) > side:
            scale = side / max(size)
            image.draft("L", (math.ceil(size[0] * scale), math.ceil(size[1] * scale)))
            # a DCT-scaled decode is 1/k of the image, its last row and column padded out to a whole pixel: the
            # image proper is the box of size / k
            k = 2 ** round(math.log2(size[0] / image.size[0]))
            box = (0.0, 0.0, size[0] / k, size[1] / k)
        try:
            image.load()
        except (OSError, SyntaxError) as exc:
            raise UsageError(f"not a readable image: {exc}") from exc
        if image.mode not in ("L", "RGB"):
            image = Image.fromarray(rgb_array(image))
    if wh is None:
        scale = min(1.0, WORK_SIDE / max(size))
        wh = (max(1, round(size[0] * scale)), max(1, round(size[1] * scale)))
    image = image.convert("L")
    if image.size != wh or (box is not None and box[2:] != image.size):
        image = image.resize(wh, Image.BILINEAR, box=box, reducing_gap=2.0)
    return np.asarray(image, dtype=np.float32), size


def _hann(n: int) -> np.ndarray:
    return np.hanning(n + 2)[1:-1].astype(np.float32)


class _Blocks:
    """The block grid of one working shape: positions, window, peak shaping, and each block's centre."""

    def __init__(self, shape: tuple[int, int]):
        height, width = shape
        self.side = side = max(8, (min(height, width) // 2) // 2 * 2)
        ys = np.linspace(0, height - side, BLOCKS).round().astype(int)
        xs = np.linspace(0, width - side, BLOCKS).round().astype(int)
        self.corners = [(y, x) for y in ys for x in xs]
        self.centres = np.array([(x + (side - 1) / 2 - (width - 1) / 2, y + (side - 1) / 2 - (height - 1) / 2)
                                 for y, x in self.corners])
        self.window = np.outer(_hann(side), _hann(side))
        fy, fx = np.fft.fftfreq(side)[:, None], np.fft.rfftfreq(side)[None, :]
        sigma_f = 1 / (2 * math.pi * PEAK_SIGMA)
        self.shaping = np.exp(-(fx ** 2 + fy ** 2) / (2 * sigma_f ** 2)).astype(np.float32)
        self.full_peak = float(fft.irfft2(self.shaping, s=(side, side))[0, 0])

    def spectra(self, grey: np.ndarray) -> np.ndarray:
        stack = np.stack([grey[y:y + self.side, x:x + self.side] for y, x in self.corners])
        stack -= stack.mean(axis=(1, 2), keepdims=True)
        stack *= self.window
        return fft.rfft2(stack, workers=1)

    def shifts(self, reference: np.ndarray, moving: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Each block's displacement (x, y) of `moving` relative to the reference's spectra, and its peak (0-1)."""
        cross = reference * np.conj(self.spectra(moving))
        weight = np.abs(cross)  # whitened (a real reciprocal times the complex: cheaper than a complex division)
        weight += 1e-6
        np.reciprocal(weight, out=weight)
        weight *= self.shaping
        cross *= weight
        surface = fft.irfft2(cross, s=(self.side, self.side), workers=1)
        k, n = len(self.corners), self.side
        flat = surface.reshape(k, -1).argmax(axis=1)
        py, px = np.divmod(flat, n)
        rows = np.arange(k)
        peak = surface[rows, py, px]
        offsets = []
        for axis_values in ((surface[rows, (py - 1) % n, px], surface[rows, (py + 1) % n, px]),
                            (surface[rows, py, (px - 1) % n], surface[rows, py, (px + 1) % n])):
            lo, hi = (np.log(np.maximum(v, 1e-6 * self.full_peak)) for v in axis_values)
            mid = np.log(np.maximum(peak, 1e-6 * self.full_peak))
            curvature = lo - 2 * mid + hi
            offsets.append(np.where(curvature < 0, (lo - hi) / (2 * np.where(curvature < 0, curvature, -1)), 0.0))
        sy = (py + np.clip(offsets[0], -0.5, 0.5) + n / 2) % n - n / 2
        sx = (px + np.clip(offsets[1], -0.5, 0.5) + n / 2) % n - n / 2
        # the peak sits at minus the displacement of `moving`'s content
        return -np.stack([sx, sy], axis=1), peak / self.full_peak


@dataclass
class _Fit:
    matrix: np.ndarray  # A, working px about the centre (x, y)
    shift: np.ndarray  # t
    match: float
    agreeing: int

    @property
    def score(self) -> float:
        return self.match * min(1.0, self.agreeing / (BLOCKS * BLOCKS))


def _fit(centres: np.ndarray, displacement: np.ndarray, peaks: np.ndarray) -> _Fit | None:
    """The affine fit d = (A - I) p + t over the blocks with a peak, reweighted to leave out those that disagree."""
    use = peaks >= MIN_PEAK
    design = np.hstack([centres, np.ones((len(centres), 1))])
    for _ in range(4):
        if use.sum() < MIN_BLOCKS:
            return None
        weights = peaks[use][:, None]
        solution, *_ = np.linalg.lstsq(design[use] * weights, displacement[use] * weights, rcond=None)
        residual = np.linalg.norm(design @ solution - displacement, axis=1)
        keep = (peaks >= MIN_PEAK) & (residual <= max(AGREE, 2.5 * float(np.median(residual[use]))))
        if np.array_equal(keep, use):
            break
        use = keep
    if use.sum() < MIN_BLOCKS:
        return None
    return _Fit(np.eye(2) + solution[:2].T, solution[2].copy(), float(peaks[use].mean()), int(use.sum()))


class PreparedSource:
    """What depends on the source alone, kept per source (a task's rounds and tasks share it)."""

    def __init__(self, data: bytes | np.ndarray):
        self.grey, self.size = _grey(data)
        self.blocks = _Blocks(self.grey.shape)
        self.spectra = self.blocks.spectra(self.grey)
        self._fm: np.ndarray | None = None

    @property
    def wh(self) -> tuple[int, int]:
        return self.grey.shape[1], self.grey.shape[0]

    def log_polar(self) -> np.ndarray:
        if self._fm is None:
            self._fm = _log_polar(self.grey)
        return self._fm


_SOURCES: SourceCache[PreparedSource] = SourceCache(64)


# ---------------------------------------------------------------- Fourier-Mellin

_FM_ANGLES, _FM_RADII = 180, 64  # warp_polar's rows span 360 degrees: the first half is one period of |F|


def _fm_grid(grey: np.ndarray) -> np.ndarray:
    """`grey` mean-removed, windowed and zero-padded to a FM_SIDE square (shrunk to fit first)."""
    height, width = grey.shape
    scale = min(1.0, FM_SIDE / max(height, width))
    if scale < 1:
        grey = np.asarray(Image.fromarray(grey).resize((max(1, round(width * scale)), max(1, round(height * scale))),
                                                       Image.BILINEAR), dtype=np.float32)
    height, width = grey.shape
    out = np.zeros((FM_SIDE, FM_SIDE), np.float32)
    top, left = (FM_SIDE - height) // 2, (FM_SIDE - width) // 2
    out[top:top + height, left:left + width] = (grey - grey.mean()) * np.outer(_hann(height), _hann(width))
    return out


def _log_polar(grey: np.ndarray) -> np.ndarray:
    from skimage.transform import warp_polar

    magnitude = np.abs(fft.fftshift(fft.fft2(_fm_grid(grey), workers=1)))
    f = np.fft.fftshift(np.fft.fftfreq(FM_SIDE))
    c = np.cos(np.pi * f[:, None]) * np.cos(np.pi * f[None, :])
    magnitude *= (1 - c) * (2 - c)  # high-pass: the low frequencies (the image's outline and window) say little
    polar = warp_polar(magnitude, radius=FM_SIDE // 2, output_shape=(_FM_ANGLES, _FM_RADII), scaling="log")
    return polar[:_FM_ANGLES // 2]


def _fourier_mellin(source: PreparedSource, edit: np.ndarray) -> tuple[float, float]:
    """(rotation in degrees modulo 180, scale) of the edit's content relative to the source's."""
    from skimage.registration import phase_cross_correlation

    shift, _, _ = phase_cross_correlation(source.log_polar(), _log_polar(edit), upsample_factor=10,
                                          normalization="phase")
    rotation = -float(shift[0]) * 360.0 / _FM_ANGLES
    scale = math.exp(float(shift[1]) * math.log(FM_SIDE // 2) / _FM_RADII)
    return rotation, scale


def _global_shift(reference: np.ndarray, moving: np.ndarray) -> np.ndarray:
    """The whole-image displacement (x, y) of `moving`'s content, in whole pixels (phase correlation)."""
    window = np.outer(_hann(reference.shape[0]), _hann(reference.shape[1]))
    a = fft.rfft2((reference - reference.mean()) * window, workers=1)
    b = fft.rfft2((moving - moving.mean()) * window, workers=1)
    cross = a * np.conj(b)
    surface = fft.irfft2(cross / (np.abs(cross) + 1e-6), s=reference.shape, workers=1)
    py, px = np.unravel_index(int(surface.argmax()), surface.shape)
    height, width = reference.shape
    return -np.array([(px + width / 2) % width - width / 2, (py + height / 2) % height - height / 2], float)


def _warped(grey: np.ndarray, matrix: np.ndarray, shift: np.ndarray) -> np.ndarray:
    """`grey` sampled at A p + t (working px about the centre, x y), bilinear: the content moved back onto the source
    grid; what lies outside the image is its mean grey (a soft border, where zeros would draw a hard one)."""
    height, width = grey.shape
    centre = np.array([width / 2, height / 2])  # Pillow's coordinates: pixel i spans [i, i + 1)
    offset = centre + shift - matrix @ centre
    image = Image.fromarray(grey, mode="F")
    moved = image.transform((width, height), Image.AFFINE, (*matrix[0], offset[0], *matrix[1], offset[1]),
                            resample=Image.BILINEAR, fillcolor=float(grey.mean()))
    return np.asarray(moved, dtype=np.float32)


def _mirrored(grey: np.ndarray, flip: str) -> np.ndarray:
    return grey[:, ::-1] if flip == "horizontal" else grey[::-1] if flip == "vertical" else grey


# ---------------------------------------------------------------- the estimate

def _refined(source: PreparedSource, edit: np.ndarray, start: tuple[np.ndarray, np.ndarray] | None) -> _Fit | None:
    """The blocks' fit from `start` (A, t; None: unchanged), refined on the edit warped back by the fit so far while
    the fit still moves it: a block decorrelates under a zoom or turn of a few percent, not under a residual."""
    matrix, shift = start if start is not None else (np.eye(2), np.zeros(2))
    fit = None
    for _ in range(REFINE_STEPS):
        moved = edit if start is None and fit is None else _warped(edit, matrix, shift)
        displacement, peaks = source.blocks.shifts(source.spectra, moved)
        step = _fit(source.blocks.centres, displacement, peaks)
        if step is None:
            return fit
        matrix, shift = matrix @ step.matrix, matrix @ step.shift + shift
        fit = _Fit(matrix, shift, step.match, step.agreeing)
        if np.abs(step.matrix - np.eye(2)).max() < REFINE_BELOW:
            break
    return fit


def _modest(matrix: np.ndarray) -> bool:
    """A change the blocks measure well by themselves: a turn under MODEST_TURN degrees, a zoom under MODEST_ZOOM."""
    turn = math.degrees(math.atan2(matrix[1, 0] - matrix[0, 1], matrix[0, 0] + matrix[1, 1]))
    return abs(turn) < MODEST_TURN and abs(math.sqrt(abs(np.linalg.det(matrix))) - 1) < MODEST_ZOOM


def _candidate(source: PreparedSource, edit: np.ndarray) -> tuple[_Fit | None, str]:
    """The best fit of an (unflipped) edit: the blocks alone, or from Fourier-Mellin's start when they disagree."""
    best = _refined(source, edit, None)
    if best is not None and best.match >= GOOD_MATCH and _modest(best.matrix):
        return best, "blocks"
    stage = "blocks"
    rotation, scale = _fourier_mellin(source, edit)
    for angle in (rotation, rotation + 180.0):
        c, s = math.cos(math.radians(angle)), math.sin(math.radians(angle))
        coarse = scale * np.array([[c, -s], [s, c]])
        shift = coarse @ _global_shift(source.grey, _warped(edit, coarse, np.zeros(2)))
        fit = _refined(source, edit, (coarse, shift))
        if fit is not None and (best is None or fit.score > best.score):
            best, stage = fit, "fourier-mellin"
    return best, stage


@dataclass(frozen=True)
class Fit:
    """A pair's fit in source pixels about the source's centre: the anatomy at p is at matrix @ p + shift in the edit
    resized to the source's canvas (matrix includes the mirror `flip`)."""

    matrix: np.ndarray
    shift: np.ndarray
    flip: str
    match: float
    stage: str


def chance_bar(block: int) -> float:
    """The lowest `match` a fit on blocks of `block` px must reach to count: MIN_MATCH, higher on small blocks, where
    unrelated images already peak near 0.23 (32 px) by chance."""
    return max(MIN_MATCH, 0.45 * (32 / block) ** 0.7)


def prepare_source(data: bytes | np.ndarray, key: str = "") -> PreparedSource:
    """A source's working image and block spectra, kept by `key` (default: its bytes' SHA-256; an array is not kept)
    for the next edit of the same source."""
    if isinstance(data, np.ndarray):
        return PreparedSource(data)
    return _SOURCES.get(key or hashlib.sha256(data).hexdigest(), "", lambda: PreparedSource(data))


def fit_pair(source: PreparedSource, edited: bytes | np.ndarray) -> tuple[Fit | None, tuple[int, int]]:
    """The best fit of `edited` onto the source (None: nothing in the pair matches), and the edit's size."""
    edit, edit_size = _grey(edited, source.wh)
    if edit.std() < FLAT or source.grey.std() < FLAT:  # a blank image: nothing to match
        return None, edit_size
    best, stage, flip = *_candidate(source, edit), ""
    if best is None or best.match < GOOD_MATCH:  # nothing explains the pair well: was it mirrored?
        for mirror in ("horizontal", "vertical"):
            fit, how = _candidate(source, _mirrored(edit, mirror))
            if fit is not None and fit.score > 1.5 * (best.score if best else 0.0):
                best, stage, flip = fit, how, mirror
    if best is None or best.match < chance_bar(source.blocks.side):
        return None, edit_size
    width, height = source.size
    mirror = MIRRORS[flip]  # the fit is of the mirrored edit: A = F A', t = F t'
    scale = np.diag([width / source.wh[0], height / source.wh[1]])
    return Fit(scale @ mirror @ best.matrix @ np.linalg.inv(scale), scale @ mirror @ best.shift, flip,
               round(best.match, 4), stage), edit_size


def warp_to_source(edited: np.ndarray, matrix: np.ndarray, shift: np.ndarray,
                   source_size: tuple[int, int]) -> np.ndarray:
    """uint8 RGB `edited` moved back onto the source's grid (bicubic): each source pixel takes the edit's at
    matrix @ p + shift (source pixels about the centre), the edit's canvas resized to the source's; what the edit
    does not show is black."""
    width, height = source_size
    edit_h, edit_w = edited.shape[:2]
    centre = np.array([width / 2, height / 2])  # Pillow's coordinates: pixel i spans [i, i + 1)
    canvas = np.diag([edit_w / width, edit_h / height])
    affine = canvas @ matrix
    offset = canvas @ (centre + shift - matrix @ centre)
    image = Image.fromarray(np.asarray(edited, dtype=np.uint8)).convert("RGB")
    moved = image.transform((width, height), Image.AFFINE, (*affine[0], offset[0], *affine[1], offset[1]),
                            resample=Image.BICUBIC, fillcolor=(0, 0, 0))
    return np.asarray(moved)
