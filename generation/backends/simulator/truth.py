"""The ground truth of a simulated edit: the pixels it drew, recorded in the edit's details.

`drawn_mask` is where the edit's noise-free change (what it painted plus what it blended, before grain and the
global tone drift) reaches DRAWN_LEVELS grey levels in some channel, on the working grid. The editor records it as
a 1-bit PNG in base64 (`details["drawn_mask"]`, a few KB; raster.encode_mask); `read_drawn_mask` gives it back at
any size, so the dataset's computed `edit_mask` (generation/masks.py) can be scored against it (bench/bench_masks.py,
the demo test).
"""

from __future__ import annotations

import numpy as np

from ...raster import decode_mask

DRAWN_LEVELS = 4.0  # grey levels: a change below this is invisible against JPEG noise and film grain
DETAILS_KEY = "drawn_mask"


def drawn_mask(ops, canvas) -> np.ndarray:
    """Where the ops change the working-grid image by DRAWN_LEVELS or more (boolean, WORK²)."""
    painted = np.abs(ops.add).max(axis=-1)
    blended = ops.mix * np.abs(ops.target - canvas.rgb).max(axis=-1)
    return (painted + blended) >= DRAWN_LEVELS


def read_drawn_mask(details: dict | None, size: tuple[int, int]) -> np.ndarray | None:
    """The recorded truth of an edit's details at `size` = (width, height), or None when it has none."""
    text = (details or {}).get(DETAILS_KEY)
    if not text:
        return None
    return decode_mask(text, size)
