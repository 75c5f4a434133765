"""The instruction vocabulary <-> numeric edit parameters, shared by the writer (words out) and the editor (words in).

Each dimension is an ordered scale of levels; a level has the phrase the writer uses, the patterns the editor
recognises (also in instructions written by someone else) and the number it stands for:

    intensity  add: how strong the finding is (x the target's nominal contrast);
               remove: how completely it is cleared (fraction replaced by healthy tissue)
    size       x the target's nominal extent (remove: how far around the lesion the clearing reaches)
    softness   Gaussian width of the lesion margin, in pixels of the 512² working grid
    grain      fraction of the image's own grain kept / re-synthesised inside the edit
    tone       0: ordinary "keep exposure" rule; 1: emphatic "identical global brightness" rule

`side` ("right" | "left" | "") is the patient's side; `inward` asks for placement well inside the region.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Level:
    key: str
    add_phrase: str
    remove_phrase: str
    value: float
    pattern: str


INTENSITY = (
    Level("faint", "faint, just perceptible", "fade it partially", 0.35,
          r"\bfaint\b|just perceptible|\bfade it partially\b"),
    Level("subtle", "subtle but definite", "reduce it substantially", 0.55,
          r"\bsubtle\b|reduce it substantially"),
    Level("moderate", "moderate, clearly visible", "remove it", 0.8,
          r"\bmoderate\b|clearly visible|\bremove it\b(?! completely)"),
    Level("marked", "marked, conspicuous", "remove it completely", 1.1,
          r"\bmarked\b|conspicuous|remove it completely"),
    Level("dense", "dense, high-contrast", "erase every trace of it", 1.5,
          r"\bdense\b|high-contrast|every trace"),
)
SIZE = (
    Level("small", "small", "a tight area", 0.75, r"\bsmall\b|\btight area\b"),
    Level("medium", "medium-sized", "a medium-sized area", 1.0, r"medium-sized|\bmedium\b"),
    Level("large", "large", "a generous area", 1.3, r"(?<!very )\blarge\b|generous area"),
    Level("extensive", "extensive", "the whole affected zone", 1.6,
          r"\bextensive\b|very large|whole affected zone"),
)
SOFTNESS = (
    Level("sharp", "sharply demarcated margins", "a sharply demarcated border", 0.6,
          r"sharply demarcated|crisp (?:margin|edge|border)"),
    Level("defined", "well-defined but not cut-out margins", "a well-defined border", 1.3,
          r"well-defined but not cut-out|well-defined (?:margin|edge|border)"),
    Level("soft", "soft, feathered margins", "a soft, feathered border", 3.2,
          r"soft, feathered|feathered (?:margin|edge|border)|soft (?:margin|edge|border)"),
    Level("diffuse", "diffuse margins that fade gradually into the surrounding tissue",
          "a broad, gradual transition into the surrounding tissue", 6.0,
          r"diffuse margins|fade gradually|gradual transition"),
)
GRAIN = (
    Level("natural", "with a natural texture", "with a natural texture", 0.55, r"natural texture"),
    Level("matched", "matching the surrounding grain and noise", "matching the surrounding grain and noise", 0.8,
          r"match\w* the surrounding grain"),
    Level("exact", "reproducing the image's own film grain and noise pixel for pixel, with no smoothing",
          "reproducing the image's own film grain and noise pixel for pixel, with no smoothing", 0.96,
          r"pixel for pixel|no smoothing"),
)
SCALES = {"intensity": INTENSITY, "size": SIZE, "softness": SOFTNESS, "grain": GRAIN}
TONE_PATTERN = r"identical global brightness"
INWARD_PATTERN = r"well inside"
SIDE_PATTERN = r"\b(right|left)\b"


@dataclass(frozen=True)
class EditParams:
    intensity: int = 1
    size: int = 1
    softness: int = 2
    grain: int = 1
    tone: int = 0
    side: str = ""
    inward: bool = False

    def value(self, dimension: str) -> float:
        return SCALES[dimension][getattr(self, dimension)].value

    def phrase(self, dimension: str, direction: str) -> str:
        level = SCALES[dimension][getattr(self, dimension)]
        return level.add_phrase if direction == "add" else level.remove_phrase

    def step(self, dimension: str, by: int) -> "EditParams":
        """One level up or down, clamped to the scale."""
        top = len(SCALES[dimension]) - 1
        return replace(self, **{dimension: min(top, max(0, getattr(self, dimension) + by))})

    def at_limit(self, dimension: str, by: int) -> bool:
        return self.step(dimension, by) == self

    def as_dict(self) -> dict:
        out = {dim: SCALES[dim][getattr(self, dim)].key for dim in SCALES}
        out.update(tone=self.tone, side=self.side, inward=self.inward)
        return out


def _level(text: str, scale: tuple[Level, ...], default: int) -> int:
    """The level whose pattern occurs first in the text (ties: the stronger level)."""
    best = None
    for index, level in enumerate(scale):
        match = re.search(level.pattern, text, flags=re.IGNORECASE)
        if match and (best is None or match.start() < best[0] or (match.start() == best[0] and index > best[1])):
            best = (match.start(), index)
    return default if best is None else best[1]


def parse(text: str, default: EditParams | None = None) -> EditParams:
    """Edit parameters stated in an instruction; dimensions it does not mention keep `default`'s values."""
    default = default or EditParams()
    side = re.search(SIDE_PATTERN, text, flags=re.IGNORECASE)
    return EditParams(intensity=_level(text, INTENSITY, default.intensity),
                      size=_level(text, SIZE, default.size),
                      softness=_level(text, SOFTNESS, default.softness),
                      grain=_level(text, GRAIN, default.grain),
                      tone=1 if re.search(TONE_PATTERN, text, flags=re.IGNORECASE) else default.tone,
                      side=side.group(1).lower() if side else default.side,
                      inward=bool(re.search(INWARD_PATTERN, text, flags=re.IGNORECASE)) or default.inward)
