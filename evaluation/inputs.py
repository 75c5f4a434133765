"""What `medbanana eval` and `medbanana judge-agreement` read: edits to score, from three kinds of input.

1. An evaluation folder (any editing model's outputs): ``DIR/samples.jsonl`` (or ``samples.csv``, or the file
   itself), one sample per line with paths relative to the file's folder::

       {"id": "cxr-001", "source": "inputs/cxr-001.png", "edited": "model-x/cxr-001.png",
        "instruction": "Add a small left pleural effusion.", "modality": "chest_xray",
        "disease": "Pleural_Effusion", "direction": "add",
        "mask": "masks/cxr-001.png", "ground_truth": "reference/cxr-001.png"}

   Required: id, source, edited, instruction, disease, direction (add | remove). Optional: modality (else from the
   disease), mask (ROI: white = region of interest, grey levels allowed), ground_truth (a reference edit),
   dataset, accepted (true | false: the separability probe reports rejected edits apart). Diseases may be folder
   or display names (``medbanana taxonomy``).
2. A folder written by ``medbanana build`` and one of its configs holding source and edited images (sft,
   failed, judge); source images come from the rows, or from ``source_images`` when the build left them out.
3. A run directory (or one ``{D}-edit`` folder of it), ours or the original scripts' layout (read by
   ``generation.rundir.runs``): the accepted edits, or every attempt that produced an image; sources from ``source_images``.
   The sources folder a run records (``sources_root`` in medbanana-run.json) is a path written on the machine that
   made the run: it is named in the message, never followed (`sources_notice`).

Images a run's data names (attempt images, sources looked up by task, model outputs by uid) are read only from inside
the folder the user named (``generation.rundir.confined``); one that leads outside is that sample's error, never read.
With ``edits`` (dataset and run inputs), the edit scored is a model's output ``EDITS/<uid>.png|.jpg|.jpeg`` and
the dataset's or run's edit becomes the ground truth. Sample ids of dataset and run inputs are ``<uid>#<round>``
(the bare uid where the round is unknown).
"""

from __future__ import annotations

import csv
import json
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..generation.dataset.folder import shard_files
from ..generation.dataset.inputs import MANIFEST_NAMES, input_kind
from ..generation.rundir.runs import discover_units, read_tasks
from ..generation.rundir.confined import Refused, inside
from ..generation.rundir.source_index import SourceIndex
from ..generation.records import VERDICT_FIELDS, decode_rgb, verdict_values
from ..generation.rundir import schema
from ..generation.rundir.layout import IMAGE_SUFFIXES
from ..generation.taxonomy import DIRECTIONS, canonical_prompt, load_taxonomy
from ..generation.failures import NotFound, UsageError

REQUIRED = ("id", "source", "edited", "instruction", "disease", "direction")
SCORABLE_CONFIGS = ("sft", "failed", "judge")  # configs whose rows hold a source and an edited image
_SHARD_COLUMNS = ("uid", "dataset", "modality", "disease", "task")  # what a row must have to be a sample

ImageRef = bytes | Path  # bytes as stored in a dataset row, or a file


class LeadsOutside(str):
    """The problem of a data-named path leading outside the folder the user named (refused, never read), as the
    readers below produce it; a `Sample` given one sets its `outside` flag and keeps the text as a plain str."""


@dataclass
class Sample:
    id: str
    dataset: str
    modality: str | None
    disease: str
    direction: str
    instruction: str
    source: ImageRef | None
    edited: ImageRef | None
    mask: ImageRef | None = None  # an ROI the input gives (an evaluation folder's `mask`)
    ground_truth: ImageRef | None = None
    edit_mask: ImageRef | None = None  # a dataset row's `edit_mask`; computed when absent (evaluate.roi_mask)
    region_mask: ImageRef | None = None  # a dataset row's `region_mask`
    task_edit: bool = False  # from a dataset or run: its edit (or the ground truth) defines the task's edit mask
    recorded_verdict: dict | None = None  # the run's or dataset's verdict (VERDICT_FIELDS), when it has one
    problem: str | None = None  # why the sample cannot be scored (a missing image), recorded as its error
    accepted: bool | None = None  # whether the run accepted this edit, where the input says (None: not said)
    outside: bool = False  # the problem is a path leading outside the folder named: refused, never read

    def __post_init__(self):  # a LeadsOutside problem sets `outside`; the problem is kept as plain text
        if isinstance(self.problem, LeadsOutside):
            self.problem, self.outside = str(self.problem), True


def sample_id(uid: str, round_no: int | None) -> str:
    """`<uid>#<round>`; the bare uid where the round is not known (image-only releases)."""
    return uid if round_no is None else f"{uid}#{round_no}"


def image_bytes(ref: ImageRef) -> bytes:
    return ref if isinstance(ref, bytes) else Path(ref).read_bytes()


def read_image(ref: ImageRef) -> np.ndarray:
    return decode_rgb(image_bytes(ref))


def open_samples(path: Path, *, config: str | None = None, split: str | None = None, edits: Path | None = None,
                 source_images: Path | None = None, attempts: str = "accepted",
                 follow_recorded_sources: bool = True) -> Iterator[Sample]:
    """The samples of any input; errors about the input itself are raised here, before the first sample.
    `follow_recorded_sources`: for a run without `source_images`, use the sources folder it records, with a
    warning naming it (the `medbanana eval` command passes False: the user confirms it with --source-images)."""
    path = Path(path)
    kind = input_kind(path)
    if kind == "manifest":
        if edits is not None or config is not None:
            raise UsageError("--edits and --config apply to built datasets and run directories, not to samples files")
        samples = iter(read_samples_file(path))
    elif kind == "dataset":
        samples = dataset_samples(path, config or "sft", split, source_images)
    else:
        if config is not None:
            raise UsageError(f"{path} is a run directory: --config applies to built datasets")
        samples = run_samples(path, source_images, attempts, follow_recorded_sources)
    if edits is not None:
        edits = Path(edits)
        if not edits.is_dir():
            raise NotFound(f"edits folder not found: {edits}")
        samples = (with_model_edit(s, edits) for s in samples)
    return samples


# ---------------------------------------------------------------- evaluation folders

def _samples_file(path: Path) -> Path:
    return path if path.is_file() else next(path / n for n in MANIFEST_NAMES if (path / n).is_file())


def _json_line(file: Path, line_no: int, line: str):
    try:
        return json.loads(line)
    except ValueError as exc:
        raise UsageError(f"{file}:{line_no}: not a JSON line ({exc})") from None


def read_samples_file(path: Path) -> list[Sample]:
    file = _samples_file(path)
    root = file.parent
    try:
        if file.suffix == ".csv":
            with file.open(newline="", encoding="utf-8") as fh:
                entries = list(enumerate(csv.DictReader(fh), start=2))
        else:
            with file.open(encoding="utf-8") as fh:
                entries = [(n, _json_line(file, n, line)) for n, line in enumerate(fh, 1) if line.strip()]
    except UnicodeDecodeError as exc:
        raise UsageError(f"{file}: not UTF-8 text ({exc})") from None
    samples, seen = [], set()
    for line_no, raw in entries:
        where = f"{file}:{line_no}"
        if not isinstance(raw, dict):
            raise UsageError(f"{where}: a sample is a JSON object, not {type(raw).__name__}")
        missing = [k for k in REQUIRED if not str(raw.get(k) or "").strip()]
        if missing:
            raise UsageError(f"{where}: missing {', '.join(missing)} (required: {', '.join(REQUIRED)})")
        if raw["direction"] not in DIRECTIONS:
            raise UsageError(f"{where}: direction must be add or remove, not {raw['direction']!r}")
        if raw["id"] in seen:
            raise UsageError(f"{where}: duplicate id {raw['id']!r}")
        seen.add(raw["id"])
        disease, modality = normalise_disease(raw["disease"], raw.get("modality") or None)
        accepted = str(raw.get("accepted", "")).strip().lower()
        refs = {k: root / raw[k] if raw.get(k) else None for k in ("source", "edited", "mask", "ground_truth")}
        absent = [f"{k} {p}" for k, p in refs.items() if p is not None and not p.is_file()]
        samples.append(Sample(id=str(raw["id"]), dataset=raw.get("dataset") or "eval", modality=modality,
                              disease=disease, direction=raw["direction"], instruction=raw["instruction"],
                              problem=f"file not found: {'; '.join(absent)}" if absent else None,
                              accepted={"true": True, "1": True, "false": False, "0": False}.get(accepted), **refs))
    if not samples:
        raise UsageError(f"{file}: no samples")
    return samples


def normalise_disease(disease: str, modality: str | None) -> tuple[str, str | None]:
    """The released folder name and modality of a disease given by any name; unknown names stay as given."""
    label = load_taxonomy().find(disease, modality)
    return (label.folder, label.modality) if label else (disease, modality)


# ---------------------------------------------------------------- built datasets

def dataset_samples(folder: Path, config: str, split: str | None, source_images: Path | None) -> Iterator[Sample]:
    import pyarrow.parquet as pq

    if config not in SCORABLE_CONFIGS:
        raise UsageError(f"config {config!r} has no source/edited image pair to score; use one of "
                         f"{', '.join(SCORABLE_CONFIGS)}")
    files = _shards(folder, config, split)
    if not files:
        present = sorted(p.name for p in folder.iterdir() if p.is_dir() and any(p.glob("*.parquet")))
        raise UsageError(f"{folder}: no parquet files for config {config!r}"
                         f"{f' split {split!r}' if split else ''}; configs present: {', '.join(present) or 'none'}")
    sources = SourceIndex(source_images) if source_images else None
    return _dataset_rows(files, config, sources, pq)


def _shards(folder: Path, config: str, split: str | None) -> list[Path]:
    """The config's shards (of `split`, or every split) in a built folder: its own regular files alone, each
    footer checked (generation/dataset/folder.py; Unreadable, a ValueError naming the file, otherwise)."""
    found = shard_files(folder, config, _SHARD_COLUMNS)
    return [Path(f) for name, files in sorted(found.items()) if split in (None, name) for f in files]


def _dataset_rows(files: list[Path], config: str, sources: SourceIndex | None, pq) -> Iterator[Sample]:
    for file in files:
        parquet = pq.ParquetFile(file)
        names = set(parquet.schema_arrow.names)
        for batch in parquet.iter_batches(batch_size=8):
            for row in batch.to_pylist():
                yield _row_sample(row, config, names, sources)


def _row_sample(row: dict, config: str, names: set, sources: SourceIndex | None) -> Sample:
    round_no = row.get("round") if "round" in names else row.get("success_round")
    source = (row.get("source_image") or {}).get("bytes")
    problem = None
    if source is None and sources is not None:
        try:
            source = sources.find(row["dataset"], row["task"], row["disease"], row["source_id"],
                                  row.get("source_path"))
        except Refused as exc:  # a source file linked out of --source-images: this sample's error, not read
            problem = LeadsOutside(exc)
    edited = (row.get("edited_image") or {}).get("bytes")
    if problem is not None:
        pass
    elif source is None:
        problem = ("source image not in the dataset (built without --source-images) and not found"
                   + (" in --source-images" if sources else "; pass --source-images DIR"))
    elif edited is None:
        problem = f"no edited image ({row.get('edit_error') or 'the image file was missing at build time'})"
    verdict = {k: row.get(k) for k in VERDICT_FIELDS}
    accepted = {"sft": True, "failed": False}.get(config, row.get("accepted"))
    masks = {k: (row.get(k) or {}).get("bytes") for k in ("edit_mask", "region_mask")}  # null: built without sources
    return Sample(id=sample_id(row["uid"], round_no), dataset=row["dataset"], modality=row["modality"],
                  disease=row["disease"], direction=row["task"], instruction=row.get("instruction") or "",
                  source=source, edited=edited, problem=problem, **masks, task_edit=True,
                  recorded_verdict=verdict if verdict["qualified"] is not None else None, accepted=accepted)


# ---------------------------------------------------------------- run directories

def run_samples(run_path: Path, source_images: Path | None, attempts: str,
                follow_recorded_sources: bool = True) -> Iterator[Sample]:
    """Without `source_images` (and the recorded folder not followed, or none) the samples keep their recorded
    verdicts (what `judge-agreement` compares with human labels) and each has `sources_notice` as its problem."""
    if attempts not in ("accepted", "all"):
        raise UsageError(f"attempts is 'accepted' or 'all', not {attempts!r}")
    units = discover_units(run_path)
    recorded = recorded_sources(run_path) if source_images is None and follow_recorded_sources else None
    if recorded is not None and Path(recorded).is_dir():
        warnings.warn(f"{run_path}: no source images given; using the folder the run records, {recorded!r} "
                      "(sources_root in medbanana-run.json, a path from the machine that made it)", stacklevel=3)
        source_images = Path(recorded)
    if source_images is not None:
        return _run_attempts(units, SourceIndex(source_images), attempts)
    return _run_attempts(units, None, attempts, sources_notice(run_path))


def recorded_sources(run_path: Path) -> str | None:
    """The sources folder a run records (`sources_root` in medbanana-run.json), read only from a run given whole
    and a medbanana-run.json inside it; None when there is none. A hint from the machine that made the run."""
    run_path = Path(run_path)
    try:
        recorded = (schema.read_run_config(run_path) or {}).get("sources_root") if run_path.is_dir() else None
    except (ValueError, OSError):  # linked out, not a run configuration, unreadable: no hint
        return None
    return recorded if isinstance(recorded, str) and recorded else None


def sources_notice(run_path: Path) -> str:
    """Why a run's samples have no source image without --source-images, naming the folder the run records: a
    hint, which the user confirms by passing it."""
    recorded = recorded_sources(run_path)
    if recorded:
        return (f"{run_path}: no --source-images given; the run records its sources folder as {recorded!r} "
                "(sources_root in medbanana-run.json), a path from the machine that made it, which is not followed: "
                f"pass --source-images {recorded} to confirm it, or another folder")
    return (f"{run_path}: no --source-images given and the run records no sources folder; pass --source-images DIR "
            "(the {D}/normal, {D}/{Disease} input layout)")


def _run_attempts(units, sources: SourceIndex | None, attempts: str, notice: str | None = None) -> Iterator[Sample]:
    for unit in units:
        for task in read_tasks(unit):
            chosen = _chosen_attempts(task, attempts)
            source = problem_of_source = None
            if sources is not None:
                try:
                    source = sources.find(task.dataset, task.direction, task.disease, task.source_id,
                                          task.source_path)
                except Refused as exc:
                    problem_of_source = LeadsOutside(exc)
            for attempt in chosen:
                if not attempt.image:
                    continue  # the editor produced no image: nothing to score
                edited, problem = _attempt_image(task, attempt)
                if edited is None:
                    pass  # refused: said before anything else
                elif sources is None:
                    problem = notice
                elif problem_of_source or source is None:
                    problem = problem_of_source or f"source image {task.source_id} not found in {sources.root}"
                yield Sample(id=sample_id(task.uid, attempt.round), dataset=task.dataset, modality=task.modality,
                             disease=task.disease, direction=task.direction,
                             instruction=attempt.instruction or canonical_prompt(task), source=source,
                             edited=edited, problem=problem,
                             recorded_verdict=verdict_values(attempt.verdict) if attempt.verdict else None,
                             accepted=bool(attempt.accepted), task_edit=True)


def _chosen_attempts(task, attempts: str) -> list:
    return ([task.accepted] if task.accepted else []) if attempts == "accepted" else task.attempts


def count_samples(path: Path, *, config: str | None = None, split: str | None = None,
                  attempts: str = "accepted") -> int | None:
    """How many samples `open_samples` gives, for a progress bar's total, where a cheap count exists: a samples
    file's entries, a built dataset's rows from its parquet footers, a run's attempts with an image from its
    records. None when it cannot tell (`open_samples` says what is wrong with the input)."""
    path = Path(path)
    try:
        kind = input_kind(path)
        if kind == "manifest":
            with _samples_file(path).open(newline="", encoding="utf-8") as fh:
                if fh.name.endswith(".csv"):
                    return sum(1 for _ in csv.DictReader(fh))
                return sum(1 for line in fh if line.strip())
        if kind == "dataset":
            import pyarrow.parquet as pq

            files = _shards(path, config or "sft", split)
            return sum(pq.ParquetFile(file).metadata.num_rows for file in files) if files else None
        return sum(1 for unit in discover_units(path) for task in read_tasks(unit)
                   for attempt in _chosen_attempts(task, attempts) if attempt.image)
    except (OSError, ValueError, StopIteration):
        return None


def _attempt_image(task, attempt) -> tuple[Path | None, str | None]:
    """(the attempt's image file, resolved inside the folder the user named; its problem): a path leading
    outside, e.g. an image that is a symlink out of the run, is a problem and is not read."""
    try:
        edited = inside(task.run_dir, attempt.image, f"{task.origin}, round {attempt.round}", task.scope)
    except Refused as exc:
        return None, LeadsOutside(exc)
    return edited, None if edited.is_file() else f"image file missing: {attempt.image}"


# ---------------------------------------------------------------- a model's outputs on dataset or run tasks

def with_model_edit(sample: Sample, edits: Path) -> Sample:
    """The model's output for the sample's task as the edit; the dataset's or run's edit as the ground truth.
    The uid comes from the data: the file is looked up only inside `edits`."""
    uid = sample.id.rsplit("#", 1)[0]
    found, refused = None, None
    for suffix in IMAGE_SUFFIXES:
        try:
            path = inside(edits, f"{uid}{suffix}", f"the uid of sample {sample.id!r}")
        except Refused as exc:
            refused = LeadsOutside(exc)
            break
        if path.is_file():
            found = path
            break
    first, *others = IMAGE_SUFFIXES
    problem = sample.problem or refused or (None if found else f"no model output {edits / uid}{first} (nor "
                                            f"{', '.join(others)}) in --edits")
    return Sample(id=sample.id, dataset=sample.dataset, modality=sample.modality, disease=sample.disease,
                  direction=sample.direction, instruction=sample.instruction, source=sample.source, edited=found,
                  ground_truth=sample.edited, problem=problem, edit_mask=sample.edit_mask,
                  region_mask=sample.region_mask, task_edit=sample.task_edit,  # the task's edit's masks
                  outside=sample.outside and problem == sample.problem)
