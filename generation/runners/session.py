"""The skeleton every runner fills in: one invocation's hold on a run directory.

`RunSession` opens the run directory (lock, replay, reconcile) and picks this invocation's tasks, shows the
progress bar, journals each outcome and materialises the JSON files now and then, closes the backends' clients,
and at the end counts what finished and writes the stats file; on any way out it releases the directory. The
local, the worker-process and the Batch runner differ only in how they get outcomes for `RunSession.todo`.
"""

from __future__ import annotations

import hashlib
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from tqdm.auto import tqdm

from ..backends.response_cache import drop_task_answers
from ..backends.settings import CACHE_DIR, remove_batch_files
from ..costs import Tally, cost_lines, cost_report, rounds_of
from ..files import atomic_write_json
from ..pricing import load_prices
from ..acceptance import DEFAULT_ACCEPT
from ..records import DEFAULT_CONCURRENCY, DEFAULT_GEOMETRY, DEFAULT_MAX_PIXELS, DEFAULT_MAX_ROUNDS, Task
from ..outcomes import ENDED, FailureKind, TaskOutcome, TaskStatus
from ..rundir import layout
from ..rundir.signing import SigningCredentials
from ..rundir.store import RunStore
from .budget import Ledger, LocalState, RunPricing


@dataclass
class RunOptions:
    max_rounds: int = DEFAULT_MAX_ROUNDS
    concurrency: int = DEFAULT_CONCURRENCY
    seed: int = 0
    accept: str = DEFAULT_ACCEPT
    retry_failed: bool = False  # also re-run tasks that ended api_failed (their kept rounds are resumed)
    drop_missing_sources: bool = False  # with retry_failed: api_failed tasks whose source is gone end for good
    shard: tuple[int, int] | None = None  # (i, N): this process takes the i-th of N deterministic parts
    workers: int = 1  # processes sharing the calls (processes.py); 1 runs everything in this process
    max_pixels: int = DEFAULT_MAX_PIXELS  # larger sources are source errors, refused from their header
    materialize_every: float = 30.0
    quiet: bool = False
    c2pa: SigningCredentials | None = None  # sign every image written (rundir/signing.py); paths only, no key
    pricing: RunPricing | None = None  # price the calls (a paid backend, or --budget): spend, projection, limit
    geometry: str = DEFAULT_GEOMETRY  # the geometry guard's mode (generation/geometry.py): reject | register | record


@dataclass
class RunSummary:
    run_dir: Path
    tasks: int = 0
    skipped: int = 0  # finished in an earlier invocation
    statuses: Counter = field(default_factory=Counter)  # over all finished tasks in the run directory
    success_rounds: Counter = field(default_factory=Counter)
    failed_attempts: int = 0
    error_kinds: Counter = field(default_factory=Counter)
    seconds: float = 0.0
    api_calls: int = 0  # network calls made now, retries included (answers from the request cache not counted)
    cache_hits: int = 0
    reconciled: Counter = field(default_factory=Counter)  # what opening the run fixed (store.RunStore.reconciled)
    dataset_dir: Path | None = None  # set when a dataset was built from the run (the demo)
    dataset: dict | None = None  # its medbanana-build.json
    missing_sources: list[str] = field(default_factory=list)  # retried api_failed tasks whose source file is gone
    dropped: int = 0  # of those, how many --drop-missing-sources ended now
    cost: dict | None = None  # tokens and USD per role and model over the run's recorded rounds (costs.CostReport)
    spent_now: float = 0.0  # USD of the calls of this invocation
    budget: float | None = None  # --budget USD
    budget_reached: bool = False  # the next round did not fit: rounds stopped starting
    unfinished: int = 0  # with budget_reached: this invocation's tasks left unfinished (resumable)
    projected_usd: float | None = None  # what finishing every task of this invocation would have cost in all
    geometry: Counter = field(default_factory=Counter)  # the geometry guard's actions over all attempt images

    def count_finished(self, records) -> None:
        """Add finished task records (journal `record`s) to the statuses, failed attempts, rounds and errors."""
        for record in records:  # read back from a journal, optional fields may be missing
            rounds = record.get("rounds") or []
            self.statuses[record["status"]] += 1
            self.failed_attempts += sum(1 for r in rounds if not r.get("accepted"))
            self.geometry.update(r["geometry"].get("action") for r in rounds
                                 if isinstance(r.get("geometry"), dict) and r["geometry"].get("action"))
            if record["status"] == TaskStatus.SUCCESS:
                self.success_rounds[record.get("success_round") or len(rounds)] += 1
            if record.get("error"):
                self.error_kinds[record["error"].get("kind") or "unknown"] += 1

    def as_dict(self) -> dict:
        return {"tasks": sum(self.statuses.values()), "ran_now": self.tasks - self.skipped - self.unfinished,
                "skipped": self.skipped,
                **{status.value: self.statuses[status] for status in TaskStatus},
                "failed_attempts": self.failed_attempts,
                "success_rounds": {str(k): v for k, v in sorted(self.success_rounds.items())},
                "error_kinds": dict(self.error_kinds), "api_calls": self.api_calls, "cache_hits": self.cache_hits,
                "reconciled": {k: v for k, v in sorted(self.reconciled.items()) if v},
                "geometry": dict(sorted(self.geometry.items())), "seconds": round(self.seconds, 2),
                **self._money()}

    def _money(self) -> dict:
        out: dict = {"cost": self.cost} if self.cost is not None else {}
        if self.spent_now or self.budget is not None:
            out["spent_now_usd"] = round(self.spent_now, 4)
        if self.budget is not None:
            out["budget"] = {"usd": self.budget, "reached": self.budget_reached, "unfinished": self.unfinished,
                             "projected_usd": None if self.projected_usd is None else round(self.projected_usd, 4)}
        return out

    def price(self, rounds, backends: dict, pricing: RunPricing | None) -> None:
        """Set `cost` from journalled rounds, priced with the run's pricing (else the shipped table)."""
        tally = Tally()
        for raw in rounds:
            tally.add_round(raw)
        prices = pricing.prices if pricing is not None else load_prices()
        self.cost = cost_report(tally, backends, prices, bool(pricing and pricing.batch)).as_dict()

    def format(self) -> str:
        d = self.as_dict()
        hist = "  ".join(f"round {k}: {v}" for k, v in d["success_rounds"].items()) or "none"
        lines = [f"tasks {d['tasks']} (ran {d['ran_now']}, already done {d['skipped']}) in {d['seconds']} s",
                 f"  accepted edits   {d['success']}", f"  failed tasks     {d['failed']}",
                 f"  failed attempts  {d['failed_attempts']} (kept as images and records)",
                 f"  errors           {d['api_failed']} {_kinds(d['error_kinds'])}".rstrip(),
                 f"  success by round {hist}", f"run directory: {self.run_dir}"]
        if moved := geometry_text(d["geometry"]):
            lines.insert(-1, f"  frame moved      {moved}")
        if self.api_calls or self.cache_hits:
            lines.insert(-1, f"  API calls        {self.api_calls} (from the request cache: {self.cache_hits})")
        if fixed := reconciled_text(d["reconciled"]):
            lines.insert(-1, f"  on opening       {fixed}")
        if self.cost is not None and (self.spent_now or any(r["input_tokens"] or r["output_tokens"]
                                                            for r in self.cost["roles"].values())):
            lines[-1:-1] = cost_lines(self.cost, self.spent_now)
        if self.budget_reached:
            lines.insert(-1, f"  budget           {self.budget:.2f} USD reached: {self.unfinished:,} task(s) left "
                             "unfinished, their finished rounds kept")
        for dataset, direction, path in layout.find_output_dirs(self.run_dir):
            lines.append(f"  {path.name}/ and {path.name}-failed/  ({direction}, {layout.ALL_CONVERSATIONS})")
        if self.dataset_dir is not None:
            rows = "  ".join(f"{config} {sum(s['rows'] for s in splits.values())}"
                             for config, splits in self.dataset["configs"].items())
            lines += [f"dataset: {self.dataset_dir}  (rows: {rows})",
                      f"  load it: python -c 'from datasets import load_dataset; "
                      f"print(load_dataset(\"{self.dataset_dir}\", \"dpo_pairs\"))'"]
        return "\n".join(lines)


def _kinds(counts: dict) -> str:
    """'(source_error 11, server_error 2)': failures per kind, in words ('' for none)."""
    return f"({', '.join(f'{kind} {n}' for kind, n in counts.items())})" if counts else ""


def recorded_rounds(store: RunStore) -> list[dict]:
    """Every round the run directory's journal holds: finished tasks' and unfinished tasks' (each once)."""
    rounds = [r for uid, record in store.finished.items() if uid not in store.partial for r in rounds_of(record)]
    return rounds + [r for by_round in store.partial.values() for r in by_round.values()]


def geometry_text(actions: dict) -> str:
    """What the geometry guard did with edits whose frame moved, in words ('' when none moved)."""
    words = {"rejected": "rejected before the judge", "registered": "warped back onto the source's grid",
             "recorded": "judged as they came (--geometry record)"}
    return ", ".join(f"{actions[k]} {text}" for k, text in words.items() if actions.get(k))


def reconciled_text(counts: dict) -> str:
    """What opening the run directory fixed, in words ('' when nothing)."""
    words = {"orphan_images": "images of killed writes without a journal line removed",
             "quarantined_images": f"unknown images moved to {layout.ORPHANS}/",
             "orphan_masks": f"masks of no journalled image removed from {layout.MASKS}/",
             "orphan_originals": f"editor's originals of no journalled image removed from {layout.ORIGINALS}/",
             "temp_files": "temp files of killed writes removed",
             "continued_tasks": "api_failed tasks continued from rounds of a killed retry",
             "batch_files": "request or results files of a killed --batch run removed"}
    return ", ".join(f"{counts[k]} {text}" for k, text in words.items() if counts.get(k))


def in_shard(task: Task | str, shard: tuple[int, int] | None) -> bool:
    """Whether a task (or a task uid) belongs to the i-th of N deterministic parts."""
    if shard is None:
        return True
    index, count = shard
    uid = task if isinstance(task, str) else task.uid
    return int(hashlib.sha256(uid.encode()).hexdigest()[:8], 16) % count == index


def sources_gone(store: RunStore, tasks: list[Task], shard: tuple[int, int] | None) -> list[str]:
    """The uids of the run's api_failed tasks (of this shard) that no scanned task stands for any more: their source
    file was deleted or moved since, so a retry cannot run them. Those already dropped are not counted."""
    scanned = {t.uid for t in tasks}
    return sorted(uid for uid, record in store.finished.items()
                  if record["status"] == TaskStatus.API_FAILED and uid not in scanned and in_shard(uid, shard)
                  and (record.get("error") or {}).get("kind") != FailureKind.SOURCE_MISSING)


def drop_task(store: RunStore, uid: str) -> None:
    """End an api_failed task whose source is gone for good: its record, rounds kept, with the failure kind
    FailureKind.SOURCE_MISSING, which later retries and the exit code leave out."""
    record = dict(store.finished[uid])
    message = (f"source {record.get('source_path') or record.get('image') or record['key']} no longer exists: "
               f"dropped (--drop-missing-sources)")
    record["error"] = {"step": "load_source", "kind": FailureKind.SOURCE_MISSING, "message": message}
    record["api_failure"] = {**(record.get("api_failure") or {"task": record["key"], "image": record.get("image"),
                                                               "disease": record["disease"], "round": None}),
                             "step": "load_source", "kind": FailureKind.SOURCE_MISSING, "error": message}
    store.add_finished(record)


def open_run(tasks: list[Task], run_dir: Path, options: RunOptions,
             config: dict | None) -> tuple[RunStore, RunSummary, list[Task]]:
    """Open (lock, replay, reconcile) the run directory and pick this invocation's tasks: its shard, minus finished
    ones, plus api_failed ones with retry_failed or with rounds journalled after their record (a killed retry).
    Close with `close_run`."""
    signer = None
    if options.c2pa is not None:  # built in this process: the one that writes every image, --workers or not
        from ..rundir.signing import ImageSigner

        signer = ImageSigner(options.c2pa)
    store = RunStore(run_dir, {"max_rounds": options.max_rounds, "accept": options.accept, "seed": options.seed,
                               "geometry": options.geometry, **(config or {})}, signer=signer).open()
    summary = RunSummary(Path(run_dir), reconciled=Counter(store.reconciled))
    if removed := remove_batch_files(run_dir):  # any run, --batch or not: only a live batch run needs them
        summary.reconciled["batch_files"] = removed
    # answers of tasks that ended, left by a process killed between the task's journal line and their removal
    if removed := drop_task_answers(Path(run_dir) / CACHE_DIR, [uid for uid, record in store.finished.items()
                                                               if record["status"] in ENDED]):
        summary.reconciled["cached_answers_of_ended_tasks"] = removed
    mine = [t for t in tasks if in_shard(t, options.shard)]
    summary.tasks = len(mine)
    redo = {TaskStatus.API_FAILED} if options.retry_failed else set()
    # a retry starts only tasks the run finished api_failed: none it never finished, whatever the sources hold now
    todo = [t for t in mine if (t.uid not in store.finished and not options.retry_failed) or t.uid in store.reopened
            or (t.uid in store.finished and store.finished[t.uid]["status"] in redo)]
    summary.skipped = len(mine) - len(todo)
    if options.retry_failed and (gone := sources_gone(store, tasks, options.shard)):
        if options.drop_missing_sources:
            for uid in gone:
                drop_task(store, uid)
            summary.dropped = len(gone)
        else:
            summary.missing_sources = [store.finished[uid].get("source_path") or uid for uid in gone]
    return store, summary, todo


def close_run(store: RunStore, summary: RunSummary, started: float, pricing: RunPricing | None = None) -> RunSummary:
    """Materialise the JSON files, count every finished task and price every recorded round, write the stats
    file, then close the store (the directory stays locked until the stats are written). store.close() is also
    called on every way out, for when a runner is interrupted: it does nothing after this."""
    store.materialize()
    summary.seconds = time.perf_counter() - started
    summary.count_finished(store.finished.values())
    backends = store.config.get("backends") if isinstance(store.config.get("backends"), dict) else {}
    summary.price(recorded_rounds(store), backends, pricing)
    atomic_write_json(Path(summary.run_dir) / layout.STATS, {**summary.as_dict(), "finished_at": time.time()})
    store.close()
    return summary


class RunSession:
    """One invocation of a runner over a run directory:

        with RunSession(tasks, run_dir, options, config) as session:
            try:
                ...  # get an outcome for each of session.todo; session.finish(outcome) each
            finally:
                await session.close_clients(writer, editor, judge)
            return session.end()

    Leaving the `with` any other way (an interruption, a crash) materialises what finished and unlocks."""

    def __init__(self, tasks: list[Task], run_dir: Path, options: RunOptions, config: dict | None = None,
                 on_open=None):
        """`on_open()` is called once the run directory is this process's (locked, replayed), before any call."""
        self.options = options
        self.started = time.perf_counter()
        self.store, self.summary, self.todo = open_run(tasks, run_dir, options, config)
        if on_open is not None:
            on_open()
        self.bar = tqdm(total=len(self.todo), desc="tasks", unit="task", disable=options.quiet, dynamic_ncols=True)
        self.ledger: Ledger | None = None  # with pricing: spent (recorded rounds, then each step) and held USD
        self.finished_now = 0
        if options.pricing is not None:
            self.spent_before = options.pricing.recorded(recorded_rounds(self.store))
            self.ledger = Ledger(options.pricing, LocalState(self.spent_before))
            self.summary.budget = options.pricing.budget
            self._show_spend()

    def __enter__(self) -> "RunSession":
        return self

    def __exit__(self, *exc_info) -> None:
        self.bar.close()
        self.store.close()  # when interrupted: the JSON files are materialised from what finished, the lock released

    def finish(self, *outcomes: TaskOutcome) -> None:
        """Journal finished tasks, drop the cached answers of those that ended (an api_failed one may continue),
        count them on the bar, and materialise if it is time to."""
        for outcome in outcomes:
            self.store.finish_task(outcome)
        drop_task_answers(Path(self.store.run_dir) / CACHE_DIR, [o.task.uid for o in outcomes if o.status in ENDED])
        self.finished_now += len(outcomes)
        self.bar.update(len(outcomes))
        self._show_spend()
        self.store.maybe_materialize(self.options.materialize_every)

    def budget_reached(self) -> None:
        """A round did not fit in the budget: the run starts no more (the runner leaves the rest unfinished)."""
        self.summary.budget_reached = True

    def projected(self) -> float | None:
        """Spent so far plus this invocation's tasks left at the cost per task measured now (assumed until a
        task has finished)."""
        if self.ledger is None:
            return None
        spent = self.ledger.spent
        per_task = ((spent - self.spent_before) / self.finished_now if self.finished_now
                    else self.options.pricing.per_task_usd)
        return spent + max(0, len(self.todo) - self.finished_now) * per_task

    def _show_spend(self) -> None:
        if self.ledger is not None and not self.bar.disable:
            self.bar.set_postfix_str(f"{self.ledger.spent:.2f} USD spent, ~{self.projected():.2f} projected",
                                     refresh=False)

    async def close_clients(self, *backends, count_calls: bool = True) -> None:
        """Close the backends' clients inside the run's event loop; with `count_calls`, record their call counts
        in the summary (the Batch runner's stats have never counted its calls)."""
        await close_clients(*backends)
        if count_calls:
            self.summary.api_calls, self.summary.cache_hits = call_counts(*backends)

    def end(self) -> RunSummary:
        """The normal end: materialise, count every finished task, write the stats file, unlock."""
        self.bar.close()
        if self.ledger is not None:
            self.summary.spent_now = self.ledger.spent - self.spent_before
            self.summary.projected_usd = self.projected()
        if self.summary.budget_reached:
            self.summary.unfinished = len(self.todo) - self.finished_now
        return close_run(self.store, self.summary, self.started, self.options.pricing)


def _clients(backends) -> list:
    """Each distinct client behind the backends (a transport shared by several roles once)."""
    seen = {}
    for backend in backends:
        client = getattr(backend, "transport", backend)
        seen.setdefault(id(client), client)
    return list(seen.values())


def call_counts(*backends) -> tuple[int, int]:
    """(network calls, request-cache hits) over the backends' distinct transports."""
    clients = _clients(backends)
    return (sum(getattr(c, "network_calls", 0) for c in clients), sum(getattr(c, "cache_hits", 0) for c in clients))


async def open_clients(*backends) -> None:
    """Set up each distinct client that sets up in the run's event loop (a Gemini API client: its session and
    TLS contexts, a tenth of a second) before anything else takes the CPUs."""
    for client in _clients(backends):
        if hasattr(client, "aopen"):
            await client.aopen()


async def close_clients(*backends) -> None:
    """Close each distinct client connection pool (a shared transport once) inside the run's event loop."""
    for client in _clients(backends):
        if hasattr(client, "aclose"):
            await client.aclose()
