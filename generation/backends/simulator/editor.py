"""The simulated editor: reads edit parameters from the instruction and synthesises (or removes) the finding.

Like a real editing model it is seeded and not exact: the realised strength, extent, margin softness and grain
vary around what the instruction asks for, placement varies within the region, and stronger edits sometimes
drift the global tone unless the instruction insists on identical global brightness. Every round edits the
ORIGINAL source. The result is a JPEG (q95) of the source's size; the realised parameters go in `details`.
With `drift` (a rate, `generate --simulator-drift`), that share of its edits also moves the frame as real editors
do (drift.py: a shift, a zoom, or another canvas aspect), recorded in `details["frame_drift"]`; the geometry
guard (generation/geometry.py) is meant to catch them.
"""

from __future__ import annotations

import asyncio

import numpy as np

from ..base import Editor, EditRefused
from ...raster import encode_mask
from ...records import EditedImage, SourceImage, Task, encode_jpeg
from .drift import drifted, random_drift
from .findings import build_add
from .lesions import apply_ops, build_remove, make_canvas, spec_for
from .params import EditParams, parse
from .truth import DETAILS_KEY, drawn_mask
from ...failures import UsageError


FRAME_STREAM = 0x6E0  # the drift's random stream, beside the edit's own seed


def realise(params: EditParams, rng: np.random.Generator, jitter: float = 1.0) -> dict:
    """What the editor actually does for these parameters: the stated values with model-like scatter."""
    return {"intensity": params.value("intensity") * float(np.exp(rng.normal(0, 0.12 * jitter))),
            "size": params.value("size") * float(np.exp(rng.normal(0, 0.08 * jitter))),
            # Pushed harder, editing models draw crisper borders than asked for.
            "softness": params.value("softness") * float(np.exp(rng.normal(0, 0.3 * jitter)))
            / (0.55 + 0.45 * params.value("intensity")),
            "grain": float(np.clip(params.value("grain") - abs(rng.normal(0, 0.04 * jitter)), 0, 1)),
            "side": params.side, "inward": params.inward}


class SimulatedEditor(Editor):
    """Procedural, region-aware editor for the 20 targets. `jitter` scales the model-like scatter (0: exact);
    `drift` is the share of edits whose frame moves (0: none)."""

    name = "simulator"
    # IPTC code for the synthetic-content mark: procedural, not a trained model (see generation/rundir/provenance.py)
    digital_source_type = "compositeSynthetic"

    def __init__(self, *, jitter: float = 1.0, model: str = "medbanana-simulator-editor-1", drift: float = 0.0):
        if not 0 <= drift <= 1:
            raise UsageError(f"the simulator's drift is a rate between 0 and 1, not {drift!r}")
        self.jitter = jitter
        self.model = model
        self.drift = drift

    async def edit(self, task: Task, source: SourceImage, instruction: str, seed: int) -> EditedImage:
        return await asyncio.to_thread(self.edit_sync, task, source, instruction, seed)

    def edit_sync(self, task: Task, source: SourceImage, instruction: str, seed: int) -> EditedImage:
        spec_for(task.disease)  # unknown targets fail here, before any work
        try:
            rgb = source.array
        except ValueError as exc:
            raise EditRefused("unreadable_source", str(exc)) from exc
        params = parse(instruction)
        rng = np.random.default_rng(seed)
        realised = realise(params, rng, self.jitter)
        canvas = make_canvas(rgb, task.modality, key=source.sha256)
        if task.direction == "add":
            ops = build_add(canvas, task.disease, rng, realised)
        else:
            ops = build_remove(canvas, task.disease, realised)
        # Fine grain lost inside the lesion grows with how hard the edit pushes the image, and with how noisy
        # the source is (editing models denoise what they repaint).
        loss_scale = float(np.clip(realised["intensity"] / 0.8, 0.3, 1.6)) * (0.6 + canvas.grain / 5)
        shift = (int(rng.integers(17, 61)), int(rng.integers(17, 61)))
        out = apply_ops(rgb, ops, realised["grain"], loss_scale, shift)
        drift = float(rng.normal(0, (0.6 + 0.5 * params.intensity) * (0.2 if params.tone else 1.0) * self.jitter))
        out = np.clip(out + drift + 0.5, 0, 255).astype(np.uint8)
        details = {"params": params.as_dict(),
                   "realised": {k: round(v, 3) if isinstance(v, float) else v for k, v in realised.items()},
                   "global_drift": round(drift, 2), "seed": seed, **ops.facts,
                   DETAILS_KEY: encode_mask(drawn_mask(ops, canvas))}  # the ground truth of the edit's ROI (truth.py)
        if self.drift:
            # a stream of its own: the same seed edits alike with and without drift, the frame aside
            frame = np.random.default_rng([seed, FRAME_STREAM])
            if frame.random() < self.drift:
                change = random_drift(frame, (out.shape[1], out.shape[0]))
                out = drifted(out, change)
                details["frame_drift"] = change.as_dict()
        return EditedImage(data=encode_jpeg(out, quality=95), model=self.model, details=details)
