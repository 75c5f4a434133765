"""The ODIR-5K adapter of `medbanana prepare`: fundus photographs labelled from the annotation spreadsheet.

The spreadsheet (xlsx or csv) has Left-Fundus, Right-Fundus and the left/right diagnostic keywords; one source per
eye, labelled from that eye's keywords (the N..O flags are per patient and only cross-checked). An eye is used when
its keywords name exactly one class: only "normal fundus" (normal) or one target (Diabetes, Glaucoma, Cataract, AMD,
Hypertension, Myopia); image-quality remarks (lens dust, image offset, ...) are ignored; "suspected ..." counts as
uncertain and excludes the eye; non-fundus images are skipped.
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

from ...taxonomy import Taxonomy
from .base import (PREPARE_INPUT_SUFFIXES, AdapterOptions, Candidate, DatasetSource, PrepareError, Problem,
                   dataset_name, find_label_file, link_problem, norm, read_table, table_columns)

ODIR_CLASSES = (  # keyword pattern -> class; first match wins
    (r"normal fundus", "normal"), (r"suspected", "?"), (r"diabetic retinopathy|proliferative retinopathy", "Diabetes"),
    (r"glaucoma", "Glaucoma"), (r"cataract", "Cataract"), (r"macular degeneration", "AMD"),
    (r"hypertensive retinopathy", "Hypertension"), (r"myopi", "Myopia"))
ODIR_QUALITY = ("lens dust", "low image quality", "image offset", "optic disk photographically invisible",
                "optic disc photographically invisible")
ODIR_NOT_FUNDUS = ("no fundus image", "anterior segment image")
ODIR_FLAGS = {"Diabetes": "d", "Glaucoma": "g", "Cataract": "c", "AMD": "a", "Hypertension": "h", "Myopia": "m"}


def odir(root: Path, opts: AdapterOptions, tax: Taxonomy) -> list[DatasetSource]:
    sheet = find_label_file(root, opts.labels, (), "ODIR spreadsheet", "--labels") if opts.labels else _odir_sheet(root)
    src = DatasetSource(dataset_name(opts.name or "ODIR_fundus_single_disease", "fundus", tax), "fundus", "odir",
                        root)
    table = read_table(Path(sheet))
    cols = table_columns(table, Path(sheet), {"leftfundus": "Left-Fundus", "rightfundus": "Right-Fundus",
                                              "leftdiagnostickeywords": "Left-Diagnostic Keywords",
                                              "rightdiagnostickeywords": "Right-Diagnostic Keywords"},
                         {"id", "patientage", "patientsex", *"ndgcahmo", "filepath", "labels", "target", "filename"},
                         src.problems)
    flags = {norm(c): c for c in table.columns if norm(c) in set("ndgcahmo")}
    image_root = Path(opts.images) if opts.images else _odir_image_folder(root)
    if not opts.images and (problem := link_problem(root, image_root)):  # found, not named: it must stay inside
        src.skipped = f"image folder {image_root.relative_to(root).as_posix()} skipped: {problem}"
        src.problems.append(Problem(image_root.relative_to(root).as_posix(), src.skipped))
        return [src]
    index = _image_index(image_root)
    counts, seen = Counter(), set()
    id_column = next((c for c in table.columns if norm(c) == "id"), None)
    for row in table.to_dict("records"):
        patient = str(row[id_column]).strip() if id_column is not None else ""
        for eye in ("left", "right"):
            name, keywords = str(row[cols[f"{eye}fundus"]]).strip(), str(row[cols[f"{eye}diagnostickeywords"]])
            if not name or name in seen:
                continue  # the Kaggle full_df.csv repeats each patient once per eye
            seen.add(name)
            if "/" in name or "\\" in name or ".." in name:
                src.problems.append(Problem(name, "file name in the spreadsheet is a path (unsafe); skipped"))
                continue
            words = [w.strip().lower() for w in re.split(r"[,\uff0c;]", keywords) if w.strip()]
            if any(w in ODIR_NOT_FUNDUS for w in words):
                src.problems.append(Problem(name, f"not a fundus photograph ({keywords.strip()})"))
                continue
            classes = {next((c for pattern, c in ODIR_CLASSES if re.search(pattern, w)), "other")
                       for w in words if w not in ODIR_QUALITY}
            if len(classes) != 1 or classes & {"other", "?"}:
                counts["excluded_multiple_other_or_uncertain" if classes else "excluded_no_keywords"] += 1
                continue
            label = classes.pop()
            flag = flags.get(ODIR_FLAGS.get(label, ""))
            if flag and str(row[flag]).strip() in ("0", "0.0"):
                src.problems.append(Problem(name, f"keywords say {label} but the patient's "
                                                  f"{ODIR_FLAGS[label].upper()} flag is 0; skipped"))
                continue
            paths = index.get(name, [])
            if len(paths) != 1:
                src.problems.append(Problem(name, "listed in the spreadsheet but not found under the image folder"
                                            if not paths else f"{len(paths)} files have this name; pass --images"))
                continue
            path = paths[0]
            if problem := link_problem(image_root, path, "the image folder"):
                src.problems.append(Problem(name, problem))
                continue
            src.candidates.append(Candidate(path, path.relative_to(root).as_posix() if not link_problem(root, path)
                                            else path.name, label, Path(name).stem, eye, tuple(words), patient))
    src.counts = dict(counts)
    return [src]


def _odir_sheet(root: Path) -> Path:
    found = sorted(p for p in root.iterdir() if p.is_file() and p.suffix.lower() in {".xlsx", ".xlsm", ".csv"})
    if len(found) > 1:
        found = [p for p in found if re.search(r"odir|annotation|full_df", p.name, re.I)] or found
    if len(found) != 1:
        what = "no" if not found else f"{len(found)} candidate"
        raise PrepareError(f"missing label file: {what} ODIR annotation spreadsheet(s) (.xlsx/.csv) in {root}; "
                           "pass --labels FILE")
    if problem := link_problem(root, found[0]):
        raise PrepareError(f"ODIR spreadsheet {found[0]}: {problem}; pass --labels FILE if you mean it")
    return found[0]


def _odir_image_folder(root: Path) -> Path:
    """The "Training Images" folder when there is one (the Kaggle copy also holds preprocessed duplicates)."""
    for depth in ("*", "*/*", "*/*/*"):
        hits = [p for p in sorted(root.glob(depth)) if p.is_dir() and norm(p.name) == "trainingimages"]
        if hits:
            return hits[0]
    return root


def _image_index(folder: Path) -> dict[str, list[Path]]:
    index: dict[str, list[Path]] = {}
    for path in sorted(folder.rglob("*")):
        if path.suffix.lower() in PREPARE_INPUT_SUFFIXES and (path.is_file() or path.is_symlink()):  # broken: reported
            index.setdefault(path.name, []).append(path)
    return index
