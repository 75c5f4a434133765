"""Spread a run over worker processes when one event loop's CPU is the bottleneck (`generate --workers N`).

A client library spends several milliseconds of CPU per call (request conversion, JSON, base64 of the images, the
HTTP stack), so one process saturates a core near a hundred calls a second. With N workers each process runs its
share of the tasks in flight on its own event loop with its own backends, built from the same `BackendSpec`
(each with 1/N of the --rpm and --tpm budget). The parent keeps the one run directory: workers send each finished
round (record and image bytes) and each finished task over a pipe, and the parent writes images, journal lines
and JSON files exactly as a single-process run does, so resume, crash safety and the layout are unchanged. The
parent alone holds the run directory's lock (workers are spawned, so they inherit no descriptor of it).

A worker exits when its pipe from the parent closes (the parent was killed): nothing is left running. A worker
that dies stops the run with an error; every round it finished is in the journal, so rerunning resumes.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import signal
import threading
import time
from collections import deque
from multiprocessing.connection import Connection, wait
from pathlib import Path

from tqdm.auto import tqdm

from ..loop import acceptance_policy
from ..records import Attempt, EditedImage, Task, TaskOutcome
from .local import RunOptions, RunSummary, _SourceCache, call_counts, close_clients, close_run, open_run, run_one_task


class WorkerCrashed(RuntimeError):
    """A worker process ended before finishing its tasks."""


def shares(total: int, parts: int) -> list[int]:
    """`total` split into `parts` near-equal whole shares, largest first.

    >>> shares(20, 3)
    [7, 7, 6]
    """
    return [total // parts + (i < total % parts) for i in range(parts)]


# ---------------------------------------------------------------- the worker process

def worker_main(spec, out: str, options: RunOptions, slots: int, share: int, tasks: Connection,
                results: Connection) -> None:
    """Entry point of a worker: run tasks sent by the parent, `slots` at a time, until told to stop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle; it ends the workers
    asyncio.run(_serve(spec, Path(out), options, slots, share, tasks, results))


async def _serve(spec, out: Path, options: RunOptions, slots: int, share: int, tasks: Connection,
                 results: Connection) -> None:
    backends = spec.build(out, share=share)
    accept = acceptance_policy(options.accept)
    sources = _SourceCache(options.max_pixels)
    inbox: asyncio.Queue = asyncio.Queue()
    loop = asyncio.get_running_loop()

    def receive() -> None:  # a thread, so that a blocking read never stalls the event loop
        while True:
            try:
                message = tasks.recv()
            except (EOFError, OSError):
                os._exit(3)  # the parent is gone: stop calling the API at once
            loop.call_soon_threadsafe(inbox.put_nowait, message)
            if message[0] == "stop":
                return

    threading.Thread(target=receive, name="medbanana-worker-inbox", daemon=True).start()

    def send_round(task: Task, attempt: Attempt, image: EditedImage | None) -> None:
        results.send(("round", task.uid, attempt, image.data if image is not None else None))

    async def slot() -> None:
        while True:
            message = await inbox.get()
            if message[0] == "stop":
                inbox.put_nowait(message)  # for the other slots
                return
            _, task, history = message
            outcome = await run_one_task(task, sources, backends, options, accept, history, send_round)
            results.send(("done", task.uid, outcome.status, outcome.failure))

    await asyncio.gather(*(slot() for _ in range(slots)))
    await close_clients(*backends)
    results.send(("calls", *call_counts(*backends)))


# ---------------------------------------------------------------- the parent

class _Worker:
    def __init__(self, context, spec, out: Path, options: RunOptions, slots: int, share: int, index: int):
        self.slots = slots
        receive_tasks, self.tasks = context.Pipe(duplex=False)
        self.results, send_results = context.Pipe(duplex=False)
        self.process = context.Process(target=worker_main, name=f"medbanana-worker-{index}", daemon=True,
                                       args=(spec, str(out), options, slots, share, receive_tasks, send_results))
        self.process.start()
        receive_tasks.close()  # only the worker holds these ends now: either side's death closes the pipes
        send_results.close()
        self.in_flight: set[str] = set()
        self.calls = (0, 0)
        self.stopped = False

    def stop(self) -> None:
        self.tasks.send(("stop",))
        self.stopped = True


def run_in_workers(tasks: list[Task], run_dir: Path, spec, options: RunOptions,
                   config: dict | None = None) -> RunSummary:
    """Like `runner.run`, with the calls made by `options.workers` processes (see the module docstring)."""
    started = time.perf_counter()
    store, summary, todo = open_run(tasks, run_dir, options, config)
    pending = deque(todo)
    count = max(1, min(options.workers, len(todo)))
    context = multiprocessing.get_context("spawn")  # no fork: the parent may hold threads and open clients
    workers: list[_Worker] = []
    running: dict[str, tuple[Task, list[Attempt]]] = {}  # uid -> task, its rounds as the parent wrote them
    bar = tqdm(total=len(todo), desc="tasks", unit="task", disable=options.quiet, dynamic_ncols=True)

    def dispatch(worker: _Worker) -> None:
        task = pending.popleft()
        history = store.history(task)
        running[task.uid] = (task, list(history))
        worker.in_flight.add(task.uid)
        worker.tasks.send(("task", task, history))

    try:
        if todo:
            for index, slots in enumerate(shares(max(options.concurrency, count), count)):
                workers.append(_Worker(context, spec, Path(run_dir), options, slots, count, index))
            for slot in range(max(w.slots for w in workers)):  # round-robin, so that every worker gets work
                for worker in workers:
                    if slot < worker.slots and pending:
                        dispatch(worker)
            for worker in workers:
                if not worker.in_flight:
                    worker.stop()
        live = {w.results: w for w in workers}
        while live:
            for connection in wait(list(live)):
                worker = live[connection]
                try:
                    message = connection.recv()
                except (EOFError, OSError):
                    del live[connection]
                    if worker.in_flight or not worker.stopped:
                        worker.process.join(5)
                        raise WorkerCrashed(f"{worker.process.name} ended (exit code {worker.process.exitcode}) "
                                            f"with {len(worker.in_flight)} task(s) unfinished; their finished "
                                            f"rounds are saved: rerun the same command to resume") from None
                    continue
                kind = message[0]
                if kind == "round":
                    _, uid, attempt, data = message
                    task, attempts = running[uid]
                    store.write_attempt(task, attempt, EditedImage(data=data) if data is not None else None)
                    attempts.append(attempt)
                elif kind == "done":
                    _, uid, status, failure = message
                    task, attempts = running.pop(uid)
                    worker.in_flight.discard(uid)
                    store.finish_task(TaskOutcome(task, status, attempts, failure))
                    bar.update(1)
                    store.maybe_materialize(options.materialize_every)
                    if pending:
                        dispatch(worker)
                    elif not worker.in_flight:
                        worker.stop()
                elif kind == "calls":
                    worker.calls = message[1:]
        summary.api_calls = sum(w.calls[0] for w in workers)
        summary.cache_hits = sum(w.calls[1] for w in workers)
        return close_run(store, summary, started)
    finally:
        bar.close()
        for worker in workers:
            if worker.process.is_alive() and not worker.stopped:
                worker.process.terminate()
            worker.process.join(10)
        store.close()  # when interrupted: JSON files materialised from what finished; lock released last
