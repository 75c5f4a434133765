"""What every dataset adapter of `medbanana prepare` shares: the records it returns and the checks it applies.

An adapter reads labels and layout only (no pixels) and returns `DatasetSource`s: the output dataset folder name,
its modality, one `Candidate` per usable file with its class folder (`normal` or a released disease folder name),
and `Problem`s for files or rows it had to skip. A missing label file or a label table without the columns it
needs is a `PrepareError` (fatal, raised before anything is written).
"""

from __future__ import annotations

import importlib.util
import re
from dataclasses import dataclass, field
from pathlib import Path

from ...files import not_regular
from ...rundir import layout
from ...taxonomy import Taxonomy
from ...failures import UsageError

# what `prepare` accepts as input (DICOM included); the generator's own sources are scan.SOURCE_SUFFIXES
PREPARE_INPUT_SUFFIXES = {".jpg", ".jpeg", ".png", ".bmp", ".tif", ".tiff", ".webp", ".dcm", ".dicom"}
NORMAL_NAMES = {"normal", "notumor", "no_tumor", "no tumor"}
MODALITY_SUFFIX = {"chest_xray": "chest", "brain_mri": "brain", "fundus": "fundus"}
SAFE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


class PrepareError(UsageError, RuntimeError):
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
    # source_id is the file's stem: a DICOM input is then named from its content instead (its file name may hold
    # the patient's name); False where the adapter's id comes from the dataset's de-identified table
    named_from_file: bool = True


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
    skipped: str = ""  # why the whole folder was skipped (a link out of the root); no candidates then


@dataclass
class AdapterOptions:
    name: str | None = None
    labels: Path | None = None  # MIMIC chexpert csv / ODIR spreadsheet
    metadata: Path | None = None  # MIMIC metadata csv
    images: Path | None = None  # ODIR image folder
    uncertain: str = "exclude"
    splits: tuple[str, ...] = ("Training", "Testing")
    modality: str | None = None
    skip_unknown: bool = False  # folders: a class folder no taxonomy name matches is skipped (reported), not fatal


def norm(text: str) -> str:
    """`text` lower-cased with everything but letters and digits removed: how column and folder names compare."""
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


def skipped_folder(root: Path, folder: Path, kind: str) -> DatasetSource | None:
    """A record of the dataset folder `folder` (an entry of `root`) skipped for leading outside `root`, or None
    when it may be read: the report lists it under its folder name."""
    if problem := link_problem(root, folder, f"ROOT ({root})"):
        reason = f"dataset folder skipped: {problem}"
        return DatasetSource(folder.name, "", kind, folder, problems=[Problem(folder.name, reason)], skipped=reason)
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


def read_table(path: Path):
    """A label table as strings (pandas DataFrame); xlsx needs openpyxl, an optional dependency."""
    import pandas as pd

    if path.suffix.lower() in {".xlsx", ".xlsm"}:
        if importlib.util.find_spec("openpyxl") is None:
            raise PrepareError(f"reading {path.name} needs openpyxl: pip install 'medbanana[xlsx]' "
                               "(or save the sheet as CSV and pass --labels FILE.csv)")
        return pd.read_excel(path, dtype=str).fillna("")
    return pd.read_csv(path, dtype=str, keep_default_na=False)


def table_columns(table, path: Path, required: dict[str, str], known: set[str], problems: list[Problem]) -> dict:
    """Map normalised required names to the table's columns; fatal when one is missing, a warning for extras."""
    by_norm = {norm(c): c for c in table.columns}
    missing = [name for key, name in required.items() if key not in by_norm]
    if missing:
        found = ", ".join(map(str, table.columns))
        raise PrepareError(f"{path}: missing column(s) {', '.join(missing)}; found {found}")
    extra = [str(c) for c in table.columns if norm(c) not in required and norm(c) not in known]
    if extra:
        problems.append(Problem(path.name, f"unexpected column(s) ignored: {', '.join(extra)}", "warning"))
    return {key: by_norm[key] for key in required}


def find_label_file(root: Path, given: Path | None, names: tuple[str, ...], what: str, option: str) -> Path:
    """`given` (the value of `option`) when it exists, else the first of `names` found in `root`; a PrepareError,
    naming `option`, otherwise."""
    if given is not None:
        if not Path(given).is_file():
            raise PrepareError(f"{what} {given} ({option}) does not exist")
        return Path(given)
    for name in names:
        if (root / name).is_file():
            if problem := link_problem(root, root / name):
                raise PrepareError(f"{what} {root / name}: {problem}; pass it with {option} {root / name} if you "
                                   "mean it")
            return root / name
    raise PrepareError(f"missing label file: no {' or '.join(names)} in {root} ({what}); pass its path with "
                       f"{option} FILE")


def _is_utf8(text: str) -> bool:
    """False for a file name with bytes that are no UTF-8 (Python keeps them as lone surrogates)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def add_folder_files(src: DatasetSource, folder: Path, label: str, extra: dict) -> None:
    """Every image file of a class folder as a candidate of class `label`; anything else as a problem."""
    for path in sorted(folder.iterdir()):
        rel = path.relative_to(src.root).as_posix()
        if path.name.startswith("."):
            continue  # .DS_Store and friends
        if not _is_utf8(rel):  # its bytes could not be written to the report or the manifest
            src.problems.append(Problem(ascii(rel)[1:-1], "file name is not UTF-8 text; rename it"))
        elif problem := link_problem(src.root, path):
            src.problems.append(Problem(rel, problem))
        elif path.is_dir():
            src.problems.append(Problem(rel, "subfolder inside a class folder ignored"))
        elif problem := not_regular(path):
            src.problems.append(Problem(rel, f"{problem}; skipped without opening it"))
        elif path.suffix.lower() not in PREPARE_INPUT_SUFFIXES:
            src.problems.append(Problem(rel, f"unsupported file type {path.suffix or '(none)'}"))
        else:
            src.candidates.append(Candidate(path, rel, label, path.stem, labels=(label,), extra=dict(extra)))
