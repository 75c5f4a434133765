"""What rewriting a run's JSON files costs as the run grows, and how much of a run's time it takes.

    python bench/bench_materialize.py                     # 1,000 / 10,000 / 50,000 finished tasks in 6 folder pairs
    python bench/bench_materialize.py --tasks 88457       # the paper's 88k tasks

A run's JSON files of the original layout (progress.json, all_conversations.json, ...) are rebuilt from its finished
task records at the end and at intervals while it runs (`RunStore.maybe_materialize`, every 30 s at least), on the
run's event loop, which makes no call meanwhile. For each size this bench gives a real RunStore that many finished
tasks (records with the paper's outcome shape and texts of --text-words, from builder/synthetic_run.py, 3 datasets x
2 directions), then times:
  * "all pairs": a materialisation of every folder pair, what each one cost before only changed pairs were written
    (and still the first after opening a run, and the one at its end);
  * "one pair": one after a task of one pair finished, what a running run's costs now (the tasks in flight belong to
    one or two pairs at a time: sources are taken in order).
"share" is the part of a run's time spent there: with a fixed 30 s interval, and with the rule the store applies
(wait at least 30 s and at least 1 / MATERIALIZE_SHARE times what the last one took).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from medbanana.builder.synthetic_run import make_synthetic_run
from medbanana.generation.outcomes import TaskStatus
from medbanana.generation.rundir import layout
from medbanana.generation.rundir.store import MATERIALIZE_SHARE, RunStore

PAIRS = 6  # 3 datasets x 2 directions
EVERY = 30.0  # RunOptions.materialize_every's default


def synthetic_records(work: Path, tasks: int, text_words: int) -> list[dict]:
    """Finished task records as our generator journals them: all_conversations.json entries of a synthetic run,
    with the two fields that file leaves out (key; api_failure, absent here: no api_failed task)."""
    run = work / "synthetic"
    make_synthetic_run(run, flavor="ours", tasks_per_folder=max(1, tasks // PAIRS), api_failed_per_folder=0,
                       text_words=text_words, write_images=False, seed=3)
    records = []
    for dataset, direction, folder in layout.find_output_dirs(run):
        for key, record in json.loads((folder / layout.ALL_CONVERSATIONS).read_text()).items():
            records.append({**record, "key": key, "dataset": dataset, "task": direction})
    return records


def timed(store: RunStore) -> float:
    started = time.perf_counter()
    store.materialize()
    return time.perf_counter() - started


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tasks", type=int, nargs="+", default=[1_000, 10_000, 50_000])
    ap.add_argument("--text-words", type=int, default=26, help="words per reason; thinking texts are 4x (default 26)")
    args = ap.parse_args()
    print(f"{'tasks':>7} {'JSON MB':>8} {'all pairs s':>11} {'one pair s':>10} {'share, every 30 s':>17} "
          f"{'share, the rule':>15} {'interval s':>10}")
    for tasks in args.tasks:
        with tempfile.TemporaryDirectory(prefix="medbanana-bench-materialize-") as tmp:
            work = Path(tmp)
            records = synthetic_records(work, tasks, args.text_words)
            store = RunStore(work / "run", {"max_rounds": 5, "accept": "qualified", "seed": 0}).open()
            try:
                for record in records:
                    store.add_finished(record)
                every_pair = timed(store)  # the first after opening: every pair
                json_mb = sum(p.stat().st_size for p in (work / "run").rglob("*.json")) / 1e6
                one = records[0]
                store.add_finished({**one, "status": TaskStatus.FAILED if one["status"] == TaskStatus.SUCCESS
                                    else TaskStatus.SUCCESS})  # the same task, finished again: one pair changed
                one_pair = timed(store)
            finally:
                store.close()
        interval = max(EVERY, one_pair / MATERIALIZE_SHARE)
        print(f"{len(records):>7,} {json_mb:>8,.0f} {every_pair:>11.2f} {one_pair:>10.2f} "
              f"{every_pair / (EVERY + every_pair):>17.0%} {one_pair / (interval + one_pair):>15.1%} "
              f"{interval:>10.0f}")


if __name__ == "__main__":
    main()
