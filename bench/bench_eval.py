"""Benchmark `medbanana eval`: samples per second, end to end, with one scoring process and with more, and against
an earlier version of the code.

    python bench/bench_eval.py                         # a demo dataset at 1024 px (2 normal, 1 diseased per class)
    python bench/bench_eval.py --before HEAD~3 --workers 1 2 --repeat 3
    python bench/bench_eval.py --dataset DATASET --workers 1 2 auto

Each eval runs in a child process of its own (`medbanana eval DATASET --out TMP -q --no-lpips --workers N`, the
default simulator judge included), start-up included, settings alternating within each repeat; the median wall
time per setting is printed with samples/s and the speed-up over the first setting. `--before REV` adds the code
of that git revision (`git archive` into a temp folder, run with one process and the same options but --workers,
which it may not have) as the first setting. Every setting's samples.jsonl is compared with the first's: the
largest difference of any metric is printed (the target is at most 1e-6).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def records(out: Path) -> dict[str, dict]:
    return {r["id"]: r for r in map(json.loads, (out / "samples.jsonl").read_text().splitlines())}


def largest_difference(before: dict[str, dict], after: dict[str, dict]) -> float:
    """The largest absolute difference of a number between two evals' records (inf when they differ otherwise)."""
    if before.keys() != after.keys():
        return float("inf")
    worst = 0.0
    for key, record in before.items():
        other = after[key]
        if record.keys() != other.keys():
            return float("inf")
        for field, value in record.items():
            if isinstance(value, float) and isinstance(other[field], float):
                worst = max(worst, abs(value - other[field]))
            elif value != other[field]:
                return float("inf")
    return worst


def checkout(revision: str, into: Path) -> Path:
    """The package of `revision` as a folder to put on PYTHONPATH (its `medbanana/`)."""
    (into / "medbanana").mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(REPO), "archive", revision], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into / "medbanana")], input=archive, check=True)
    return into


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dataset", type=Path, help="a built dataset (default: build a demo one in a temp folder)")
    parser.add_argument("--workers", nargs="+", default=["1", "2"], help="eval --workers of each setting (default 1 2)")
    parser.add_argument("--before", metavar="REV", help="also run this git revision's code (one process), first")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-eval-") as tmp:
        dataset = args.dataset
        if dataset is None:
            from medbanana.demo import run_demo

            run_demo(Path(tmp) / "demo", n_normal=2, n_diseased=1, size=1024, quiet=True)
            dataset = Path(tmp) / "demo" / "dataset"
        settings = [(f"--workers {n}", ["--workers", n], os.environ.get("PYTHONPATH", "")) for n in args.workers]
        if args.before:
            settings.insert(0, (f"{args.before} (before)", [], str(checkout(args.before, Path(tmp) / "before"))))
        seconds: dict[str, list[float]] = {name: [] for name, *_ in settings}
        outs: dict[str, Path] = {}
        loads = [os.getloadavg()[0]]
        for repeat in range(args.repeat):
            for name, options, path in settings:
                out = Path(tmp) / f"out-{len(outs)}"
                start = time.perf_counter()
                subprocess.run([sys.executable, "-m", "medbanana", "eval", str(dataset), "--out", str(out), "-q",
                                "--no-lpips", *options], check=True, stdout=subprocess.DEVNULL,
                               env={**os.environ, "PYTHONPATH": path})
                seconds[name].append(time.perf_counter() - start)
                outs.setdefault(name, out)
                loads.append(os.getloadavg()[0])
        first = records(outs[settings[0][0]])
        base = statistics.median(seconds[settings[0][0]])
        print(f"eval of {len(first)} samples, simulator judge, no LPIPS (median of {args.repeat}, each in its own "
              f"process, start-up included); {os.cpu_count()} CPUs, 1-minute load average "
              f"{min(loads):.1f}-{max(loads):.1f} while it ran:")
        for name, *_ in settings:
            median = statistics.median(seconds[name])
            difference = largest_difference(first, records(outs[name]))
            print(f"  {name:>24}: {median:6.2f} s, {len(first) / median:5.2f} samples/s, x{base / median:.2f}; "
                  f"largest difference from the first: {difference:.1e}")


if __name__ == "__main__":
    main()
