"""`medbanana verify --c2pa`: check the C2PA Content Credentials of every generated image in a dataset or a run.

Each image is read back with `c2pa.Reader` (the C2PA reference implementation) and counted as valid, untrusted,
invalid or missing (generation/rundir/signing.py says which is which), or mismatched: intact, but its medbanana
assertion names another task, round, outcome, instruction, source or run than the record of the place it sits in.
In a dataset folder that is every generated image column of every parquet file (edited, chosen and rejected images;
source images are real scans and carry no manifest), compared with its row; in a run directory, every image of its
layout, compared with the journal line that names its path. Identical bytes (the same image in `sft` and
`dpo_pairs`) are checked once and compared and counted for each row. Checking is spread over worker processes.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections import Counter, defaultdict, deque
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from ..generation.interrupts import ignore_sigint
from ..generation.rundir import layout, schema
from ..generation.rundir.signing import (STATUSES, check_image, provenance_differences, reading_context,
                                         require_c2pa)
from ..generation.rundir.store import read_journal
from ..generation.failures import UsageError

# image column -> (its round's column, accepted: a value or the column holding it, its instruction's column), as
# rows.py fills them; source_image (real scans, never signed by us) is not checked
SIGNED_COLUMNS = {
    "sft": {"edited_image": ("success_round", True, "instruction")},
    "failed": {"edited_image": ("round", False, "instruction")},
    "judge": {"edited_image": ("round", "accepted", "instruction")},
    "dpo_pairs": {"chosen_image": ("chosen_round", True, "chosen_instruction"),
                  "rejected_image": ("rejected_round", False, "rejected_instruction")},
}
UNRECORDED = "no journal line names this image"  # a run's image outside its record: mismatched when intact
_SHOWN = 10
_BATCH = 64


@dataclass
class C2paReport:
    trusting: bool
    counts: Counter = field(default_factory=Counter)  # status -> rows
    rows: dict[str, list[str]] = field(default_factory=lambda: defaultdict(list))  # status -> where (not valid)
    failures: Counter = field(default_factory=Counter)  # validator failure codes over non-valid rows
    images: int = 0  # distinct image byte strings checked
    unrecorded: int = 0  # rows with no record to compare the provenance with (a run without a journal)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.counts["valid"] > 0 and all(not self.counts[s] for s in STATUSES if s != "valid")

    def describe(self) -> str:
        total = sum(self.counts.values())
        rate = self.images / self.seconds if self.seconds else 0.0
        lines = [f"C2PA: {total} image(s) ({self.images} distinct) checked in {self.seconds:.1f} s ({rate:.0f}/s): "
                 + ", ".join(f"{self.counts[s]} {s}" for s in STATUSES)]
        if not self.trusting:
            lines.append("  no --trust given: 'valid' means signature and hashes match; the signer was not checked")
        if self.unrecorded:
            lines.append(f"  {self.unrecorded} image(s) have no record ({layout.JOURNAL}) to compare their "
                         "provenance with: 'valid' says nothing of which task they belong to")
        for status in STATUSES[1:]:
            where = self.rows.get(status) or []
            more = f" (and {len(where) - _SHOWN} more)" if len(where) > _SHOWN else ""
            if where and status == "mismatched":  # each with what differs: one a line
                lines += [f"  {status}: {w}" for w in where[:_SHOWN]] + ([f"  {more.strip(' ()')}"] if more else [])
            elif where:
                lines.append(f"  {status}: " + "; ".join(where[:_SHOWN]) + more)
        if self.failures:
            lines.append("  failure codes: " + ", ".join(f"{c} x{n}" for c, n in self.failures.most_common()))
        if not total:
            lines.append("  no generated images found")
        return "\n".join(lines)


def _sha256(text) -> str | None:
    return hashlib.sha256(text.encode("utf-8")).hexdigest() if isinstance(text, str) else None


def dataset_images(folder: Path):
    """(where, bytes, expected provenance) of every generated image in the dataset folder's parquet files; the
    row gives the task uid, round, outcome, instruction and (when embedded) the source image. The dataset records
    no run id, so that field is not compared."""
    import pyarrow.parquet as pq

    for path in sorted(Path(folder).rglob("*.parquet")):
        rel = path.relative_to(folder).as_posix()
        signed = SIGNED_COLUMNS.get(rel.split("/", 1)[0])
        if signed is None:
            continue  # a config without generated images, or not one of ours
        parquet = pq.ParquetFile(path)
        names = parquet.schema_arrow.names
        signed = {column: spec for column, spec in signed.items() if column in names}
        wanted = {"uid", "source_image", *signed, *(c for spec in signed.values() for c in spec if isinstance(c, str))}
        columns = [c for c in names if c in wanted]
        row = 0
        for batch in parquet.iter_batches(columns=columns, batch_size=256):
            values = {c: batch.column(c).to_pylist() for c in columns}
            for i in range(batch.num_rows):
                got = {c: values[c][i] for c in columns}
                source = got.get("source_image")
                source_sha = hashlib.sha256(source["bytes"]).hexdigest() if source and source.get("bytes") else None
                for column, (round_column, accepted, instruction_column) in signed.items():
                    image = got[column]
                    if image and image.get("bytes"):
                        expected = {"task_uid": got.get("uid"), "round": got.get(round_column),
                                    "accepted": got.get(accepted) if isinstance(accepted, str) else accepted,
                                    "instruction_sha256": _sha256(got.get(instruction_column)),
                                    "source_sha256": source_sha}
                        yield f"{rel} row {row + i} {column}", image["bytes"], expected
            row += batch.num_rows


def run_images(run_dir: Path):
    """(where, bytes, expected provenance) of every image in a run directory's layout folders (not
    medbanana-orphans/), expected from the journal line naming its path: UNRECORDED when none does, None when the
    run has no journal."""
    run_dir = Path(run_dir)
    records = run_records(run_dir)
    for top in sorted(p for p in run_dir.iterdir() if p.is_dir() and layout.is_layout_dir(p.name)):
        for path in sorted(top.rglob("*")):
            if path.is_file() and path.name.lower().endswith(layout.IMAGE_SUFFIXES):
                rel = path.relative_to(run_dir).as_posix()
                yield rel, path.read_bytes(), None if records is None else records.get(rel, UNRECORDED)


def run_records(run_dir: Path) -> dict[str, dict] | None:
    """Image path -> the provenance its journal line (the last naming it) records; None without a journal. The
    run id is the run's own, except in a merged run, whose shards each signed with theirs (not compared)."""
    if not (run_dir / layout.JOURNAL).exists():
        return None
    journal = read_journal(layout.inside(run_dir, layout.JOURNAL, named_by=f"the run directory {run_dir}"))
    run_id = None
    if (config := schema.read_run_config(run_dir)) and not config.get("merged_from"):
        run_id = config.get("run_id")
    expected: dict[str, dict] = {}
    for entry in journal:
        if not isinstance(entry, dict):
            continue
        record = entry.get("record") if isinstance(entry.get("record"), dict) else {}
        rounds = [entry.get("round")] if entry.get("type") == "round" else record.get("rounds")
        for raw in rounds if isinstance(rounds, list) else []:
            if isinstance(raw, dict) and isinstance(raw.get("image"), str) and raw["image"]:
                expected[raw["image"]] = {"run_id": run_id, "task_uid": entry.get("uid"), "round": raw.get("round"),
                                          "accepted": bool(raw.get("accepted")),
                                          "instruction_sha256": _sha256(raw.get("instruction")),
                                          "source_sha256": record.get("source_sha256")}
    return expected


_context = None


def _init_worker(trust_pem: bytes | None, in_pool: bool = False) -> None:
    global _context
    if in_pool:  # Ctrl-C is the parent's to handle
        ignore_sigint()
    _context = (reading_context(trust_pem), trust_pem is not None)


def _check_many(images: list[bytes]) -> list[tuple[str, tuple[str, ...], dict | None]]:
    context, trusting = _context
    return [(r.status, r.failures, r.provenance) for r in (check_image(data, context, trusting) for data in images)]


def verify_c2pa(images, *, trust: Path | None = None, workers: int | None = None) -> C2paReport:
    """Check every (where, bytes, expected) of `images`; `expected` is the provenance the record gives (a dict of
    signing.PROVENANCE_FIELDS, None where a field is not recorded), UNRECORDED, or None when there is no record.
    `trust` is a PEM file of trust anchors (e.g. keys init's ca.pem). Images stream through: at most a few batches
    per worker, and the rows waiting for them, are held in memory at once."""
    require_c2pa()
    trust_pem = Path(trust).read_bytes() if trust is not None else None
    if trust_pem is not None and b"-----BEGIN CERTIFICATE-----" not in trust_pem:
        raise UsageError(f"--trust {trust}: no PEM certificate in it")
    report = C2paReport(trusting=trust_pem is not None)
    started = time.perf_counter()
    workers = workers or os.cpu_count() or 1
    checked: dict[str, tuple] = {}  # digest -> (status, failure codes, signed provenance)
    waiting: dict[str, list[tuple[int, str, object]]] = {}  # digest in flight -> its rows (index, where, expected)
    named: dict[str, list[tuple[int, str]]] = defaultdict(list)  # status -> (index, where) of rows not valid
    pool = ProcessPoolExecutor(workers, initializer=_init_worker, initargs=(trust_pem, True)) if workers > 1 else None
    if pool is None:
        _init_worker(trust_pem)
    in_flight: deque = deque()

    def count(index: int, where: str, expected, outcome: tuple) -> None:
        status, failures, signed = outcome
        if status in ("valid", "untrusted") and expected is not None:  # intact: is it where its record says?
            differences = [expected] if expected == UNRECORDED else provenance_differences(signed, expected)
            if differences:
                status, where = "mismatched", f"{where}: {'; '.join(differences)}"
        report.unrecorded += expected is None
        report.counts[status] += 1
        if status != "valid":
            named[status].append((index, where))
            report.failures.update(code for code in failures if code)

    def submit(batch: list[tuple[str, bytes]]) -> None:
        digests, data = [d for d, _ in batch], [b for _, b in batch]
        in_flight.append((digests, pool.submit(_check_many, data) if pool else _check_many(data)))

    def drain(keep: int) -> None:
        while len(in_flight) > keep:
            digests, result = in_flight.popleft()
            for digest, outcome in zip(digests, result.result() if pool else result):
                checked[digest] = outcome
                for row in waiting.pop(digest):
                    count(*row, outcome)

    try:
        pending: list[tuple[str, bytes]] = []
        for index, (where, data, expected) in enumerate(images):
            digest = hashlib.sha256(data).hexdigest()
            if digest in checked:
                count(index, where, expected, checked[digest])
            elif digest in waiting:
                waiting[digest].append((index, where, expected))
            else:
                waiting[digest] = [(index, where, expected)]
                pending.append((digest, data))
                if len(pending) == _BATCH:
                    submit(pending)
                    pending = []
                    drain(2 * workers)
        if pending:
            submit(pending)
        drain(0)
    finally:
        if pool is not None:
            pool.shutdown(cancel_futures=True)
    report.images = len(checked)
    for status, rows in named.items():  # in the order the rows came
        report.rows[status] = [where for _, where in sorted(rows)]
    report.seconds = time.perf_counter() - started
    return report
