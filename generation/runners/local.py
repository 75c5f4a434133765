"""Run many tasks concurrently into a run directory: resume, progress, periodic materialisation, stats."""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

from tqdm.auto import tqdm

from ..rundir import layout
from ..backends import Editor, InstructionWriter, Judge
from ..loop import Acceptance, OnRound, acceptance_policy, refine_task
from ..records import DEFAULT_MAX_PIXELS, ApiFailure, Attempt, SourceImage, Task, TaskOutcome, open_image
from ..rundir.store import ORPHANS, RunStore, atomic_write_json


@dataclass
class RunOptions:
    max_rounds: int = 5
    concurrency: int = 4
    seed: int = 0
    accept: str = "qualified"
    retry_failed: bool = False  # also re-run tasks that ended api_failed (their kept rounds are resumed)
    shard: tuple[int, int] | None = None  # (i, N): this process takes the i-th of N deterministic parts
    workers: int = 1  # processes sharing the calls (workers.py); 1 runs everything in this process
    max_pixels: int = DEFAULT_MAX_PIXELS  # larger sources are source errors, refused from their header
    materialize_every: float = 30.0
    quiet: bool = False


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

    def as_dict(self) -> dict:
        return {"tasks": sum(self.statuses.values()), "ran_now": self.tasks - self.skipped, "skipped": self.skipped,
                "success": self.statuses["success"], "failed": self.statuses["failed"],
                "api_failed": self.statuses["api_failed"], "failed_attempts": self.failed_attempts,
                "success_rounds": {str(k): v for k, v in sorted(self.success_rounds.items())},
                "error_kinds": dict(self.error_kinds), "api_calls": self.api_calls, "cache_hits": self.cache_hits,
                "reconciled": {k: v for k, v in sorted(self.reconciled.items()) if v},
                "seconds": round(self.seconds, 2)}

    def format(self) -> str:
        d = self.as_dict()
        hist = "  ".join(f"round {k}: {v}" for k, v in d["success_rounds"].items()) or "none"
        lines = [f"tasks {d['tasks']} (ran {d['ran_now']}, already done {d['skipped']}) in {d['seconds']} s",
                 f"  accepted edits   {d['success']}", f"  failed tasks     {d['failed']}",
                 f"  failed attempts  {d['failed_attempts']} (kept as images and records)",
                 f"  errors           {d['api_failed']} {d['error_kinds'] or ''}".rstrip(),
                 f"  success by round {hist}", f"run directory: {self.run_dir}"]
        if self.api_calls or self.cache_hits:
            lines.insert(-1, f"  API calls        {self.api_calls} (from the request cache: {self.cache_hits})")
        if fixed := reconciled_text(d["reconciled"]):
            lines.insert(-1, f"  on opening       {fixed}")
        for dataset, direction, path in layout.find_output_dirs(self.run_dir):
            lines.append(f"  {path.name}/ and {path.name}-failed/  ({direction}, {layout.ALL_CONVERSATIONS})")
        if self.dataset_dir is not None:
            rows = "  ".join(f"{config} {sum(s['rows'] for s in splits.values())}"
                             for config, splits in self.dataset["configs"].items())
            lines += [f"dataset: {self.dataset_dir}  (rows: {rows})",
                      f"  load it: python -c 'from datasets import load_dataset; "
                      f"print(load_dataset(\"{self.dataset_dir}\", \"dpo_pairs\"))'"]
        return "\n".join(lines)


def reconciled_text(counts: dict) -> str:
    """What opening the run directory fixed, in words ('' when nothing)."""
    words = {"orphan_images": "images of killed writes without a journal line removed",
             "quarantined_images": f"unknown images moved to {ORPHANS}/",
             "temp_files": "temp files of killed writes removed",
             "continued_tasks": "api_failed tasks continued from rounds of a killed retry"}
    return ", ".join(f"{counts[k]} {text}" for k, text in words.items() if counts.get(k))


def in_shard(task: Task, shard: tuple[int, int] | None) -> bool:
    if shard is None:
        return True
    index, count = shard
    return int(hashlib.sha256(task.uid.encode()).hexdigest()[:8], 16) % count == index


def read_source(path: Path, max_pixels: int = DEFAULT_MAX_PIXELS) -> SourceImage:
    """A source image, checked now: an unreadable file, or one over `max_pixels` (from its header, before any
    decoding), must fail here, to be recorded as a source error.

    The check decodes JPEGs at 1/8 scale (every byte is still read, so a truncated file fails; 2-3x cheaper than
    a full decode). Pixels are decoded in full only if a backend asks for `source.array`; Gemini never does.
    """
    source = SourceImage(path, max_pixels=max_pixels)
    with open_image(source.data, max_pixels) as image:
        try:
            image.draft("RGB", (max(1, image.width // 8), max(1, image.height // 8)))
            image.load()
        except (OSError, SyntaxError) as exc:
            raise ValueError(f"not a readable image: {exc}") from exc
    return source


class _SourceCache:
    """Add tasks cross one source with every disease; keep a few checked sources instead of re-reading them."""

    def __init__(self, max_pixels: int = DEFAULT_MAX_PIXELS, size: int = 32):
        self.max_pixels, self.size, self.items = max_pixels, size, OrderedDict()

    def get(self, path: Path) -> SourceImage:
        if path in self.items:
            self.items.move_to_end(path)
            return self.items[path]
        source = read_source(path, self.max_pixels)
        self.items[path] = source
        if len(self.items) > self.size:
            self.items.popitem(last=False)
        return source


def open_run(tasks: list[Task], run_dir: Path, options: RunOptions,
             config: dict | None) -> tuple[RunStore, RunSummary, list[Task]]:
    """Open (lock, replay, reconcile) the run directory and pick this invocation's tasks: its shard, minus finished
    ones, plus api_failed ones with retry_failed or with rounds journalled after their record (a killed retry).
    Shared by the concurrent, the multi-process and the batch runner; close with `close_run`."""
    store = RunStore(run_dir, {"max_rounds": options.max_rounds, "accept": options.accept, "seed": options.seed,
                               **(config or {})}).open()
    summary = RunSummary(Path(run_dir), reconciled=Counter(store.reconciled))
    mine = [t for t in tasks if in_shard(t, options.shard)]
    summary.tasks = len(mine)
    redo = {"api_failed"} if options.retry_failed else set()
    todo = [t for t in mine if t.uid not in store.finished or t.uid in store.reopened
            or store.finished[t.uid]["status"] in redo]
    summary.skipped = len(mine) - len(todo)
    return store, summary, todo


def source_error(task: Task, exc: Exception) -> TaskOutcome:
    return TaskOutcome(task, "api_failed", [], ApiFailure("load_source", 0, f"{task.source_path}: {exc}",
                                                          "source_error"))


def close_run(store: RunStore, summary: RunSummary, started: float) -> RunSummary:
    """Materialise the JSON files, count every finished task, write the stats file, then close the store (the
    directory stays locked until the stats are written). Runners call store.close() too, in a `finally`, for
    when they are interrupted: it does nothing after this."""
    store.materialize()
    summary.seconds = time.perf_counter() - started
    for record in store.finished.values():
        summary.statuses[record["status"]] += 1
        summary.failed_attempts += sum(1 for r in record["rounds"] if not r.get("accepted"))
        if record["status"] == "success":
            summary.success_rounds[record["success_round"]] += 1
        if record.get("error"):
            summary.error_kinds[record["error"]["kind"]] += 1
    atomic_write_json(Path(summary.run_dir) / layout.STATS, {**summary.as_dict(), "finished_at": time.time()})
    store.close()
    return summary


async def run_one_task(task: Task, sources: _SourceCache, backends: tuple[InstructionWriter, Editor, Judge],
                       options: RunOptions, accept: Acceptance, history: list[Attempt],
                       on_round: OnRound) -> TaskOutcome:
    """One task from its journalled `history` to an outcome; whatever goes wrong becomes the outcome's record."""
    try:
        source = await asyncio.to_thread(sources.get, task.source_path)
    except (OSError, ValueError) as exc:
        return source_error(task, exc)
    writer, editor, judge = backends
    kept = list(history)

    async def keep(task: Task, attempt: Attempt, image) -> None:
        if (maybe := on_round(task, attempt, image)) is not None:
            await maybe
        kept.append(attempt)

    try:
        return await refine_task(task, source, writer, editor, judge, max_rounds=options.max_rounds, accept=accept,
                                 seed=options.seed, history=history, on_round=keep)
    except Exception as exc:  # a backend bug must not take the whole run down: it becomes a record
        return TaskOutcome(task, "api_failed", kept, ApiFailure("unexpected", len(kept) + 1,
                                                                f"{type(exc).__name__}: {exc}", "unexpected"))


async def run_tasks(tasks: list[Task], run_dir: Path, writer: InstructionWriter, editor: Editor, judge: Judge,
                    options: RunOptions | None = None, config: dict | None = None) -> RunSummary:
    options = options or RunOptions()
    accept = acceptance_policy(options.accept)
    started = time.perf_counter()
    store, summary, todo = open_run(tasks, run_dir, options, config)
    sources = _SourceCache(options.max_pixels)
    queue: asyncio.Queue[Task] = asyncio.Queue()
    for task in todo:
        queue.put_nowait(task)
    bar = tqdm(total=len(todo), desc="tasks", unit="task", disable=options.quiet, dynamic_ncols=True)

    async def worker() -> None:
        while not queue.empty():
            task = queue.get_nowait()
            outcome = await run_one_task(task, sources, (writer, editor, judge), options, accept,
                                         store.history(task), store.write_attempt)
            store.finish_task(outcome)
            bar.update(1)
            store.maybe_materialize(options.materialize_every)

    try:
        try:
            await asyncio.gather(*(worker() for _ in range(max(1, options.concurrency))))
        finally:
            bar.close()
            await close_clients(writer, editor, judge)
            summary.api_calls, summary.cache_hits = call_counts(writer, editor, judge)
        return close_run(store, summary, started)
    finally:
        store.close()  # when interrupted: the JSON files are materialised from what finished, the lock released


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


async def close_clients(*backends) -> None:
    """Close each distinct client connection pool (a shared transport once) inside the run's event loop."""
    for client in _clients(backends):
        if hasattr(client, "aclose"):
            await client.aclose()


def run(tasks, run_dir, writer, editor, judge, options=None, config=None) -> RunSummary:
    return asyncio.run(run_tasks(tasks, run_dir, writer, editor, judge, options, config))


def describe_backends(writer, editor, judge) -> dict:
    """What medbanana-run.json records about the backends (names and models, never secrets)."""
    def info(obj):
        return {"backend": getattr(obj, "name", type(obj).__name__), "model": getattr(obj, "model", "")}
    return {"writer": info(writer), "editor": info(editor), "judge": info(judge)}


def load_stats(run_dir: Path) -> dict:
    return json.loads((Path(run_dir) / layout.STATS).read_text())
