"""Attention-grounding diagnostics for the diffusers editor (after MedEBench): does the model look where the disease
belongs?

While a pipeline edits, `CrossAttentionRecorder` (an attention processor on the UNet's cross-attention layers) adds
up, for each image of the batch, the attention its latent positions pay to the disease words of its instruction,
over every layer, head and denoising step (text-conditioned branch only). `heat_map` averages and normalises that
sum to [0, 1] at the image's size; `attention_mask` thresholds it at 1.3 x Otsu. The editor records that mask in
the edit's details (`raster.encode_mask`, at the source's size) with its IoU at generation time against
`region_mask`: the task's grown region (generation/anatomy.py `grown_region`, the definition the dataset's
`region_mask` column uses) located on the source. `eval --attention` (evaluation/attention.py) scores the recorded
mask again against the eval's ROI, the dataset's `edit_mask` when there is one, and gives the mislocalisation rate
per disease.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from contextlib import contextmanager
from pathlib import Path

import numpy as np

MISLOCALISED_BELOW = 0.1  # IoU under which an edit counts as mislocalised (our choice; configurable)
OTSU_FACTOR = 1.3
MASK_KEY = "mask"  # details["attention"][MASK_KEY]: the thresholded attention mask, raster.encode_mask's text


def disease_words(disease: str, modality: str | None = None) -> list[str]:
    """The words naming a disease: the taxonomy's display name split into words, e.g. ['pleural', 'effusion']."""
    from ..taxonomy import load_taxonomy

    label = load_taxonomy().find(disease, modality)
    names = {disease.replace("_", " ")} | ({label.name} if label else set())
    return sorted({w.lower() for name in names for w in name.replace("-", " ").split() if len(w) > 2})


def token_positions(tokenizer, prompt: str, words: Iterable[str]) -> list[int]:
    """Positions in the encoded prompt of every token of every occurrence of the words (the tokenizer's own
    pieces, so BPE sub-words count); positions past the encoder's length are dropped."""
    ids = tokenizer(prompt).input_ids[: tokenizer.model_max_length]
    positions: set[int] = set()
    for variant in {v for word in words for v in (word, word.lower(), word.capitalize())}:
        pieces = tokenizer(variant, add_special_tokens=False).input_ids
        for start in range(len(ids) - len(pieces) + 1) if pieces else ():
            if ids[start:start + len(pieces)] == pieces:
                positions.update(range(start, start + len(pieces)))
    return sorted(positions)


class CrossAttentionRecorder:
    """An attention processor (computed as diffusers' AttnProcessor does) that also sums the attention paid to
    chosen token positions, per batch item, at the latent grid (lh, lw)."""

    def __init__(self, positions: list[list[int]], latent_size: tuple[int, int]):
        self.positions = positions
        self.latent_size = latent_size
        self.sums: list = [None] * len(positions)
        self.counts = [0] * len(positions)

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, temb=None, **_):
        import torch
        import torch.nn.functional as F

        residual = hidden_states
        if attn.spatial_norm is not None:
            hidden_states = attn.spatial_norm(hidden_states, temb)
        input_ndim = hidden_states.ndim
        if input_ndim == 4:
            batch_size, channel, height, width = hidden_states.shape
            hidden_states = hidden_states.view(batch_size, channel, height * width).transpose(1, 2)
        batch_size, sequence_length, _ = (hidden_states.shape if encoder_hidden_states is None
                                          else encoder_hidden_states.shape)
        attention_mask = attn.prepare_attention_mask(attention_mask, sequence_length, batch_size)
        if attn.group_norm is not None:
            hidden_states = attn.group_norm(hidden_states.transpose(1, 2)).transpose(1, 2)
        query = attn.to_q(hidden_states)
        if encoder_hidden_states is None:
            encoder_hidden_states = hidden_states
        elif attn.norm_cross:
            encoder_hidden_states = attn.norm_encoder_hidden_states(encoder_hidden_states)
        key, value = attn.to_k(encoder_hidden_states), attn.to_v(encoder_hidden_states)
        query, key, value = attn.head_to_batch_dim(query), attn.head_to_batch_dim(key), attn.head_to_batch_dim(value)
        probs = attn.get_attention_scores(query, key, attention_mask)
        self._record(probs, batch_size, attn.heads, F)
        hidden_states = attn.batch_to_head_dim(torch.bmm(probs, value))
        hidden_states = attn.to_out[1](attn.to_out[0](hidden_states))
        if input_ndim == 4:
            hidden_states = hidden_states.transpose(-1, -2).reshape(batch_size, channel, height, width)
        if attn.residual_connection:
            hidden_states = hidden_states + residual
        return hidden_states / attn.rescale_output_factor

    def _record(self, probs, batch_size: int, heads: int, F) -> None:
        lh, lw = self.latent_size
        n_items, queries = len(self.positions), probs.shape[1]
        factor = math.sqrt(lh * lw / queries)
        h, w = math.ceil(lh / round(factor)), math.ceil(lw / round(factor))
        if h * w != queries or batch_size % n_items:
            return  # a layer whose grid we cannot place: left out rather than guessed
        # the text-conditioned branch comes first in the classifier-free guidance batch
        per_head = probs.reshape(batch_size, heads, queries, -1)[:n_items].float().mean(dim=1)
        for i, positions in enumerate(self.positions):
            if not positions:
                continue
            grid = per_head[i, :, positions].sum(dim=-1).reshape(1, 1, h, w)
            grid = F.interpolate(grid, size=(lh, lw), mode="bilinear", align_corners=False)[0, 0].cpu()
            self.sums[i] = grid if self.sums[i] is None else self.sums[i] + grid
            self.counts[i] += 1

    def maps(self) -> list[np.ndarray | None]:
        """Each item's mean attention at the latent grid (None where no disease token was found)."""
        return [None if s is None else (s / c).numpy() for s, c in zip(self.sums, self.counts)]


@contextmanager
def recording(unet, recorder: CrossAttentionRecorder):
    """The recorder on every cross-attention layer (attn2) of `unet` inside the block, the old processors after."""
    original = dict(unet.attn_processors)
    unet.set_attn_processor({name: recorder if name.endswith("attn2.processor") else processor
                             for name, processor in original.items()})
    try:
        yield recorder
    finally:
        unet.set_attn_processor(original)


def heat_map(latent_map: np.ndarray, size: tuple[int, int]) -> np.ndarray:
    """A latent-grid map resized to the image's (width, height) and min-max normalised to [0, 1]."""
    from PIL import Image

    field = np.asarray(Image.fromarray(np.asarray(latent_map, dtype=np.float32), mode="F").resize(size, Image.BILINEAR))
    low, high = float(field.min()), float(field.max())
    return np.zeros_like(field) if high - low < 1e-12 else ((field - low) / (high - low)).astype(np.float32)


def attention_mask(heat: np.ndarray, factor: float = OTSU_FACTOR) -> np.ndarray:
    """Where the heat exceeds factor x its Otsu threshold."""
    from skimage.filters import threshold_otsu

    if float(heat.max()) == float(heat.min()):
        return np.zeros(heat.shape, dtype=bool)
    return heat > factor * threshold_otsu(heat)


def iou(a: np.ndarray, b: np.ndarray) -> float:
    """Intersection over union of two boolean masks of one shape; two empty masks agree (1.0)."""
    if a.shape != b.shape:
        raise ValueError(f"masks of different shapes: {a.shape} and {b.shape}")
    union = np.logical_or(a, b).sum()
    return 1.0 if union == 0 else float(np.logical_and(a, b).sum() / union)


def region_mask(source_rgb: np.ndarray, modality: str, disease: str) -> np.ndarray:
    """The task's grown region (anatomy.grown_region on the ANAT grid, located on this source), at the source's
    size. KeyError for a region the modality has no mask for."""
    from PIL import Image

    from ..anatomy import ANAT, estimate_anatomy, grown_region
    from ..raster import resize_rgb
    from ..taxonomy import load_taxonomy

    label = load_taxonomy().target(disease, modality)
    region = grown_region(estimate_anatomy(resize_rgb(source_rgb, ANAT), label.modality), label.region, ANAT)
    height, width = source_rgb.shape[:2]
    mask = Image.fromarray(region.astype(np.uint8) * 255).resize((width, height), Image.NEAREST)
    return np.asarray(mask) > 127


def save_overlay(path: Path, source_rgb: np.ndarray, heat: np.ndarray, roi: np.ndarray | None = None) -> Path:
    """The heat map over the source in red (alpha = heat), the region of interest's outline in green; PNG."""
    from PIL import Image
    from scipy import ndimage

    base = source_rgb.astype(np.float32)
    alpha = 0.6 * heat[..., None]
    out = base * (1 - alpha) + np.array([255.0, 0.0, 0.0]) * alpha
    if roi is not None:
        out[roi & ~ndimage.binary_erosion(roi, iterations=2)] = (0, 255, 0)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.clip(out, 0, 255).astype(np.uint8)).save(path)
    return path
