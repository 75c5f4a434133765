"""Run many tasks concurrently in this process, into a run directory: the default runner.

`concurrency` tasks are in flight at once on one event loop, each driven through the refinement loop by
`loop.refine_task` (its backends `budget.Metered` when the run is priced: a round that does not fit the budget
is not started, and neither is any task after it); the run directory, resume, progress and stats are the
`RunSession` skeleton's. Each edit's geometry check and each image's masks run in a process pool sized to the
machine (image_work.py). The worker-process runner uses `run_one_task` from here in each worker.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from pathlib import Path

from ..backends import Editor, InstructionWriter, Judge
from ..backends.response_cache import answers_of_task
from ..loop import Acceptance, OnRound, acceptance_policy, refine_task
from ..records import DEFAULT_MAX_PIXELS, Attempt, SourceImage, Task, open_image
from ..outcomes import ApiFailure, FailureKind, TaskOutcome, TaskStatus
from ..pools import pool_size
from .budget import BudgetReached, metered
from .image_work import ImageWork
from .session import RunOptions, RunSession, RunSummary, open_clients
from ..failures import UsageError


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
            raise UsageError(f"not a readable image: {exc}") from exc
    return source


class SourceCache:
    """Add tasks cross one source with every disease; keep a few checked sources instead of re-reading them."""

    def __init__(self, max_pixels: int = DEFAULT_MAX_PIXELS, size: int = 32):
        self.max_pixels, self.size, self.items = max_pixels, size, OrderedDict()
        self._reading: dict[Path, asyncio.Future] = {}

    async def read(self, path: Path) -> SourceImage:
        """The checked source, read on a worker thread once however many tasks ask for it at the same time (a
        run's first hundred tasks start together, eleven to a source)."""
        if (source := self.cached(path)) is not None:
            return source
        if (reading := self._reading.get(path)) is None:
            reading = self._reading[path] = asyncio.ensure_future(asyncio.to_thread(self.get, path))
            reading.add_done_callback(lambda _: self._reading.pop(path, None))
        return await asyncio.shield(reading)  # one task cancelled does not cancel the others' read

    def cached(self, path: Path) -> SourceImage | None:
        """The source when it was read already, without I/O (so on the event loop); None otherwise."""
        try:
            self.items.move_to_end(path)
            return self.items[path]
        except KeyError:  # never read, or dropped meanwhile by a reading thread
            return None

    def get(self, path: Path) -> SourceImage:
        if (source := self.cached(path)) is not None:
            return source
        source = read_source(path, self.max_pixels)
        self.items[path] = source
        if len(self.items) > self.size:
            self.items.popitem(last=False)
        return source


def source_error(task: Task, exc: Exception) -> TaskOutcome:
    return TaskOutcome(task, TaskStatus.API_FAILED, [], ApiFailure("load_source", 0, f"{task.source_path}: {exc}",
                                                                   FailureKind.SOURCE_ERROR))


async def run_one_task(task: Task, sources: SourceCache, backends: tuple[InstructionWriter, Editor, Judge],
                       options: RunOptions, accept: Acceptance, history: list[Attempt],
                       on_round: OnRound, work: ImageWork) -> TaskOutcome:
    """One task from its journalled `history` to an outcome; whatever goes wrong becomes the outcome's record.
    `work` checks each edit's geometry and makes its masks (`on_round` gets them from there)."""
    try:
        source = await sources.read(task.source_path)
    except (OSError, ValueError) as exc:
        return source_error(task, exc)
    writer, editor, judge = backends
    try:
        with answers_of_task(task.uid):  # cached apart, dropped once the task's end is journalled (session.finish)
            return await refine_task(task, source, writer, editor, judge, max_rounds=options.max_rounds,
                                     accept=accept, seed=options.seed, history=history, on_round=on_round,
                                     geometry=options.geometry, check=work.check)
    finally:
        work.forget(task)


async def run_tasks(tasks: list[Task], run_dir: Path, writer: InstructionWriter, editor: Editor, judge: Judge,
                    options: RunOptions | None = None, config: dict | None = None, on_open=None) -> RunSummary:
    options = options or RunOptions()
    accept = acceptance_policy(options.accept)
    with RunSession(tasks, run_dir, options, config, on_open) as session:
        store, sources = session.store, SourceCache(options.max_pixels)
        queue: asyncio.Queue[Task] = asyncio.Queue()
        for task in session.todo:
            queue.put_nowait(task)

        await open_clients(writer, editor, judge)  # before the pool's processes start, which take the CPUs a while
        work = ImageWork(pool_size())

        async def store_round(task: Task, attempt: Attempt, image) -> None:
            # An image's masks (10-30 ms of CPU) are made in the pool, started at its geometry check, and its
            # signature (milliseconds) in a worker thread, while the event loop keeps the calls in flight moving. The
            # journal line follows the image, here.
            if image is not None:
                made = await work.masks(task, image, attempt.frame_rejected)
                await asyncio.to_thread(store.write_image, task, attempt, image, made)
            store.journal_attempt(task, attempt)

        ledger = session.ledger
        backends = metered((writer, editor, judge), ledger)  # with a price: every round admitted, every step counted

        async def worker() -> None:
            while not queue.empty():
                task = queue.get_nowait()
                try:
                    outcome = await run_one_task(task, sources, backends, options, accept, store.history(task),
                                                 store_round, work)
                except BudgetReached:  # its finished rounds are journalled; it resumes when run again
                    session.budget_reached()
                    while not queue.empty():  # and no other task starts
                        queue.get_nowait()
                    continue
                finally:
                    if ledger is not None:
                        ledger.release(task.uid)
                session.finish(outcome)

        try:
            await asyncio.gather(*(worker() for _ in range(max(1, options.concurrency))))
        finally:
            work.close(wait=False)  # the pool's processes end while the run's files are written
            await session.close_clients(writer, editor, judge)
        try:
            return session.end()
        finally:
            work.close()


def run(tasks, run_dir, writer, editor, judge, options=None, config=None, on_open=None) -> RunSummary:
    return asyncio.run(run_tasks(tasks, run_dir, writer, editor, judge, options, config, on_open))


def describe_backends(writer, editor, judge) -> dict:
    """What medbanana-run.json records about the backends (names and models, never secrets)."""
    def info(obj):  # a Gemini backend on Vertex AI adds its project and location (--retry-failed reads them)
        vertex = {"vertex": obj.vertex} if getattr(obj, "vertex", None) is not None else {}
        drift = {"drift": obj.drift} if getattr(obj, "drift", 0) else {}  # the simulated editor's frame drift
        return {"backend": getattr(obj, "name", type(obj).__name__), "model": getattr(obj, "model", ""), **vertex,
                **drift}
    return {"writer": info(writer), "editor": info(editor), "judge": info(judge)}
