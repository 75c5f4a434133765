"""`generate --executor ray`: a run's shards as Ray tasks, merged into the run directory once all have finished.

Shard i of N is one Ray task (its CPUs and GPUs reserved) that makes the same `generate` call as
`--shard i/N`, into its own run directory OUT/medbanana-shards/{i}-of-{N}/ on storage every node sees. Each shard
directory has its writer's lock and journal as any run directory, so a shard is resumed exactly like a run:
when Ray retries a task whose worker process died (killed, out of memory), the new attempt skips the tasks the
journal finished and continues the rest from their journalled rounds; the dead worker's `flock` went with it.
Only failures of processes are retried (the task's worker, or one of its `--workers`): an error raised by the run
itself (bad options, another process holding the shard) would fail again and is reported instead. When every
shard has finished, the driver merges them (rundir/merge.py) into OUT and writes OUT's stats. Resubmitting the
same command resumes: a shard whose tasks are all in its journal is not submitted again, one merged into OUT
already is not merged again, and a merge the driver did not finish goes on after the tasks it wrote.

The driver holds OUT's lock (and OUT/medbanana-shards') for the whole job, so a second driver, or a plain
`generate` into the same OUT, is refused at once. Without --ray-address or RAY_ADDRESS it starts a local cluster of
its own (never one that `ray start` left running on this machine) and says which it uses. API keys are never sent
through Ray (its runtime-environment agent logs a task's `env_vars` in its session logs): a local cluster inherits
this process's environment; the nodes of a cluster you join read them from their own (start them with
GEMINI_API_KEY set). A shard on this machine ends itself when the driver is gone (killed), so that no shard keeps
calling the API for a job nobody waits for.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path

from ..costs import rounds_of
from ..extras import require
from ..files import atomic_write_json
from ..pricing import PriceTable, load_prices
from ..rundir import layout
from ..rundir.lock import LockHeld, hold_lock, lend
from ..rundir.merge import merge_runs
from ..rundir.store import read_journal
from ..records import Task
from ..sources.scan import Selection
from .budget import RunPricing, journal_rounds
from .generate import BackendSpec, generate, select_tasks, spec_models
from ..failures import WorkerCrashed
from .session import RunOptions, RunSummary, in_shard
from ..failures import UsageError

SHARDS = "medbanana-shards"  # OUT's folder of shard run directories (not a layout folder: runs ignore it)
MAX_RETRIES = 3  # attempts after a shard's worker died, each resuming from the shard's journal


@dataclass(frozen=True)
class ShardJob:
    """What every shard task runs, in plain picklable values: `generate` with these arguments and `--shard i/N`."""
    sources: Path
    spec: BackendSpec
    options: RunOptions
    selection: Selection = field(default_factory=Selection)
    modality: str | None = None
    limit: int | None = None
    driver: tuple[str, int] | None = None  # (host, pid) of the driver: a shard on its host ends when it is gone
    prices: PriceTable | None = None
    budget: float | None = None  # USD for the whole job: each shard to run gets its part of what is left


def shard_dir(out: Path, index: int, count: int) -> Path:
    return Path(out) / SHARDS / f"{index}-of-{count}"


def run_shard(job: ShardJob, index: int, count: int, out: str, budget: float | None = None) -> RunSummary:
    """The body of one Ray task (also callable without Ray): shard index/count of the job, into its directory,
    spending at most `budget` USD in all (what its directory recorded included)."""
    if job.driver is not None and job.driver[0] == socket.gethostname():
        threading.Thread(target=_end_with, args=(job.driver[1],), name="medbanana-driver-watch", daemon=True).start()
    options = replace(job.options, shard=(index, count), quiet=True)
    return generate(job.sources, shard_dir(Path(out), index, count), selection=job.selection,
                    modality=job.modality, spec=job.spec, options=options, limit=job.limit, prices=job.prices,
                    budget=budget)


def shard_budgets(job: ShardJob, out: Path, todo: list[int], count: int) -> dict[int, float | None]:
    """Each shard to run's budget: what its directory has spent, plus an equal part of what the job's budget
    leaves after every shard's recorded spending, so that together they never pass it."""
    if job.budget is None:
        return dict.fromkeys(todo)
    pricing = RunPricing(job.prices or load_prices(), spec_models(job.spec))
    spent = {i: pricing.recorded(journal_rounds(shard_dir(out, i, count))) for i in range(count)}
    left = max(0.0, job.budget - sum(spent.values()))
    return {i: spent[i] + left / max(len(todo), 1) for i in todo}


def _end_with(driver: int, every: float = 0.5) -> None:
    """End this process (a shard's Ray worker) once the driver's process is gone: its journal keeps what finished,
    and resubmitting resumes. Ray itself notices a dead driver only later, or never for a cluster it did not start."""
    while True:
        time.sleep(every)
        try:
            os.kill(driver, 0)
        except (ProcessLookupError, PermissionError):  # gone, or its pid taken by another user's process
            os._exit(WorkerCrashed.exit_code)


def absolute_paths(job: ShardJob) -> ShardJob:
    """The job with every path it names made absolute (a Ray worker starts in another folder than the driver):
    the sources, the signing certificate and key, and the diffusers editor's model folder and attention maps
    (a model named by a Hub id stays as it is)."""
    options, diffusers = job.options, job.spec.diffusers
    if options.c2pa is not None:
        options = replace(options, c2pa=replace(options.c2pa, cert=options.c2pa.cert.resolve(),
                                                key=options.c2pa.key.resolve()))
    if diffusers.model and Path(diffusers.model).exists():  # as from_pretrained decides: a folder here first
        diffusers = replace(diffusers, model=str(Path(diffusers.model).resolve()))
    if diffusers.attention_dir:
        diffusers = replace(diffusers, attention_dir=Path(diffusers.attention_dir).resolve())
    return replace(job, sources=Path(job.sources).resolve(), options=options,
                   spec=replace(job.spec, diffusers=diffusers))


def finished_uids(run_dir: Path) -> set[str]:
    """Uids of the tasks a run directory's journal has finished (none for a directory not made yet)."""
    return {e["uid"] for e in read_journal(Path(run_dir) / layout.JOURNAL) if e["type"] == "task"}


def recorded_shard_count(out: Path) -> int | None:
    """N of the shard directories under OUT from an earlier submission (None if none; ValueError if mixed)."""
    counts = {p.name.partition("-of-")[2] for p in (Path(out) / SHARDS).glob("*-of-*") if p.is_dir()}
    if len(counts) > 1:
        raise UsageError(f"{Path(out) / SHARDS} holds shards of different counts ({', '.join(sorted(counts))}); "
                         f"give --shards")
    return int(counts.pop()) if counts else None


def run_on_ray(job: ShardJob, out: Path, *, shards: int | None = None, address: str | None = None,
               cpus_per_shard: float = 1, gpus_per_shard: float = 0, quiet: bool = False) -> RunSummary:
    """Run the job's shards as Ray tasks on the cluster at `address` ("auto": the one this node belongs to;
    None: RAY_ADDRESS, else a local cluster started for this run), then merge them into OUT. When every shard
    has finished already, no cluster is joined: only what is left of the merge is done."""
    ray = require("ray", needed_for="--executor ray", extra="ray")
    out = Path(out).resolve()  # workers start elsewhere: every path they get is absolute
    job = replace(absolute_paths(job), driver=(socket.gethostname(), os.getpid()))
    address = address or os.environ.get("RAY_ADDRESS") or None
    started = time.perf_counter()
    # OUT's own lock, lent to the merge at the end (it locks OUT again); the shards' folder's, for older drivers
    with hold_lock(out, "run directory (its Ray driver)") as lock, lend(lock), \
            hold_lock(out / SHARDS, "sharded run (its Ray driver)"):
        tasks = select_tasks(job.sources, job.selection, job.modality, job.limit)  # as each shard's `generate`
        recorded = recorded_shard_count(out)
        if shards and recorded and shards != recorded:  # other parts would run every task again, from scratch
            raise UsageError(f"{out / SHARDS} holds {recorded} shards; resume with --shards {recorded}, or use "
                             f"another --out")
        count = shards or recorded
        todo = _unfinished(tasks, out, count) if count else None
        ran: list[RunSummary] = []
        if todo is None or todo:
            connected_here = not ray.is_initialized()
            if connected_here:
                _join(ray, address)
            try:
                if count is None:
                    count = _cluster_shards(ray, cpus_per_shard, gpus_per_shard)
                    todo = _unfinished(tasks, out, count)
                _say(quiet, f"{count} shards: {len(todo)} to run, {count - len(todo)} finished already")
                # max_calls=1: a fresh worker per shard, so a model or client never outlives its shard
                task = ray.remote(num_cpus=cpus_per_shard, num_gpus=gpus_per_shard, max_retries=MAX_RETRIES,
                                  retry_exceptions=[WorkerCrashed], max_calls=1)(run_shard)
                budgets = shard_budgets(job, out, todo, count)
                ran = _gather(ray, {task.remote(job, i, count, str(out), budgets[i]): i for i in todo}, count, quiet)
            finally:
                if connected_here:
                    ray.shutdown()
        _merge_shards(out, count)
    return _summary(out, ran, len(tasks), time.perf_counter() - started, job)


def _join(ray, address: str | None) -> None:
    """Join the cluster at `address`, or start a local one (address None: never one found running here), and say
    which (even with -q: it is no progress report)."""
    try:
        if address:
            ray.init(address=address, logging_level="ERROR", configure_logging=True)
        else:  # "local" starts a new cluster even when `ray start` left one running on this machine
            ray.init(address="local", logging_level="ERROR", configure_logging=True, include_dashboard=False)
    except Exception as exc:  # ConnectionError, an authentication error, a version mismatch
        raise UsageError(f"cannot {f'join the Ray cluster at {address}' if address else 'start a local Ray cluster'}"
                           f": {_first_line(exc)}") from None
    cpus = int(ray.cluster_resources().get("CPU", 0))
    _say(False, f"Ray: joined the cluster at {address} ({cpus} CPUs)" if address else
         f"Ray: started a local cluster for this run ({cpus} CPUs; give --ray-address to join another)")


def _unfinished(tasks: list[Task], out: Path, count: int) -> list[int]:
    """The shards whose journal lacks any of their tasks."""
    return [i for i in range(count)
            if not {t.uid for t in tasks if in_shard(t, (i, count))} <= finished_uids(shard_dir(out, i, count))]


def _cluster_shards(ray, cpus: float, gpus: float) -> int:
    """One shard per slot the cluster has for a shard's resources."""
    resources = ray.cluster_resources()
    slots = resources.get("GPU", 0) / gpus if gpus else resources.get("CPU", 1) / max(cpus, 1e-9)
    return max(1, int(slots))


def _gather(ray, pending: dict, count: int, quiet: bool) -> list[RunSummary]:
    """Each shard's summary as it finishes; after all have ended, the first failure is raised (the others ran on
    and keep what they finished)."""
    summaries, failures = [], []
    while pending:
        (done,), _ = ray.wait(list(pending), num_returns=1)
        index = pending.pop(done)
        try:
            summary = ray.get(done)
        except ray.exceptions.RayError as exc:
            # the run raised (RayTaskError): its own error; anything else is Ray's (worker or node lost)
            cause = exc.cause if isinstance(exc, ray.exceptions.RayTaskError) and exc.cause is not None else exc
            failures.append((index, cause, cause is exc or isinstance(cause, WorkerCrashed)))
            _say(quiet, f"shard {index}/{count} failed: {_first_line(cause)}")
            continue
        summaries.append(summary)
        _say(quiet, f"shard {index}/{count} finished: {summary.tasks} tasks (ran {summary.tasks - summary.skipped}) "
                    f"in {summary.seconds:.1f} s")
    if failures:
        index, cause, crashed = failures[0]
        text = (f"shard {index}/{count} failed ({len(failures)} of {count} shards failed): {_first_line(cause)}; "
                f"what the shards finished is kept: rerun the same command to resume")
        if isinstance(cause, LockHeld):
            raise LockHeld(text)
        if crashed:  # after its retries: the infrastructure's failure, with its own exit code
            raise WorkerCrashed(text)
        if isinstance(cause, UsageError):
            raise UsageError(text)
        raise RuntimeError(text) from cause
    return summaries


def _merge_shards(out: Path, count: int) -> None:
    """Merge the shard directories not merged whole yet into OUT (a driver killed while merging left one in part:
    the merge goes on after the tasks it wrote)."""
    inputs = [d for d in (shard_dir(out, i, count) for i in range(count)) if (d / layout.RUN_CONFIG).exists()]
    merged = finished_uids(out)
    if todo := [d for d in inputs if not finished_uids(d) <= merged]:
        merge_runs(todo, out, partial=True)  # the others were merged before: OUT's record counts them


def _summary(out: Path, ran: list[RunSummary], tasks: int, seconds: float, job: ShardJob) -> RunSummary:
    """OUT's summary: every finished task of the merged run counted and priced, the calls and spending of the
    shards run now."""
    summary = RunSummary(out, tasks=tasks, seconds=seconds, budget=job.budget)
    summary.spent_now = sum(s.spent_now for s in ran)
    summary.budget_reached = any(s.budget_reached for s in ran)
    summary.unfinished = sum(s.unfinished for s in ran)
    summary.skipped = tasks - sum(s.tasks - s.skipped for s in ran)
    summary.api_calls = sum(s.api_calls for s in ran)
    summary.cache_hits = sum(s.cache_hits for s in ran)
    summary.reconciled = sum((s.reconciled for s in ran), Counter())
    finished: dict[str, dict] = {}
    for entry in read_journal(out / layout.JOURNAL):
        if entry["type"] == "task":
            finished[entry["uid"]] = entry["record"]
    summary.count_finished(finished.values())
    summary.price([r for record in finished.values() for r in rounds_of(record)], spec_models(job.spec),
                  RunPricing(job.prices or load_prices(), spec_models(job.spec)))
    atomic_write_json(out / layout.STATS, {**summary.as_dict(), "finished_at": time.time()})
    return summary


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")


def _say(quiet: bool, line: str) -> None:
    if not quiet:
        print(f"medbanana generate: {line}", file=sys.stderr, flush=True)
