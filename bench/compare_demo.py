"""Compare two `medbanana demo` outputs, written at the same path by two versions of the code.

Equal means every file is equal byte for byte once what legitimately changes from run to run is set aside: the
run id (a random UUID, also inside each image's XMP mark), wall-clock stamps, durations (and the byte size of the
rows that hold them), the lock holder's pid, and the order of journal lines (tasks run concurrently). Parquet files are
compared cell by cell with the same rule, because a different run id changes their compressed pages. Use it to show
that a refactor changed no output:

    medbanana demo --out /tmp/demo && mv /tmp/demo /tmp/demo-before   # on the old commit
    medbanana demo --out /tmp/demo && python bench/compare_demo.py /tmp/demo-before /tmp/demo

or let it run both demos, each with the `medbanana` package of one code tree on its PYTHONPATH (a folder holding
`medbanana`, or a link of that name to a checkout), at the same path one after the other:

    python bench/compare_demo.py --code /tmp/pp-main /work/wt/mine/.pp [--size 256] [--normal 2] [--diseased 1]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pyarrow.parquet as pq

VOLATILE_KEYS = {"seconds", "created", "finished_at", "started_at", "run_id", "pid", "since"}  # clocks, the random id
RUN_ID = re.compile(rb"[0-9a-f]{32}")


def run_ids(root: Path) -> set[bytes]:
    ids = set()
    for config in root.rglob("medbanana-run.json"):
        ids.add(json.loads(config.read_text())["run_id"].encode())
    return ids


def scrub_bytes(data: bytes, ids: set[bytes]) -> bytes:
    for run_id in ids:
        data = data.replace(run_id, b"<run-id>")
    return data


def scrub_value(value, ids):
    if isinstance(value, dict) and value.get("config") == "conversations" and "count" in value:
        return {**value, "count": "<bytes of rows holding durations>"}
    if isinstance(value, dict):
        return {k: ("<volatile>" if k in VOLATILE_KEYS else scrub_value(v, ids)) for k, v in value.items()}
    if isinstance(value, list):
        return [scrub_value(v, ids) for v in value]
    if isinstance(value, bytes):
        return scrub_bytes(value, ids)
    if isinstance(value, str):
        text = scrub_bytes(value.encode(), ids).decode()
        if text.startswith(("{", "[")):
            try:
                return scrub_value(json.loads(text), ids)
            except ValueError:
                pass
        return text
    return value


def normalised(path: Path, ids: set[bytes]):
    if path.suffix == ".parquet":
        return scrub_value(pq.read_table(path).to_pylist(), ids)
    data = path.read_bytes()
    if path.suffix in (".json", ".jsonl", ".lock"):
        lines = data.splitlines() if path.suffix == ".jsonl" else [data]
        values = [scrub_value(json.loads(line), ids) for line in lines if line.strip()]
        return sorted(values, key=json.dumps)  # concurrent tasks finish in any order
    if path.name in ("README.md", "SHA256SUMS"):  # sizes and hashes of the parquet files above
        return None
    return scrub_bytes(data, ids)


def compare(a: Path, b: Path) -> list[str]:
    ids = run_ids(a) | run_ids(b)
    files_a = {p.relative_to(a) for p in a.rglob("*") if p.is_file()}
    files_b = {p.relative_to(b) for p in b.rglob("*") if p.is_file()}
    problems = [f"only in {a}: {p}" for p in sorted(files_a - files_b)]
    problems += [f"only in {b}: {p}" for p in sorted(files_b - files_a)]
    for rel in sorted(files_a & files_b):
        if normalised(a / rel, ids) != normalised(b / rel, ids):
            problems.append(f"differs: {rel}")
    return problems


def run_demos(code: list[str], work: Path, demo_args: list[str]) -> tuple[Path, Path]:
    """`medbanana demo --out WORK/demo DEMO_ARGS` with each code tree's package, each output then moved aside."""
    outs = []
    for n, pythonpath in enumerate(code):
        out, kept = work / "demo", work / f"demo-{'ab'[n]}"
        env = {**os.environ, "PYTHONPATH": str(Path(pythonpath).resolve())}
        started = time.perf_counter()
        subprocess.run([sys.executable, "-m", "medbanana.cli", "demo", "--out", str(out), "--quiet", *demo_args],
                       env=env, check=True)
        print(f"demo with {pythonpath}: {time.perf_counter() - started:.1f} s", flush=True)
        shutil.move(out, kept)
        outs.append(kept)
    return outs[0], outs[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folders", nargs="*", type=Path, help="two demo outputs to compare (without --code)")
    parser.add_argument("--code", nargs=2, metavar="PYTHONPATH", help="run the demo with each, then compare")
    parser.add_argument("--work", type=Path, help="where the demos are written (default: a temporary folder)")
    for option in ("--normal", "--diseased", "--size", "--seed"):
        parser.add_argument(option, help=f"the demo's {option} (with --code)")
    args = parser.parse_args()
    demo_args = [word for option in ("normal", "diseased", "size", "seed") if getattr(args, option) is not None
                 for word in (f"--{option}", getattr(args, option))]
    if args.code:
        work = args.work or Path(tempfile.mkdtemp(prefix="compare-demo-"))
        a, b = run_demos(args.code, work, demo_args)
    elif len(args.folders) == 2:
        a, b = args.folders
    else:
        parser.error("give two demo folders, or --code PYTHONPATH_A PYTHONPATH_B")
    problems = compare(a, b)
    count = sum(1 for p in a.rglob("*") if p.is_file())
    for line in problems:
        print(line)
    rows = {}  # the built dataset's rows per config, each compared cell by cell above
    for path in sorted(a.rglob("*.parquet")):
        config = path.relative_to(a).parts[-2]
        rows[config] = rows.get(config, 0) + pq.read_metadata(path).num_rows
    if rows:
        print("dataset rows compared: " + ", ".join(f"{config} {n}" for config, n in rows.items()))
    print(f"{count} files compared: {'identical' if not problems else f'{len(problems)} differ'} "
          "(run ids, clock stamps and durations set aside)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
