"""How good is `medbanana plan --pilot`? Pilots of 5 % and 10 % of a run, then the full run, against the fake
Gemini server (echo engine: a task's rounds follow its judge's acceptance rate; usage as the fake reports it), at
several acceptance rates and task counts, each over several seeds (the seed changes the source images, hence which
edits the judge accepts, and which tasks fall in the pilot's shard).

For each run it prints the plan's expected calls and USD with their 90 % interval, the full run's actual calls (as
the fake server counted them) and USD (its medbanana-stats.json), whether the actual lies in the interval, and the
expected value's error. The issue's targets: the actual in the 90 % interval in at least 9 of 10 seeds, and the
expected value within 10 % for runs of 200 tasks or more from a 10 % pilot. The summary's "bias" is the mean
expected USD over the mean actual USD, less one: the error on average over the seeds, where "|err|<=10%" counts the
runs whose own estimate was that close; "9 of 10" takes the seeds ten at a time and counts the tens that met the
first target.

    python bench/bench_plan.py                        # 200 and 1000 tasks, rates .3 .6 .9, 10 seeds
    python bench/bench_plan.py --sizes 200 --seeds 3  # a quick look
    python bench/bench_plan.py --jobs 16              # on 16 idle cores

A pilot is `generate --shard 0/20` (5 %) or `--shard 0/10` (10 %): a hash of each task's uid picks it, so it is a
sample of the whole selection (a --limit would take the first tasks in sort order, one disease at a time).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

import numpy as np
from PIL import Image

from medbanana.cli import main
from medbanana.generation.records import DEFAULT_MAX_ROUNDS
from medbanana.generation.testing.fake_gemini import FakeGemini

MAX_ROUNDS = DEFAULT_MAX_ROUNDS
CHEST_TARGETS = 11  # add tasks per normal chest image (the taxonomy's chest targets)


def make_sources(root: Path, tasks: int, seed: int) -> int:
    """A chest dataset folder of about `tasks` tasks (normal images x 11 targets, plus remove tasks); returns how
    many. Pixels and names depend on the seed."""
    rng = np.random.default_rng(seed)
    normal, remove = divmod(tasks, CHEST_TARGETS)
    if remove < 2:
        normal, remove = normal - 1, remove + CHEST_TARGETS
    for folder, count in (("normal", normal), ("Pneumothorax", remove)):
        (root / "MIMIC_bench" / folder).mkdir(parents=True, exist_ok=True)
        for i in range(count):
            pixels = rng.integers(0, 255, (32, 32, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(root / "MIMIC_bench" / folder / f"s{seed}-{i:04d}.jpeg", quality=90)
    return normal * CHEST_TARGETS + remove


def quiet_main(argv: list[str]) -> tuple[int, str]:
    """(exit code, what it printed on stdout); stderr's last line joins stdout when the command fails."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    return code, out.getvalue() if code == 0 else out.getvalue() + err.getvalue().strip().splitlines()[-1]


def generate(sources: Path, out: Path, *extra: str) -> None:
    code, printed = quiet_main(["generate", "--sources", str(sources), "--out", str(out), "--backend", "gemini",
                                "--max-rounds", str(MAX_ROUNDS), "--concurrency", "16", "--max-attempts", "3",
                                "--retry-base-delay", "0.01", "-q", *extra])
    if code != 0:
        raise RuntimeError(f"generate into {out} ended with exit code {code}: {printed}")


def one(fake: FakeGemini, work: Path, size: int, seed: int, pilots: list[float]) -> list[dict]:
    sources = work / f"sources-{size}-{seed}"
    tasks = make_sources(sources, size, seed)
    rows = []
    for fraction in pilots:
        parts = round(1 / fraction)
        pilot = work / f"pilot-{size}-{seed}-{parts}"
        generate(sources, pilot, "--shard", f"0/{parts}")
        code, printed = quiet_main(["plan", "--sources", str(sources), "--backend", "gemini", "--max-rounds",
                                    str(MAX_ROUNDS), "--pilot", str(pilot), "--json", "--seed", str(seed)])
        assert code == 0, printed
        rows.append({"fraction": fraction, "pilot_tasks": json.loads(printed)["pilot"]["tasks"],
                     "plan": json.loads(printed)})
    fake.reset()
    full = work / f"full-{size}-{seed}"
    generate(sources, full)
    calls = fake.count()
    usd = json.loads((full / "medbanana-stats.json").read_text())["cost"]["usd"]
    for row in rows:
        plan = row.pop("plan")
        assert plan["tasks"] == tasks, (plan["tasks"], tasks)
        row.update(tasks=tasks, seed=seed, actual_calls=calls, actual_usd=usd,
                   calls=plan["calls"], usd=plan["usd"])
    return rows


def inside(figure: dict, actual: float) -> bool:
    return figure["low"] <= actual <= figure["high"]


def error(figure: dict, actual: float) -> float:
    return (figure["expected"] - actual) / actual


def report(rows: list[dict], rate: float) -> None:
    for row in rows:
        print(f"  rate {rate:.1f}  tasks {row['tasks']:>5}  seed {row['seed']:>2}  pilot {row['fraction']:>4.0%} "
              f"({row['pilot_tasks']:>3} tasks)  calls {row['calls']['expected']:>7.0f} "
              f"[{row['calls']['low']:>6.0f}, {row['calls']['high']:>6.0f}] actual {row['actual_calls']:>6} "
              f"{'in ' if inside(row['calls'], row['actual_calls']) else 'OUT'}  USD {row['usd']['expected']:>7.2f} "
              f"[{row['usd']['low']:>6.2f}, {row['usd']['high']:>6.2f}] actual {row['actual_usd']:>6.2f} "
              f"{'in ' if inside(row['usd'], row['actual_usd']) else 'OUT'}  error {error(row['usd'], row['actual_usd']):+.1%}",
              flush=True)


def summary(rows: list[dict]) -> None:
    print("\nsummary: per acceptance rate, tasks and pilot size, over the seeds")
    print(f"{'rate':>4} {'tasks':>5} {'pilot':>5} {'seeds':>5}  {'calls in 90%':>12} {'USD in 90%':>10}  "
          f"{'mean |err|':>10} {'max |err|':>9}  {'|err|<=10%':>10}  {'bias':>6}  {'9 of 10':>7}")
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        groups.setdefault((row["rate"], row["tasks"], row["fraction"]), []).append(row)
    for (rate, tasks, fraction), group in sorted(groups.items()):
        errors = [abs(error(r["usd"], r["actual_usd"])) for r in group]
        calls_in = sum(inside(r["calls"], r["actual_calls"]) for r in group)
        usd_in = sum(inside(r["usd"], r["actual_usd"]) for r in group)
        print(f"{rate:>4.1f} {tasks:>5} {fraction:>5.0%} {len(group):>5}  {calls_in:>7}/{len(group):<4} "
              f"{usd_in:>5}/{len(group):<4}  {statistics.mean(errors):>10.1%} {max(errors):>9.1%}  "
              f"{sum(e <= 0.10 for e in errors):>5}/{len(group)}  {bias(group):>+6.1%}  {nine_of_ten(group):>7}")


def nine_of_ten(group: list[dict]) -> str:
    """Of the seeds taken ten at a time in order, how many tens had the actual calls inside the interval 9 or 10
    times (the issue's target, asked of one set of ten seeds); '-' with fewer than 10 seeds."""
    ordered = sorted(group, key=lambda r: r["seed"])
    tens = [ordered[i:i + 10] for i in range(0, len(ordered) - 9, 10)]
    met = sum(sum(inside(r["calls"], r["actual_calls"]) for r in ten) >= 9 for ten in tens)
    return f"{met}/{len(tens)}" if tens else "-"


def bias(group: list[dict]) -> float:
    """The mean expected USD over the mean actual, less one: how far the plans are off on average, not per run."""
    return (statistics.mean(r["usd"]["expected"] for r in group)
            / statistics.mean(r["actual_usd"] for r in group) - 1)


def simulate(rates: list[float], sizes: list[int], pilots: list[float], seeds: int) -> list[dict]:
    """The plan's interval checked by simulation under its model, without runs: each task's rounds drawn as the echo
    judge makes them (accepted with probability `rate` each round, at most MAX_ROUNDS), the same per-round usage
    for every task, a pilot of about `fraction` of the tasks (a binomial draw, as a --shard hash gives), the plan
    made by `runners.plan.estimate` from that pilot, and the total of all the tasks as the actual."""
    from medbanana.generation.pricing import load_prices
    from medbanana.generation.records import Task
    from medbanana.generation.runners.pilot import Pilot, TaskSample
    from medbanana.generation.runners.plan import PlanSetting, estimate

    backends = {"writer": {"backend": "gemini", "model": "gemini-2.5-pro"},
                "editor": {"backend": "gemini", "model": "gemini-2.5-flash-image"},
                "judge": {"backend": "gemini", "model": "gemini-2.5-pro"}}
    setting = PlanSetting(backends, load_prices(), max_rounds=MAX_ROUNDS)
    rows = []
    for rate in rates:
        for size in sizes:
            tasks = [Task("SIM", "chest_xray", "Edema", "add", Path(f"t{i}.jpeg")) for i in range(size)]
            for seed in range(seeds):
                rng = np.random.default_rng(seed)
                accepted_at = rng.geometric(rate, size)
                rounds = np.minimum(accepted_at, MAX_ROUNDS)
                samples = [TaskSample("add", int(k), (int(k),) * 3, (700 * int(k), 400 * int(k), 1000 * int(k)),
                                      (30 * int(k), 1300 * int(k), 45 * int(k)), 1.0 * int(k), bool(a <= MAX_ROUNDS))
                           for k, a in zip(rounds, accepted_at)]
                actual_calls = 3 * int(rounds.sum())
                for fraction in pilots:
                    chosen = [s for s, pick in zip(samples, rng.random(size) < fraction) if pick]
                    if not chosen:
                        continue
                    pilot = Pilot(Path("simulated"), chosen, backends, MAX_ROUNDS, (), {})
                    plan = estimate(tasks, setting, pilot, seed=seed)
                    usd = {"expected": plan.figures["usd"][0], "low": plan.figures["usd"][1],
                           "high": plan.figures["usd"][2]}
                    calls = {"expected": plan.figures["calls"][0], "low": plan.figures["calls"][1],
                             "high": plan.figures["calls"][2]}
                    per_call = plan.figures["usd"][0] / plan.figures["calls"][0]  # usage is the same every round
                    rows.append({"rate": rate, "tasks": size, "seed": seed, "fraction": fraction,
                                 "pilot_tasks": len(chosen), "calls": calls, "usd": usd,
                                 "actual_calls": actual_calls, "actual_usd": actual_calls * per_call})
    return rows


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", type=int, nargs="+", default=[200, 1000], help="tasks per run")
    p.add_argument("--rates", type=float, nargs="+", default=[0.3, 0.6, 0.9], help="the fake judge's acceptance")
    p.add_argument("--seeds", type=int, default=10)
    p.add_argument("--pilots", type=float, nargs="+", default=[0.05, 0.10], help="pilot fractions")
    p.add_argument("--jobs", type=int, default=1, help="runs at once, each in its own process with its own fake "
                                                      "server (default 1)")
    p.add_argument("--json", type=Path, help="also write every row here")
    p.add_argument("--simulate", action="store_true",
                   help="check the interval by simulation under the plan's model instead of runs (fast: use "
                        "--seeds 200); no fake server, no generate")
    return p.parse_args(argv)


def unit(job: tuple) -> list[dict]:
    """One (rate, size, seed): its own fake server, pilots, plans and full run, in a folder of its own."""
    rate, size, seed, pilots, tmp = job
    with FakeGemini(engine="echo", accept_rate=rate) as fake:
        os.environ.update(GEMINI_API_KEY="bench-plan-key", GOOGLE_GEMINI_BASE_URL=fake.base_url)
        return [{**row, "rate": rate} for row in one(fake, Path(tmp) / f"r{rate}-n{size}-s{seed}", size, seed, pilots)]


def run(argv=None) -> list[dict]:
    args = parse_args(argv)
    started, rows = time.perf_counter(), []
    if args.simulate:
        rows = simulate(args.rates, args.sizes, args.pilots, args.seeds)
        print(f"bench_plan --simulate: {time.strftime('%Y-%m-%d')}, the plan's interval under its own model, "
              f"{args.seeds} seeds per row")
        summary(rows)
        print(f"\n{len(rows)} plans checked in {time.perf_counter() - started:.0f} s")
        return rows
    print(f"bench_plan: {time.strftime('%Y-%m-%d')}, fake Gemini (echo engine), max rounds {MAX_ROUNDS}, "
          f"prices of the shipped table; sizes {args.sizes}, rates {args.rates}, {args.seeds} seeds, "
          f"pilots {args.pilots}, {os.cpu_count()} CPUs, {args.jobs} at once", flush=True)
    with tempfile.TemporaryDirectory(prefix="bench-plan-") as tmp:
        jobs = [(rate, size, seed, args.pilots, tmp) for rate in args.rates for size in args.sizes
                for seed in range(args.seeds)]
        if args.jobs > 1:  # not a multiprocessing.Pool: its daemonic workers could not start a run's mask process
            with ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
                for done in as_completed([pool.submit(unit, job) for job in jobs]):
                    new = done.result()
                    report(new, new[0]["rate"])
                    rows += new
        else:
            for job in jobs:
                new = unit(job)
                report(new, job[0])
                rows += new
    summary(rows)
    print(f"\n{len(rows)} plans checked in {time.perf_counter() - started:.0f} s")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return rows


if __name__ == "__main__":
    sys.exit(0 if run() else 1)
