"""Dataset adapters for `medbanana prepare`: each turns a downloaded dataset into labelled candidate files.

    base.py        the records adapters return (`DatasetSource`, `Candidate`, `Problem`), `PrepareError`, and the
                   checks they share (containment of links, dataset names, label tables)
    mimic_cxr.py   MIMIC-CXR-JPG, labelled from its CheXpert table
    odir.py        ODIR-5K, one source per eye, labelled from the spreadsheet's keywords
    folders.py     Brain Tumor MRI (Kaggle) and the original scripts' full-data folders: class = folder name

`load_dataset_sources(kind, root, opts)` runs the adapter registered under `kind` in ADAPTERS.
"""

from __future__ import annotations

from pathlib import Path

from ...taxonomy import load_taxonomy
from .base import (PREPARE_INPUT_SUFFIXES, AdapterOptions, Candidate, DatasetSource, PrepareError, Problem,
                   dataset_name, link_problem)
from .folders import brain_tumor_mri, folders
from .mimic_cxr import UNCERTAIN_POLICIES, mimic_cxr
from .odir import odir

__all__ = ["ADAPTERS", "PREPARE_INPUT_SUFFIXES", "UNCERTAIN_POLICIES", "AdapterOptions", "Candidate",
           "DatasetSource", "PrepareError", "Problem", "dataset_name", "link_problem", "load_dataset_sources"]

ADAPTERS = {"mimic-cxr": mimic_cxr, "brain-tumor-mri": brain_tumor_mri, "odir": odir, "folders": folders}


def load_dataset_sources(kind: str, root: Path, opts: AdapterOptions | None = None) -> list[DatasetSource]:
    """Run the adapter `kind` over `root`; fatal input problems raise PrepareError."""
    root = Path(root)
    if not root.is_dir():
        raise PrepareError(f"dataset root {root} does not exist or is not a folder")
    if kind not in ADAPTERS:
        raise PrepareError(f"unknown dataset kind {kind!r}; known: {', '.join(ADAPTERS)}")
    return ADAPTERS[kind](root, opts or AdapterOptions(), load_taxonomy())
