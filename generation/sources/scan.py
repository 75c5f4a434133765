"""Find source images in the original scripts' input layout and turn them into tasks.

    SOURCES/{D}/normal/*.jp(e)g       sources for `add`, crossed with every target disease of D's modality
    SOURCES/{D}/{Disease}/*.jp(e)g    sources for `remove` of that disease

SOURCES may be a folder of dataset folders or one dataset folder. The modality comes from the dataset folder's name
(mimic/chest -> chest_xray, brain/tumor -> brain_mri, odir/fundus -> fundus), from `modality=`, or from its disease
folder names when those belong to one modality only.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

from ..records import Task
from ..taxonomy import DIRECTIONS, Taxonomy, load_taxonomy
from ..failures import UsageError

SOURCE_SUFFIXES = {".jpg", ".jpeg", ".png"}  # what the generator reads as sources (prepare writes .jpeg)
log = logging.getLogger(__name__)


class SourceLayoutError(UsageError):
    """The sources folder cannot be used as given (the message says why and what to do)."""


@dataclass
class Selection:
    """Which part of the taxonomy a run covers; empty means everything."""

    modalities: set[str] = field(default_factory=set)
    diseases: set[str] = field(default_factory=set)  # released folder names, after validation
    directions: tuple[str, ...] = DIRECTIONS

    @classmethod
    def parse(cls, modalities=(), diseases=(), directions=(), taxonomy: Taxonomy | None = None) -> "Selection":
        tax = taxonomy or load_taxonomy()
        mods = set()
        for m in modalities:
            tax.modality(m)  # raises with the known names
            mods.add(m)
        dis = {tax.target(d).folder for d in diseases}
        dirs = tuple(directions) or DIRECTIONS
        for d in dirs:
            if d not in DIRECTIONS:
                raise UsageError(f"unknown direction {d!r}; use add or remove")
        return cls(mods, dis, dirs)

    def wants(self, modality: str, disease: str, direction: str) -> bool:
        return ((not self.modalities or modality in self.modalities)
                and (not self.diseases or disease in self.diseases) and direction in self.directions)


def _images(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.is_file() and p.suffix.lower() in SOURCE_SUFFIXES)


def _looks_like_dataset(folder: Path, tax: Taxonomy) -> bool:
    return any(sub.is_dir() and (sub.name.lower() in {"normal", "notumor", "no_tumor"} or tax.find(sub.name))
               for sub in folder.iterdir())


def dataset_folders(root: Path) -> list[Path]:
    root = Path(root)
    if not root.is_dir():
        raise SourceLayoutError(f"sources folder {root} does not exist or is not a folder")
    tax = load_taxonomy()
    if _looks_like_dataset(root, tax):
        return [root]
    found = [sub for sub in sorted(root.iterdir()) if sub.is_dir() and _looks_like_dataset(sub, tax)]
    if not found:
        raise SourceLayoutError(
            f"no dataset folders in {root}: expected {root}/<dataset>/normal/*.jpeg and "
            f"{root}/<dataset>/<Disease>/*.jpeg (or {root}/normal/... for a single dataset)")
    return found


def _modality_of(folder: Path, given: str | None, tax: Taxonomy) -> str:
    if given:
        return tax.modality(given).key
    inferred = tax.infer_modality(folder.name)
    if inferred:
        return inferred
    mods = {lab.modality for sub in folder.iterdir() if sub.is_dir() and (lab := tax.find(sub.name)) and lab.edit_target}
    if len(mods) == 1:
        return mods.pop()
    raise SourceLayoutError(f"cannot tell the modality of {folder.name!r} from its name or disease folders; "
                            f"pass --modality ({', '.join(tax.modalities)})")


def scan_sources(root: Path, selection: Selection | None = None, modality: str | None = None) -> list[Task]:
    """All tasks under `root` that `selection` wants, in a stable order (dataset, direction, source, disease)."""
    tax = load_taxonomy()
    selection = selection or Selection()
    root = Path(root)
    tasks: list[Task] = []
    for folder in dataset_folders(root):
        mod = _modality_of(folder, modality, tax)
        targets = tax.modality(mod).targets
        for sub in sorted(p for p in folder.iterdir() if p.is_dir()):
            label = tax.find(sub.name, mod)
            if label is not None and not label.edit_target and label.signs:
                log.warning("skipping %s: %s is a label but not an edit target (%s)", sub, label.name, label.note)
            elif sub.name.lower() in {"normal", "notumor", "no_tumor"} or (label and not label.edit_target):
                for image in _images(sub):
                    tasks += [Task(folder.name, mod, t.folder, "add", image, root) for t in targets
                              if selection.wants(mod, t.folder, "add")]
            elif label is not None:
                if selection.wants(mod, label.folder, "remove"):
                    tasks += [Task(folder.name, mod, label.folder, "remove", image, root) for image in _images(sub)]
            else:
                known = ", ".join(["normal"] + [t.folder for t in targets])
                raise SourceLayoutError(f"{sub}: {sub.name!r} is not a {mod} disease folder; known: {known}")
    tasks.sort(key=lambda t: (t.dataset, t.direction, t.source_id, t.disease))
    seen: set[str] = set()
    for task in tasks:
        if task.uid in seen:
            raise SourceLayoutError(f"two sources give the same task {task.uid} (same file stem with different "
                                    f"extensions in {task.source_path.parent}); rename one")
        seen.add(task.uid)
    return tasks
