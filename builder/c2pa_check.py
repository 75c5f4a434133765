"""`medbanana verify --c2pa`: check the C2PA Content Credentials of every generated image in a dataset or a run.

Each image is read back with `c2pa.Reader` (the C2PA reference implementation) and counted as valid, untrusted,
invalid or missing (generation/rundir/signing.py says which is which). In a dataset folder that is every generated
image column of every parquet file (edited, chosen and rejected images; source images are real scans and carry no
manifest); in a run directory, every image of its layout. Identical bytes (the same image in `sft` and
`dpo_pairs`) are checked once and counted for each row. Checking is spread over worker processes.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections import Counter, defaultdict, deque
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from ..generation.rundir import layout
from ..generation.rundir.signing import STATUSES, check_image, reading_context, require_c2pa
from .features import image_columns

SIGNED_COLUMNS_SKIP = ("source_image",)  # real scans: never signed by us, and not ours to vouch for
_SHOWN = 10
_BATCH = 64


@dataclass
class C2paReport:
    trusting: bool
    counts: Counter = field(default_factory=Counter)  # status -> rows
    rows: dict[str, list[str]] = field(default_factory=lambda: defaultdict(list))  # status -> where (not valid)
    failures: Counter = field(default_factory=Counter)  # validator failure codes over non-valid rows
    images: int = 0  # distinct image byte strings checked
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
        for status in STATUSES[1:]:
            where = self.rows.get(status) or []
            if where:
                more = f" (and {len(where) - _SHOWN} more)" if len(where) > _SHOWN else ""
                lines.append(f"  {status}: " + "; ".join(where[:_SHOWN]) + more)
        if self.failures:
            lines.append("  failure codes: " + ", ".join(f"{c} x{n}" for c, n in self.failures.most_common()))
        if not total:
            lines.append("  no generated images found")
        return "\n".join(lines)


def dataset_images(folder: Path):
    """(where, bytes) of every generated image in the dataset folder's parquet files."""
    import pyarrow.parquet as pq

    for path in sorted(Path(folder).rglob("*.parquet")):
        rel = path.relative_to(folder).as_posix()
        config = rel.split("/", 1)[0]
        try:
            columns = [c for c in image_columns(config) if c not in SIGNED_COLUMNS_SKIP]
        except KeyError:
            continue  # not one of our configs
        parquet = pq.ParquetFile(path)
        columns = [c for c in columns if c in parquet.schema_arrow.names]
        row = 0
        for batch in parquet.iter_batches(columns=columns, batch_size=256):
            values = {c: batch.column(c).to_pylist() for c in columns}
            for i in range(batch.num_rows):
                for column in columns:
                    image = values[column][i]
                    if image and image.get("bytes"):
                        yield f"{rel} row {row + i} {column}", image["bytes"]
            row += batch.num_rows


def run_images(run_dir: Path):
    """(where, bytes) of every image in a run directory's layout folders (not medbanana-orphans/)."""
    run_dir = Path(run_dir)
    for top in sorted(p for p in run_dir.iterdir() if p.is_dir() and layout.is_layout_dir(p.name)):
        for path in sorted(top.rglob("*")):
            if path.is_file() and path.name.lower().endswith(layout.IMAGE_SUFFIXES):
                yield path.relative_to(run_dir).as_posix(), path.read_bytes()


_context = None


def _init_worker(trust_pem: bytes | None) -> None:
    global _context
    _context = (reading_context(trust_pem), trust_pem is not None)


def _check_many(images: list[bytes]) -> list[tuple[str, tuple[str, ...]]]:
    context, trusting = _context
    return [(r.status, r.failures) for r in (check_image(data, context, trusting) for data in images)]


def verify_c2pa(images, *, trust: Path | None = None, workers: int | None = None) -> C2paReport:
    """Check every (where, bytes) of `images`; `trust` is a PEM file of trust anchors (e.g. keys init's ca.pem).
    Images stream through: at most a few batches per worker are held in memory at once."""
    require_c2pa()
    trust_pem = Path(trust).read_bytes() if trust is not None else None
    if trust_pem is not None and b"-----BEGIN CERTIFICATE-----" not in trust_pem:
        raise ValueError(f"--trust {trust}: no PEM certificate in it")
    report = C2paReport(trusting=trust_pem is not None)
    started = time.perf_counter()
    workers = workers or os.cpu_count() or 1
    rows: list[tuple[str, str]] = []  # (where, digest) in order
    checked: dict[str, tuple[str, tuple[str, ...]]] = {}  # digest -> (status, failure codes)
    pool = ProcessPoolExecutor(workers, initializer=_init_worker, initargs=(trust_pem,)) if workers > 1 else None
    if pool is None:
        _init_worker(trust_pem)
    in_flight: deque = deque()

    def submit(batch: list[tuple[str, bytes]]) -> None:
        digests, data = [d for d, _ in batch], [b for _, b in batch]
        in_flight.append((digests, pool.submit(_check_many, data) if pool else _check_many(data)))

    def drain(keep: int) -> None:
        while len(in_flight) > keep:
            digests, result = in_flight.popleft()
            checked.update(zip(digests, result.result() if pool else result))

    try:
        pending: list[tuple[str, bytes]] = []
        for where, data in images:
            digest = hashlib.sha256(data).hexdigest()
            rows.append((where, digest))
            if digest in checked:
                continue
            checked[digest] = ("", ())  # placeholder: submitted
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
    for where, digest in rows:
        status, failures = checked[digest]
        report.counts[status] += 1
        if status != "valid":
            report.rows[status].append(where)
            report.failures.update(code for code in failures if code)
    report.seconds = time.perf_counter() - started
    return report
