"""Weight-free image-forensics features for the separability probe (no downloaded model).

Each image gives two fixed-length vectors:

* **raw**: the file as stored — its size, bits per pixel, colour spread and JPEG quantisation tables (the traces a
  pipeline leaves: an editor returns 1024² JPEGs at quality 95 while sources are 2048² quality 75, say) — plus the
  pixel statistics below, computed on each view of the image;
* **controlled**: the same pixel statistics after both real and edited images went through one identical
  pipeline (grey, each view re-encoded as JPEG at `quality`), so format and final compression cannot separate
  them; what is left is content and the image's earlier history.

Two views, both `size`² pixels: the whole image brought to `size`², and (unless `detail` is 0) the centre of the
image brought to `detail`² — fine detail that the whole view's downscale discards, where a blur or a resampling
editor leaves its trace (bench/bench_probe_power.py: at 256² alone a 2x down-up resample of brain MRI is close to
invisible). Both sides go through the same resizes, but the detail view, near the stored resolution, sees
resolution and fine traces of each file's own JPEG coding: edits returned smaller than their sources, or as JPEG
next to PNG sources, differ there for that reason alone (`--probe-detail 0` leaves it out).

Pixel statistics: intensity mean / spread; the noise residual (image minus its 3x3 mean) — spread, mean
absolute value, kurtosis, share of near-zero values; horizontal, vertical and Laplacian high-pass responses —
log spread and kurtosis; the 8-periodic profile of neighbour differences (JPEG block grid); the radial power
spectrum in `SPECTRUM_BINS` bands (log power relative to the whole spectrum).

JPEG files are decoded with PIL's draft mode (DCT scaling) straight to about the largest size needed: without the
detail view a 1024² file is decoded at 256², several times faster than a full decode (bench/bench_probes.py).
"""

from __future__ import annotations

import io
from dataclasses import dataclass

import numpy as np
from PIL import Image, JpegImagePlugin
from scipy import fft as scipy_fft
from scipy import ndimage
from ..generation.failures import UsageError

FEATURE_VERSION = 2  # part of the probe cache's key: raise it whenever a change alters any feature's value
SPECTRUM_BINS = 16
BLOCK = 8
FILE_FEATURES = ("log2_width", "log2_height", "bits_per_pixel", "is_jpeg", "colour_spread", "luma_q_mean",
                 "luma_q_dc", "luma_q_low", "chroma_q_mean", "quant_tables", "subsampling")
PIXEL_FEATURES = ("mean", "std", "residual_std", "residual_abs", "residual_kurtosis", "residual_near_zero",
                  *(f"{f}_{s}" for f in ("dx", "dy", "laplace") for s in ("log_std", "kurtosis")),
                  *(f"grid_{i}" for i in range(BLOCK)), *(f"spectrum_{i}" for i in range(SPECTRUM_BINS)))
DETAIL_FEATURES = tuple(f"detail_{name}" for name in PIXEL_FEATURES)
PROBE_SIZE = 256  # the defaults of `eval --probe-size` and `--probe-detail`, chosen by bench_probe_power.py
PROBE_DETAIL = 1024


@dataclass(frozen=True)
class FeatureSettings:
    size: int = PROBE_SIZE  # pixels a side of each view, raw and controlled
    quality: int = 90  # JPEG quality of the controlled re-encoding
    detail: int = PROBE_DETAIL  # the detail view's scale: a size² centre crop of the image at detail² (0: none)

    def __post_init__(self):
        if self.detail and self.detail < self.size:
            raise UsageError(f"--probe-detail is 0 (none) or at least --probe-size ({self.size}), not {self.detail}")

    def names(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """The (raw, controlled) feature names, in vector order."""
        pixels = PIXEL_FEATURES + (DETAIL_FEATURES if self.detail else ())
        return FILE_FEATURES + pixels, pixels


def image_features(data: bytes, settings: FeatureSettings = FeatureSettings()) -> tuple[np.ndarray, np.ndarray]:
    """(raw, controlled) feature vectors of one encoded image (bytes of any format PIL reads)."""
    largest = max(settings.size, settings.detail)
    with Image.open(io.BytesIO(data)) as im:
        file_part = _file_features(im, len(data))
        if im.format == "JPEG":
            im.draft(im.mode if im.mode in ("L", "RGB") else "RGB", (largest, largest))
        if im.mode == "L" or _wide_grey(im.mode):  # grey: no colour to measure
            grey = _grey_8bit(im) if _wide_grey(im.mode) else im.convert("L")
        else:
            rgb = np.asarray(im.convert("RGB"))
            file_part[FILE_FEATURES.index("colour_spread")] = _colour_spread(rgb)
            grey = Image.fromarray(rgb).convert("L")
    views = [_resized(grey, settings.size)]
    if settings.detail:
        start = (settings.detail - settings.size) // 2
        views.append(_resized(grey, settings.detail).crop((start, start, start + settings.size, start + settings.size)))
    raw = np.concatenate([file_part] + [pixel_statistics(np.asarray(view, np.float32)) for view in views])
    controlled = np.concatenate([pixel_statistics(np.asarray(reencoded(view, settings.quality), np.float32))
                                 for view in views])
    return raw.astype(np.float32), controlled.astype(np.float32)


def _resized(grey: Image.Image, size: int) -> Image.Image:
    return grey if grey.size == (size, size) else grey.resize((size, size), Image.Resampling.BILINEAR)


def reencoded(grey: Image.Image, quality: int) -> Image.Image:
    """The controlled copy: the same JPEG re-encoding for real and edited images."""
    buffer = io.BytesIO()
    grey.save(buffer, "JPEG", quality=quality)
    with Image.open(buffer) as again:
        return again.convert("L")


def controlled_image(data: bytes, settings: FeatureSettings) -> Image.Image:
    """Any image brought to the controlled form (grey, `size`², re-encoded at `quality`)."""
    with Image.open(io.BytesIO(data)) as im:
        if im.format == "JPEG":
            im.draft(im.mode if im.mode in ("L", "RGB") else "RGB", (settings.size, settings.size))
        grey = _grey_8bit(im) if _wide_grey(im.mode) else im.convert("L")
    return reencoded(grey.resize((settings.size, settings.size), Image.Resampling.BILINEAR), settings.quality)


def _file_features(im: Image.Image, n_bytes: int) -> np.ndarray:
    width, height = im.size
    values = dict.fromkeys(FILE_FEATURES, 0.0)
    values.update(log2_width=np.log2(width), log2_height=np.log2(height),
                  bits_per_pixel=8.0 * n_bytes / (width * height))
    if im.format == "JPEG":
        tables = getattr(im, "quantization", None) or {}
        luma = np.asarray(tables.get(0, [0] * 64), np.float32)
        chroma = np.asarray(tables.get(1, [0] * 64), np.float32)
        # tables are in zigzag order: the first entries are the lowest frequencies
        values.update(is_jpeg=1.0, luma_q_mean=float(luma.mean()), luma_q_dc=float(luma[0]),
                      luma_q_low=float(luma[:10].mean()), chroma_q_mean=float(chroma.mean()),
                      quant_tables=float(len(tables)),
                      subsampling=float(JpegImagePlugin.get_sampling(im)) if im.mode != "L" else -1.0)
    return np.array([values[name] for name in FILE_FEATURES], np.float64)


def _wide_grey(mode: str) -> bool:
    return mode.startswith("I") or mode == "F"  # 16-bit, 32-bit integer or float grey


def _grey_8bit(im: Image.Image) -> Image.Image:
    """16-bit or float grey scaled to 0..255 by its own range (the features are about texture, not level)."""
    values = np.asarray(im, np.float32)
    low, high = float(values.min()), float(values.max())
    return Image.fromarray(((values - low) * (255.0 / max(high - low, 1e-6))).astype(np.uint8))


def _colour_spread(rgb: np.ndarray) -> float:
    """Mean absolute difference between channels: 0 for a grey image stored as RGB."""
    sample = rgb[::4, ::4].astype(np.int16)
    return float(np.abs(sample - sample.mean(axis=2, keepdims=True)).mean())


def _kurtosis(values: np.ndarray) -> float:
    centred = (values - values.mean()).ravel()
    squared = centred * centred
    var = float(squared.sum()) / squared.size
    # dot products: BLAS sums in float32 fast enough and accurately enough for a feature
    return float(np.dot(squared, squared)) / squared.size / (var * var) if var > 1e-12 else 0.0


def pixel_statistics(grey: np.ndarray) -> np.ndarray:
    """The pixel part of the features, for a float grey image with values in 0..255."""
    grey = (grey / 255.0).astype(np.float32, copy=False)
    residual = grey - ndimage.uniform_filter(grey, 3, mode="reflect")
    stats = [grey.mean(), grey.std(), residual.std(), np.abs(residual).mean(), _kurtosis(residual),
             float((np.abs(residual) < 0.5 / 255).mean())]
    dx = np.diff(grey, axis=1)
    dy = np.diff(grey, axis=0)
    laplace = 4 * grey[1:-1, 1:-1] - grey[:-2, 1:-1] - grey[2:, 1:-1] - grey[1:-1, :-2] - grey[1:-1, 2:]
    for response in (dx, dy, laplace):
        stats += [np.log(response.std() + 1e-6), _kurtosis(response)]
    stats += list(block_grid_profile(dx, dy))
    stats += list(radial_spectrum(grey))
    return np.asarray(stats, np.float64)


def block_grid_profile(dx: np.ndarray, dy: np.ndarray) -> np.ndarray:
    """Mean |neighbour difference| by position modulo 8 (columns and rows together), relative to the overall
    mean: flat for an image without a block grid, peaked at the block edges for a blocky JPEG."""
    columns = np.abs(dx).mean(axis=0)
    rows = np.abs(dy).mean(axis=1)
    profile = np.zeros(BLOCK)
    for line in (columns, rows):
        usable = len(line) // BLOCK * BLOCK
        profile += line[:usable].reshape(-1, BLOCK).mean(axis=0)
    return profile / (profile.mean() + 1e-12) - 1.0


_RADIUS_CACHE: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = {}


def _radius_bins(shape: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    if shape not in _RADIUS_CACHE:
        fy = np.fft.fftfreq(shape[0])[:, None]
        fx = np.fft.rfftfreq(shape[1])[None, :]
        radius = np.sqrt(fx * fx + fy * fy) / 0.5  # 1.0 = Nyquist along an axis
        bins = np.minimum((radius * SPECTRUM_BINS).astype(np.int64), SPECTRUM_BINS)  # corners -> overflow bin
        window = np.outer(np.hanning(shape[0]), np.hanning(shape[1])).astype(np.float32)
        _RADIUS_CACHE[shape] = (bins.ravel(), window)
    return _RADIUS_CACHE[shape]


def radial_spectrum(grey: np.ndarray) -> np.ndarray:
    """Log mean power per radial frequency band (band 0 = lowest), minus the log mean power of all bands."""
    bins, window = _radius_bins(grey.shape)
    spectrum = scipy_fft.rfft2((grey - grey.mean()) * window)  # float32 in, complex64 out
    power = (spectrum.real * spectrum.real + spectrum.imag * spectrum.imag).astype(np.float64)
    sums = np.bincount(bins, weights=power.ravel(), minlength=SPECTRUM_BINS + 1)[:SPECTRUM_BINS]
    counts = np.bincount(bins, minlength=SPECTRUM_BINS + 1)[:SPECTRUM_BINS]
    band = np.log10(sums / np.maximum(counts, 1) + 1e-12)
    return band - np.log10(sums.sum() / counts.sum() + 1e-12)
