"""Optional pretrained features for the separability probe (`eval --separability --probe-features SPEC`).

SPEC is ``timm:NAME`` (a timm model; ``pretrained=True`` downloads its weights at run time, e.g.
``timm:resnet18.a1_in1k``), ``timm:FOLDER`` (a folder written by timm's ``save_for_hf`` / ``push_to_hub``:
``config.json`` naming the architecture plus ``model.safetensors`` or ``pytorch_model.bin``), or
``open_clip:MODEL/PRETRAINED`` (open_clip's image tower, e.g. ``open_clip:ViT-B-32/laion2b_s34b_b79k``). The pooled
embedding of each image, raw (as stored, RGB) and controlled (the same re-encoding as the weight-free features),
goes into the same grouped logistic-regression probe.
"""

from __future__ import annotations

import io
import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from PIL import Image

from ..generation.extras import require
from .inputs import ImageRef, image_bytes
from .probe_features import FeatureSettings, controlled_image
from ..generation.failures import UsageError

BATCH = 32
EMBEDDING_VERSION = 1  # part of the probe cache's key (with the spec): raise it when the images' preparation changes


@dataclass
class Embedder:
    name: str
    embed_batch: object = field(repr=False)  # list of PIL RGB images -> (n, d) array
    weights: str = ""  # sha256 of a local weights file: new weights in the same folder are a new feature set

    @property
    def cache_name(self) -> str:
        """What the probe cache's key names: the spec, and the local weights' digest when there are some."""
        return f"{self.name}@{self.weights}" if self.weights else self.name

    def embed(self, refs: list[ImageRef], settings: FeatureSettings) -> list[tuple[np.ndarray, np.ndarray] | str]:
        """(raw, controlled) embeddings per image, or the error's text for an unreadable one."""
        out: list[tuple[np.ndarray, np.ndarray] | str] = []
        for start in range(0, len(refs), BATCH):
            raw, controlled, slots = [], [], []
            for ref in refs[start:start + BATCH]:
                try:
                    data = image_bytes(ref)
                    with Image.open(io.BytesIO(data)) as im:
                        raw.append(im.convert("RGB"))
                    controlled.append(controlled_image(data, settings).convert("RGB"))
                    slots.append(len(out))
                    out.append("")
                except Exception as exc:  # noqa: BLE001 — left out and counted, like the weight-free features
                    out.append(f"{type(exc).__name__}: {exc}")
            if slots:
                for slot, r, c in zip(slots, self.embed_batch(raw), self.embed_batch(controlled)):
                    out[slot] = (r, c)
        return out


def load_embedder(spec: str) -> Embedder:
    kind, _, name = spec.partition(":")
    if not name or kind not in ("timm", "open_clip"):
        raise UsageError(f"--probe-features {spec!r}: use timm:NAME, timm:FOLDER or open_clip:MODEL/PRETRAINED")
    torch = require("torch", needed_for="--probe-features", extra="probes-pretrained")
    if kind == "timm":
        return _timm_embedder(name, torch)
    return _open_clip_embedder(name, torch)


def _timm_embedder(name: str, torch) -> Embedder:
    timm = require("timm", needed_for="--probe-features timm:...", extra="probes-pretrained")
    folder = Path(name)
    if folder.is_dir():
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
        weights = next((folder / f for f in ("model.safetensors", "pytorch_model.bin") if (folder / f).is_file()),
                       None)
        if weights is None:
            raise UsageError(f"--probe-features timm:{folder}: no model.safetensors or pytorch_model.bin there")
        model = timm.create_model(config["architecture"], pretrained=True,
                                  pretrained_cfg_overlay={**config.get("pretrained_cfg", {}), "file": str(weights)},
                                  **{**config.get("model_args", {}), "num_classes": 0})
    else:
        model = timm.create_model(name, pretrained=True, num_classes=0)
    transform = timm.data.create_transform(**timm.data.resolve_data_config({}, model=model))
    return _torch_embedder(f"timm:{name}", model, transform, torch, weights=weights if folder.is_dir() else None)


def _open_clip_embedder(name: str, torch) -> Embedder:
    open_clip = require("open_clip", needed_for="--probe-features open_clip:...", extra="probes-pretrained")
    architecture, _, pretrained = name.partition("/")
    model, _, transform = open_clip.create_model_and_transforms(architecture, pretrained=pretrained or None)
    local = Path(pretrained).is_file() if pretrained else False  # a checkpoint file rather than a tag
    return _torch_embedder(f"open_clip:{name}", model, transform, torch, method="encode_image",
                           weights=Path(pretrained) if local else None)


def _torch_embedder(name: str, model, transform, torch, method: str = "__call__",
                    weights: Path | None = None) -> Embedder:
    """`weights`: a local weights file, whose digest the probe cache's keys name."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = model.to(device).eval()
    forward = getattr(model, method)

    def embed(images: list[Image.Image]) -> np.ndarray:
        with torch.no_grad():
            batch = torch.stack([transform(im) for im in images]).to(device)
            return forward(batch).float().reshape(len(images), -1).cpu().numpy()

    if weights is None:
        return Embedder(name, embed)
    from ..generation.dataset.manifest import sha256_file

    return Embedder(name, embed, sha256_file(weights))
