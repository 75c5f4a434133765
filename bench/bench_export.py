"""Benchmark `medbanana export medebench`: rows per second with one PNG-encoding thread and with more.

    python bench/bench_export.py                          # a demo dataset at 1024 px (2 normal, 1 diseased per class)
    python bench/bench_export.py --dataset DATASET --threads 1 2 4 --repeat 3

Each export runs in a child process of its own (`medbanana export medebench DATASET --out TMP -q --threads N`),
settings alternating within each repeat; the median wall time per setting is printed with rows/s and the speed-up
over the first setting. The exports are compared file by file: every setting must write the same bytes.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from medbanana.generation.vocabulary import old_spelling


def digest(folder: Path) -> str:
    sha = hashlib.sha256()
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            sha.update(path.relative_to(folder).as_posix().encode() + b"\0" + path.read_bytes())
    return sha.hexdigest()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dataset", type=Path, help="a built dataset (default: build a demo one in a temp folder)")
    old_spelling(parser, parser.add_argument("--threads", type=int, nargs="+", default=[1, 2],
                                             help="PNG-encoding threads of each setting (default 1 2)"), "--workers")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--split", default="train",
                        help="the split exported (default train: the demo dataset has no test split)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-export-") as tmp:
        dataset = args.dataset
        if dataset is None:
            from medbanana.demo import run_demo

            run_demo(Path(tmp) / "demo", n_normal=2, n_diseased=1, size=1024, quiet=True)
            dataset = Path(tmp) / "demo" / "dataset"
        seconds: dict[int, list[float]] = {n: [] for n in args.threads}
        digests, rows = set(), None
        for repeat in range(args.repeat):
            for n in args.threads:
                out = Path(tmp) / f"out-{n}-{repeat}"
                start = time.perf_counter()
                subprocess.run([sys.executable, "-m", "medbanana", "export", "medebench", str(dataset), "--split",
                                args.split, "--out", str(out), "-q", "--threads", str(n)], check=True,
                               stdout=subprocess.DEVNULL)
                seconds[n].append(time.perf_counter() - start)
                report = json.loads((out / "editing" / "medbanana-export.json").read_text())
                rows = report["exported"]
                digests.add(digest(out / "editing"))
    base = statistics.median(seconds[args.threads[0]])
    print(f"export medebench, {rows} rows (median of {args.repeat}, each in its own process):")
    for n in args.threads:
        median = statistics.median(seconds[n])
        print(f"  --threads {n}: {median:.2f} s, {rows / median:.1f} rows/s, x{base / median:.2f}")
    print("every setting wrote the same files" if len(digests) == 1 else f"EXPORTS DIFFER ({len(digests)} digests)")


if __name__ == "__main__":
    main()
