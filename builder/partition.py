"""One build partition, in the process that writes it: its units' tasks -> rows -> parquet shards, statistics.

Spawned build workers import this module, not `build`: it needs pyarrow and the run readers, not `datasets` (the
schemas arrive made, in `PartitionSpec.schemas`), so a worker starts in a fraction of a second.
"""

from __future__ import annotations

import traceback
from collections import Counter, deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from itertools import islice
from pathlib import Path

from ..generation.acceptance import AcceptanceRule
from .acceptance import note_judged, redecide
from .parquet import ConfigSchema, ShardedParquetWriter
from .rows import IMAGE_CONFIGS, MASK_CONFIGS, ROW_ITERATORS, load_images, split_of
from ..generation.rundir.alignment import fill_geometry
from ..generation.rundir.stored_masks import MaskFolders, Rejections, row_masks
from ..generation.rundir.runs import read_tasks
from ..generation.rundir.task_records import Unit
from ..generation.rundir.confined import Confined, Refused
from ..generation.rundir.source_index import SourceIndex
from .stats import BuildStats

_PROGRESS_EVERY = 25
_READERS = 4  # threads reading images ahead of the writer
_READ_AHEAD = 16  # tasks whose images may be in memory ahead of the writer (a few MB)


@dataclass
class PartitionSpec:
    part: int
    items: list[tuple[Unit, int, int]]  # (unit, block, blocks): read the block-th of `blocks` parts of the unit
    folder: Path
    configs: tuple[str, ...]
    test_fraction: float
    max_shard_bytes: int
    schemas: dict[str, ConfigSchema]  # config -> its parquet schema, made by the parent from CONFIG_FEATURES
    source_images: Path | None
    unsafe: str = "error"  # confined.POLICIES
    review_uids: frozenset[str] = frozenset()  # `build --reviews`: tasks reviewed, noted when built
    accept: str | None = None  # `build --accept`: the rule re-deciding every task's recorded verdicts
    labelled: frozenset[str] = frozenset()  # attempts (<uid>#<round>) with expert labels: noted for the card


class ShardWriters:
    """The parquet writers of one partition, one per (config, split) made on first use; rows, their bytes and the
    shards' sizes counted into `stats`."""

    def __init__(self, folder: Path, part: int, schemas: dict[str, ConfigSchema], max_shard_bytes: int, hasher,
                 stats: BuildStats):
        self.folder, self.part, self.schemas, self.max_shard_bytes = folder, part, schemas, max_shard_bytes
        self.hasher, self.stats = hasher, stats
        self._writers: dict[tuple[str, str], ShardedParquetWriter] = {}

    def write(self, config: str, split: str, row: dict) -> None:
        writer = self._writers.get((config, split))
        if writer is None:
            writer = self._writers[(config, split)] = ShardedParquetWriter(
                self.folder / config, split, self.part, self.schemas[config], self.max_shard_bytes, self.hasher)
        self.stats.row_bytes[(config, split)] += writer.write(row)
        self.stats.rows[(config, split)] += 1

    def close(self) -> dict[str, str]:
        """Close every shard; the SHA-256 of each by its partial path."""
        digests = {}
        for (config, split), writer in self._writers.items():
            for shard in writer.close():
                self.stats.shard_bytes[(config, split)] += shard.size
                digests[str(shard.path)] = shard.sha256
        return digests


def build_partition(spec: PartitionSpec, progress: Callable[[int], None]) -> tuple[BuildStats, dict[str, str]]:
    """Write one partition's shards; returns its statistics and the SHA-256 of each shard by its partial path."""
    with ThreadPoolExecutor(max_workers=1) as hasher, ThreadPoolExecutor(max_workers=_READERS) as readers:
        return _write_partition(spec, progress, hasher, readers)


def _write_partition(spec: PartitionSpec, progress: Callable[[int], None], hasher,
                     readers) -> tuple[BuildStats, dict]:
    stats = BuildStats()
    writers = ShardWriters(spec.folder, spec.part, spec.schemas, spec.max_shard_bytes, hasher, stats)
    sources = SourceIndex(spec.source_images) if spec.source_images else None
    refused = stats.add_refusal if spec.unsafe == "skip" else None
    confined = Confined()  # folders resolved once for the partition (see confined.Confined)
    folders = MaskFolders(skip=spec.unsafe == "skip")  # each run's masks folder, checked once for the partition
    rule = AcceptanceRule.parse(spec.accept) if spec.accept is not None else None
    for unit, block, blocks in spec.items:
        # one unit at a time, in a function of its own: its records are freed before the next is decoded
        _write_unit(_decided(read_tasks(unit, block, blocks, refused), rule), spec, writers, stats, sources,
                    (confined, folders), readers, progress)
    for exc in folders.refusals:  # a masks folder left out: its tasks are built, with computed or null masks
        stats.add_refusal(exc, task_left_out=False)
    stats.count_reasons()  # here, in the partition's process: the partitions split their verdict texts in parallel
    return stats, writers.close()


def _decided(tasks: list, rule: AcceptanceRule | None) -> list:
    """The tasks as read, or as `build --accept`'s rule re-decides them from their recorded verdicts."""
    return tasks if rule is None else [redecide(task, rule) for task in tasks]


def _inputs_ahead(tasks: list, readers: ThreadPoolExecutor, sources: SourceIndex | None,
                  confined: tuple[Confined, MaskFolders], skip: bool, with_masks: bool):
    """(task, its images, its source image, its masks, where its edit masks came from, the stored masks rejected on
    read (stored_masks.Rejections), where its alignment came from) in order, reading (and with `with_masks` reading or
    computing the masks and measuring the alignment of) the next _READ_AHEAD tasks in threads meanwhile: with a cold
    cache one read at a time leaves the disk idle between files (reads, and numpy and scipy's work on the masks,
    release the GIL). With `skip`, a task whose input is refused comes as (task, the Refused, None, None, None, None,
    None)."""
    confined, folders = confined

    def read(task):
        try:
            source = None
            if sources is not None:
                source = sources.image_value(task.dataset, task.direction, task.disease, task.source_id,
                                             task.source_path, task.source_sha256)
            images = load_images(task, confined)
            origins: Counter = Counter()
            rejections = Rejections()
            masks = row_masks(task, images, source, confined, folders, origins, rejections) if with_masks else None
            alignment = fill_geometry(task, images, source) if with_masks else Counter()
        except Refused as exc:
            if not skip:
                raise
            return exc, None, None, None, None, None
        return images, source, masks, origins, rejections, alignment

    window: deque = deque()
    upcoming = iter(tasks)
    for task in islice(upcoming, _READ_AHEAD):
        window.append((task, readers.submit(read, task)))
    while window:
        task, inputs = window.popleft()
        following = next(upcoming, None)
        if following is not None:
            window.append((following, readers.submit(read, following)))
        yield task, *inputs.result()


def _write_unit(tasks, spec: PartitionSpec, writers: ShardWriters, stats: BuildStats, sources: SourceIndex | None,
                confined: tuple[Confined, MaskFolders], readers: ThreadPoolExecutor,
                progress: Callable[[int], None]) -> None:
    with_images = bool(IMAGE_CONFIGS & set(spec.configs))
    loaded = (_inputs_ahead(tasks, readers, sources, confined, spec.unsafe == "skip",
                            bool(MASK_CONFIGS & set(spec.configs))) if with_images
              else ((task, {}, None, None, None, None, None) for task in tasks))
    for done, (task, images, source, masks, origins, rejections, alignment) in enumerate(loaded, 1):
        if isinstance(images, Refused):  # policy skip: the task gives no row in any config
            stats.add_refusal(images)
            continue
        split = split_of(task.source_id, spec.test_fraction)
        stats.add_task(task, images, None if sources is None or not with_images else source is not None)
        if origins:
            stats.add_mask_origins(origins, rejections)
        if alignment:
            stats.alignment.update(alignment)
        if task.uid in spec.review_uids:
            stats.reviewed_tasks.add(task.uid)
        if spec.labelled:
            note_judged(stats, task, spec.labelled)
        for config in spec.configs:
            for row in ROW_ITERATORS[config](task, images, source, masks):
                writers.write(config, split, row)
        if done % _PROGRESS_EVERY == 0:
            progress(_PROGRESS_EVERY)
    progress(len(tasks) % _PROGRESS_EVERY)


def partition_worker(spec: PartitionSpec, messages) -> None:
    try:
        stats, digests = build_partition(spec, lambda n: messages.put(("progress", n)))
        messages.put(("done", spec.part, (stats, digests)))
    except (ValueError, OSError) as exc:  # bad input or a full disk: the message says it all
        messages.put(("error", spec.part, error_line(exc)))
    except BaseException as exc:  # a bug: keep the traceback
        messages.put(("error", spec.part, f"{exc.__class__.__name__}: {exc}\n{traceback.format_exc()}"))


def error_line(exc: Exception) -> str:
    """One line: the error, and for a refusal the option that turns refusals into recorded skips."""
    text = " ".join(str(exc).split())
    if isinstance(exc, Refused):
        text += " (`--unsafe skip` leaves such inputs out and lists them in medbanana-build.json)"
    return text
