"""The folder-layout adapters of `medbanana prepare`: datasets whose class is the name of the image's folder.

- Brain Tumor MRI (Kaggle): {Training,Testing}/{glioma,meningioma,pituitary,notumor}/*.jpg (older *_tumor and
  no_tumor names too); notumor is the normal class; the file stem (Tr-gl_0010) is the source id.
- folders: the original scripts' full-data/{D}/{normal,<Disease>}/ folders (images or DICOM), or one {D} folder.
"""

from __future__ import annotations

import difflib
import re
from pathlib import Path

from ...taxonomy import Taxonomy
from .base import (NORMAL_NAMES, AdapterOptions, DatasetSource, PrepareError, Problem, add_folder_files,
                   dataset_name, link_problem, norm, skipped_folder)


# --- Brain Tumor MRI (Kaggle) -----------------------------------------------------------------------------------
def brain_tumor_mri(root: Path, opts: AdapterOptions, tax: Taxonomy) -> list[DatasetSource]:
    src = DatasetSource(dataset_name(opts.name or "Brain_Tumor_MRI", "brain_mri", tax), "brain_mri",
                        "brain-tumor-mri", root)
    wanted = {norm(s) for s in opts.splits}
    splits = []
    for d in sorted(root.iterdir()):
        if d.is_dir() and norm(d.name) in wanted:
            if problem := link_problem(root, d):  # a split folder linked out of the root: none of it is read
                src.problems.append(Problem(d.name, f"folder skipped: {problem}"))
            else:
                splits.append(d)
    if not splits and any(_brain_label(d.name, tax) for d in root.iterdir() if d.is_dir()):
        splits = [root]  # only one split downloaded: class folders directly under the root
    if not splits and not src.problems:
        raise PrepareError(f"{root} is not the Kaggle Brain Tumor MRI layout: expected "
                           f"{'|'.join(opts.splits)}/{{glioma,meningioma,pituitary,notumor}}/*.jpg")
    for split in splits:
        for sub in sorted(d for d in split.iterdir() if d.is_dir()):
            label = _brain_label(sub.name, tax)
            if problem := link_problem(root, sub):
                src.problems.append(Problem(sub.relative_to(root).as_posix(), f"folder skipped: {problem}"))
                continue
            if label is None:
                src.problems.append(Problem(sub.relative_to(root).as_posix(), "not a brain tumor class folder"))
                continue
            add_folder_files(src, sub, label, {"split": split.name} if split != root else {})
    return [src]


def _brain_label(name: str, tax: Taxonomy) -> str | None:
    key = re.sub(r"_?tumou?r$", "", name.strip().lower()) if norm(name) not in {"notumor", "notumour"} else "notumor"
    label = tax.find(key, "brain_mri")
    if label is None:
        return None
    return label.folder if label.edit_target else "normal"


# --- the original scripts' full-data folders ---------------------------------------------------------------------
def folders(root: Path, opts: AdapterOptions, tax: Taxonomy) -> list[DatasetSource]:
    def class_of(name: str, modality: str | None) -> str | None:
        if name.strip().lower() in NORMAL_NAMES:
            return "normal"
        label = tax.find(name, modality)
        return label.folder if label and label.edit_target else None

    def is_dataset(folder: Path) -> bool:
        return any(d.is_dir() and (d.name.lower() in NORMAL_NAMES or tax.find(d.name)) for d in folder.iterdir())

    out, datasets = [], []  # out starts with the dataset folders linked out of ROOT: listed, never looked into
    if is_dataset(root):
        datasets = [root]
    else:
        for d in sorted(root.iterdir()):
            if d.is_symlink() and d.is_dir() and (skipped := skipped_folder(root, d, "folders")):
                out.append(skipped)
            elif d.is_dir() and is_dataset(d):
                datasets.append(d)
    if not datasets and not out:
        raise PrepareError(f"no dataset folders in {root}: expected {root}/<D>/normal/*.jpeg and "
                           f"{root}/<D>/<Disease>/*.jpeg (or {root}/normal/... for one dataset)")
    if opts.name and len(datasets) > 1:
        raise PrepareError(f"--name applies to one dataset folder; {root} holds {len(datasets)}")
    unknown: list[str] = []  # "D/Folder (did you mean ...?)" for each class folder no taxonomy name matches
    for folder in datasets:
        modality = opts.modality or tax.infer_modality(folder.name) or _modality_from_classes(folder, tax)
        src = DatasetSource(dataset_name(opts.name or folder.name, modality, tax), modality, "folders", folder)
        for sub in sorted(folder.iterdir()):
            if problem := link_problem(folder, sub):  # a class folder linked out of it, looping or dangling
                src.problems.append(Problem(sub.name, problem if not sub.is_dir() else f"folder skipped: {problem}"))
                continue
            if not sub.is_dir():  # other files beside the class folders are ignored
                continue
            label = class_of(sub.name, modality)
            if label is None:
                found = tax.find(sub.name, modality)
                guess = "" if found else closest_class(sub.name, modality, tax)
                why = ("is a label but not an edit target" if found else
                       f"is not a {modality} class folder{f' (did you mean {guess}?)' if guess else ''}")
                src.problems.append(Problem(sub.name, f"folder {sub.name!r} {why}; skipped"))
                if not found:
                    unknown.append(f"{folder.name}/{sub.name}{f' (did you mean {guess}?)' if guess else ''}")
                continue
            add_folder_files(src, sub, label, {})
        out.append(src)
    if unknown and not opts.skip_unknown:  # a misspelt disease folder must not vanish from the sources unnoticed
        raise PrepareError(f"{'folder' if len(unknown) == 1 else f'{len(unknown)} folders'} not in the taxonomy: "
                           f"{'; '.join(unknown)}. Rename {'it' if len(unknown) == 1 else 'them'} to a class name "
                           "(`medbanana taxonomy` lists them), or pass --skip-unknown to leave "
                           f"{'it' if len(unknown) == 1 else 'them'} out")
    return out


def closest_class(name: str, modality: str, tax: Taxonomy) -> str:
    """The class folder name of `modality` (normal or an edit target) closest in spelling to `name`, '' when none
    is close (difflib, case and separators ignored)."""
    names = ["normal", *(label.folder for label in tax.modality(modality).targets)]
    by_norm = {norm(n): n for n in names}
    match = difflib.get_close_matches(norm(name), list(by_norm), n=1, cutoff=0.6)
    return by_norm[match[0]] if match else ""


def _modality_from_classes(folder: Path, tax: Taxonomy) -> str:
    mods = {lab.modality for d in folder.iterdir() if d.is_dir() and (lab := tax.find(d.name)) and lab.edit_target}
    if len(mods) != 1:
        raise PrepareError(f"cannot tell the modality of {folder.name!r}; pass --modality "
                           f"({', '.join(tax.modalities)})")
    return mods.pop()
