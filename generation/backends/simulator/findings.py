"""Adding a finding: each of the 20 edit targets' builder (`lesions_chest.py`, `lesions_neuro_fundus.py`, over the
primitives of `lesions.py`), and a diseased demo source made with them."""

from __future__ import annotations

import numpy as np

from .lesions import Canvas, EditOps, apply_ops, make_canvas, spec_for
from .lesions_chest import CHEST_BUILDERS
from .lesions_neuro_fundus import NEURO_FUNDUS_BUILDERS
from .params import EditParams

BUILDERS = {**CHEST_BUILDERS, **NEURO_FUNDUS_BUILDERS}


def build_add(canvas: Canvas, disease: str, rng: np.random.Generator, realised: dict) -> EditOps:
    """Synthesise the finding with the realised parameters (see editor.realise)."""
    ops = EditOps.empty(canvas)
    BUILDERS[disease](canvas, ops, spec_for(disease), realised, rng)
    return ops


def synthesise_disease_source(rgb: np.ndarray, modality: str, disease: str, *, seed: int) -> tuple[np.ndarray, dict]:
    """A diseased demo source: the finding synthesised at a known place with the editor's own lesion models."""
    rng = np.random.default_rng(seed)
    params = EditParams(intensity=3, size=1, softness=2, grain=2)
    realised = {"intensity": params.value("intensity"), "size": params.value("size"),
                "softness": params.value("softness"), "side": "", "inward": False}
    canvas = make_canvas(rgb, modality)
    ops = build_add(canvas, disease, rng, realised)
    out = apply_ops(rgb, ops, grain_keep=0.96, loss_scale=1.0, shift=(37, 53))
    lesion = {"disease": disease, "params": params.as_dict(), **{k: _plain(v) for k, v in ops.facts.items()}}
    return np.clip(out + 0.5, 0, 255).astype(np.uint8), lesion


def _plain(value):
    if isinstance(value, (np.floating, np.integer)):
        return value.item()
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    return value
