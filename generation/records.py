"""Plain records passed between stages: tasks, instructions, edits, verdicts and attempts (how a task ended:
`outcomes.py`).

`Attempt.to_round_json()` and `rundir.store.conversation_record()` write the original scripts' JSON shapes
(see ARCHITECTURE.md, "Run directory"), plus our extra fields; nothing of the original is dropped.
"""

from __future__ import annotations

import hashlib
import io
import math
from dataclasses import asdict, dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
from .failures import UsageError


# Pillow's own warning threshold: the default of `prepare --max-pixels` and `generate --max-pixels`
DEFAULT_MAX_PIXELS = 89_478_485
DEFAULT_MAX_ROUNDS = 5  # rounds per task at most (the paper's), where neither the user nor the run says otherwise
DEFAULT_CONCURRENCY = 4  # a run's tasks in flight at once
# what `--geometry` does with an edit whose frame moved (generation/geometry.py); here, where the commands' parsers
# reach it without importing the estimator's PIL and scipy
GEOMETRY_MODES = ("reject", "register", "record")
DEFAULT_GEOMETRY = "register"
RUBRIC_WEIGHTS = {"has_disease": 0.40, "structure_reasonable": 0.25, "looks_realistic": 0.20,
                  "fidelity_preserved": 0.15}
# The one declaration of a verdict's judged fields, names, types and order (the dataset's verdict columns). The
# builder's msgspec struct and `datasets` features, the judge's answer schema and `Verdict` follow it (tests pin
# `Verdict`). Original judges wrote no fidelity_preserved nor score: those are ours.
VERDICT_COLUMNS: dict[str, type] = {
    "qualified": bool, "has_disease": bool, "structure_reasonable": bool, "looks_realistic": bool,
    "fidelity_preserved": bool,
    "score": float,  # weighted rubric score (40/25/20/15) in [0, 1]
    "reason": str,
}
VERDICT_FIELDS = tuple(VERDICT_COLUMNS)
VERDICT_BOOLEANS = (*RUBRIC_WEIGHTS, "qualified")  # the rubric's dimensions, then the overall decision

# What a yes or a no may be written as: judges have answered "yes"/"no", numbers as strings; humans label in CSVs.
TRUE_WORDS = frozenset({"true", "yes", "1", "pass", "passed", "y", "t"})
FALSE_WORDS = frozenset({"false", "no", "0", "fail", "failed", "n", "f"})


def task_uid(dataset: str, direction: str, source_id: str, disease: str) -> str:
    """A task's id, unique within a run: `{dataset}/{direction}/{source_id}-{disease}` (the key is unique per
    dataset and direction only)."""
    return f"{dataset}/{direction}/{source_id}-{disease}"


def as_bool(value) -> bool | None:
    """A boolean as a judge wrote it: None and booleans as they are, a word of TRUE_WORDS (any case, blanks
    stripped) true and any other word false, a number by its truth."""
    if value is None or value.__class__ is bool:
        return value
    if isinstance(value, str):
        return value.strip().lower() in TRUE_WORDS
    return bool(value)


def strict_bool(value) -> bool | None:
    """`as_bool`, where a word must be one of TRUE_WORDS or FALSE_WORDS (a person's label): ValueError otherwise."""
    if isinstance(value, str) and value.strip().lower() not in TRUE_WORDS | FALSE_WORDS:
        raise UsageError(f"{value!r} is not true/false, yes/no, 1/0 or pass/fail")
    return as_bool(value)


def json_bool(value) -> bool | None:
    """A JSON boolean, or the strings "true"/"false" (any case); None for anything else, which a reader that must
    not guess (a non-empty string such as "false" is truthy in Python) refuses."""
    if value is True or value is False:
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    return None


def as_score(value) -> float | None:
    """A rubric score as a float (ints too: pyarrow takes no int past int64 as float); None when it is not a
    number (a judge's words, "nan" or "inf", an integer too large for a float)."""
    if value is None or value.__class__ is float:
        return value
    try:
        number = float(value)
    except (TypeError, ValueError, OverflowError):
        return None
    return number if math.isfinite(number) else None


def verdict_values(verification) -> dict:
    """The VERDICT_COLUMNS of a round JSON's `verification`, booleans and score normalised; all None when it is
    None (never judged): the one reading of a verdict, for the journal and the builder. `verification` is an
    object with those attributes: the builder's msgspec struct, or `JsonFields(a dict as json decodes it)`."""
    if verification is None:
        return dict.fromkeys(VERDICT_FIELDS)
    v = verification
    score = v.score
    # written out rather than looped over VERDICT_COLUMNS (twice as fast): a build calls this for every row it
    # writes; tests pin the keys to VERDICT_COLUMNS
    return {"qualified": as_bool(v.qualified), "has_disease": as_bool(v.has_disease),
            "structure_reasonable": as_bool(v.structure_reasonable), "looks_realistic": as_bool(v.looks_realistic),
            "fidelity_preserved": as_bool(v.fidelity_preserved),
            "score": score if score is None or score.__class__ is float else as_score(score), "reason": v.reason}


class JsonFields:
    """A JSON object's keys as attributes, None where missing: a dict for `verdict_values`."""

    __slots__ = ("_raw",)

    def __init__(self, raw: dict):
        self._raw = raw

    def __getattr__(self, name: str):
        return self._raw.get(name)


@dataclass(frozen=True)
class Task:
    """One (source image, disease, direction) editing task. `key` is the original scripts' `{stem}-{Disease}`."""

    dataset: str  # source dataset folder name {D}
    modality: str  # chest_xray | brain_mri | fundus
    disease: str  # released folder name of the target, e.g. "Pleural_Effusion"
    direction: str  # add | remove
    source_path: Path
    source_root: Path | None = None  # the --sources folder, to record paths relative to it

    @property
    def source_id(self) -> str:
        return self.source_path.stem

    @property
    def key(self) -> str:
        return f"{self.source_id}-{self.disease}"

    @property
    def uid(self) -> str:
        return task_uid(self.dataset, self.direction, self.source_id, self.disease)

    @property
    def source_relpath(self) -> str:
        try:
            return self.source_path.relative_to(self.source_root).as_posix() if self.source_root else self.source_path.name
        except ValueError:
            return self.source_path.name


class SourceImage:
    """A source image: the bytes as they are on disk (sent as-is to APIs) and a lazily decoded RGB array."""

    def __init__(self, path: Path, data: bytes | None = None, max_pixels: int | None = None):
        self.path = Path(path)
        self.data = data if data is not None else self.path.read_bytes()
        self.max_pixels = max_pixels  # None: only Pillow's own guard

    @cached_property
    def mime_type(self) -> str:
        return "image/png" if self.data[:8] == b"\x89PNG\r\n\x1a\n" else "image/jpeg"

    @cached_property
    def array(self) -> np.ndarray:
        return decode_rgb(self.data, self.max_pixels)

    @cached_property
    def sha256(self) -> str:
        return hashlib.sha256(self.data).hexdigest()


def open_image(data: bytes, max_pixels: int | None = None):
    """The image opened lazily (Pillow reads only its header), refused with ValueError when its width x height is
    over `max_pixels`: a small file can claim a huge image, and decoding one costs its full size in memory."""
    from PIL import Image, UnidentifiedImageError

    try:
        image = Image.open(io.BytesIO(data))
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        # Pillow's own guard, from the header too (the warning is raised only when warnings are errors)
        limit = f" > {max_pixels} (--max-pixels)" if max_pixels else ""
        raise UsageError(f"over the pixel limit{limit}: {exc}") from None
    except UnidentifiedImageError:  # its message names the in-memory buffer, which tells the user nothing
        raise UsageError("not a readable image: not an image format Pillow knows") from None
    except (OSError, SyntaxError) as exc:
        raise UsageError(f"not a readable image: {exc}") from exc
    w, h = image.size
    if max_pixels is not None and w * h > max_pixels:
        image.close()
        raise UsageError(f"over the pixel limit: {w}x{h} = {w * h} pixels > {max_pixels} (--max-pixels); "
                         "not decoded")
    return image


def decode_rgb(data: bytes, max_pixels: int | None = None) -> np.ndarray:
    """Decode image bytes to an RGB uint8 array; raises ValueError with the reason for unreadable input, or for
    more pixels than `max_pixels` (checked on the header, before decoding)."""
    with open_image(data, max_pixels) as im:
        try:
            im.load()
            return rgb_array(im)
        except (OSError, SyntaxError) as exc:
            raise UsageError(f"not a readable image: {exc}") from exc


def rgb_array(image) -> np.ndarray:
    """uint8 RGB of a loaded PIL image; a 16- or 32-bit grey one min-max scaled to 0-255 (whatever its byte order),
    where PIL's own conversion would clip it."""
    if image.mode in ("I;16", "I;16B", "I;16L", "I"):
        values = np.asarray(image, dtype=np.float64)
        values = (values - values.min()) / max(values.max() - values.min(), 1) * 255
        return np.repeat(values.astype(np.uint8)[..., None], 3, axis=-1)
    return np.asarray(image.convert("RGB"))


def encode_jpeg(array: np.ndarray, quality: int = 95) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.asarray(array, dtype=np.uint8)).convert("RGB").save(buf, format="JPEG", quality=quality)
    return buf.getvalue()


@dataclass
class Usage:
    input_tokens: int = 0
    output_tokens: int = 0
    thinking_tokens: int = 0


@dataclass
class Instruction:
    text: str
    thinking_summary: str = ""
    model: str = ""
    usage: Usage = field(default_factory=Usage)


@dataclass
class EditedImage:
    data: bytes  # JPEG bytes, saved as they are
    mime_type: str = "image/jpeg"
    model: str = ""
    text: str = ""  # any text the editor returned alongside the image
    details: dict = field(default_factory=dict)  # backend facts worth keeping (realised parameters, ...)
    usage: Usage = field(default_factory=Usage)
    original: bytes | None = None  # the editor's bytes when `data` is its edit warped back onto the source's grid

    @cached_property
    def array(self) -> np.ndarray:
        return decode_rgb(self.data)


@dataclass
class Verdict:
    has_disease: bool
    structure_reasonable: bool
    looks_realistic: bool
    fidelity_preserved: bool
    qualified: bool
    reason: str
    score: float = 0.0  # weighted rubric score (40/25/20/15) in [0, 1]
    thinking_summary: str = ""
    model: str = ""
    details: dict = field(default_factory=dict)  # measurements behind the booleans
    usage: Usage = field(default_factory=Usage)
    unjudged: tuple[str, ...] = ()  # booleans this verdict does not speak to (written null): the geometry guard's

    def compliance(self, direction: str) -> bool:
        """Instruction compliance: the disease is present after `add`, absent after `remove`."""
        return self.has_disease if direction == "add" else not self.has_disease

    def to_json(self) -> dict:
        out = {"qualified": self.qualified, "has_disease": self.has_disease,
               "structure_reasonable": self.structure_reasonable, "looks_realistic": self.looks_realistic,
               "reason": self.reason, "thinking_summary": self.thinking_summary,
               "fidelity_preserved": self.fidelity_preserved, "score": round(float(self.score), 4),
               "model": self.model, "details": self.details}
        if self.unjudged:
            out.update({**dict.fromkeys(self.unjudged), "unjudged": list(self.unjudged)})
        return out

    @classmethod
    def from_json(cls, raw: dict) -> "Verdict":
        return cls.from_values(verdict_values(JsonFields(raw)), thinking_summary=raw.get("thinking_summary", ""),
                               model=raw.get("model", ""), details=raw.get("details", {}),
                               unjudged=tuple(raw.get("unjudged") or ()))

    @classmethod
    def from_values(cls, values: dict, **extra) -> "Verdict":
        """From `verdict_values`' output: a field the answer lacked (None) is not judged: False, 0.0 or ""."""
        return cls(**{name: _UNJUDGED[name] if value is None else value for name, value in values.items()}, **extra)


_UNJUDGED = {name: kind() for name, kind in VERDICT_COLUMNS.items()}  # False, 0.0, "": a field the JSON lacks


@dataclass
class EditScores:
    """MedEBench-style 0-10 scores of one edit, for evaluation (`medbanana eval`); not part of the rubric verdict."""

    editing_accuracy: float  # the instruction carried out, 0-10
    visual_quality: float  # realism and plausible structure, 0-10
    reason: str = ""
    model: str = ""
    details: dict = field(default_factory=dict)  # the prompt's tag, measurements behind the scores, ...
    usage: Usage = field(default_factory=Usage)


def rubric_score(has_disease_ok: bool, structure: bool, realistic: bool, fidelity: bool) -> float:
    """The paper's weighted rubric over pass/fail dimensions: 0.40, 0.25, 0.20, 0.15."""
    w = RUBRIC_WEIGHTS
    return (w["has_disease"] * has_disease_ok + w["structure_reasonable"] * structure
            + w["looks_realistic"] * realistic + w["fidelity_preserved"] * fidelity)


@dataclass
class Attempt:
    """One round: the instruction, the edit (or why there was none) and the verdict."""

    round: int
    instruction: Instruction
    verdict: Verdict | None = None
    accepted: bool = False
    edit_error: str = ""  # permanent editor failure (safety block, no image part, ...): no image this round
    image_relpath: str = ""  # relative to the run directory
    seconds: float = 0.0
    edit_details: dict = field(default_factory=dict)
    edit_usage: Usage = field(default_factory=Usage)  # the editor's tokens (also of a refused edit, when known)
    geometry: dict = field(default_factory=dict)  # the geometry guard's record (geometry.GeometryCheck.record)

    @property
    def frame_rejected(self) -> bool:
        """Rejected by the geometry guard before any judge saw it."""
        return self.geometry.get("action") == "rejected"

    def to_round_json(self) -> dict:
        out: dict[str, Any] = {"round": self.round,
               "generate_prompt": {"thinking_summary": self.instruction.thinking_summary,
                                   "prompt": self.instruction.text},
               "edit_result": {"success": not self.edit_error},
               "verification": self.verdict.to_json() if self.verdict else None,
               # our additions
               "instruction": self.instruction.text, "accepted": self.accepted, "image": self.image_relpath,
               "seconds": round(self.seconds, 3),
               "usage": {"writer": asdict(self.instruction.usage), "editor": asdict(self.edit_usage),
                         "judge": asdict(self.verdict.usage) if self.verdict else None}}
        if self.edit_error:
            out["edit_result"]["error"] = self.edit_error
        if self.edit_details:
            out["edit_result"]["details"] = self.edit_details
        if self.geometry:
            out["geometry"] = self.geometry
        return out


@dataclass
class TaskMasks:
    """One task's masks as Image values (`{"bytes", "path"}`): its region, and each attempt image's edit mask (by
    run-relative path; None where there is none). Computed by generation/masks.py, or read back from what a run
    stored by generation/rundir/stored_masks.py, which then imports no scipy."""

    region: dict | None = None
    edits: dict[str, dict | None] = field(default_factory=dict)
