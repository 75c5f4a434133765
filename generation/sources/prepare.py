"""The prepare stage: real datasets -> the source folders the generator reads, with a manifest and a report.

    OUT/{D}/normal/{id}.jpeg         sources for "add"
    OUT/{D}/{Disease}/{id}.jpeg      sources for "remove" (single-disease images)
    OUT/prepare_manifest.jsonl       one line per prepared image (append-only; the resume record), with its data-use
                                     class (`data_use`, `licence`: generation/destinations.py)
    OUT/prepare_report.json          per dataset: options, counts, one entry per file skipped/converted/renamed
    OUT/prepare_private.jsonl        the input path of each image named from its content (DICOM): not to publish

Output names: the file stem made safe (ASCII, at most MAX_ID characters), except for DICOM inputs whose adapter
names them by file name: those are named `dicom_<first 16 hex of the file's SHA-256>`, because DICOM file names
often hold the patient's name; their input path goes only to prepare_private.jsonl and the report (the manifest,
which travels with the sources, has original_path null). Every per-file failure (a FIFO or device, an unreadable or
hostile image) is a report entry and the run goes on.

Adapters (adapters/) find labelled files; preprocess.py turns each into a SIZE x SIZE RGB JPEG (q95, aspect kept
by padding unless --aspect stretch) without any metadata. Files are taken per class in sorted order, or with
--per-class N in a seeded order (a bad file is replaced by the next one), identical content is kept once, and the
image is written (temp file + rename) before its manifest line. Nothing is written outside OUT; a rerun skips what
the manifest lists and is on disk, and refuses an OUT made with other image settings.

`prepare(kind, root, out, adapter_opts, opts)` is the whole stage; the `medbanana prepare` command (options, help,
summary lines, exit codes) is generation/commands/prepare.py.
"""

from __future__ import annotations

import difflib
import hashlib
import importlib.util
import json
import os
import random
import re
import stat
import unicodedata
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..destinations import CREDENTIALED, DATA_USE_CLASSES, MANIFEST, OPEN, UNKNOWN
from ..files import atomic_write_bytes, atomic_write_json, not_regular, open_append, read_jsonl
from ..taxonomy import load_taxonomy
from .adapters import AdapterOptions, Candidate, DatasetSource, PrepareError, Problem, load_dataset_sources
from .preprocess import BadImage, ImageOptions, Prepared, prepare_image

REPORT = "prepare_report.json"
PRIVATE = "prepare_private.jsonl"
# output stems stay far below NAME_MAX (255 bytes) once the generator adds -{Disease}-edit-failed-{round}.jpeg and
# a temporary file's prefix and suffix
MAX_ID = 100
# each kind's data-use class and licence (generation/destinations.py); `folders` takes --data-use, else unknown
DATA_USE = {"mimic-cxr": (CREDENTIALED, "PhysioNet Credentialed Health Data Use Agreement (credentialed access)"),
            "brain-tumor-mri": (OPEN, "Brain Tumor MRI Dataset (Kaggle): the licence on its dataset page"),
            "odir": (OPEN, "ODIR-5K: the licence on its dataset page")}


@dataclass
class PrepareOptions:
    image: ImageOptions = field(default_factory=ImageOptions)
    per_class: int | None = None  # at most N per class, drawn in a seeded order; None = all
    seed: int = 0
    classes: tuple[str, ...] = ()  # only these class folders (normal or released disease names)
    workers: int = 2
    quiet: bool = False
    data_use: str | None = None  # `folders`: the class of its images (default unknown)
    licence: str | None = None  # `folders` with data_use open: the licence, recorded with each image


def data_use_of(kind: str, opts: PrepareOptions) -> tuple[str, str | None]:
    """(data-use class, licence) that `kind`'s images are recorded with; PrepareError for options that do not fit."""
    if kind in DATA_USE:
        if opts.data_use is not None or opts.licence is not None:
            fixed = DATA_USE[kind][0]
            raise PrepareError(f"{kind} images are {fixed} data: --data-use and --licence apply to `folders` only")
        return DATA_USE[kind]
    kind_of = opts.data_use or UNKNOWN
    if kind_of not in DATA_USE_CLASSES:
        raise PrepareError(f"--data-use {kind_of!r}: one of {', '.join(DATA_USE_CLASSES)}")
    if (kind_of == OPEN) != (opts.licence is not None):
        raise PrepareError("--data-use open names its licence with --licence TEXT (and --licence goes with open only)")
    return kind_of, opts.licence


# --- ids --------------------------------------------------------------------------------------------------------
def safe_id(stem: str) -> str:
    """An ASCII file stem of letters, digits, '.', '_' and '-' (no leading dot), from any name."""
    text = unicodedata.normalize("NFKD", stem).encode("ascii", "ignore").decode()
    text = re.sub(r"[^A-Za-z0-9._-]+", "_", text).strip("._-") or "source"
    if len(text) > MAX_ID:  # cut, with a hash of the whole stem so that cut names stay apart
        digest = hashlib.sha1(stem.encode()).hexdigest()[:8]
        text = f"{text[:MAX_ID - 9]}_{digest}"
    return text


def assign_ids(candidates: list[Candidate]) -> tuple[dict[str, str], list[Problem]]:
    """relpath -> unique safe id; a report entry for every renamed file. Deterministic for a given candidate list.
    (A DICOM named by its content at write time does not use its id, nor report its renaming.)"""
    ids, problems, used = {}, [], {}
    for cand in sorted(candidates, key=lambda c: c.relpath):
        want = safe_id(cand.source_id)
        if want in used:
            want = f"{want}_{hashlib.sha1(cand.relpath.encode()).hexdigest()[:8]}"
        used[want] = cand.relpath
        ids[cand.relpath] = want
        if want != cand.source_id:
            problems.append(Problem(cand.relpath, f"renamed to {want!r} (output names are unique ASCII without "
                                                  "spaces)", "renamed"))
    return ids, problems


# --- a dataset --------------------------------------------------------------------------------------------------
def read_prepare_manifest(out: Path) -> list[dict]:
    """The lines of OUT/prepare_manifest.jsonl in order; a torn last line (killed mid-write) is ignored."""
    return read_jsonl(Path(out) / MANIFEST)


def read_regular_file(path: Path) -> bytes:
    """The bytes of `path`, a regular file by stat before it is opened (opening a FIFO blocks) and by fstat after,
    in case it was swapped; opened non-blocking so that not even a swapped-in FIFO blocks."""
    if problem := not_regular(path):
        raise BadImage(f"{problem}; skipped without opening it")
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0))
    with open(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise BadImage("not a regular file when opened (replaced after it was listed); skipped")
        return f.read()


def _load(cand: Candidate, opts: ImageOptions) -> Prepared | BadImage:
    try:
        return prepare_image(read_regular_file(cand.path), opts, cand.path.name)
    except BadImage as exc:
        return exc
    except OSError as exc:
        return BadImage(f"cannot read the file: {exc.strerror or exc}")
    except Exception as exc:  # an unforeseen decoder error on one hostile file must not end the run
        return BadImage(f"unexpected error decoding it: {type(exc).__name__}: {exc}")


def _ordered(cands: list[Candidate], opts: PrepareOptions, dataset: str, label: str) -> list[Candidate]:
    ordered = sorted(cands, key=lambda c: c.relpath)
    if opts.per_class is not None:  # a seeded permutation independent of N: a larger N extends a smaller one
        random.Random(f"{opts.seed}/{dataset}/{label}").shuffle(ordered)
    return ordered


def prepare_source(src: DatasetSource, out: Path, opts: PrepareOptions, done_rows: list[dict], manifest,
                   pool: ThreadPoolExecutor, data_use: tuple[str, str | None] = (UNKNOWN, None)) -> dict:
    """Prepare one dataset's candidates into OUT/{D}/; returns its report section."""
    from tqdm.auto import tqdm

    ids, renamed = assign_ids(src.candidates)
    renamed, taken = {p.path: p for p in renamed}, set(ids.values())
    # a content-named row whose private line is lost is keyed by its output path: prepared again, then a duplicate
    done = {r["original_path"] or r["path"]: r for r in done_rows if (out / r["path"]).is_file()}
    seen_hash = {r["sha256"]: r["original_path"] or r["path"] for r in done.values()}
    have = {}
    for row in done.values():
        have[row["label"]] = have.get(row["label"], 0) + 1
    entries: list[Problem] = list(src.problems)
    examined = {p.path for p in src.problems}
    by_label: dict[str, list[Candidate]] = {}
    for cand in src.candidates:
        if not opts.classes or cand.label in opts.classes:
            by_label.setdefault(cand.label, []).append(cand)
    new, chunk_max = 0, max(4, 4 * opts.workers)
    total = sum(len(v) if opts.per_class is None else min(len(v), opts.per_class) for v in by_label.values())
    bar = tqdm(total=total, desc=src.name, unit="img", disable=opts.quiet)
    bar.update(sum(min(have.get(k, 0), len(v) if opts.per_class is None else opts.per_class)
                   for k, v in by_label.items()))
    for label in sorted(by_label):
        queue = [c for c in _ordered(by_label[label], opts, src.name, label) if c.relpath not in done]
        i = 0
        while i < len(queue) and (opts.per_class is None or have.get(label, 0) < opts.per_class):
            want = len(queue) - i if opts.per_class is None else opts.per_class - have.get(label, 0)
            chunk = queue[i:i + min(want, chunk_max)]
            i += len(chunk)
            for cand, result in zip(chunk, pool.map(lambda c: _load(c, opts.image), chunk)):
                examined.add(cand.relpath)
                bar.update(1)
                if isinstance(result, BadImage):
                    entries.append(Problem(cand.relpath, str(result)))
                    continue
                if result.sha256 in seen_hash:
                    entries.append(Problem(cand.relpath, f"duplicate: same content as {seen_hash[result.sha256]}"))
                    continue
                private = result.dicom and cand.named_from_file  # its file name may hold the patient's name
                stem = f"dicom_{result.source_sha256[:16]}" if private else ids[cand.relpath]
                stem += "_dcm" if private and stem in taken else ""  # a JPEG named so by chance keeps its file
                rel = f"{src.name}/{label}/{stem}.jpeg"
                row = {"dataset": src.name, "modality": src.modality, "source_id": stem,
                       "label": label, "labels": list(cand.labels), "view": cand.view, "group": cand.group,
                       "original_path": None if private else cand.relpath, "path": rel, "sha256": result.sha256,
                       "source_sha256": result.source_sha256, "source_width": result.source_width,
                       "source_height": result.source_height, "width": opts.image.size, "height": opts.image.size,
                       "prep": opts.image.fingerprint(), "notes": result.notes, "extra": cand.extra,
                       "data_use": data_use[0], "licence": data_use[1]}
                _write_prepared(out, rel, result.data, row, cand.relpath if private else None, manifest)
                seen_hash[result.sha256] = cand.relpath
                done[cand.relpath] = row
                have[label] = have.get(label, 0) + 1
                new += 1
                if result.notes:
                    entries.append(Problem(cand.relpath, "; ".join(result.notes), "converted"))
                if cand.relpath in renamed and not private:
                    entries.append(renamed[cand.relpath])
    bar.close()
    section = {
        "kind": src.kind, "root": str(src.root.resolve()), "modality": src.modality, "output": src.name,
        "data_use": {"class": data_use[0], "licence": data_use[1]},
        "options": {**asdict(opts.image), "per_class": opts.per_class, "seed": opts.seed,
                    "classes": list(opts.classes)},
        "selection": src.counts,
        "counts": {"candidates": len(src.candidates), "prepared_now": new, "prepared_total": len(done)},
        "per_class": {k: have.get(k, 0) for k in sorted(set(have) | set(by_label))},
        "entries": [asdict(e) for e in entries]}
    if opts.per_class is not None:
        section["shortfall"] = {k: opts.per_class - have.get(k, 0) for k in sorted(by_label)
                                if have.get(k, 0) < opts.per_class}
    if src.skipped:
        section["skipped"] = src.skipped
    section["examined"] = sorted(examined)
    return section


def _write_prepared(out: Path, rel: str, data: bytes, row: dict, original_path: str | None, manifest) -> None:
    """The image, then its private line (a content-named input's path; the file exists only when one does), then
    its manifest line: no line names an image not on disk. A write error is OUT's, not the input file's: it ends
    the run with one line."""
    try:
        atomic_write_bytes(out / rel, data)
        if original_path is not None:
            with open_append(out / PRIVATE) as private:
                private.write(_json_line({"path": rel, "original_path": original_path}))
        manifest.write(_json_line(row))
        manifest.flush()
    except OSError as exc:
        raise PrepareError(f"cannot write {out / rel} or its manifest line: {exc.strerror or exc}") from None


def _json_line(obj: dict) -> bytes:
    return json.dumps(obj, ensure_ascii=False).encode("utf-8") + b"\n"


def prepare(kind: str, root: Path, out: Path, adapter_opts: AdapterOptions | None = None,
            opts: PrepareOptions | None = None) -> dict[str, dict]:
    """Run adapter `kind` on `root`, prepare its images into `out`; returns this run's report sections by dataset
    name (OUT/prepare_report.json holds them with those of earlier runs on other datasets).

    Fatal problems (missing label file, unusable table, options that differ from those OUT was made with) raise
    PrepareError before anything is written."""
    opts, out = opts or PrepareOptions(), Path(out)
    _check_options(opts)
    data_use = data_use_of(kind, opts)
    sources = load_dataset_sources(kind, Path(root), adapter_opts or AdapterOptions())
    _check_dicom_support(sources)
    names = {r.get("path"): r.get("original_path") for r in read_jsonl(out / PRIVATE)}
    existing = [r if r.get("original_path") else {**r, "original_path": names.get(r.get("path"))}
                for r in read_prepare_manifest(out)]
    for src in sources:
        made = {json.dumps(r.get("prep"), sort_keys=True) for r in existing if r.get("dataset") == src.name}
        if made - {json.dumps(opts.image.fingerprint(), sort_keys=True)}:
            raise PrepareError(f"{out / src.name} was prepared with {', '.join(sorted(made))}; now "
                               f"{opts.image.fingerprint()}. Use another --out or the same --size/--aspect/--quality.")
        recorded = {r.get("data_use") for r in existing if r.get("dataset") == src.name and r.get("data_use")}
        if recorded - {data_use[0]}:
            raise PrepareError(f"{out / src.name} holds images recorded as {', '.join(sorted(recorded))} data; now "
                               f"{data_use[0]}. Use another --out, or the same --data-use.")
    out.mkdir(parents=True, exist_ok=True)
    report, sections = _read_report(out), {}
    with open_append(out / MANIFEST) as manifest, ThreadPoolExecutor(max(1, opts.workers)) as pool:
        for src in sources:
            rows = [r for r in existing if r.get("dataset") == src.name]
            section = prepare_source(src, out, opts, rows, manifest, pool, data_use)
            examined = set(section.pop("examined"))
            old = report["datasets"].get(src.name, {}).get("entries", [])
            section["entries"] = [e for e in old if e["path"] not in examined] + section["entries"]
            section["counts"].update({a: sum(e["action"] == a for e in section["entries"])
                                      for a in ("skipped", "converted", "renamed", "warning")})
            report["datasets"][src.name] = sections[src.name] = section
            atomic_write_json(out / REPORT, report)
    return sections


def _read_report(out: Path) -> dict:
    try:
        report = json.loads((out / REPORT).read_text(encoding="utf-8"))
        if isinstance(report.get("datasets"), dict):
            return report
    except (OSError, ValueError):
        pass
    return {"format": "medbanana-prepare-report/1", "datasets": {}}


def _check_options(opts: PrepareOptions) -> None:
    tax = load_taxonomy()
    try:
        opts.image.check()
    except ValueError as exc:
        raise PrepareError(str(exc)) from None
    if opts.per_class is not None and opts.per_class < 1:
        raise PrepareError("--per-class must be at least 1")
    known = {"normal", *(t.folder for t in tax.targets)}
    unknown = [c for c in opts.classes if c not in known]
    if unknown:
        named = ", ".join(f"{c} (did you mean {guess[0]}?)" if (guess := difflib.get_close_matches(c, known, 1))
                          else c for c in unknown)
        raise PrepareError(f"unknown class(es) {named}; known: {', '.join(sorted(known))}")


def _check_dicom_support(sources: list[DatasetSource]) -> None:
    if any(c.path.suffix.lower() in (".dcm", ".dicom") for s in sources for c in s.candidates):
        if importlib.util.find_spec("pydicom") is None:
            raise PrepareError("the input holds DICOM files, which need pydicom: pip install 'medbanana[dicom]'")
