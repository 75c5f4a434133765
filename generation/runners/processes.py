"""Spread a run over worker processes when one event loop's CPU is the bottleneck (`generate --workers N|auto`).

A client library spends several milliseconds of CPU per call (request conversion, JSON, base64 of the images, the
HTTP stack), so one process saturates a core near a hundred calls a second. With N workers each process runs its
share of the tasks in flight on its own event loop with its own backends, built from the same `BackendSpec`
(each with 1/N of the --rpm and --tpm budget). The parent keeps the one run directory: workers send each finished
round (record, image bytes and the image's masks, computed in the worker) and each finished task over a pipe, and
the parent writes images, masks, journal lines and JSON files exactly as a single-process run does, so resume,
crash safety and the layout are unchanged. The parent alone holds the run directory's lock (workers are spawned,
so they inherit no descriptor of it). Parent and workers talk in the small message classes below.

A worker exits when its pipe from the parent closes (the parent was killed): nothing is left running. A worker
that dies stops the run with an error; every round it finished is in the journal, so rerunning resumes.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import queue
import threading
from collections import deque
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from pathlib import Path

from ..failures import EXIT_INCOMPLETE, WorkerCrashed
from ..interrupts import children_ignore_sigint, ignore_sigint
from ..loop import acceptance_policy
from ..outcomes import ApiFailure, TaskOutcome, TaskStatus
from ..pools import available_cpus, pool_size, quiet_resource_tracker
from ..records import Attempt, EditedImage, Task
from ..rundir import mask_files
from .budget import BudgetReached, Ledger, SharedState, metered
from .image_work import ImageWork
from .local import SourceCache, run_one_task
from .session import RunOptions, RunSession, RunSummary, call_counts, close_clients, open_clients




def auto_workers(concurrency: int, tasks: int | None = None, cpus: int | None = None) -> int:
    """`--workers auto`: one process per available CPU, never more than the calls in flight (a worker needs at
    least one) nor the tasks to run.

    >>> auto_workers(concurrency=20, cpus=8), auto_workers(concurrency=3, cpus=8), auto_workers(20, tasks=2, cpus=8)
    (8, 3, 2)
    """
    count = min(available_cpus() if cpus is None else cpus, max(1, concurrency))
    return max(1, min(count, tasks) if tasks is not None else count)


def shares(total: int, parts: int) -> list[int]:
    """`total` split into `parts` near-equal whole shares, largest first.

    >>> shares(20, 3)
    [7, 7, 6]
    """
    return [total // parts + (i < total % parts) for i in range(parts)]


# ---------------------------------------------------------------- messages (pickled over the pipes)

@dataclass(frozen=True)
class RunTask:
    """Parent -> worker: run this task on from its journalled rounds."""
    task: Task
    history: list[Attempt]


@dataclass(frozen=True)
class Stop:
    """Parent -> worker: no more tasks; finish those in flight, report the calls, exit."""


@dataclass(frozen=True)
class AttemptDone:
    """Worker -> parent: a finished round of a task, with its image's bytes (None after a refused edit) and the
    image's masks (rundir/mask_files.py), made in the worker's pool so that the parent, which writes every
    worker's rounds, only writes them."""
    uid: str
    attempt: Attempt
    image: bytes | None
    masks: mask_files.MaskFiles | None = None
    original: bytes | None = None  # the editor's bytes when `image` is its edit registered (EditedImage.original)


@dataclass(frozen=True)
class TaskDone:
    """Worker -> parent: a task's outcome; its rounds are the AttemptDone messages sent before."""
    uid: str
    status: TaskStatus
    failure: ApiFailure | None


@dataclass(frozen=True)
class TaskPaused:
    """Worker -> parent: the task's next round did not fit in the budget; it stays unfinished (its finished
    rounds were sent before), and no task should start any more."""
    uid: str


@dataclass(frozen=True)
class CallCounts:
    """Worker -> parent, last: the calls its backends made."""
    network_calls: int
    cache_hits: int


# ---------------------------------------------------------------- the worker process

def worker_main(spec, out: str, options: RunOptions, slots: int, share: int, tasks: Connection,
                results: Connection, spend: SharedState | None = None) -> None:
    """Entry point of a worker: run tasks sent by the parent, `slots` at a time, until told to stop. `spend`:
    the run's ledger figures, shared by every worker (with options.pricing)."""
    ignore_sigint()  # Ctrl-C is the parent's to handle; it ends the workers (started with SIGINT blocked too)
    asyncio.run(_serve(spec, Path(out), options, slots, share, tasks, results, spend))


def _receive(tasks: Connection, inbox: asyncio.Queue, loop: asyncio.AbstractEventLoop) -> None:
    """Hand the parent's messages to the event loop (in a thread: a blocking read must never stall the loop)."""
    while True:
        try:
            message = tasks.recv()
        except (EOFError, OSError):
            os._exit(EXIT_INCOMPLETE)  # the parent is gone: stop calling the API at once
        loop.call_soon_threadsafe(inbox.put_nowait, message)
        if isinstance(message, Stop):
            return


async def _serve(spec, out: Path, options: RunOptions, slots: int, share: int, tasks: Connection,
                 results: Connection, spend: SharedState | None = None) -> None:
    built = spec.build(out, share=share)
    ledger = Ledger(options.pricing, spend) if options.pricing is not None and spend is not None else None
    backends = metered(built, ledger)
    accept = acceptance_policy(options.accept)
    sources = SourceCache(options.max_pixels)
    inbox: asyncio.Queue = asyncio.Queue()
    threading.Thread(target=_receive, args=(tasks, inbox, asyncio.get_running_loop()),
                     name="medbanana-worker-inbox", daemon=True).start()

    # Messages go out from a thread of their own, in order: a round's image fills the pipe while the parent is
    # busy writing another worker's, and that wait must not stall this loop's calls in flight. Each edit's
    # geometry check and masks run in this worker's pool, sized to its share of the machine (image_work.py).
    outbox: queue.SimpleQueue = queue.SimpleQueue()
    sender = threading.Thread(target=_send_all, args=(outbox, results), name="medbanana-worker-outbox", daemon=True)
    sender.start()
    await open_clients(*built)  # before the pool's processes start (local.py)
    work = ImageWork(pool_size(share))

    async def send_round(task: Task, attempt: Attempt, image: EditedImage | None) -> None:
        if image is None:
            outbox.put(AttemptDone(task.uid, attempt, None))
        else:
            masks = await work.masks(task, image, attempt.frame_rejected)
            outbox.put(AttemptDone(task.uid, attempt, image.data, masks, image.original))

    async def slot() -> None:
        while isinstance(message := await inbox.get(), RunTask):
            try:
                outcome = await run_one_task(message.task, sources, backends, options, accept, message.history,
                                             send_round, work)
            except BudgetReached:
                outbox.put(TaskPaused(message.task.uid))
                continue
            finally:
                if ledger is not None:
                    ledger.release(message.task.uid)
            outbox.put(TaskDone(message.task.uid, outcome.status, outcome.failure))
        inbox.put_nowait(message)  # the Stop, for the other slots

    try:
        await asyncio.gather(*(slot() for _ in range(slots)))
    finally:
        work.close()
    await close_clients(*built)
    outbox.put(CallCounts(*call_counts(*built)))
    outbox.put(None)
    await asyncio.to_thread(sender.join)


def _send_all(outbox: queue.SimpleQueue, results: Connection) -> None:
    """Send the outbox's messages to the parent until None; a parent gone ends the worker."""
    while (message := outbox.get()) is not None:
        try:
            results.send(message)
        except OSError:
            os._exit(EXIT_INCOMPLETE)


# ---------------------------------------------------------------- the parent

class _Worker:
    def __init__(self, context, spec, out: Path, options: RunOptions, slots: int, share: int, index: int,
                 spend: SharedState | None = None):
        self.slots = slots
        receive_tasks, self.tasks = context.Pipe(duplex=False)
        self.results, send_results = context.Pipe(duplex=False)
        # not a daemon: a daemon process may not start children, and each worker starts its image pool's. It ends
        # when its pipe from the parent closes, and `_Pool.shutdown` ends it after an error.
        self.process = context.Process(target=worker_main, name=f"medbanana-worker-{index}", daemon=False,
                                       args=(spec, str(out), options, slots, share, receive_tasks, send_results,
                                             spend))
        with children_ignore_sigint():  # Ctrl-C is the parent's: the worker never sees it, not even while importing
            self.process.start()
        receive_tasks.close()  # only the worker holds these ends now: either side's death closes the pipes
        send_results.close()
        self.in_flight: set[str] = set()
        self.calls = CallCounts(0, 0)
        self.stopped = False

    def stop(self) -> None:
        self.tasks.send(Stop())
        self.stopped = True


class _Pool:
    """The parent's side: hands the session's tasks to the workers, a slot's worth at a time, and writes what
    they send back into the run directory."""

    def __init__(self, session: RunSession, spec, run_dir: Path, options: RunOptions):
        self.session, self.store = session, session.store
        self.spec, self.run_dir, self.options = spec, run_dir, options
        self.pending = deque(session.todo)
        self.running: dict[str, tuple[Task, list[Attempt]]] = {}  # uid -> task, its rounds as the parent wrote them
        self.workers: list[_Worker] = []

    def start(self) -> None:
        """Spawn the workers (no fork: the parent may hold threads and open clients) and fill their slots
        round-robin, so that every worker gets work; a worker left without any is stopped at once."""
        if not self.pending:
            return
        count = max(1, min(self.options.workers, len(self.pending)))
        context = multiprocessing.get_context("spawn")
        spend = None
        # the resource tracker starts here, with the first semaphore or process: a worker killed with its image pool
        # leaves semaphores that it unlinks quietly (pools.quiet_resource_tracker)
        with quiet_resource_tracker():
            if self.session.ledger is not None:  # one ledger for all: the workers' steps go to shared memory
                spend = SharedState(self.session.ledger.spent, context)
                self.session.ledger.state = spend
            for index, slots in enumerate(shares(max(self.options.concurrency, count), count)):
                self.workers.append(_Worker(context, self.spec, self.run_dir, self.options, slots, count, index,
                                            spend))
        for slot in range(max(w.slots for w in self.workers)):
            for worker in self.workers:
                if slot < worker.slots and self.pending:
                    self.dispatch(worker)
        for worker in self.workers:
            if not worker.in_flight:
                worker.stop()

    def dispatch(self, worker: _Worker) -> None:
        task = self.pending.popleft()
        history = self.store.history(task)
        self.running[task.uid] = (task, list(history))
        worker.in_flight.add(task.uid)
        worker.tasks.send(RunTask(task, history))

    def serve(self) -> None:
        """Handle the workers' messages until every worker has closed its pipe."""
        live = {w.results: w for w in self.workers}
        while live:
            for connection in wait(list(live)):
                try:
                    message = connection.recv()
                except (EOFError, OSError):
                    self.check_ended(live.pop(connection))
                    continue
                self.handle(live[connection], message)

    def check_ended(self, worker: _Worker) -> None:
        """A worker's pipe closed: fine once it was stopped with nothing in flight, a crash otherwise."""
        if worker.in_flight or not worker.stopped:
            worker.process.join(5)
            raise WorkerCrashed(f"{worker.process.name} ended (exit code {worker.process.exitcode}) with "
                                f"{len(worker.in_flight)} task(s) unfinished; their finished rounds are saved: "
                                f"rerun the same command to resume") from None

    def handle(self, worker: _Worker, message) -> None:
        if isinstance(message, AttemptDone):
            task, attempts = self.running[message.uid]
            image = (EditedImage(data=message.image, original=message.original) if message.image is not None
                     else None)
            self.store.write_attempt(task, message.attempt, image, message.masks)
            attempts.append(message.attempt)
        elif isinstance(message, TaskDone):
            task, attempts = self.running.pop(message.uid)
            worker.in_flight.discard(message.uid)
            self.session.finish(TaskOutcome(task, message.status, attempts, message.failure))
            if self.pending:
                self.dispatch(worker)
            elif not worker.in_flight:
                worker.stop()
        elif isinstance(message, TaskPaused):
            self.running.pop(message.uid)
            worker.in_flight.discard(message.uid)
            self.session.budget_reached()
            self.pending.clear()  # no task starts any more; those not started stay for the next run
            if not worker.in_flight:
                worker.stop()
        elif isinstance(message, CallCounts):
            worker.calls = message

    def shutdown(self) -> None:
        """End every worker: those still running after an error are terminated, all are joined."""
        for worker in self.workers:
            if worker.process.is_alive() and not worker.stopped:
                worker.process.terminate()
            worker.process.join(10)
            if worker.process.is_alive():  # stopped, yet still there: nothing it does now is ever written
                worker.process.kill()
                worker.process.join()


def run_in_workers(tasks: list[Task], run_dir: Path, spec, options: RunOptions,
                   config: dict | None = None, on_open=None) -> RunSummary:
    """Like `local.run`, with the calls made by `RunOptions.workers` processes (see the module docstring)."""
    with RunSession(tasks, run_dir, options, config, on_open) as session:
        pool = _Pool(session, spec, Path(run_dir), options)
        try:
            pool.start()
            pool.serve()
        finally:
            pool.shutdown()
        session.summary.api_calls = sum(w.calls.network_calls for w in pool.workers)
        session.summary.cache_hits = sum(w.calls.cache_hits for w in pool.workers)
        return session.end()
