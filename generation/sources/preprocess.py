"""One source image -> prepared bytes: decode, check, convert, fit to SIZE x SIZE, re-encode as JPEG.

The output is a fresh RGB image built from the pixels alone, so EXIF, XMP, ICC profiles, JPEG comments and DICOM
headers never reach it (EXIF orientation is applied to the pixels first). Aspect: "pad" (default) scales the image
to fit and centres it on black; "stretch" scales each axis to SIZE. JPEG quality 95, 4:2:0, baseline, not optimised:
the same input and options give the same bytes with the same Pillow/libjpeg build. Unusable input raises BadImage
with the reason the report records (a hostile file included: an EXIF block that is no TIFF, a PNG text chunk over
Pillow's PngImagePlugin.MAX_TEXT_CHUNK / MAX_TEXT_MEMORY, a header past --max-pixels); usable but unusual input is
converted and the conversion noted.
"""

from __future__ import annotations

import hashlib
import io
import struct
from dataclasses import dataclass, field

import numpy as np

from ..records import DEFAULT_MAX_PIXELS  # one default for `prepare` and `generate --max-pixels`
from ..failures import UsageError

ASPECTS = ("pad", "stretch")


class BadImage(UsageError):
    """This file cannot be used as a source; the message is the report's reason."""


@dataclass
class ImageOptions:
    size: int = 1024
    aspect: str = "pad"  # pad | stretch
    quality: int = 95
    min_side: int = 64  # shorter sides below this are rejected (a 1x1 or thumbnail is no scan)
    max_pixels: int = DEFAULT_MAX_PIXELS  # larger images are rejected before decoding

    def fingerprint(self) -> dict:
        """What makes prepared bytes differ: a folder is never filled with two settings."""
        return {"size": self.size, "aspect": self.aspect, "quality": self.quality}

    def check(self) -> None:
        if self.aspect not in ASPECTS:
            raise UsageError(f"aspect {self.aspect!r}: use {' or '.join(ASPECTS)}")
        if not 16 <= self.size <= 8192 or not 1 <= self.quality <= 100:
            raise UsageError("size must be 16..8192 and quality 1..100")


@dataclass
class Prepared:
    data: bytes
    sha256: str
    source_sha256: str
    source_width: int
    source_height: int
    notes: list[str] = field(default_factory=list)
    dicom: bool = False  # decoded as DICOM: its file name may hold the patient's name


# what Pillow's plugins raise on hostile bytes besides OSError (PNG text over MAX_TEXT_CHUNK: ValueError; an EXIF
# block that is no TIFF: SyntaxError; short structures: struct.error, EOFError, IndexError)
DECODE_ERRORS = (OSError, SyntaxError, ValueError, EOFError, struct.error, IndexError, TypeError, KeyError)


# --- one image --------------------------------------------------------------------------------------------------
def prepare_image(data: bytes, opts: ImageOptions, name: str = "") -> Prepared:
    """Decoded, checked, converted, resized and re-encoded source bytes; BadImage with the reason otherwise."""
    if not data:
        raise BadImage("empty file")
    notes: list[str] = []
    dicom = data[128:132] == b"DICM" or name.lower().endswith((".dcm", ".dicom"))
    if dicom:
        from PIL import Image

        pixels = _dicom_pixels(data, opts, notes)
        (h, w), image = pixels.shape[:2], Image.fromarray(pixels)
    else:
        try:
            image, (w, h) = _open_checked(data, opts, notes)
        except BadImage:  # a ValueError too: its own reason stands
            raise
        except DECODE_ERRORS as exc:
            raise BadImage(f"unreadable image: {type(exc).__name__}: {exc}") from None
    extrema = image.getextrema()
    if all(lo == hi for lo, hi in (extrema if isinstance(extrema[0], tuple) else [extrema])):
        raise BadImage("uniform image: every pixel has the same value")
    out = _fit(image, opts)
    buf = io.BytesIO()
    out.save(buf, format="JPEG", quality=opts.quality, subsampling="4:2:0", optimize=False, progressive=False)
    encoded = buf.getvalue()
    return Prepared(encoded, hashlib.sha256(encoded).hexdigest(), hashlib.sha256(data).hexdigest(), w, h, notes,
                    dicom)


def _open_checked(data: bytes, opts: ImageOptions, notes: list[str]):
    from PIL import Image, ImageOps, UnidentifiedImageError

    try:  # Pillow reads only the header here
        im = Image.open(io.BytesIO(data))
    except Image.DecompressionBombError as exc:  # Pillow's own hard limit, twice its warning threshold
        raise BadImage(f"over the decompression limit: {exc}") from None
    except UnidentifiedImageError:
        head = data[:16]
        kind = "text" if all(32 <= b < 127 or b in b"\r\n\t" for b in head) else "unknown bytes"
        raise BadImage(f"not an image: content starts with {kind} {head[:8]!r}") from None
    w, h = im.size
    if w * h > opts.max_pixels:
        raise BadImage(f"over the decompression limit: {w}x{h} = {w * h} pixels > {opts.max_pixels}")
    if min(w, h) < opts.min_side:
        raise BadImage(f"too small: {w}x{h} (shorter side must be at least {opts.min_side})")
    if getattr(im, "n_frames", 1) > 1:
        raise BadImage(f"{im.format} with {im.n_frames} frames; export one frame")
    if im.mode == "CMYK":
        raise BadImage("CMYK colour (a print copy, not a scan); colours cannot be recovered without its "
                       "ICC profile — convert to RGB or greyscale first")
    if im.format == "JPEG" and im.mode in ("L", "RGB"):
        # DCT-domain downscale to no less than the output size: faster, still deterministic; the fit size is
        # symmetric under the 90-degree turns of EXIF orientation, so it holds after exif_transpose too
        im.draft(im.mode, _fit_size(w, h, opts))
    try:
        im.load()
    except (OSError, SyntaxError, ValueError) as exc:
        raise BadImage(f"truncated or corrupt image data: {exc}") from None
    try:
        orientation = im.getexif().get(0x0112, 1)
    except DECODE_ERRORS as exc:  # skipped, not guessed: a wrong orientation would mislabel the anatomy
        raise BadImage(f"unreadable EXIF block, orientation unknown: {type(exc).__name__}: {exc}") from None
    if orientation in range(2, 9):  # EXIF Orientation other than "as stored"
        im = ImageOps.exif_transpose(im)
        notes.append("EXIF orientation applied to the pixels")
    return _to_l_or_rgb(im, notes), (w, h)


def _to_l_or_rgb(im, notes: list[str]):
    from PIL import Image

    if im.mode in ("I;16", "I;16B", "I;16L", "I;16N", "I", "F"):
        arr = np.asarray(im, dtype=np.float64)
        notes.append(f"{'16-bit' if im.mode.startswith('I;16') else im.mode + '-mode'} grey scaled to 8-bit "
                     f"from its range {arr.min():g}..{arr.max():g}")
        return Image.fromarray(_stretch_to_uint8(arr))
    if im.mode in ("RGBA", "LA", "PA", "RGBa", "La") or (im.mode == "P" and "transparency" in im.info):
        rgba = np.asarray(im.convert("RGBA"))
        alpha = rgba[..., 3:].astype(np.float64) / 255
        if alpha.min() == 1:
            notes.append("opaque alpha channel dropped")
        else:
            notes.append("transparent pixels composited onto black")
        return Image.fromarray(np.round(rgba[..., :3] * alpha).astype(np.uint8))
    if im.mode in ("L", "RGB"):
        return im
    if im.mode != "1":
        notes.append(f"{im.mode} converted to RGB")
    return im.convert("L" if im.mode == "1" else "RGB")


def _stretch_to_uint8(arr: np.ndarray) -> np.ndarray:
    lo, hi = float(arr.min()), float(arr.max())
    if hi <= lo:
        raise BadImage("uniform image: every pixel has the same value")
    return np.round((arr - lo) / (hi - lo) * 255).astype(np.uint8)


def _dicom_pixels(data: bytes, opts: ImageOptions, notes: list[str]) -> np.ndarray:
    """DICOM pixels to 8-bit: modality LUT, the first VOI window if any (else the full range), MONOCHROME1 inverted.
    Only pixel data is used; no header value reaches the output."""
    try:
        import pydicom
    except ImportError:
        raise BadImage("DICOM input needs pydicom: pip install 'medbanana[dicom]'") from None
    try:
        from pydicom.pixels import apply_modality_lut
    except ImportError:  # pydicom 2.x
        from pydicom.pixel_data_handlers.util import apply_modality_lut
    try:
        ds = pydicom.dcmread(io.BytesIO(data), force=True)
        frames = int(getattr(ds, "NumberOfFrames", 1) or 1)
        rows, cols = int(ds.Rows), int(ds.Columns)
        if frames > 1:
            raise BadImage(f"multi-frame DICOM ({frames} frames: a volume or cine); export one slice")
        if rows * cols > opts.max_pixels:
            raise BadImage(f"over the decompression limit: {cols}x{rows} pixels > {opts.max_pixels}")
        if min(rows, cols) < opts.min_side:
            raise BadImage(f"too small: {cols}x{rows} (shorter side must be at least {opts.min_side})")
        raw = ds.pixel_array
    except BadImage:
        raise
    except Exception as exc:  # pydicom raises many types for unreadable or compressed-without-plugin data
        raise BadImage(f"unreadable DICOM: {type(exc).__name__}: {exc}") from None
    photometric = str(getattr(ds, "PhotometricInterpretation", "MONOCHROME2")).upper()
    if raw.ndim == 3:
        notes.append(f"DICOM {photometric} colour")
        return _stretch_to_uint8(raw.astype(np.float64)) if raw.dtype != np.uint8 else raw
    values = np.asarray(apply_modality_lut(raw, ds), dtype=np.float64)
    center, width = _first(getattr(ds, "WindowCenter", None)), _first(getattr(ds, "WindowWidth", None))
    if center is not None and width is not None and width >= 1:
        # DICOM PS3.3 C.11.2.1.2.1 linear window
        lo, top = center - 0.5 - (width - 1) / 2, center - 0.5 + (width - 1) / 2
        scaled = np.where(values <= lo, 0.0, np.where(values > top, 255.0,
                                                       ((values - (center - 0.5)) / (width - 1) + 0.5) * 255))
        pixels = np.round(np.clip(scaled, 0, 255)).astype(np.uint8)
        notes.append(f"DICOM window centre {center:g} width {width:g} applied")
    else:
        pixels = _stretch_to_uint8(values)
        notes.append(f"DICOM {raw.dtype} scaled to 8-bit from its range")
    if photometric == "MONOCHROME1":
        pixels = 255 - pixels
        notes.append("MONOCHROME1 inverted")
    return pixels


def _first(value) -> float | None:
    if value is None:
        return None
    try:
        return float(value[0] if hasattr(value, "__len__") and not isinstance(value, str) else value)
    except (TypeError, ValueError, IndexError):
        return None


def _fit_size(w: int, h: int, opts: ImageOptions) -> tuple[int, int]:
    if opts.aspect == "stretch":
        return opts.size, opts.size
    scale = opts.size / max(w, h)
    return max(1, round(w * scale)), max(1, round(h * scale))


def _fit(im, opts: ImageOptions):
    """A fresh RGB image of SIZE x SIZE built from the pixels alone (no info dict carried over)."""
    from PIL import Image

    target = _fit_size(*im.size, opts)
    if im.size != target:
        im = im.resize(target, Image.Resampling.LANCZOS)
    arr = np.asarray(im)
    if arr.ndim == 2:
        arr = np.repeat(arr[..., None], 3, axis=2)
    canvas = np.zeros((opts.size, opts.size, 3), dtype=np.uint8)
    top, left = (opts.size - target[1]) // 2, (opts.size - target[0]) // 2
    canvas[top:top + target[1], left:left + target[0]] = arr
    return Image.fromarray(canvas)


