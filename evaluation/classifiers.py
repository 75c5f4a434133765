"""Independent pathology classifiers for the counterfactual-validity probe (`medbanana eval --classifier SPEC`).

SPEC is either

* ``torchxrayvision:WEIGHTS`` — a chest X-ray model of the torchxrayvision package (e.g.
  ``densenet121-res224-all``, ``resnet50-res512-all``; the package downloads the weights on first use). Its
  pathology names are mapped to the taxonomy's CheXpert-style labels (`XRV_TO_TAXONOMY`); outputs with no
  counterpart (Infiltration, Emphysema, Fibrosis, Nodule, Mass, Hernia) are not used.
* a folder holding a transformers image-classification checkpoint (``config.json`` with ``id2label``, weights and
  preferably a ``preprocessor_config.json``), or a Hub id: any modality. Labels are matched to the taxonomy by
  name (``medbanana taxonomy``); unmatched labels are kept under their own name and never a target.

A classifier answers `predict(images)` with one probability per label and image: sigmoid outputs for
multi-label models (torchxrayvision, and checkpoints whose ``problem_type`` is multi-label), softmax otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from PIL import Image

from ..generation.extras import require
from ..generation.taxonomy import load_taxonomy

XRV_TO_TAXONOMY = {
    "Atelectasis": "Atelectasis", "Cardiomegaly": "Cardiomegaly", "Consolidation": "Consolidation",
    "Edema": "Edema", "Enlarged Cardiomediastinum": "Enlarged_Cardiomediastinum", "Fracture": "Fracture",
    "Lung Lesion": "Lung_Lesion", "Lung Opacity": "Lung_Opacity", "Effusion": "Pleural_Effusion",
    "Pleural_Thickening": "Pleural_Other", "Pneumonia": "Pneumonia", "Pneumothorax": "Pneumothorax",
}
BATCH = 16


def require_torch(extra: str):
    return require("torch", needed_for="the counterfactual probe", extra=extra)


@dataclass
class Classifier:
    """A model's outputs as named probabilities; `labels[i]` is a taxonomy folder name or the model's own."""
    name: str
    labels: list[str]
    modality: str | None  # the modality its labels belong to, when all matched labels share one
    predict_batch: object = field(repr=False)  # list of RGB uint8 arrays -> (n, len(labels)) probabilities

    def predict(self, images: list[np.ndarray]) -> np.ndarray:
        out = [self.predict_batch(images[i:i + BATCH]) for i in range(0, len(images), BATCH)]
        return np.concatenate(out) if out else np.zeros((0, len(self.labels)))

    def index(self, disease: str) -> int | None:
        return self.labels.index(disease) if disease in self.labels else None


def load_classifier(spec: str) -> Classifier:
    """The classifier a `--classifier` value names (see the module docstring); one-line errors for bad values."""
    if spec.startswith("torchxrayvision:"):
        weights = spec.split(":", 1)[1]
        if not weights:
            raise ValueError("--classifier torchxrayvision:WEIGHTS needs the weights' name, e.g. "
                             "torchxrayvision:densenet121-res224-all")
        xrv = require("torchxrayvision", needed_for="--classifier torchxrayvision:...", extra="probes-xray")
        if weights not in xrv.models.model_urls:
            raise ValueError(f"--classifier {spec}: unknown torchxrayvision weights; one of "
                             f"{', '.join(sorted(xrv.models.model_urls))}")
        try:
            kind = xrv.models.ResNet if weights.startswith("resnet") else xrv.models.DenseNet  # "all" = densenet
            model = kind(weights=weights)
        except Exception as exc:  # noqa: BLE001 — a failed download or a corrupt cache file: one line, not a trace
            raise RuntimeError(f"--classifier {spec}: could not load the weights "
                               f"({type(exc).__name__}: {exc})") from exc
        return xrv_classifier(model, name=spec)
    if Path(spec).exists() and not (Path(spec) / "config.json").is_file():
        raise ValueError(f"--classifier {spec}: no config.json there (expected a transformers image-classification "
                         "checkpoint folder, or torchxrayvision:WEIGHTS)")
    return transformers_classifier(spec)


def xrv_classifier(model, *, name: str = "torchxrayvision") -> Classifier:
    """Wrap a torchxrayvision model (`xrv.models.DenseNet(weights=...)`, or untrained with `weights=None`)."""
    torch = require_torch("probes-xray")
    import torchxrayvision as xrv

    names = list(getattr(model, "pathologies", None) or xrv.datasets.default_pathologies)
    columns = [i for i, n in enumerate(names) if n in XRV_TO_TAXONOMY]
    resolution = 512 if type(model).__name__ == "ResNet" else 224
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = model.to(device).eval()
    # trained weights carry operating-point thresholds and return calibrated probabilities (0.5 = the model's
    # threshold); an untrained model returns logits
    calibrated = getattr(model, "op_threshs", None) is not None or getattr(model, "apply_sigmoid", False)

    def predict(images: list[np.ndarray]) -> np.ndarray:
        batch = np.stack([xrv_input(image, resolution) for image in images])
        with torch.no_grad():
            out = model(torch.from_numpy(batch).to(device))
            out = out if calibrated else torch.sigmoid(out)
        return out.float().cpu().numpy()[:, columns]

    return Classifier(name, [XRV_TO_TAXONOMY[names[i]] for i in columns], "chest_xray", predict)


def xrv_input(image: np.ndarray, resolution: int) -> np.ndarray:
    """torchxrayvision's expected input: grey, centre-cropped square, `resolution`², scaled to [-1024, 1024]."""
    grey = image.mean(axis=2) if image.ndim == 3 else image.astype(np.float32)
    h, w = grey.shape
    side = min(h, w)
    top, left = (h - side) // 2, (w - side) // 2
    square = Image.fromarray(grey[top:top + side, left:left + side].astype(np.float32), mode="F")
    resized = np.asarray(square.resize((resolution, resolution), Image.Resampling.BILINEAR), np.float32)
    return ((2 * np.clip(resized, 0, 255) / 255.0 - 1.0) * 1024)[None]


def transformers_classifier(path_or_id: str) -> Classifier:
    """An `AutoModelForImageClassification` checkpoint with `id2label`; its image processor when saved with it."""
    torch = require_torch("train")
    from transformers import AutoConfig, AutoImageProcessor, AutoModelForImageClassification

    try:
        config = AutoConfig.from_pretrained(path_or_id)
    except OSError as exc:  # not a folder, and not a Hub id this machine can fetch
        raise RuntimeError(f"--classifier {path_or_id}: not a checkpoint folder or a reachable Hub id ({exc})") from exc
    id2label = {int(k): v for k, v in (getattr(config, "id2label", None) or {}).items()}
    if not id2label:
        raise ValueError(f"--classifier {path_or_id}: its config has no id2label mapping")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = AutoModelForImageClassification.from_pretrained(path_or_id).to(device).eval()
    try:
        processor = AutoImageProcessor.from_pretrained(path_or_id)
    except (OSError, ValueError):
        processor = None  # no preprocessor saved: resize to the model's size, scale to [-1, 1]
    size = getattr(config, "image_size", 224)
    multi_label = getattr(config, "problem_type", None) == "multi_label_classification"
    taxonomy = load_taxonomy()
    labels, modalities = [], set()
    for i in range(len(id2label)):
        found = taxonomy.find(id2label[i])
        found = found if found and found.edit_target else None  # "normal" and the like stay the model's own name
        labels.append(found.folder if found else id2label[i])
        if found:
            modalities.add(found.modality)

    def predict(images: list[np.ndarray]) -> np.ndarray:
        if processor is not None:
            pixels = processor(images=[Image.fromarray(im) for im in images], return_tensors="pt")["pixel_values"]
        else:
            resized = [np.asarray(Image.fromarray(im).resize((size, size)), np.float32) / 127.5 - 1 for im in images]
            pixels = torch.from_numpy(np.stack(resized).transpose(0, 3, 1, 2))
        with torch.no_grad():
            logits = model(pixel_values=pixels.to(device, model.dtype)).logits.float()
        probs = torch.sigmoid(logits) if multi_label else torch.softmax(logits, dim=-1)
        return probs.cpu().numpy()

    return Classifier(str(path_or_id), labels, modalities.pop() if len(modalities) == 1 else None, predict)
