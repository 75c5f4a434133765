"""A run's per-image work, off its event loop: each edit's geometry check and each attempt image's masks, in one
process pool (generation/pools.py) sized to the machine, or to a worker's share of it under `--workers`.

The check is on its task's critical path (its answer goes to the judge), so it goes first in the pool (`urgent`).
The masks are not: they start as soon as the check has said which image goes on (the registered one, or none for
an edit rejected for its frame), so they are made while the judge call is in flight, and the round waits for them
only when it is stored. A burst of images (a hundred edits answered at once, a batch job's thousands) therefore
queues in the pool, not in front of any task's next call. A task's region mask depends on its source and taxonomy
region only: made for the first attempt that needs it, it is handed to the later ones' jobs.

The check in a pool process costs a pickle of the two images' bytes and the answer's way back (~1 ms; the
registered image's bytes only for an edit that was warped back) and keeps its 5-15 ms of numpy and scipy, which
hold the GIL, away from the loop that handles every call in flight (bench/bench_gemini.py, docs/benchmarks.md).
A pool that cannot run a job (its processes died RESTARTS times) costs the masks only: the round is stored
without them (a build recomputes them), and the check runs in a worker thread instead.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from pathlib import Path

from ..geometry import Geometry, GeometryCheck, check_edit, registered_edit
from ..masks import region_key
from ..loop import CheckGeometry
from ..pools import ImagePool, PoolBroken
from ..records import EditedImage, SourceImage, Task
from ..rundir import mask_files


def _check(mode: str, source_path: Path, source: bytes, edited: bytes) -> tuple[str, Geometry | None, str,
                                                                                 bytes | None]:
    """The geometry guard in a pool process, on the images' bytes alone: (action, geometry, note, the registered
    image's bytes when it was warped back)."""
    check = check_edit(mode, SourceImage(source_path, data=source), EditedImage(data=edited))
    return check.action, check.geometry, check.note, check.edited.data if check.action == "registered" else None


def _imports() -> None:
    """A pool process's start: what its jobs use, imported before the first job (skimage: the Fourier-Mellin
    start of the geometry fit)."""
    import skimage.registration  # noqa: F401
    import skimage.transform  # noqa: F401

    from .. import masks  # noqa: F401


# Seconds into a run at which the pool's processes start, unless a job comes first: each takes a CPU for most of a
# second (numpy, scipy and the rest imported), which the run's first requests need more (bench_gemini.py --case
# short: its first hundred went out by a median 0.31-0.38 s, against 0.52-0.72 s with the pool started at once)
START_AFTER = 0.5
# Region masks kept for the later attempts on a source (a few KB each; the tasks of a source run near each other):
# made once for the run instead of once in each process that meets the source, 787 instead of 1,022 for the 1,676
# rounds of bench_gemini.py --case fast, about 3 s of the pool's 50 s of CPU (docs/benchmarks.md)
REGIONS_KEPT = 1024


class ImageWork:
    """The checks and masks of a run's rounds in a pool of `size` processes (module docstring), started
    START_AFTER seconds after this is made in the run's event loop, or at the first job if sooner."""

    def __init__(self, size: int, start_after: float = START_AFTER):
        self.pool = ImagePool(size, initializer=_imports)
        self._start = asyncio.get_running_loop().call_later(start_after, self.pool.start)
        self._masks: dict[str, tuple[bytes, asyncio.Task]] = {}  # task uid -> (image, its masks on the way)
        # (source path, modality, taxonomy region) -> its region mask PNG, the most recently used
        self._regions: OrderedDict[tuple[str, str, str], bytes] = OrderedDict()

    async def check(self, step: CheckGeometry) -> GeometryCheck:
        """The step's GeometryCheck, computed in the pool ahead of any masks; the masks of the image it lets on
        are started. An exception of the guard's is raised (the refinement records it)."""
        check = await self._answer(step)
        self._masks[step.task.uid] = (check.edited.data, asyncio.ensure_future(
            self._compute(step.task, check.edited.data, check.action == "rejected")))
        return check

    async def _answer(self, step: CheckGeometry) -> GeometryCheck:
        try:
            action, geometry, note, moved = await self.pool.run(_check, step.mode, step.source.path, step.source.data,
                                                                step.edited.data, urgent=True)
        except PoolBroken:
            return await asyncio.to_thread(step.answer)
        return GeometryCheck(action, geometry, step.edited if moved is None else registered_edit(step.edited, moved),
                             note)

    async def masks(self, task: Task, image: EditedImage, frame_rejected: bool) -> mask_files.MaskFiles:
        """The masks of the round's `image`: those started at its check, else made now; (None, None) when the
        pool cannot make them."""
        started = self._masks.pop(task.uid, None)
        if started is not None and started[0] is image.data:
            return await started[1]
        return await self._compute(task, image.data, frame_rejected)

    def forget(self, task: Task) -> None:
        """Drop what was started for a task that ended without storing its round (an API error at the judge)."""
        started = self._masks.pop(task.uid, None)
        if started is not None:
            started[1].cancel()

    async def _compute(self, task: Task, image: bytes, frame_rejected: bool) -> mask_files.MaskFiles:
        where = region_key(task.modality, task.disease)
        key = None if where is None else (str(task.source_path), *where)
        known = self._regions.get(key)
        try:
            edit, region = await self.pool.run(mask_files.compute, task, image, frame_rejected, known)
        except Exception:  # noqa: BLE001 - PoolBroken, or anything else: a mask never fails the round it belongs to
            return None, None
        if key is not None and region is not None:
            self._regions[key] = region
            self._regions.move_to_end(key)
            if len(self._regions) > REGIONS_KEPT:
                self._regions.popitem(last=False)
        return edit, region

    def close(self, wait: bool = True) -> None:
        self._start.cancel()
        for _, started in self._masks.values():
            started.cancel()
        self._masks.clear()
        self.pool.close(wait)
