"""The label taxonomy: three modalities, 23 labels, 20 edit targets. The data lives in taxonomy.json."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from functools import lru_cache
from importlib import resources
from .failures import UsageError

DIRECTIONS = ("add", "remove")
# File names of the original scripts call the add direction "edit".
DIRECTION_FOLDER = {"add": "edit", "remove": "remove"}


@dataclass(frozen=True)
class Label:
    name: str  # display name, e.g. "Pleural Effusion"
    modality: str  # chest_xray | brain_mri | fundus
    folder: str  # folder name used by the released data, e.g. "Pleural_Effusion"
    edit_target: bool
    region: str  # region key shared by the simulator editor and judge
    region_text: str  # where it appears, in words, for prompts
    signs: tuple[str, ...] = ()
    aliases: tuple[str, ...] = ()
    note: str = ""
    phrase: str = ""  # how a sentence names one, e.g. "a pleural effusion", "pulmonary edema" (taxonomy.json)

    def noun(self, direction: str) -> str:
        """The finding as the task sentence names it: "a pleural effusion" to add, "the pleural effusion" to
        remove (the display name, lower-cased unless an acronym, when taxonomy.json gives no phrase)."""
        phrase = self.phrase or (self.name if self.name.isupper() else self.name.lower())
        if direction == "add":
            return phrase
        article, _, rest = phrase.partition(" ")
        return f"the {rest if article in ('a', 'an') and rest else phrase}"


@dataclass(frozen=True)
class Modality:
    key: str
    display: str
    view: str
    normal_label: str
    folder_hints: tuple[str, ...]
    released_prefix: str
    labels: tuple[Label, ...] = field(default=())

    @property
    def targets(self) -> tuple[Label, ...]:
        return tuple(label for label in self.labels if label.edit_target)


def _norm(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "", text.lower())


class Taxonomy:
    """Lookups over taxonomy.json. Use `load_taxonomy()` for the shared instance."""

    def __init__(self, data: dict):
        self.version = data["version"]
        labels = [Label(**{**raw, "signs": tuple(raw.get("signs", ())), "aliases": tuple(raw.get("aliases", ()))})
                  for raw in data["labels"]]
        self.labels: tuple[Label, ...] = tuple(labels)
        self.modalities: dict[str, Modality] = {}
        for key, raw in data["modalities"].items():
            self.modalities[key] = Modality(
                key=key, display=raw["display"], view=raw["view"], normal_label=raw["normal_label"],
                folder_hints=tuple(raw["folder_hints"]), released_prefix=raw["released_prefix"],
                labels=tuple(label for label in labels if label.modality == key))
        # normalised folder name, display name or alias -> the labels it names, in taxonomy order
        self._by_name: dict[str, list[Label]] = {}
        for label in labels:
            for name in {_norm(label.folder), _norm(label.name), *(_norm(a) for a in label.aliases)}:
                self._by_name.setdefault(name, []).append(label)

    @property
    def targets(self) -> tuple[Label, ...]:
        return tuple(label for label in self.labels if label.edit_target)

    def find(self, name: str, modality: str | None = None) -> Label | None:
        """A label by folder name, display name or alias (case, spaces and underscores ignored)."""
        for label in self._by_name.get(_norm(name), ()):
            if not modality or label.modality == modality:
                return label
        return None

    def target(self, name: str, modality: str | None = None) -> Label:
        """An edit target by name; a clear ValueError for unknown names and non-targets."""
        label = self.find(name, modality)
        if label is None or not label.edit_target:
            scope = self.modalities[modality].targets if modality else self.targets
            known = ", ".join(t.folder for t in scope)
            what = "is not an edit target" if label else "is not a known disease"
            raise UsageError(f"{name!r} {what}{f' for {modality}' if modality else ''}; known targets: {known}")
        return label

    def is_normal_folder(self, name: str, modality: str) -> bool:
        label = self.find(name, modality)
        return _norm(name) == "normal" or (label is not None and not label.edit_target and label.signs == ())

    def task_sentence(self, disease: str, modality: str | None, direction: str, where: str | None = None) -> str:
        """The task in one sentence: "Add a pituitary tumor to this brain MRI.", "Remove the pleural effusion from
        this chest X-ray." `where` defaults to the modality's display name; a disease the taxonomy does not know is
        named by its folder name."""
        label = self.find(disease, modality)
        if where is None:
            where = self.modalities[modality].display if modality in self.modalities else "image"
        noun = label.noun(direction) if label else disease.replace("_", " ")
        if direction == "add":
            return f"Add {noun} to this {where}."
        return f"Remove {noun if label else f'the {noun}'} from this {where}."

    def infer_modality(self, folder_name: str) -> str | None:
        """Modality from a source dataset folder name (mimic/chest -> chest_xray, brain/tumor -> brain_mri, ...)."""
        low = folder_name.lower()
        for key, mod in self.modalities.items():
            if any(hint in low for hint in mod.folder_hints):
                return key
        return None

    def modality(self, key: str) -> Modality:
        try:
            return self.modalities[key]
        except KeyError:
            raise UsageError(f"unknown modality {key!r}; known: {', '.join(self.modalities)}") from None


@lru_cache(maxsize=1)
def load_taxonomy() -> Taxonomy:
    text = resources.files("medbanana.generation").joinpath("taxonomy.json").read_text(encoding="utf-8")
    return Taxonomy(json.loads(text))


def canonical_prompt(task) -> str:
    """The task in one sentence, e.g. "Add a pleural effusion to this chest X-ray.", from anything with its
    `disease`, `modality` and `direction` (a task record, an evaluation sample)."""
    return canonical_instruction(task.disease, task.modality, task.direction)


@lru_cache(maxsize=1024)
def canonical_instruction(disease: str, modality: str | None, direction: str) -> str:
    """`canonical_prompt` from the task's fields (a row's, for readers of a built dataset)."""
    return load_taxonomy().task_sentence(disease, modality, direction)
