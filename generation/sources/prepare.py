"""The prepare stage: real datasets -> the source folders the generator reads, with a manifest and a report.

    OUT/{D}/normal/{id}.jpeg         sources for "add"
    OUT/{D}/{Disease}/{id}.jpeg      sources for "remove" (single-disease images)
    OUT/prepare_manifest.jsonl       one line per prepared image (append-only; the resume record)
    OUT/prepare_report.json          per dataset: options, counts, one entry per file skipped/converted/renamed

Adapters (adapters/) find labelled files; preprocess.py turns each into a SIZE x SIZE RGB JPEG (q95, aspect kept
by padding unless --aspect stretch) without any metadata. Files are taken per class in sorted order, or with
--per-class N in a seeded order (a bad file is replaced by the next one), identical content is kept once, and the
image is written (temp file + rename) before its manifest line. Nothing is written outside OUT; a rerun skips what
the manifest lists and is on disk, and refuses an OUT made with other image settings.

`prepare(kind, root, out, adapter_opts, opts)` is the whole stage; the `medbanana prepare` command (options, help,
summary lines, exit codes) is generation/commands/prepare.py.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import random
import re
import unicodedata
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..files import atomic_write_bytes, atomic_write_json, read_jsonl
from ..taxonomy import load_taxonomy
from .adapters import AdapterOptions, Candidate, DatasetSource, PrepareError, Problem, load_dataset_sources
from .preprocess import BadImage, ImageOptions, Prepared, prepare_image

MANIFEST = "prepare_manifest.jsonl"
REPORT = "prepare_report.json"


@dataclass
class PrepareOptions:
    image: ImageOptions = field(default_factory=ImageOptions)
    per_class: int | None = None  # at most N per class, drawn in a seeded order; None = all
    seed: int = 0
    classes: tuple[str, ...] = ()  # only these class folders (normal or released disease names)
    workers: int = 2
    quiet: bool = False


# --- ids --------------------------------------------------------------------------------------------------------
def safe_id(stem: str) -> str:
    """An ASCII file stem of letters, digits, '.', '_' and '-' (no leading dot), from any name."""
    text = unicodedata.normalize("NFKD", stem).encode("ascii", "ignore").decode()
    text = re.sub(r"[^A-Za-z0-9._-]+", "_", text).strip("._-")
    return text or "source"


def assign_ids(candidates: list[Candidate]) -> tuple[dict[str, str], list[Problem]]:
    """relpath -> unique safe id; a report entry for every renamed file. Deterministic for a given candidate list."""
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


def _load(cand: Candidate, opts: ImageOptions) -> Prepared | BadImage:
    try:
        return prepare_image(cand.path.read_bytes(), opts, cand.path.name)
    except BadImage as exc:
        return exc
    except OSError as exc:
        return BadImage(f"cannot read the file: {exc}")


def _ordered(cands: list[Candidate], opts: PrepareOptions, dataset: str, label: str) -> list[Candidate]:
    ordered = sorted(cands, key=lambda c: c.relpath)
    if opts.per_class is not None:  # a seeded permutation independent of N: a larger N extends a smaller one
        random.Random(f"{opts.seed}/{dataset}/{label}").shuffle(ordered)
    return ordered


def prepare_source(src: DatasetSource, out: Path, opts: PrepareOptions, done_rows: list[dict], manifest,
                   pool: ThreadPoolExecutor) -> dict:
    """Prepare one dataset's candidates into OUT/{D}/; returns its report section."""
    from tqdm.auto import tqdm

    ids, renamed = assign_ids(src.candidates)
    renamed = {p.path: p for p in renamed}
    done = {r["original_path"]: r for r in done_rows if (out / r["path"]).is_file()}
    seen_hash = {r["sha256"]: r["original_path"] for r in done.values()}
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
                rel = f"{src.name}/{label}/{ids[cand.relpath]}.jpeg"
                atomic_write_bytes(out / rel, result.data)
                row = {"dataset": src.name, "modality": src.modality, "source_id": ids[cand.relpath],
                       "label": label, "labels": list(cand.labels), "view": cand.view, "group": cand.group,
                       "original_path": cand.relpath, "path": rel, "sha256": result.sha256,
                       "source_sha256": result.source_sha256, "source_width": result.source_width,
                       "source_height": result.source_height, "width": opts.image.size, "height": opts.image.size,
                       "prep": opts.image.fingerprint(), "notes": result.notes, "extra": cand.extra}
                manifest.write(json.dumps(row, ensure_ascii=False).encode("utf-8") + b"\n")
                manifest.flush()
                seen_hash[result.sha256] = cand.relpath
                done[cand.relpath] = row
                have[label] = have.get(label, 0) + 1
                new += 1
                if result.notes:
                    entries.append(Problem(cand.relpath, "; ".join(result.notes), "converted"))
                if cand.relpath in renamed:
                    entries.append(renamed[cand.relpath])
    bar.close()
    section = {
        "kind": src.kind, "root": str(src.root.resolve()), "modality": src.modality, "output": src.name,
        "options": {**asdict(opts.image), "per_class": opts.per_class, "seed": opts.seed,
                    "classes": list(opts.classes)},
        "selection": src.counts,
        "counts": {"candidates": len(src.candidates), "prepared_now": new, "prepared_total": len(done)},
        "per_class": {k: have.get(k, 0) for k in sorted(set(have) | set(by_label))},
        "entries": [asdict(e) for e in entries]}
    if opts.per_class is not None:
        section["shortfall"] = {k: opts.per_class - have.get(k, 0) for k in sorted(by_label)
                                if have.get(k, 0) < opts.per_class}
    section["examined"] = sorted(examined)
    return section


def prepare(kind: str, root: Path, out: Path, adapter_opts: AdapterOptions | None = None,
            opts: PrepareOptions | None = None) -> dict[str, dict]:
    """Run adapter `kind` on `root`, prepare its images into `out`; returns this run's report sections by dataset
    name (OUT/prepare_report.json holds them with those of earlier runs on other datasets).

    Fatal problems (missing label file, unusable table, options that differ from those OUT was made with) raise
    PrepareError before anything is written."""
    opts, out = opts or PrepareOptions(), Path(out)
    _check_options(opts)
    sources = load_dataset_sources(kind, Path(root), adapter_opts or AdapterOptions())
    _check_dicom_support(sources)
    existing = read_prepare_manifest(out)
    for src in sources:
        made = {json.dumps(r.get("prep"), sort_keys=True) for r in existing if r.get("dataset") == src.name}
        if made - {json.dumps(opts.image.fingerprint(), sort_keys=True)}:
            raise PrepareError(f"{out / src.name} was prepared with {', '.join(sorted(made))}; now "
                               f"{opts.image.fingerprint()}. Use another --out or the same --size/--aspect/--quality.")
    out.mkdir(parents=True, exist_ok=True)
    report, sections = _read_report(out), {}
    with open(out / MANIFEST, "ab") as manifest, ThreadPoolExecutor(max(1, opts.workers)) as pool:
        for src in sources:
            rows = [r for r in existing if r.get("dataset") == src.name]
            section = prepare_source(src, out, opts, rows, manifest, pool)
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
        raise PrepareError(f"unknown class(es) {', '.join(unknown)}; known: {', '.join(sorted(known))}")


def _check_dicom_support(sources: list[DatasetSource]) -> None:
    if any(c.path.suffix.lower() in (".dcm", ".dicom") for s in sources for c in s.candidates):
        if importlib.util.find_spec("pydicom") is None:
            raise PrepareError("the input holds DICOM files, which need pydicom: pip install 'medbanana[dicom]'")
