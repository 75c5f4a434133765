"""A mask image's bytes checked before they are used or embedded: what `build` reads from a run's masks folder,
what `export medebench` and `eval` read from a dataset's `edit_mask` / `region_mask` columns.

A mask is what generation/masks.py writes (`png_value`): a PNG of 8-bit grey (colour type 0, bit depth 8) holding
only IHDR, IDAT and IEND chunks, every chunk's CRC right and nothing after IEND, of the size it belongs to (an edit
mask the edit's, a region mask the source's), whose pixels are all 0 or 255. Everything but the last is checked on
the bytes before any pixel is decoded, so a 300 MB file or a decompression bomb (a small file claiming a huge
image) costs nothing: the size must be the expected one and at most MAX_MASK_PIXELS, and the file at most
`max_mask_bytes` of that size (what the pixels take stored uncompressed). Then the pixels are decoded (W x H
bytes) and their histogram read. A problem is a `MaskProblem`: a fixed `kind` (to count by) and its detail.
"""

from __future__ import annotations

import io
import struct
import zlib
from typing import NamedTuple

import numpy as np
from .failures import UsageError

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
MAX_MASK_PIXELS = 8192 * 8192  # 64 MB decoded: a mask of a larger image is not kept
LIKE_ASPECT, LIKE_PIXELS = 0.02, 4  # `like`: an edit's shape, and at most 4x its pixels
ALLOWED_CHUNKS = (b"IHDR", b"IDAT", b"IEND")  # what Pillow writes for a mode-L image without info
# kinds of problem, as counted
TOO_LARGE = "too large"
NOT_PNG = "not a PNG"
CORRUPT = "truncated or corrupt"
EXTRA_CHUNK = "a chunk other than IHDR/IDAT/IEND (text or other metadata)"
NOT_GREY = "not 8-bit grey"
WRONG_SIZE = "not the expected size"
NOT_BINARY = "not binary (values other than 0 and 255)"


class MaskProblem(NamedTuple):
    kind: str  # one of the kinds above
    detail: str

    def __str__(self) -> str:
        return f"{self.kind} ({self.detail})" if self.detail else self.kind


def max_mask_bytes(size: tuple[int, int]) -> int:
    """The most bytes a mask PNG of `size` (width, height) takes: its rows stored uncompressed (a filter byte each),
    zlib's and the chunks' framing, and a margin."""
    width, height = size
    return (width + 1) * height * 101 // 100 + 65536


def mask_problem(data: bytes, size: tuple[int, int] | None = None, *,
                 like: list[tuple[int, int]] | None = None) -> MaskProblem | None:
    """Why `data` is not a mask of `size` (width, height), or None when it is one. `like`, where the exact size is
    not known (a region mask, whose source the build does not have): the mask must have the shape of one of these
    sizes (aspect ratio within LIKE_ASPECT) and at most LIKE_PIXELS times the largest one's pixels."""
    return check_mask(data, size, like)[0]


def read_checked_mask(data: bytes, size: tuple[int, int] | None = None, what: str = "mask") -> np.ndarray:
    """The mask as a boolean array (height, width); ValueError naming `what` and the problem unless `data` is a
    mask (mask_problem) of `size`."""
    problem, levels = check_mask(data, size, None)
    if problem is not None:
        raise UsageError(f"{what} refused: {problem}")
    return levels > 127


def header_size(data: bytes) -> tuple[int, int] | None:
    """(width, height) of a PNG's or JPEG's header without decoding; None when it cannot be read."""
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data)) as image:
            return image.size
    except Exception:  # noqa: BLE001 - Pillow raises many kinds on bad input: no size to check against
        return None


def check_mask(data: bytes, size: tuple[int, int] | None = None,
               like: list[tuple[int, int]] | None = None) -> tuple[MaskProblem | None, np.ndarray | None]:
    """(None, the mask's grey levels) when `data` is a mask (`mask_problem`), else (the problem, None)."""
    header = _header_problem(data, size, like)
    if isinstance(header, MaskProblem):
        return header, None
    try:
        levels = _decoded(data)
    except ValueError as exc:
        return MaskProblem(CORRUPT, str(exc)), None
    # 0 and 255 are the values v with (v + 1) & 0xFE == 0 (255 + 1 wraps to 0): one pass, no histogram
    if np.bitwise_and(levels + np.uint8(1), np.uint8(0xFE)).any():
        grey = int(np.count_nonzero((levels != 0) & (levels != 255)))
        return MaskProblem(NOT_BINARY, f"{grey:,} pixels"), None
    return None, levels


def _header_problem(data: bytes, size, like) -> MaskProblem | tuple[int, int]:
    """The problem found without decoding, else the mask's (width, height)."""
    if not isinstance(data, bytes | bytearray) or not data.startswith(PNG_MAGIC):
        return MaskProblem(NOT_PNG, "")
    chunks = _chunks(data)
    if isinstance(chunks, MaskProblem):
        return chunks
    width, height, depth, colour = chunks
    if width * height > MAX_MASK_PIXELS:
        return MaskProblem(TOO_LARGE, f"{width}x{height} pixels, more than {MAX_MASK_PIXELS:,}")
    if width < 1 or height < 1:
        return MaskProblem(WRONG_SIZE, f"{width}x{height}")
    if size is not None and (width, height) != tuple(size):
        return MaskProblem(WRONG_SIZE, f"{width}x{height}, not {size[0]}x{size[1]}")
    if like and not any(abs(width / height - w / h) <= LIKE_ASPECT * w / h and width * height <= LIKE_PIXELS * w * h
                        for w, h in like):
        return MaskProblem(WRONG_SIZE, f"{width}x{height}, not the shape of {like[0][0]}x{like[0][1]}")
    if len(data) > max_mask_bytes((width, height)):
        return MaskProblem(TOO_LARGE, f"{len(data):,} bytes for {width}x{height} pixels")
    if (depth, colour) != (8, 0):
        return MaskProblem(NOT_GREY, f"bit depth {depth}, colour type {colour}")
    return width, height


def _chunks(data: bytes) -> MaskProblem | tuple[int, int, int, int]:
    """Walk the chunks (framing and CRC), allowing ALLOWED_CHUNKS only, IHDR first and IEND last; the IHDR's
    width, height, bit depth and colour type."""
    position, ihdr, end = len(PNG_MAGIC), None, len(data)
    while position < end:
        if position + 12 > end:
            return MaskProblem(CORRUPT, "a chunk cut short")
        length, kind = struct.unpack(">I4s", data[position:position + 8])
        stop = position + 12 + length
        if stop > end:
            return MaskProblem(CORRUPT, f"a {kind!r} chunk cut short")
        body = data[position + 8:stop - 4]
        if zlib.crc32(data[position + 4:stop - 4]) != struct.unpack(">I", data[stop - 4:stop])[0]:
            return MaskProblem(CORRUPT, f"a bad CRC in a {kind.decode('latin-1')!r} chunk")
        if kind not in ALLOWED_CHUNKS:
            return MaskProblem(EXTRA_CHUNK, f"a {kind.decode('latin-1')!r} chunk of {length:,} bytes")
        if (kind == b"IHDR") != (ihdr is None):
            return MaskProblem(CORRUPT, "IHDR not first, or twice")
        if kind == b"IHDR":
            if length != 13:
                return MaskProblem(CORRUPT, "an IHDR of the wrong length")
            ihdr = struct.unpack(">IIBB", body[:10])
        position = stop
        if kind == b"IEND":
            if position != end:
                return MaskProblem(CORRUPT, f"{end - position:,} bytes after IEND")
            return ihdr
    return MaskProblem(CORRUPT, "no IEND (truncated)")


def _decoded(data: bytes) -> np.ndarray:
    """The grey levels of a checked mask PNG; ValueError when its image data does not decode."""
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data), formats=["PNG"]) as image:
            image.load()
            return np.asarray(image)
    except Exception as exc:  # noqa: BLE001 - zlib.error, OSError (truncated data), SyntaxError, ...
        raise UsageError(f"its image data does not decode: {exc.__class__.__name__}: {exc}") from None
