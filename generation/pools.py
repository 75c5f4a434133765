"""Process pools for per-image CPU work (a round's masks and geometry check, `eval`'s pixel metrics): many small numpy
and scipy steps that hold the GIL, so in a thread beside an event loop they delay every call it handles.

`pool_size` sizes a pool to the CPUs this process may use (its share of them when `--workers` processes split the
machine) and to the memory available (PROCESS_MEMORY per process). `ImagePool` runs functions in such a pool for an
event loop: at most `size` jobs are in the processes at once, so a thousand images arriving together wait as the
objects they already are, not as pickled copies in a pipe, and a job on a task's critical path (`urgent`) goes
before those queued behind it. While urgent jobs come (one in the last URGENT_WINDOW seconds) one never waits for a
job that can: the others get all the processes but one (a pool of one process is shared). Once they stop coming the
others get every process, and the next urgent job may wait for one of them to end (10-30 ms). Its processes are
spawned (a fork of a process with threads and an event loop is not safe), start with SIGINT blocked (interrupts.py:
Ctrl-C is the parent's) and end when their parent does, even when it was killed. A pool whose process died (killed,
out of memory) is replaced for the next job, at most RESTARTS times; after that `run` raises PoolBroken at once, and
the caller does the work another way or goes without it.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import os
import sys
import threading
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import Any, Callable

from .failures import UsageError
from .interrupts import children_ignore_sigint, ignore_sigint

CGROUP_CPU_MAX = Path("/sys/fs/cgroup/cpu.max")  # cgroup v2: "QUOTA PERIOD" in microseconds, or "max PERIOD"
CGROUP_MEMORY_MAX = Path("/sys/fs/cgroup/memory.max")  # cgroup v2: bytes, or "max"
MEMINFO = Path("/proc/meminfo")
# what one pool process may hold at its peak: ~60 MB of code (numpy, scipy, Pillow), ~100 MB at 1024 px (a round's
# masks and geometry check, eval's SSIM maps), with room for larger images
PROCESS_MEMORY = 256 * 2**20
RESTARTS = 3
# Seconds a process stays kept for urgent jobs after one came. While a run's geometry checks come (one every 35 ms at
# 0.2 s per call and 20 in flight) a check never waits behind masks; once a burst of them is over (a wave of 100
# edits answered together) the masks behind it get every process, and are made before their rounds are stored:
# kept for good, one process made a wave's 100 masks in 2-3 s and held the rounds up to a second after their judge
# answered (bench_gemini.py --case short, docs/benchmarks.md)
URGENT_WINDOW = 0.25


def available_cpus(cpu_max: Path = CGROUP_CPU_MAX) -> int:
    """The CPUs this process may run on: its affinity mask, lowered by a cgroup v2 CPU quota (a container's
    `--cpus`), which the mask does not show."""
    try:
        count = len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity call on this platform (macOS)
        count = os.cpu_count() or 1
    try:
        quota, period = cpu_max.read_text().split()[:2]
        if quota != "max":
            count = min(count, -(-int(quota) // int(period)))  # a quota of 1.5 CPUs still keeps 2 busy
    except (OSError, ValueError):
        pass
    return max(1, count)


def available_memory(meminfo: Path = MEMINFO, memory_max: Path = CGROUP_MEMORY_MAX) -> int | None:
    """Bytes of memory this process can still use: the kernel's MemAvailable, lowered by a cgroup v2 limit; None
    where neither can be read (not Linux)."""
    found = []
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                found.append(int(line.split()[1]) * 1024)
    except (OSError, ValueError, IndexError):
        pass
    try:
        limit = memory_max.read_text().strip()
        if limit != "max":
            found.append(int(limit))
    except (OSError, ValueError):
        pass
    return min(found) if found else None


def pool_size(share: int = 1, *, cpus: int | None = None, memory: int | None = None) -> int:
    """Processes for a pool that gets 1/`share` of the machine: its share of the available CPUs (at least one), no
    more than its share of the available memory holds at PROCESS_MEMORY each.

    >>> pool_size(cpus=8, memory=16 * 2**30), pool_size(2, cpus=8, memory=16 * 2**30), pool_size(4, cpus=2)
    (8, 4, 1)
    >>> pool_size(cpus=8, memory=600 * 2**20)  # memory for two
    2
    """
    share = max(1, share)
    count = max(1, (available_cpus() if cpus is None else cpus) // share)
    memory = available_memory() if memory is None else memory
    if memory is not None:
        count = min(count, max(1, memory // share // PROCESS_MEMORY))
    return count


# A pool's queues hold named semaphores. A process killed (out of memory) with a pool of its own cannot unlink them;
# multiprocessing's resource tracker does, and says so on stderr when the run ends: noise after the run's own error.
QUIET_TRACKER = "ignore::UserWarning:multiprocessing.resource_tracker"


@contextlib.contextmanager
def quiet_resource_tracker():
    """Processes started in the block (and the resource tracker, which starts with the first) run with the
    PYTHONWARNINGS filter QUIET_TRACKER: the tracker still unlinks what a killed process left, without a word."""
    before = os.environ.get("PYTHONWARNINGS")
    os.environ["PYTHONWARNINGS"] = f"{before},{QUIET_TRACKER}" if before else QUIET_TRACKER
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("PYTHONWARNINGS", None)
        else:
            os.environ["PYTHONWARNINGS"] = before


def refuse_in_a_starting_child(what: str) -> None:
    """UsageError when `what` is called by a script that a spawned process is running again as it starts: Python
    runs the parent's main script in every process it spawns (a pool's, a worker's), as `__mp_main__` beside the
    child's own `__main__` until it is done, so a call that is not under `if __name__ == "__main__":` would run
    again in each, before the process does any of its work. A call from a child's work, once started, is not one."""
    starting = sys.modules.get("__mp_main__")
    if getattr(starting, "__name__", None) == "__mp_main__" and starting is not sys.modules.get("__main__"):
        raise UsageError(f"{what} was called again in a process it started: the script that calls it must do so "
                         "under `if __name__ == \"__main__\":`, since Python runs the script again in each process "
                         "it starts (multiprocessing's spawn)")


class PoolBroken(RuntimeError):
    """The pool cannot run the job: its process died and it was replaced RESTARTS times already, or it was
    closed."""


def _start_child(initializer: Callable | None, initargs: tuple) -> None:
    """A pool process's first act: Ctrl-C ignored, an exit when its parent ends, then the caller's initializer."""
    ignore_sigint()
    threading.Thread(target=_exit_with_parent, name="medbanana-pool-parent", daemon=True).start()
    if initializer is not None:
        initializer(*initargs)


def _started() -> None:
    """A job that does nothing: submitted to start a process."""


def _exit_with_parent() -> None:
    """End this process once its parent has ended (a killed parent leaves no orphan computing for nobody)."""
    import multiprocessing
    from multiprocessing.connection import wait

    parent = multiprocessing.parent_process()
    if parent is not None and parent.sentinel is not None:
        wait([parent.sentinel])
        os._exit(0)


class ImagePool:
    """Functions run in `size` spawned processes for an event loop (module docstring); started at the first job.
    `initializer(*initargs)` runs once in each process."""

    def __init__(self, size: int, *, initializer: Callable | None = None, initargs: tuple = ()):
        self.size = max(1, size)
        self.initializer, self.initargs = initializer, initargs
        self.restarts = 0
        self._executor: ProcessPoolExecutor | None = None
        self._closed = False
        self._ending: threading.Thread | None = None  # the executor's shutdown, once closed
        self._running = 0
        self._background = 0  # of the jobs running, those that are not urgent
        self._urgent_at = float("-inf")  # the event loop's time when the latest urgent job came
        self._refill: asyncio.TimerHandle | None = None  # a _fill when the kept process is free for all
        self._waiting: list = []  # heap of (0 urgent | 1, order, function, arguments, future)
        self._order = itertools.count()

    def start(self) -> None:
        """Start the processes now (their imports take a second or more), so that the first jobs, which a run
        needs minutes later, do not wait for them."""
        try:
            executor = self._pool()
            with children_ignore_sigint():
                for _ in range(self.size):  # a process is spawned for each job that finds none idle
                    executor.submit(_started)
        except (BrokenProcessPool, RuntimeError, OSError):  # the first job finds out, and says so
            pass

    async def run(self, function: Callable, *args: Any, urgent: bool = False) -> Any:
        """`function(*args)` in a pool process (both picklable); its exception is raised here. PoolBroken when
        the pool cannot run it (the process died and no restart is left, or the pool was closed)."""
        if self._closed or self.restarts > RESTARTS:
            raise PoolBroken("the image pool is closed" if self._closed else
                             f"the image pool's processes died {self.restarts} times")
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        if urgent:
            self._urgent_at = loop.time()
        heapq.heappush(self._waiting, (0 if urgent else 1, next(self._order), function, args, done))
        self._fill()
        return await done

    def _fill(self) -> None:
        # While urgent jobs come, a process is kept for them: the others may all run jobs that can wait (a round's
        # masks, 10-30 ms each), so a job on a task's critical path starts at once instead of behind them
        loop = asyncio.get_running_loop()
        kept_until = self._urgent_at + URGENT_WINDOW
        while self._running < self.size and self._waiting:
            if self._waiting[0][0] and loop.time() < kept_until and self._background >= max(1, self.size - 1):
                if self._refill is None:
                    self._refill = loop.call_at(kept_until, self._refilled)
                break
            urgency, *_, function, args, done = heapq.heappop(self._waiting)
            if done.done():  # its caller was cancelled meanwhile
                continue
            executor = None
            try:
                executor = self._pool()
                with children_ignore_sigint():  # submitting may start a process: Ctrl-C is the parent's
                    job = executor.submit(function, *args)
            except (BrokenProcessPool, RuntimeError, OSError) as exc:  # RuntimeError: closed meanwhile
                self._broken(executor, done, exc)
                continue
            self._running += 1
            self._background += urgency
            asyncio.wrap_future(job).add_done_callback(
                lambda finished, done=done, executor=executor, urgency=urgency: self._finished(finished, done,
                                                                                              executor, urgency))

    def _refilled(self) -> None:
        self._refill = None
        self._fill()

    def _pool(self) -> ProcessPoolExecutor:
        if self._closed or self.restarts > RESTARTS:
            raise RuntimeError("the image pool is closed or broken")
        if self._executor is None:
            import multiprocessing

            self._executor = ProcessPoolExecutor(self.size, mp_context=multiprocessing.get_context("spawn"),
                                                 initializer=_start_child, initargs=(self.initializer, self.initargs))
        return self._executor

    def _finished(self, finished: asyncio.Future, done: asyncio.Future, executor: ProcessPoolExecutor,
                  urgency: int) -> None:
        self._running -= 1
        self._background -= urgency
        if finished.cancelled():
            if not done.done():
                done.cancel()
        elif isinstance(error := finished.exception(), BrokenProcessPool):
            self._broken(executor, done, error)
        elif not done.done():
            if error is not None:
                done.set_exception(error)
            else:
                done.set_result(finished.result())
        self._fill()

    def _broken(self, executor: ProcessPoolExecutor | None, done: asyncio.Future, error: BaseException) -> None:
        """A job lost to a dead process: PoolBroken for it; the broken pool is replaced for the jobs after it
        (once: every job it held ends here)."""
        if executor is not None and executor is self._executor and isinstance(error, BrokenProcessPool):
            executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None
            self.restarts += 1
        if not done.done():
            done.set_exception(PoolBroken(f"an image pool process died: {error}"))

    def close(self, wait: bool = True) -> None:
        """Stop the processes (jobs not started are dropped; their callers get PoolBroken). Without `wait` they
        exit while the caller goes on (a process takes a few tenths of a second to end), and a later close
        waits for them."""
        self._closed = True
        if self._refill is not None:
            self._refill.cancel()
            self._refill = None
        for *_, done in self._waiting:
            if not done.done():
                done.set_exception(PoolBroken("the image pool is closed"))
        self._waiting.clear()
        if self._executor is not None:  # (the executor forgets its processes at its first shutdown: a thread waits)
            self._ending = threading.Thread(target=self._executor.shutdown, kwargs={"cancel_futures": True},
                                            name="medbanana-pool-end", daemon=True)
            self._ending.start()
            self._executor = None
        if wait and self._ending is not None:
            self._ending.join()
