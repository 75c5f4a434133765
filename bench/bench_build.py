"""Benchmark `medbanana build`: throughput against `cp -r`, peak memory, and the metadata pass at release scale.

    python bench/bench_build.py                      # the issue's sizes: 20,000 attempts (~1.5 GB), 88,457 tasks
    python bench/bench_build.py --attempts 2000 --metadata-tasks 5000   # a quick check
    python bench/bench_build.py --skip-build --metadata-run /tmp/meta --metadata-repeat 5  # keep the JSON, 5 runs

Part 1 synthesises a run in the original layout (attempt images of about --image-kb KB from a pool of distinct
JPEGs), then, with the page cache of every image file dropped before each measurement (posix_fadvise DONTNEED,
which needs no privileges), times `cp -r` of the run and two builds in a child process each:
  * images once: configs sft + failed, where every attempt image is written exactly once, as a copy would;
  * all configs: sft, failed, dpo_pairs, conversations, judge (images are written into several configs).
It prints rows/s, MB/s read and written, the ratio to cp's throughput and the peak RSS of the build processes.
Targets (issue 4): images-once throughput >= 0.8x cp, peak RSS <= 512 MB.

Part 2 writes JSON only for --metadata-tasks tasks with --text-words sized texts (about 800 MB at the defaults)
and times reading every unit and pairing: discovery, JSON decoding, task records, DPO pairs and statistics, in one
process and in --metadata-workers spawned worker processes planned as the build plans them, each importing what a build
worker imports. Targets (issue 18): worker start-up < 1 s, failure-reason clauses < 1 s, end to end < 3 s.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from medbanana.generation.vocabulary import old_spelling

ATTEMPTS_PER_TASK = 3.15  # expected attempts per task of synthetic_run's outcome model
FOLDERS = 6  # 3 datasets x 2 directions

_CHILD = """
import json, resource, sys, time
from medbanana.builder.build import build
run, out, configs, num_proc = sys.argv[1], sys.argv[2], sys.argv[3].split(","), int(sys.argv[4])
t = time.perf_counter()
info = build([run], out, configs=configs, num_proc=num_proc, quiet=True)
seconds = time.perf_counter() - t
# VmHWM: this process's own peak (ru_maxrss would start from the parent's peak, kept across fork and exec);
# workers (num_proc > 1) report ru_maxrss of children, an upper bound for the same reason
own = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM"))
rss = max(own, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss if num_proc > 1 else 0)
rows = sum(v["rows"] for splits in info["configs"].values() for v in splits.values())
print(json.dumps({"seconds": seconds, "rows": rows, "peak_rss_mb": rss / 1024,
                  "read_bytes": info["stats"]["image_bytes_read"]}))
"""


def drop_cache(root: Path) -> None:
    """Evict the files under root from the page cache (clean pages only, hence the sync first)."""
    os.sync()
    for path in root.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def folder_bytes(root: Path, suffix: str) -> int:
    return sum(p.stat().st_size for p in root.rglob(f"*{suffix}") if p.is_file())


def time_copy(run: Path, work: Path) -> float:
    target = work / "copy"
    shutil.rmtree(target, ignore_errors=True)
    drop_cache(run)
    t = time.perf_counter()
    subprocess.run(["cp", "-r", str(run), str(target)], check=True)
    seconds = time.perf_counter() - t  # like the build's: inputs read cold, outputs left in the page cache

    shutil.rmtree(target)
    return seconds


def time_build(run: Path, work: Path, configs: str, num_proc: int) -> dict:
    out = work / "built"
    shutil.rmtree(out, ignore_errors=True)
    drop_cache(run)
    t = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", _CHILD, str(run), str(out), configs, str(num_proc)],
                          check=True, capture_output=True, text=True)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["wall_seconds"] = time.perf_counter() - t  # includes the interpreter's start and imports
    result["written_bytes"] = folder_bytes(out, ".parquet")
    shutil.rmtree(out)
    return result


def bench_build(args, work: Path) -> None:
    from medbanana.builder.synthetic_run import make_synthetic_run

    run = work / "run"
    per_folder = max(1, round(args.attempts / ATTEMPTS_PER_TASK / FOLDERS))
    side = {50: 420, 75: 512, 110: 640}.get(args.image_kb, int(512 * (args.image_kb / 75) ** 0.5))
    t = time.perf_counter()
    written = make_synthetic_run(run, tasks_per_folder=per_folder, api_failed_per_folder=0, image_size=side,
                                 distinct_images=64, text_words=20, seed=1)
    images_mb = written["image_bytes"] / 1e6
    print(f"synthetic run: {written['tasks']:,} tasks, {written['attempts']:,} attempts, {images_mb:,.0f} MB of "
          f"images ({written['image_bytes'] / max(1, written['attempts']) / 1e3:.0f} KB each), "
          f"made in {time.perf_counter() - t:.0f} s")
    cp_seconds = time_copy(run, work)
    cp_rate = folder_bytes(run, ".jpeg") / 1e6 / cp_seconds
    print(f"cp -r (cold cache): {cp_seconds:.1f} s, {cp_rate:,.0f} MB/s of images")
    for label, configs in (("images once (sft,failed)", "sft,failed"),
                           ("all configs", "sft,failed,dpo_pairs,conversations,judge")):
        r = time_build(run, work, configs, args.workers)
        read_rate = r["read_bytes"] / 1e6 / r["seconds"]
        write_rate = r["written_bytes"] / 1e6 / r["seconds"]
        print(f"build {label}, --workers {args.workers}: {r['seconds']:.1f} s ({r['wall_seconds']:.1f} s with "
              f"start-up), {r['rows'] / r['seconds']:,.0f} rows/s, "
              f"read {read_rate:,.0f} MB/s ({read_rate / cp_rate:.2f}x cp), wrote {r['written_bytes'] / 1e6:,.0f} MB "
              f"at {write_rate:,.0f} MB/s ({write_rate / cp_rate:.2f}x cp), peak RSS {r['peak_rss_mb']:,.0f} MB")


_ready_at = None  # when this worker process had imported what a build worker imports (time.time())


def worker_ready() -> None:
    """Pool initializer: import what a build worker imports (`builder.partition`), and note when that was done."""
    global _ready_at
    import medbanana.builder.partition  # noqa: F401

    _ready_at = time.time()


def scan_metadata(items) -> dict:
    """Read and pair one partition's tasks exactly as a build partition does, without images."""
    from medbanana.builder.rows import dpo_rows
    from medbanana.generation.rundir.runs import read_tasks
    from medbanana.builder.stats import BuildStats

    def scan_unit(tasks: list) -> int:  # a function, as in the build: a unit's records die before the next
        for task in tasks:
            stats.add_task(task, {}, None)
        return sum(1 for task in tasks for _ in dpo_rows(task, {}, None))

    t, cpu = time.perf_counter(), time.process_time()
    stats, tasks, pairs = BuildStats(), 0, 0
    for unit, block, blocks in items:
        records = read_tasks(unit, block, blocks)
        tasks += len(records)
        pairs += scan_unit(records)
        del records
    seconds = time.perf_counter() - t
    # the card's failure-reason table splits every distinct rejection text once, after the pass: timed apart
    t = time.perf_counter()
    stats.top_failure_reasons(10)
    peak_kb = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM"))
    return {"tasks": tasks, "pairs": pairs, "seconds": seconds, "cpu": time.process_time() - cpu, "ready_at": _ready_at,
            "reasons_seconds": time.perf_counter() - t,
            "rss_mb": peak_kb / 1024}  # VmHWM: this worker's own peak (ru_maxrss starts from the parent's)


def bench_metadata(args, work: Path) -> None:
    import multiprocessing

    from medbanana.builder.build import discover_all, plan_partitions
    from medbanana.builder.synthetic_run import make_synthetic_run

    run = args.metadata_run or work / "metadata-run"
    per_folder = max(1, round(args.metadata_tasks / FOLDERS))
    t = time.perf_counter()
    made = not run.exists()
    if made:
        make_synthetic_run(run, tasks_per_folder=per_folder, api_failed_per_folder=0, text_words=args.text_words,
                           write_images=False, seed=2)
    json_mb = sum(p.stat().st_size for p in run.rglob("all_conversations.json")) / 1e6
    print(f"metadata run: {json_mb:,.0f} MB of all_conversations.json, "
          + (f"{per_folder * FOLDERS:,} tasks made in {time.perf_counter() - t:.0f} s" if made
             else f"reused from {run}"))
    for num_proc in sorted({1, args.metadata_workers}):
        for label in ("cold cache", *["warm cache"] * args.metadata_repeat):
            if label == "cold cache":
                drop_cache(run)
            t, started = time.perf_counter(), time.time()
            plan = plan_partitions(discover_all([run]), num_proc)
            # fresh spawned workers importing what build workers import, so that start-up and peak RSS are real
            with multiprocessing.get_context("spawn").Pool(num_proc, initializer=worker_ready) as pool:
                results = pool.map(scan_metadata, plan, chunksize=1)
            wall = time.perf_counter() - t  # end to end: planning, start-up, the pass, clauses, results back
            inside = max(r["seconds"] for r in results)
            startup = max(r["ready_at"] for r in results) - started
            print(f"read + pair metadata, {num_proc} process(es), {label}: {sum(r['tasks'] for r in results):,} "
                  f"tasks, {sum(r['pairs'] for r in results):,} pairs in {inside:.2f} s "
                  f"(CPU {max(r['cpu'] for r in results):.2f} s), {json_mb / inside:,.0f} MB/s of JSON, "
                  f"peak RSS {max(r['rss_mb'] for r in results):,.0f} MB per process; worker start-up "
                  f"{startup:.2f} s; the card's failure-reason clauses "
                  f"{max(r['reasons_seconds'] for r in results):.2f} s; end to end {wall:.2f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--attempts", type=int, default=20_000, help="attempt images in the synthetic run")
    parser.add_argument("--image-kb", type=int, default=75, help="approximate size of each JPEG")
    old_spelling(parser, parser.add_argument("--workers", type=int, default=1, help="build worker processes"),
                 "--num-proc")
    parser.add_argument("--metadata-tasks", type=int, default=88_457, help="tasks in the metadata benchmark")
    parser.add_argument("--text-words", type=int, default=26,
                        help="words per reason; thinking texts are 4x (26: ~800 MB for 88,457 tasks)")
    old_spelling(parser, parser.add_argument("--metadata-workers", type=int, default=2,
                                             help="also time the metadata pass with N worker processes"),
                 "--metadata-num-proc")
    parser.add_argument("--metadata-repeat", type=int, default=1,
                        help="time the warm-cache pass this many times (a range on a shared machine)")
    parser.add_argument("--metadata-run", type=Path,
                        help="keep the metadata run here (made when absent, reused as it is when present: "
                             "--metadata-tasks and --text-words then do not apply)")
    parser.add_argument("--skip-build", action="store_true")
    parser.add_argument("--skip-metadata", action="store_true")
    parser.add_argument("--workdir", type=Path, help="where to write (default: a temporary folder, removed)")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-build-", dir=args.workdir))
    try:
        if not args.skip_build:
            bench_build(args, work)
        if not args.skip_metadata:
            bench_metadata(args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
