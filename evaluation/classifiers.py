"""Independent pathology classifiers for the counterfactual-validity probe (`medbanana eval --classifier SPEC`).

SPEC is either

* ``torchxrayvision:WEIGHTS`` — a chest X-ray model of the torchxrayvision package (e.g.
  ``densenet121-res224-all``, ``resnet50-res512-all``). The weights file is the one torchxrayvision keeps in its
  cache folder (`xrv_weights_path`: ``~/.torchxrayvision/models_data/`` and the release file's name), or the file
  given as `weights_file` (``--classifier-weights``). A missing file is fetched with a short timeout, never under
  ``HF_HUB_OFFLINE=1``; when that fails the error is one line naming the file expected and its URL. Its pathology
  names are mapped to the taxonomy's CheXpert-style labels (`XRV_TO_TAXONOMY`); outputs with no counterpart
  (Infiltration, Emphysema, Fibrosis, Nodule, Mass, Hernia) are not used.
* a folder holding a transformers image-classification checkpoint (``config.json`` with ``id2label``, weights and
  preferably a ``preprocessor_config.json``), or a Hub id (from the local cache only under ``HF_HUB_OFFLINE=1``):
  any modality. Labels are matched to the taxonomy by name (``medbanana taxonomy``); unmatched labels are kept
  under their own name and never a target.

A classifier answers `predict(images)` with one probability per label and image: sigmoid outputs for
multi-label models (torchxrayvision, and checkpoints whose ``problem_type`` is multi-label), softmax otherwise.
"""

from __future__ import annotations

import os
import tempfile
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from PIL import Image

from ..generation.backends.diffusers_editor import hub_offline
from ..generation.extras import require
from ..generation.taxonomy import load_taxonomy
from ..generation.failures import NotFound, UsageError

XRV_TO_TAXONOMY = {
    "Atelectasis": "Atelectasis", "Cardiomegaly": "Cardiomegaly", "Consolidation": "Consolidation",
    "Edema": "Edema", "Enlarged Cardiomediastinum": "Enlarged_Cardiomediastinum", "Fracture": "Fracture",
    "Lung Lesion": "Lung_Lesion", "Lung Opacity": "Lung_Opacity", "Effusion": "Pleural_Effusion",
    "Pleural_Thickening": "Pleural_Other", "Pneumonia": "Pneumonia", "Pneumothorax": "Pneumothorax",
}
BATCH = 16
DOWNLOAD_TIMEOUT = 10  # seconds without an answer before a weights download gives up


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


def load_classifier(spec: str, weights_file: Path | None = None) -> Classifier:
    """The classifier a `--classifier` value names (see the module docstring); one-line errors for bad values.
    `weights_file` (``--classifier-weights``) replaces the cached torchxrayvision weights."""
    if spec.startswith("torchxrayvision:"):
        return _torchxrayvision(spec, spec.split(":", 1)[1], weights_file)
    if weights_file is not None:
        raise UsageError("--classifier-weights applies to --classifier torchxrayvision:WEIGHTS (a checkpoint folder "
                         "holds its own weights)")
    if Path(spec).exists() and not (Path(spec) / "config.json").is_file():
        raise UsageError(f"--classifier {spec}: no config.json there (expected a transformers image-classification "
                         "checkpoint folder, or torchxrayvision:WEIGHTS)")
    return transformers_classifier(spec)


def xrv_weights_path(weights: str) -> tuple[Path, str]:
    """(the file torchxrayvision loads for `weights`, the URL it comes from): its cache folder and the release
    file's own name, as the package's `get_weights` names them."""
    import torchxrayvision as xrv

    url = xrv.models.model_urls[weights]["weights_url"]
    return Path(xrv.utils.get_cache_dir()).expanduser() / url.rsplit("/", 1)[-1], url


def _torchxrayvision(spec: str, weights: str, weights_file: Path | None) -> Classifier:
    if not weights:
        raise UsageError("--classifier torchxrayvision:WEIGHTS needs the weights' name, e.g. "
                         "torchxrayvision:densenet121-res224-all")
    xrv = require("torchxrayvision", needed_for="--classifier torchxrayvision:...", extra="probes-xray")
    if weights not in xrv.models.model_urls:
        raise UsageError(f"--classifier {spec}: unknown torchxrayvision weights; one of "
                         f"{', '.join(sorted(xrv.models.model_urls))}")
    expected, url = xrv_weights_path(weights)
    kind = xrv.models.ResNet if weights.startswith("resnet") else xrv.models.DenseNet  # "all" = densenet
    with tempfile.TemporaryDirectory(prefix="medbanana-xrv-") as scratch:
        if weights_file is not None:  # torchxrayvision reads CACHE_DIR/<release name>: a link of that name to it
            if not Path(weights_file).is_file():
                raise NotFound(f"--classifier-weights {weights_file}: no such file")
            expected = Path(scratch) / expected.name
            expected.symlink_to(Path(weights_file).resolve())
        elif not expected.is_file():
            _fetch(url, expected, spec)
        try:
            model = kind(weights=weights, cache_dir=str(expected.parent))
        except Exception as exc:  # noqa: BLE001 — a corrupt or foreign file: one line, not a trace
            raise UsageError(f"--classifier {spec}: could not load the weights file "
                               f"{weights_file or expected} ({type(exc).__name__}: {exc})") from exc
    return xrv_classifier(model, name=spec)


def _fetch(url: str, target: Path, spec: str) -> None:
    """Download `url` to `target` (through a temp file: a broken download leaves nothing), or one line naming
    the file expected: offline (HF_HUB_OFFLINE=1) no connection is tried at all."""
    hint = (f"--classifier {spec}: weights file {target} not found; on a machine with internet access download "
            f"{url} and copy it there, or pass it with --classifier-weights FILE")
    if hub_offline():
        raise NotFound(hint + " (HF_HUB_OFFLINE is set: nothing downloaded)")
    partial = target.with_name(target.name + ".part")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with urllib.request.urlopen(url, timeout=DOWNLOAD_TIMEOUT) as answer, partial.open("wb") as fh:
            while chunk := answer.read(1 << 20):
                fh.write(chunk)
        os.replace(partial, target)
    except OSError as exc:  # no network, a refused or timed-out connection, a read-only cache folder
        partial.unlink(missing_ok=True)
        raise NotFound(f"{hint} (download failed: {type(exc).__name__}: {exc})") from None


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

    offline = hub_offline() or Path(path_or_id).is_dir()  # offline: the local cache only, no connection tried
    try:
        config = AutoConfig.from_pretrained(path_or_id, local_files_only=offline)
    except (OSError, ValueError) as exc:  # not a folder, and not a Hub id this machine has or can fetch
        where = ("HF_HUB_OFFLINE is set: only the local Hugging Face cache was searched" if hub_offline() else
                 "it could not be downloaded either")
        first_line = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
        raise UsageError(f"--classifier {path_or_id}: not a checkpoint folder or a Hub id present locally ({where}; "
                           f"fetch it on a connected machine with `hf download {path_or_id}`): {first_line}") from None
    id2label = {int(k): v for k, v in (getattr(config, "id2label", None) or {}).items()}
    if not id2label:
        raise UsageError(f"--classifier {path_or_id}: its config has no id2label mapping")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = AutoModelForImageClassification.from_pretrained(path_or_id, local_files_only=offline).to(device).eval()
    try:
        processor = AutoImageProcessor.from_pretrained(path_or_id, local_files_only=offline)
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
