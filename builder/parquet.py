"""A streaming parquet writer: rows in, shards of at most `max_shard_bytes` out, memory bounded by one row group.

The schema is the config's `Features.arrow_schema`, whose metadata key `huggingface` carries the features, so
`load_dataset` decodes the `{bytes, path}` image structs. Image bytes are stored as they are: uncompressed (JPEG
does not compress), no dictionary, no min/max statistics (which would copy whole images into the footer).
Shards are written as `<split>-p<part>-<index>.parquet.partial` and renamed by `finalize_shards` once every
writer is done, to the Hub's `<split>-<i>-of-<n>.parquet`.
"""

from __future__ import annotations

import re
from concurrent.futures import Executor, Future
from dataclasses import dataclass
from pathlib import Path

import msgspec
import pyarrow as pa
import pyarrow.parquet as pq

from ..generation.dataset.folder import shard_name
from ..generation.dataset.manifest import sha256_file

ROWS_PER_GROUP = 100  # what datasets uses for image data: a few MB per group, cheap random access
GROUP_BYTES = 16 * 2**20

_encoder = msgspec.json.Encoder()


@dataclass(frozen=True)
class ConfigSchema:
    """What a writer needs of a config's `Features`, made once by the parent: it pickles without `datasets`, so
    build workers never import it."""

    arrow: pa.Schema  # with the `huggingface` metadata that load_dataset reads the features from
    image_columns: tuple[str, ...]
    options: dict  # ParquetWriter options: compression, dictionary and statistics per column

    @classmethod
    def of(cls, features) -> ConfigSchema:
        from datasets import Image

        schema = features.arrow_schema
        images = tuple(name for name, f in features.items() if isinstance(f, Image))
        return cls(schema, images, _writer_options(schema, features, images))


@dataclass
class Shard:
    path: Path
    rows: int
    size: int
    sha256: str = ""


class ShardedParquetWriter:
    """Writes the rows of one (config, split) of one build partition."""

    def __init__(self, folder: Path, split: str, part: int, schema: ConfigSchema, max_shard_bytes: int,
                 hasher: Executor | None = None):
        self.folder, self.split, self.part = Path(folder), split, part
        self.schema = schema.arrow
        self.max_shard_bytes = max_shard_bytes
        self.group_bytes = max(1, min(GROUP_BYTES, max_shard_bytes // 2))
        self.image_columns = schema.image_columns
        self._options = schema.options
        self._pending: list[dict] = []
        self._pending_bytes = 0
        self._writer: pq.ParquetWriter | None = None
        self._sink = None
        self.hasher = hasher  # closed shards are hashed for the manifest there, while writing goes on
        self._digests: list[Future] = []
        self.shards: list[Shard] = []

    def write(self, row: dict) -> int:
        """Buffer one row; returns its size estimate in bytes (image bytes plus the rest as JSON)."""
        size = self._row_size(row)
        self._pending.append(row)
        self._pending_bytes += size
        if len(self._pending) >= ROWS_PER_GROUP or self._pending_bytes >= self.group_bytes:
            self._flush()
        return size

    def close(self) -> list[Shard]:
        self._flush()
        self._close_shard()
        for shard, digest in zip(self.shards, self._digests):
            shard.sha256 = digest.result()
        return self.shards

    def _row_size(self, row: dict) -> int:
        size = 0
        rest = {}
        for name, value in row.items():
            if name in self.image_columns:
                size += len(value["bytes"]) if value and value.get("bytes") else 0
            else:
                rest[name] = value
        return size + len(_encoder.encode(rest))

    def _flush(self) -> None:
        if not self._pending:
            return
        if self._writer is not None and self._sink.tell() + self._pending_bytes > self.max_shard_bytes:
            self._close_shard()
        if self._writer is None:
            path = self.folder / f"{self.split}-p{self.part:03d}-{len(self.shards):05d}.parquet.partial"
            path.parent.mkdir(parents=True, exist_ok=True)
            self._sink = pa.OSFile(str(path), "wb")
            self._writer = pq.ParquetWriter(self._sink, self.schema, **self._options)
            self.shards.append(Shard(path, 0, 0))
        batch = pa.RecordBatch.from_pylist(self._pending, schema=self.schema)
        self._writer.write_batch(batch, row_group_size=len(self._pending))
        self.shards[-1].rows += len(self._pending)
        self._pending, self._pending_bytes = [], 0

    def _close_shard(self) -> None:
        if self._writer is None:
            return
        self._writer.close()
        self._sink.close()
        self.shards[-1].size = self.shards[-1].path.stat().st_size
        if self.hasher is not None:
            self._digests.append(self.hasher.submit(sha256_file, self.shards[-1].path))
        self._writer = self._sink = None


def _leaf_paths(name: str, typ: pa.DataType):
    if pa.types.is_struct(typ):
        for child in typ:
            yield from _leaf_paths(f"{name}.{child.name}", child.type)
    elif pa.types.is_list(typ) or pa.types.is_large_list(typ):
        yield from _leaf_paths(f"{name}.list.element", typ.value_type)
    else:
        yield name


def _writer_options(schema: pa.Schema, features, image_columns: tuple[str, ...]) -> dict:
    from datasets import Value

    image_leaves = {f"{col}.bytes" for col in image_columns}
    leaves = [leaf for field in schema for leaf in _leaf_paths(field.name, field.type)]
    text = [leaf for leaf in leaves if leaf not in image_leaves]
    # statistics only where they help filtering: short identity strings and non-string scalars
    short = {name for name, f in features.items()
             if isinstance(f, Value) and (f.dtype != "string" or name in ("dataset", "modality", "disease", "task"))}
    return {"compression": {leaf: ("none" if leaf in image_leaves else "zstd") for leaf in leaves},
            "use_dictionary": text, "write_statistics": [leaf for leaf in leaves if leaf in short]}


_PARTIAL = re.compile(r"^(?P<split>[^/]+)-p(?P<part>\d+)-(?P<index>\d+)\.parquet\.partial$")
def finalize_shards(config_dir: Path) -> dict[str, list[tuple[Path, Path]]]:
    """Rename every partial shard of a config folder to `<split>-0000i-of-0000n.parquet`, partition order kept.
    Returns split -> [(partial path, final path)]."""
    by_split: dict[str, list[tuple[int, int, Path]]] = {}
    for path in Path(config_dir).iterdir():
        m = _PARTIAL.match(path.name)
        if m:
            by_split.setdefault(m["split"], []).append((int(m["part"]), int(m["index"]), path))
    final: dict[str, list[tuple[Path, Path]]] = {}
    for split, items in sorted(by_split.items()):
        items.sort()
        n = len(items)
        final[split] = []
        for i, (_part, _index, path) in enumerate(items):
            target = path.with_name(shard_name(split, i, n))
            path.rename(target)
            final[split].append((path, target))
    return final
