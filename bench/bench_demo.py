"""Run the offline demo at a larger size and print tasks/s and peak memory.

    python bench/bench_demo.py --normal 6 --diseased 3 --concurrency 2
"""

import argparse
import resource
import shutil
import tempfile
import time
from pathlib import Path

from medbanana.demo import run_demo


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--normal", type=int, default=6, help="normal sources per modality")
    ap.add_argument("--diseased", type=int, default=3, help="diseased sources per target")
    ap.add_argument("--concurrency", type=int, default=2)
    ap.add_argument("--size", type=int, default=1024)
    ap.add_argument("--keep", type=Path, help="write here and keep it (default: a temporary folder)")
    args = ap.parse_args()
    out = args.keep or Path(tempfile.mkdtemp(prefix="medbanana-bench-"))
    started = time.perf_counter()
    summary = run_demo(out, n_normal=args.normal, n_diseased=args.diseased, concurrency=args.concurrency,
                       size=args.size, quiet=True)
    wall = time.perf_counter() - started
    stats = summary.as_dict()
    attempts = stats["failed_attempts"] + stats["success"]
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"tasks {stats['tasks']}  attempts {attempts}  wall {wall:.1f} s (generation {summary.seconds:.1f} s)")
    print(f"tasks/s {stats['tasks'] / summary.seconds:.2f}  attempts/s {attempts / summary.seconds:.2f}  "
          f"peak RSS {peak_mb:.0f} MB")
    print(f"success {stats['success']}  failed {stats['failed']}  errors {stats['api_failed']}  "
          f"success by round {stats['success_rounds']}")
    if not args.keep:
        shutil.rmtree(out)


if __name__ == "__main__":
    main()
