"""What C2PA signing costs: generation throughput with and without `--c2pa-cert/--c2pa-key` on the fake Gemini
side-by-side bench (bench_gemini.py's harness: its sources, its fake server, its `--one` child runs), and how many
images per second `verify --c2pa` checks.

    python bench/bench_c2pa.py                      # 200 tasks, concurrency 20, 1 and 2 procs, 3 repeats each
    python bench/bench_c2pa.py --tasks 500 --repeats 5 --verify-workers 2

Signed and unsigned runs alternate, so load on the shared machine falls on both alike; the overhead is the ratio of
their median throughputs. Targets (issue 19): overhead <= 5 %, verify >= 200 images/s on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_gemini  # noqa: E402  (the harness is reused, not copied)


def one_run(args, sources: Path, out: Path, base_url: str, workers: int, keys) -> dict:
    extra = ["--c2pa-cert", str(keys.chain), "--c2pa-key", str(keys.key)] if keys else []
    child = subprocess.run(
        [sys.executable, bench_gemini.__file__, "--one", "--tasks", str(args.tasks), "--concurrency",
         str(args.concurrency), "--workers", str(workers), "--sources", str(sources), "--out", str(out),
         "--latency", str(args.latency), "--base-url", base_url, *extra],
        env={**os.environ, "GEMINI_API_KEY": "bench-key"}, capture_output=True, text=True, check=True)
    return json.loads(child.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tasks", type=int, default=200)
    ap.add_argument("--concurrency", type=int, default=20)
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--latency", type=float, default=0.2, help="seconds the fake adds to every call")
    ap.add_argument("--verify-workers", type=int, default=2, help="processes for the verify figure (default 2)")
    args = ap.parse_args()

    from medbanana.builder.c2pa_check import dataset_images, run_images, verify_c2pa
    from medbanana.cli import main as cli
    from medbanana.generation.rundir.signing_keys import init_keys

    with bench_gemini.fake_gemini_and_workdir(args.latency, "c2pa") as (base_url, work, _server_pid):
        keys = init_keys(work / "keys")
        sources = bench_gemini.make_sources(work / "sources", args.tasks)
        print(f"fake Gemini (echo, {args.latency} s per call); {args.tasks} tasks, concurrency {args.concurrency}; "
              f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}")
        print(f"{'procs':>5} {'unsigned tasks/s':>17} {'signed tasks/s':>15} {'overhead':>9} {'cpu ms/task +':>14}")
        kept = None
        for workers in args.workers:
            figures = {False: [], True: []}
            cpu = {False: [], True: []}
            for repeat in range(args.repeats):
                for signed in (False, True):
                    out = work / f"run-{workers}-{repeat}-{int(signed)}"
                    r = one_run(args, sources, out, base_url, workers, keys if signed else None)
                    figures[signed].append(args.tasks / r["wall"])
                    cpu[signed].append(r["client_cpu"] / args.tasks)
                    if signed and kept is None:
                        kept = out
                    else:
                        shutil.rmtree(out)
            plain, signed = statistics.median(figures[False]), statistics.median(figures[True])
            extra_cpu = 1000 * (statistics.median(cpu[True]) - statistics.median(cpu[False]))
            print(f"{workers:>5} {plain:>17.2f} {signed:>15.2f} {100 * (1 - signed / plain):>8.1f}% "
                  f"{extra_cpu:>14.1f}", flush=True)

        images = sum(1 for _ in run_images(kept))
        assert cli(["build", str(kept), "--out", str(work / "ds"), "-q"]) == 0
        for label, source in (("run", lambda: run_images(kept)), ("dataset", lambda: dataset_images(work / "ds"))):
            started = time.perf_counter()
            report = verify_c2pa(source(), trust=keys.ca, workers=args.verify_workers)
            wall = time.perf_counter() - started
            assert report.ok, report.describe()
            print(f"verify --c2pa ({label}, {args.verify_workers} workers): {report.images} distinct images "
                  f"({sum(report.counts.values())} rows) in {wall:.2f} s = {report.images / wall:.0f} images/s "
                  f"(run holds {images} signed 1024x1024 JPEGs)")


if __name__ == "__main__":
    main()
