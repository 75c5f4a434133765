"""Throughput of `generate --backend gemini` against the fake Gemini server: how close to the concurrency bound?

    python bench/bench_gemini.py          # the case that matters: 2 s per call, 1,000 tasks at --concurrency 100, 200
    python bench/bench_gemini.py --case short    # 300 one-round tasks (3 calls each) at 2 s, 100 in flight: waves
    python bench/bench_gemini.py --case fast     # 1,000 tasks at 0.2 s per call, 20 in flight: the client's CPU
    python bench/bench_gemini.py --latency 0.2 --concurrency 20 100 --workers 1 2   # client CPU-bound: information

The two cases and their targets (one process on 2 cores, the fake server on the same cores): `short`, where every
task's image arrives at once with its wave's, reaches >= 0.9 of the ideal (18 s: 300 tasks x 3 calls x 2 s / 100);
`fast` reaches >= 0.85 of the concurrency bound. `--check-in thread` makes each edit's geometry check in a thread
beside the event loop instead of the run's process pool (the alternative the runners do not take), to compare.
`--check-in none` makes no check and no masks at all: the same run with no per-image work, what the client alone
reaches on this machine. A case runs it after the real run and prints the difference: what the per-image work costs.

Gemini's own latencies are 2-10 s for judge and writer calls and 10-30 s for image edits, so 2 s per call is the
fast end of real use; the target there is 0.9 of the ideal (below) on 2 cores with the server on the same cores.
At 0.2 s per call the client's CPU per call sets the figures instead; they are kept as information.

The fake runs in its own process with the echo engine (no image work) and a fixed latency per call, so a perfect
client keeps `concurrency` calls in flight all the time and needs calls x latency / concurrency seconds: the bound.
Each client process is one event loop, so it can also be CPU-bound: at c ms of client CPU per call, P processes
(`generate --workers P`, "procs") make at most min(P, CPUs) x 1000/c calls per second, which caps the ratio at
min(P, CPUs) x latency / (concurrency x c) ("cpu cap"; above 1 means not CPU-bound). The fake server shares the same
CPUs: "server ms/call" is its CPU per call, and "shared cap" the ratio the machine allows when its CPUs do both the
client's and the server's work (above 1: not CPU-bound). Sources are 1024x1024 JPEGs (the released samples in
../shared/samples when present, else synthetic ones).
The bound assumes `concurrency` calls in flight from the first call to the last, which no client can do at the end
of a run: a task's calls follow each other (write, edit, judge, round after round), so once fewer tasks than slots
are left the slots empty, and a task that takes five rounds near the end sets the wall time. "ideal s" is the wall
time of a client that costs nothing: the run's own tasks, with the calls each made (counted from its journal),
started in the run's order on `concurrency` slots. "of ideal" is ideal / wall: how close the client came to what
this workload allows. At concurrency 100 with 1,000 tasks the ideal is about 0.84 of the bound.
Each configuration runs in a fresh child process; peak RSS is that of its largest process; "import s" is the one-off
import of google-genai and the backends, done before the clock starts. "cpu ms/call" is the client's user + system
CPU from then to the end of the run (worker processes included), per call. "load" is the machine's 1-minute load
average when the row ended (other work on the same CPUs slows client and server alike).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import heapq
import itertools
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SAMPLES = Path(__file__).resolve().parents[2] / "shared" / "samples"
DATASET = "MIMIC_bench"


def make_sources(root: Path, tasks: int) -> Path:
    """Enough 1024^2 normal chest X-ray sources for `tasks` add tasks (11 targets each): samples are linked."""
    import numpy as np

    from medbanana.generation.records import encode_jpeg

    folder = root / DATASET / "normal"
    folder.mkdir(parents=True)
    needed = -(-tasks // 11)
    samples = sorted(SAMPLES.rglob("*.jpeg"))[:needed] if SAMPLES.is_dir() else []
    for i, sample in enumerate(samples):
        os.symlink(sample, folder / f"s{i:04d}.jpeg")
    rng = np.random.default_rng(0)
    yy, xx = np.mgrid[0:1024, 0:1024] / 1024
    for i in range(len(samples), needed):  # smooth synthetic scans: JPEG sizes like real ones
        gray = 110 + 60 * np.sin(6 * xx + i) * np.cos(4 * yy) + rng.normal(0, 4, (1024, 1024))
        (folder / f"x{i:04d}.jpeg").write_bytes(encode_jpeg(np.repeat(np.clip(gray, 0, 255)[..., None], 3, 2)))
    return root


def ideal_wall(task_calls: list[int], concurrency: int, latency: float) -> float:
    """Wall time of a client with no cost at all: tasks start in order, each on the first free of `concurrency`
    slots, and hold it for their calls one after the other.

    >>> ideal_wall([1, 1, 1, 1], 2, 0.2)
    0.4
    >>> ideal_wall([1, 1, 1, 5], 2, 0.2)  # 8 calls on 2 slots: the bound is 0.8 s, the late long task makes it 1.2
    1.2
    """
    slots = [0.0] * max(1, concurrency)
    for calls in task_calls:
        heapq.heappush(slots, heapq.heappop(slots) + calls * latency)
    return round(max(slots), 9)


def calls_per_task(run_dir: Path, uids: list[str]) -> list[int]:
    """Each task's calls, in `uids`' order, from the run's journal: per round one to the writer, the editor's tries,
    and the judge's tries when the edit came back."""
    from medbanana.generation.rundir.store import read_journal

    calls = dict.fromkeys(uids, 0)
    for line in read_journal(run_dir / "medbanana-journal.jsonl"):
        if line["type"] == "round":
            rnd = line["round"]
            judged = rnd.get("verification")
            calls[line["uid"]] += (1 + rnd["edit_result"].get("details", {}).get("tries", 1)
                                   + (judged.get("details", {}).get("tries", 1) if judged else 0))
    return [calls[uid] for uid in uids]


def run_one(args) -> dict:
    """One configuration in this process (a child of main): run, then report figures as a JSON line."""
    imports = time.perf_counter()  # a one-off cost of every run (google-genai, pydantic models), printed apart
    from medbanana.generation.backends import gemini, gemini_transport as transport# noqa: F401
    from medbanana.generation.runners.generate import BackendSpec, generate, select_tasks
    from medbanana.generation.sources.scan import Selection
    from medbanana.generation.runners.session import RunOptions
    from medbanana.generation.rundir.signing import SigningCredentials

    if args.check_in == "thread":  # the alternative: each check in a thread beside the loop (masks stay pooled)
        from medbanana.generation.runners.image_work import ImageWork

        ImageWork._answer = lambda self, step: asyncio.to_thread(step.answer)
    elif args.check_in == "none":  # the reference: no per-image work at all (no check, no masks)
        from medbanana.generation.geometry import GeometryCheck
        from medbanana.generation.runners.image_work import ImageWork

        async def unchecked(self, step):
            return GeometryCheck("kept", None, step.edited, "not measured (bench: --check-in none)")

        async def no_masks(self, task, image, frame_rejected):
            return None, None

        ImageWork._answer, ImageWork._compute = unchecked, no_masks
    imports = time.perf_counter() - imports
    roles = {"writer": "gemini", "editor": "gemini", "judge": "gemini"}
    spec = BackendSpec("gemini", roles, gemini={"base_url": args.base_url, "timeout": 60, "max_attempts": 3})
    before = _cpu_seconds()  # the run's CPU, the one-off imports apart
    started = time.perf_counter()
    summary = generate(Path(args.sources), Path(args.out), spec=spec, limit=args.tasks,
                       options=RunOptions(concurrency=args.concurrency, workers=args.workers, quiet=True,
                                          max_rounds=args.max_rounds,
                                          c2pa=SigningCredentials.from_options(args.c2pa_cert, args.c2pa_key, {})))
    wall = time.perf_counter() - started
    order = [task.uid for task in select_tasks(Path(args.sources), Selection(), None, args.tasks)]
    task_calls = calls_per_task(Path(args.out), order)
    own, workers = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return {"tasks": args.tasks, "concurrency": args.concurrency, "workers": args.workers, "calls": summary.api_calls,
            "cache_hits": summary.cache_hits, "wall": wall, "imports": imports, "run_seconds": summary.seconds,
            "client_cpu": _cpu_seconds() - before,
            "ideal": ideal_wall(task_calls, args.concurrency, args.latency), "journal_calls": sum(task_calls),
            "peak_rss_mb": max(own.ru_maxrss, workers.ru_maxrss) / 1024, "statuses": dict(summary.statuses)}


def _cpu_seconds() -> float:
    """User + system CPU of this process and its finished children (the worker processes of --workers)."""
    return sum(u.ru_utime + u.ru_stime for u in map(resource.getrusage, (resource.RUSAGE_SELF,
                                                                        resource.RUSAGE_CHILDREN)))


@contextlib.contextmanager
def fake_gemini_and_workdir(latency: float, name: str):
    """(base URL, work folder): the fake Gemini server (echo engine) in its own process, which shares the CPUs as
    a remote server would not, and a scratch folder; both gone afterwards."""
    work = Path(tempfile.mkdtemp(prefix=f"medbanana-bench-{name}-"))
    fake = subprocess.Popen([sys.executable, "-m", "medbanana.generation.testing.fake_gemini", "--engine", "echo",
                             "--latency", str(latency)], stdout=subprocess.PIPE, text=True)
    try:
        yield fake.stdout.readline().rsplit(" ", 1)[1].strip(), work, fake.pid
    finally:
        fake.terminate()
        fake.wait()
        shutil.rmtree(work)


def process_cpu(pid: int) -> float:
    """User + system CPU seconds a running process has used (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


CASES = {  # --case: (tasks, concurrency, latency, max rounds, the figure with a target, the target)
    "short": (300, 100, 2.0, 1, "of ideal", 0.9),
    "fast": (1000, 20, 0.2, 5, "ratio", 0.85),
}


def run_child(command: list[str], env: dict) -> tuple[str, list[float]]:
    """The child's stdout, and the 1-minute load average sampled every second while it ran."""
    loads = []
    with subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as child:
        while True:
            try:
                out, err = child.communicate(timeout=1)
                break
            except subprocess.TimeoutExpired:
                loads.append(os.getloadavg()[0])
    if child.returncode:
        raise SystemExit(f"the run failed ({child.returncode}):\n{err[-3000:]}")
    return out, loads or [os.getloadavg()[0]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--case", choices=sorted(CASES), help="a named case with its target (module docstring)")
    ap.add_argument("--tasks", type=int, nargs="+", default=[1000])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[100, 200])
    ap.add_argument("--workers", type=int, nargs="+", default=[1],
                    help="client processes (generate --workers); default 1")
    ap.add_argument("--latency", type=float, default=2.0, help="seconds the fake adds to every call (default 2)")
    ap.add_argument("--max-rounds", type=int, default=5, help="rounds per task (default 5; --case short: 1)")
    ap.add_argument("--check-in", choices=("pool", "thread", "none"), nargs="+",
                    help="where each edit's geometry check runs: the run's process pool (what generate does), a "
                         "thread beside the event loop (to compare), or nowhere: 'none' also makes no masks, what "
                         "the client alone reaches; default pool (a --case: pool and none)")
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # internal: run one configuration
    ap.add_argument("--sources", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--base-url", help=argparse.SUPPRESS)
    ap.add_argument("--c2pa-cert", help=argparse.SUPPRESS)  # bench_c2pa.py: the same run, signed
    ap.add_argument("--c2pa-key", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        args.tasks, args.concurrency, args.workers = args.tasks[0], args.concurrency[0], args.workers[0]
        args.check_in = args.check_in[0]
        print(json.dumps(run_one(args)))
        return
    target = None
    if args.case:
        tasks, concurrency, args.latency, args.max_rounds, *target = CASES[args.case]
        args.tasks, args.concurrency = [tasks], [concurrency]
    args.check_in = args.check_in or (["pool", "none"] if args.case else ["pool"])
    reference = {}  # the case's figure with per-image work (pool or thread), by (tasks, concurrency, workers)

    with fake_gemini_and_workdir(args.latency, "gemini") as (base_url, work, server_pid):
        sources = make_sources(work / "sources", max(args.tasks))
        print(f"{time.strftime('%Y-%m-%d %H:%M')}; fake Gemini (echo engine, {args.latency} s per call) at "
              f"{base_url}; sources: {'released samples' if SAMPLES.is_dir() else 'synthetic'} 1024x1024 JPEGs; "
              f"at most {args.max_rounds} round(s) per task; {os.cpu_count()} CPUs, load average "
              f"{os.getloadavg()[0]:.1f}")
        print(f"{'tasks':>6} {'conc':>5} {'procs':>5} {'check':>6} {'calls':>6} {'wall s':>7} {'tasks/s':>8} "
              f"{'bound s':>8} {'ratio':>6} {'ideal s':>7} {'of ideal':>8} {'cpu ms/call':>11} {'cpu cap':>8} "
              f"{'server ms/call':>14} {'shared cap':>10} {'peak RSS MB':>11} {'import s':>8} {'load':>14}")
        for concurrency, workers, tasks, check_in in itertools.product(args.concurrency, args.workers, args.tasks,
                                                                       args.check_in):
            out = work / f"run-{tasks}-{concurrency}-{workers}-{check_in}"
            server_cpu, load_before = process_cpu(server_pid), os.getloadavg()[0]
            stdout, loads = run_child(
                [sys.executable, __file__, "--one", "--tasks", str(tasks), "--concurrency", str(concurrency),
                 "--workers", str(workers), "--sources", str(sources), "--out", str(out), "--base-url", base_url,
                 "--latency", str(args.latency), "--max-rounds", str(args.max_rounds), "--check-in", check_in],
                {**os.environ, "GEMINI_API_KEY": os.environ.get("GEMINI_API_KEY", "bench-key")})
            r = json.loads(stdout.strip().splitlines()[-1])
            bound, cpu_per_call = r["calls"] * args.latency / concurrency, r["client_cpu"] / r["calls"]
            cap = min(workers, os.cpu_count() or 1) * args.latency / (concurrency * cpu_per_call)
            server_per_call = (process_cpu(server_pid) - server_cpu) / r["calls"]
            # client and server share the machine: its CPUs do both's work for every call
            shared_cap = (os.cpu_count() or 1) * args.latency / (concurrency * (cpu_per_call + server_per_call))
            figures = {"ratio": bound / r["wall"], "of ideal": r["ideal"] / r["wall"]}
            load = f"{load_before:.1f}/{sum(loads) / len(loads):.1f}/{max(loads):.1f}"
            print(f"{tasks:>6} {concurrency:>5} {workers:>5} {check_in:>6} {r['calls']:>6} {r['wall']:>7.1f} "
                  f"{tasks / r['wall']:>8.2f} {bound:>8.1f} {figures['ratio']:>6.2f} {r['ideal']:>7.1f} "
                  f"{figures['of ideal']:>8.2f} {1000 * cpu_per_call:>11.1f} {cap:>8.2f} {1000 * server_per_call:>14.1f} "
                  f"{shared_cap:>10.2f} {r['peak_rss_mb']:>11.0f} {r['imports']:>8.1f} {load:>14}", flush=True)
            if r["journal_calls"] != r["calls"]:
                print(f"  (the journal accounts for {r['journal_calls']} of the {r['calls']} calls: the ideal is "
                      f"approximate)")
            if target and check_in != "none":
                name, wanted = target
                print(f"  {args.case}: {name} {figures[name]:.2f} against a target of {wanted} "
                      f"({'met' if figures[name] >= wanted else 'NOT met'})")
                reference[(tasks, concurrency, workers)] = (check_in, figures[name])
            elif target and (tasks, concurrency, workers) in reference:
                name, _ = target
                check, before = reference[(tasks, concurrency, workers)]
                print(f"  {args.case}: {name} {figures[name]:.2f} without per-image work (no check, no masks), "
                      f"{before:.2f} with it ({check}): the per-image work costs "
                      f"{round(figures[name] - before, 2) + 0:+.2f}")
            shutil.rmtree(out)
        print("load: the 1-minute load average before the row / its mean / its maximum while the row ran (the run's "
              "own processes included)")


if __name__ == "__main__":
    main()
