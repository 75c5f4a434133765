"""Dataset adapters for `medbanana prepare`: each turns a downloaded dataset into labelled candidate files.

An adapter reads labels and layout only (no pixels) and returns `DatasetSource`s: the output dataset folder name,
its modality, one `Candidate` per usable file with its class folder (`normal` or a released disease folder name),
and `Problem`s for files or rows it had to skip. A missing label file or a label table without the columns it
needs is a `PrepareError` (fatal, raised before anything is written).

- MIMIC-CXR-JPG: files/pXX/pNNNNNNNN/sNNNNNNNN/<dicom_id>.jpg (.dcm accepted) + mimic-cxr-2.0.0-chexpert.csv(.gz)
  and mimic-cxr-2.0.0-metadata.csv(.gz). Frontal views only (ViewPosition PA or AP), one image per study (PA
  preferred, then the smallest dicom_id), named s<study_id> as in the released data. Normal: No Finding = 1 and
  no finding positive or uncertain. Single disease: exactly one of the 13 findings (12 CheXpert findings except No
  Finding and Support Devices, i.e. the 11 edit targets plus Pleural Other) is positive, and it is an edit target.
  Uncertain (-1) labels, `uncertain=`: "exclude" (default; a study with any uncertain finding is neither normal nor
  single-disease), "negative" (-1 read as 0), "positive" (-1 read as 1). Blank means not mentioned (negative).
  Support Devices are ignored.
- Brain Tumor MRI (Kaggle): {Training,Testing}/{glioma,meningioma,pituitary,notumor}/*.jpg (older *_tumor and
  no_tumor names too); notumor is the normal class; the file stem (Tr-gl_0010) is the source id.
- ODIR-5K: the annotation spreadsheet (xlsx or csv) with Left-Fundus, Right-Fundus and the left/right diagnostic
  keywords; one source per eye, labelled from that eye's keywords (the N..O flags are per patient and only
  cross-checked). An eye is used when its keywords name exactly one class: only "normal fundus" (normal) or one
  target (Diabetes, Glaucoma, Cataract, AMD, Hypertension, Myopia); image-quality remarks (lens dust, image offset,
  ...) are ignored; "suspected ..." counts as uncertain and excludes the eye; non-fundus images are skipped.
- folders: the original scripts' full-data/{D}/{normal,<Disease>}/ folders (images or DICOM), or one {D} folder.
"""

from __future__ import annotations

import importlib.util
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from ..rundir import layout
from ..taxonomy import Taxonomy, load_taxonomy

IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".bmp", ".tif", ".tiff", ".webp", ".dcm", ".dicom"}
NORMAL_NAMES = {"normal", "notumor", "no_tumor", "no tumor"}
MODALITY_SUFFIX = {"chest_xray": "chest", "brain_mri": "brain", "fundus": "fundus"}
SAFE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


class PrepareError(RuntimeError):
    """A fatal problem with the input as a whole (missing label file, unusable table, unknown layout)."""


@dataclass
class Candidate:
    path: Path  # the file, inside the dataset root
    relpath: str  # path relative to the dataset root, as recorded in the manifest
    label: str  # class folder: "normal" or a released disease folder name
    source_id: str  # wanted output file stem (prepare makes it safe and unique)
    view: str = ""  # PA/AP, left/right eye, ... when the dataset says
    labels: tuple[str, ...] = ()  # every finding on record for this image
    group: str = ""  # patient id when known, for patient-level splits
    extra: dict = field(default_factory=dict)


@dataclass
class Problem:
    path: str
    reason: str
    action: str = "skipped"  # skipped | warning


@dataclass
class DatasetSource:
    name: str  # output dataset folder name {D}; implies the modality
    modality: str
    kind: str
    root: Path
    candidates: list[Candidate] = field(default_factory=list)
    problems: list[Problem] = field(default_factory=list)
    counts: dict = field(default_factory=dict)  # selection statistics (excluded studies, ...)


@dataclass
class AdapterOptions:
    name: str | None = None
    labels: Path | None = None  # MIMIC chexpert csv / ODIR spreadsheet
    metadata: Path | None = None  # MIMIC metadata csv
    images: Path | None = None  # ODIR image folder
    uncertain: str = "exclude"
    splits: tuple[str, ...] = ("Training", "Testing")
    modality: str | None = None


def _norm(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "", str(text).lower())


def link_problem(root: Path, path: Path, where: str = "the dataset root") -> str | None:
    """Why the file `path` found under `root` must not be read, or None: layout.inside's containment rule, with a
    looping or dangling symlink told apart from one leading outside (each needs another fix)."""
    if path.is_symlink():
        try:
            path.resolve(strict=True)
        except FileNotFoundError:
            return "dangling symlink (target missing)"
        except (RuntimeError, OSError):  # a loop: RuntimeError in Python 3.11, OSError (ELOOP) later
            return "symlink loop"
    try:
        layout.inside(root, path.relative_to(root))
    except ValueError:  # layout.UnsafePath, or `path` not under `root` at all
        return f"{'link points' if path.is_symlink() or '..' not in path.parts else 'path leads'} outside {where}"
    return None


def dataset_name(name: str, modality: str, tax: Taxonomy) -> str:
    """`name`, suffixed when needed so that the generator infers `modality` from it."""
    if not SAFE_NAME.fullmatch(name):
        raise PrepareError(f"dataset name {name!r}: use letters, digits, '.', '_' and '-' only")
    for candidate in (name, f"{name}_{MODALITY_SUFFIX[modality]}"):
        if tax.infer_modality(candidate) == modality:
            return candidate
    hints = ", ".join(tax.modality(modality).folder_hints)
    raise PrepareError(f"dataset name {name!r} does not tell the generator it is {modality}; use --name with "
                       f"one of: {hints}")


def _read_table(path: Path):
    """A label table as strings (pandas DataFrame); xlsx needs openpyxl, an optional dependency."""
    import pandas as pd

    if path.suffix.lower() in {".xlsx", ".xlsm"}:
        if importlib.util.find_spec("openpyxl") is None:
            raise PrepareError(f"reading {path.name} needs openpyxl: pip install 'medbanana[xlsx]' "
                               "(or save the sheet as CSV and pass --labels FILE.csv)")
        return pd.read_excel(path, dtype=str).fillna("")
    return pd.read_csv(path, dtype=str, keep_default_na=False)


def _columns(table, path: Path, required: dict[str, str], known: set[str], problems: list[Problem]) -> dict:
    """Map normalised required names to the table's columns; fatal when one is missing, a warning for extras."""
    by_norm = {_norm(c): c for c in table.columns}
    missing = [name for key, name in required.items() if key not in by_norm]
    if missing:
        found = ", ".join(map(str, table.columns))
        raise PrepareError(f"{path}: missing column(s) {', '.join(missing)}; found {found}")
    extra = [str(c) for c in table.columns if _norm(c) not in required and _norm(c) not in known]
    if extra:
        problems.append(Problem(path.name, f"unexpected column(s) ignored: {', '.join(extra)}", "warning"))
    return {key: by_norm[key] for key in required}


def _find_label_file(root: Path, given: Path | None, names: tuple[str, ...], what: str) -> Path:
    if given is not None:
        if not Path(given).is_file():
            raise PrepareError(f"{what} {given} does not exist")
        return Path(given)
    for name in names:
        if (root / name).is_file():
            return root / name
    raise PrepareError(f"missing label file: no {' or '.join(names)} in {root} ({what}); pass its path")


# --- MIMIC-CXR-JPG ----------------------------------------------------------------------------------------------
MIMIC_FINDINGS = ("Atelectasis", "Cardiomegaly", "Consolidation", "Edema", "Enlarged Cardiomediastinum", "Fracture",
                  "Lung Lesion", "Lung Opacity", "Pleural Effusion", "Pleural Other", "Pneumonia", "Pneumothorax")
UNCERTAIN_POLICIES = ("exclude", "negative", "positive")


def mimic_cxr(root: Path, opts: AdapterOptions, tax: Taxonomy) -> list[DatasetSource]:
    if opts.uncertain not in UNCERTAIN_POLICIES:
        raise PrepareError(f"uncertain-label policy {opts.uncertain!r}; use one of {', '.join(UNCERTAIN_POLICIES)}")
    chexpert_path = _find_label_file(root, opts.labels, ("mimic-cxr-2.0.0-chexpert.csv.gz",
                                                         "mimic-cxr-2.0.0-chexpert.csv"), "CheXpert label file")
    meta_path = _find_label_file(root, opts.metadata, ("mimic-cxr-2.0.0-metadata.csv.gz",
                                                       "mimic-cxr-2.0.0-metadata.csv"), "metadata file")
    src = DatasetSource(dataset_name(opts.name or "MIMIC_CXR_single_disease", "chest_xray", tax), "chest_xray",
                        "mimic-cxr", root)
    labels = _read_table(chexpert_path)
    finding_cols = {_norm(f): f for f in (*MIMIC_FINDINGS, "No Finding")}
    cols = _columns(labels, chexpert_path, {"subjectid": "subject_id", "studyid": "study_id", **finding_cols},
                    {"supportdevices"}, src.problems)
    meta = _read_table(meta_path)
    mcols = _columns(meta, meta_path, {"dicomid": "dicom_id", "subjectid": "subject_id", "studyid": "study_id",
                                       "viewposition": "ViewPosition"}, set(map(_norm, meta.columns)), src.problems)
    frontal: dict[str, list[tuple[int, str, str]]] = {}  # study -> [(preference, dicom_id, view)]
    for dicom, study, view in zip(meta[mcols["dicomid"]], meta[mcols["studyid"]], meta[mcols["viewposition"]]):
        view = str(view).strip().upper()
        if view in ("PA", "AP") and SAFE_NAME.fullmatch(str(dicom)):  # ids become path parts: no separators
            frontal.setdefault(_int_text(study), []).append((view != "PA", str(dicom), view))
    counts = Counter()
    uncertain_value = {"exclude": "?", "negative": 0, "positive": 1}[opts.uncertain]
    for row in labels.itertuples(index=False):
        row = dict(zip(labels.columns, row))
        subject, study = _int_text(row[cols["subjectid"]]), _int_text(row[cols["studyid"]])
        values = {f: _chexpert_value(row[cols[_norm(f)]], uncertain_value, study) for f in MIMIC_FINDINGS}
        positives = [f for f, v in values.items() if v == 1]
        if "?" in values.values():
            counts["excluded_uncertain"] += 1
            continue
        if not positives and _chexpert_value(row[cols["nofinding"]], uncertain_value, study) == 1:
            label = "normal"
        elif len(positives) == 1 and tax.find(positives[0], "chest_xray").edit_target:
            label = tax.find(positives[0], "chest_xray").folder
        else:
            counts["excluded_multiple_or_other" if positives else "excluded_no_label"] += 1
            continue
        if study not in frontal or not (subject.isdigit() and study.isdigit()):
            counts["excluded_no_frontal_view" if subject.isdigit() else "excluded_bad_subject_id"] += 1
            continue
        folder = root / "files" / f"p{subject[:2]}" / f"p{subject}" / f"s{study}"
        found = None
        for _, dicom, view in sorted(frontal[study]):
            found = next(((p, view) for p in (folder / f"{dicom}.jpg", folder / f"{dicom}.dcm")
                          if p.is_file() or p.is_symlink()), None)  # a broken link is reported, not "missing"
            if found:
                break
        if found is not None and (problem := link_problem(root, found[0])):
            src.problems.append(Problem(found[0].relative_to(root).as_posix(), problem))
            continue
        if found is None:
            counts["missing_on_disk"] += 1
            if counts["missing_on_disk"] <= 20:
                src.problems.append(Problem(folder.relative_to(root).as_posix(),
                                            "study selected by its labels but no frontal image of it is on disk"))
            continue
        path, view = found
        src.candidates.append(Candidate(path, path.relative_to(root).as_posix(), label, f"s{study}", view,
                                        tuple(positives) or ("No Finding",), f"p{subject}",
                                        {"subject_id": subject, "study_id": study, "dicom_id": path.stem}))
    src.counts = dict(counts, uncertain_policy=opts.uncertain)
    return [src]


def _int_text(value) -> str:
    text = str(value).strip()
    return text[:-2] if text.endswith(".0") else text


def _chexpert_value(raw, uncertain_value, study: str):
    text = str(raw).strip()
    if text in ("", "nan", "NaN", "0", "0.0"):
        return 0
    if text in ("1", "1.0"):
        return 1
    if text in ("-1", "-1.0"):
        return uncertain_value
    raise PrepareError(f"CheXpert labels of study {study}: value {text!r} is not 1, 0, -1 or blank")


# --- Brain Tumor MRI (Kaggle) -----------------------------------------------------------------------------------
def brain_tumor_mri(root: Path, opts: AdapterOptions, tax: Taxonomy) -> list[DatasetSource]:
    src = DatasetSource(dataset_name(opts.name or "Brain_Tumor_MRI", "brain_mri", tax), "brain_mri",
                        "brain-tumor-mri", root)
    wanted = {_norm(s) for s in opts.splits}
    splits = [d for d in sorted(root.iterdir()) if d.is_dir() and _norm(d.name) in wanted]
    if not splits and any(_brain_label(d.name, tax) for d in root.iterdir() if d.is_dir()):
        splits = [root]  # only one split downloaded: class folders directly under the root
    if not splits:
        raise PrepareError(f"{root} is not the Kaggle Brain Tumor MRI layout: expected "
                           f"{'|'.join(opts.splits)}/{{glioma,meningioma,pituitary,notumor}}/*.jpg")
    for split in splits:
        for sub in sorted(d for d in split.iterdir() if d.is_dir()):
            label = _brain_label(sub.name, tax)
            if label is None:
                src.problems.append(Problem(sub.relative_to(root).as_posix(), "not a brain tumor class folder"))
                continue
            _add_folder_files(src, sub, label, {"split": split.name} if split != root else {})
    return [src]


def _brain_label(name: str, tax: Taxonomy) -> str | None:
    key = re.sub(r"_?tumou?r$", "", name.strip().lower()) if _norm(name) not in {"notumor", "notumour"} else "notumor"
    label = tax.find(key, "brain_mri")
    if label is None:
        return None
    return label.folder if label.edit_target else "normal"


def _add_folder_files(src: DatasetSource, folder: Path, label: str, extra: dict) -> None:
    for path in sorted(folder.iterdir()):
        rel = path.relative_to(src.root).as_posix()
        if path.name.startswith("."):
            continue  # .DS_Store and friends
        if problem := link_problem(src.root, path):
            src.problems.append(Problem(rel, problem))
        elif path.is_dir():
            src.problems.append(Problem(rel, "subfolder inside a class folder ignored"))
        elif path.suffix.lower() not in IMAGE_SUFFIXES:
            src.problems.append(Problem(rel, f"unsupported file type {path.suffix or '(none)'}"))
        else:
            src.candidates.append(Candidate(path, rel, label, path.stem, labels=(label,), extra=dict(extra)))


# --- the original scripts' full-data folders ---------------------------------------------------------------------
def folders(root: Path, opts: AdapterOptions, tax: Taxonomy) -> list[DatasetSource]:
    def class_of(name: str, modality: str | None) -> str | None:
        if name.strip().lower() in NORMAL_NAMES:
            return "normal"
        label = tax.find(name, modality)
        return label.folder if label and label.edit_target else None

    def is_dataset(folder: Path) -> bool:
        return any(d.is_dir() and (d.name.lower() in NORMAL_NAMES or tax.find(d.name)) for d in folder.iterdir())

    datasets = [root] if is_dataset(root) else [d for d in sorted(root.iterdir()) if d.is_dir() and is_dataset(d)]
    if not datasets:
        raise PrepareError(f"no dataset folders in {root}: expected {root}/<D>/normal/*.jpeg and "
                           f"{root}/<D>/<Disease>/*.jpeg (or {root}/normal/... for one dataset)")
    if opts.name and len(datasets) > 1:
        raise PrepareError(f"--name applies to one dataset folder; {root} holds {len(datasets)}")
    out = []
    for folder in datasets:
        modality = opts.modality or tax.infer_modality(folder.name) or _modality_from_classes(folder, tax)
        src = DatasetSource(dataset_name(opts.name or folder.name, modality, tax), modality, "folders", folder)
        for sub in sorted(folder.iterdir()):
            if not sub.is_dir():  # a looping or dangling class folder link is reported, other files ignored
                if sub.is_symlink() and (problem := link_problem(folder, sub)):
                    src.problems.append(Problem(sub.name, problem))
                continue
            label = class_of(sub.name, modality)
            if label is None:
                found = tax.find(sub.name, modality)
                why = "is a label but not an edit target" if found else f"is not a {modality} class folder"
                src.problems.append(Problem(sub.name, f"folder {sub.name!r} {why}; skipped"))
                continue
            _add_folder_files(src, sub, label, {})
        out.append(src)
    return out


def _modality_from_classes(folder: Path, tax: Taxonomy) -> str:
    mods = {lab.modality for d in folder.iterdir() if d.is_dir() and (lab := tax.find(d.name)) and lab.edit_target}
    if len(mods) != 1:
        raise PrepareError(f"cannot tell the modality of {folder.name!r}; pass --modality "
                           f"({', '.join(tax.modalities)})")
    return mods.pop()


# --- ODIR-5K ----------------------------------------------------------------------------------------------------
ODIR_CLASSES = (  # keyword pattern -> class; first match wins
    (r"normal fundus", "normal"), (r"suspected", "?"), (r"diabetic retinopathy|proliferative retinopathy", "Diabetes"),
    (r"glaucoma", "Glaucoma"), (r"cataract", "Cataract"), (r"macular degeneration", "AMD"),
    (r"hypertensive retinopathy", "Hypertension"), (r"myopi", "Myopia"))
ODIR_QUALITY = ("lens dust", "low image quality", "image offset", "optic disk photographically invisible",
                "optic disc photographically invisible")
ODIR_NOT_FUNDUS = ("no fundus image", "anterior segment image")
ODIR_FLAGS = {"Diabetes": "d", "Glaucoma": "g", "Cataract": "c", "AMD": "a", "Hypertension": "h", "Myopia": "m"}


def odir(root: Path, opts: AdapterOptions, tax: Taxonomy) -> list[DatasetSource]:
    sheet = _find_label_file(root, opts.labels, (), "ODIR spreadsheet") if opts.labels else _odir_sheet(root)
    src = DatasetSource(dataset_name(opts.name or "ODIR_fundus_single_disease", "fundus", tax), "fundus", "odir",
                        root)
    table = _read_table(Path(sheet))
    cols = _columns(table, Path(sheet), {"leftfundus": "Left-Fundus", "rightfundus": "Right-Fundus",
                                         "leftdiagnostickeywords": "Left-Diagnostic Keywords",
                                         "rightdiagnostickeywords": "Right-Diagnostic Keywords"},
                    {"id", "patientage", "patientsex", *"ndgcahmo", "filepath", "labels", "target", "filename"},
                    src.problems)
    flags = {_norm(c): c for c in table.columns if _norm(c) in set("ndgcahmo")}
    image_root = Path(opts.images) if opts.images else _odir_image_folder(root)
    index = _image_index(image_root)
    counts, seen = Counter(), set()
    id_column = next((c for c in table.columns if _norm(c) == "id"), None)
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
    return found[0]


def _odir_image_folder(root: Path) -> Path:
    """The "Training Images" folder when there is one (the Kaggle copy also holds preprocessed duplicates)."""
    for depth in ("*", "*/*", "*/*/*"):
        hits = [p for p in sorted(root.glob(depth)) if p.is_dir() and _norm(p.name) == "trainingimages"]
        if hits:
            return hits[0]
    return root


def _image_index(folder: Path) -> dict[str, list[Path]]:
    index: dict[str, list[Path]] = {}
    for path in sorted(folder.rglob("*")):
        if path.suffix.lower() in IMAGE_SUFFIXES and (path.is_file() or path.is_symlink()):  # broken: reported
            index.setdefault(path.name, []).append(path)
    return index


ADAPTERS = {"mimic-cxr": mimic_cxr, "brain-tumor-mri": brain_tumor_mri, "odir": odir, "folders": folders}


def load_dataset_sources(kind: str, root: Path, opts: AdapterOptions | None = None) -> list[DatasetSource]:
    """Run the adapter `kind` over `root`; fatal input problems raise PrepareError."""
    root = Path(root)
    if not root.is_dir():
        raise PrepareError(f"dataset root {root} does not exist or is not a folder")
    if kind not in ADAPTERS:
        raise PrepareError(f"unknown dataset kind {kind!r}; known: {', '.join(ADAPTERS)}")
    return ADAPTERS[kind](root, opts or AdapterOptions(), load_taxonomy())
