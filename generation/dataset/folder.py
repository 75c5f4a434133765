"""A built dataset folder's read contract (what `load_medbanana`, `export medebench` and `eval` read of a local one).

A config's rows are the regular files `CONFIG/<split>-0000i-of-0000n.parquet` of the folder the user named, and
nothing else: the card's YAML (`configs: data_files`, `data_dir`, builder options), a `.huggingface.yaml` or a
`dataset_infos.json` never choose a file, a link (a shard, or the config folder itself) is refused, and each shard's
footer is read and its schema decoded here first, so that a hostile footer is one line naming the file. The card is
read, bounded, by a safe YAML loader (`read_card`): a folder whose card does not parse is not one `medbanana build`
wrote. Every refusal is an `Unreadable` (a ValueError) naming the file.
"""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path

import yaml
from ..failures import UsageError

CARD = "README.md"  # the dataset card, its YAML `configs:` first
BUILD_INFO = "medbanana-build.json"
FIGURE = "figure3.png"  # the paper's Figure 3 beside the card (builder/paper.py)
# a finished shard's name (the Hub's), as the builder's `finalize_shards` gives it: `<split>-0000i-of-0000n.parquet`
SHARD_NAME = re.compile(r"(?P<split>[^/]+)-(?P<index>\d{5})-of-(?P<count>\d{5})\.parquet")
MAX_CARD_BYTES = 4 * 2**20  # a built card is ~20 KB (its tables grow with the diseases, not the rows)
MAX_FOOTER_BYTES = 64 * 2**20  # a shard's footer (schema and row-group index): a few MB for a 500 MB shard
_SPLIT = re.compile(r"\w+")  # what datasets accepts as a split name


def shard_name(split: str, index: int, count: int) -> str:
    return f"{split}-{index:05d}-of-{count:05d}.parquet"


class Unreadable(UsageError):
    """A dataset folder's file that load_medbanana will not read; the message names it."""


def read_card(folder: Path) -> dict:
    """The card's YAML header as a dict; Unreadable when the card is a link, not a regular file, too large, or its
    header is not a YAML mapping (a `!!python` tag, a syntax error, a duplicate key, nesting past the parser's
    depth)."""
    path = folder / CARD
    text = _read_regular(path, MAX_CARD_BYTES, "the dataset card").decode("utf-8", "replace")
    lines = text.splitlines()
    if not lines or lines[0].strip() != "---" or "---" not in (line.strip() for line in lines[1:]):
        raise Unreadable(f"{path} has no YAML header (--- ... ---): not a card written by `medbanana build`")
    header = "\n".join(lines[1:[line.strip() for line in lines[1:]].index("---") + 1])
    try:
        data = yaml.load(header, Loader=_StrictLoader)  # noqa: S506 - a SafeLoader subclass
    except (yaml.YAMLError, RecursionError, ValueError) as exc:
        mark = getattr(exc, "problem_mark", None)
        problem = getattr(exc, "problem", None) or " ".join(str(exc).split())[:200]
        if mark is not None:
            problem = f"{problem}, line {mark.line + 2}"
        raise Unreadable(f"{path}: its YAML header cannot be read ({exc.__class__.__name__}: {problem}): "
                         "not a card written by `medbanana build`") from None
    if not isinstance(data, dict):
        raise Unreadable(f"{path}: its YAML header is not a mapping: not a card written by `medbanana build`")
    return data


def shard_files(folder: Path, config: str, columns) -> dict[str, list[str]]:
    """split -> the config's shard files (absolute paths, in name order), each a regular file directly in
    `folder/config` whose footer reads and whose schema holds `columns`; {} when the config has no folder.

    Named to `load_dataset` as files, its cache follows them (their paths and modification times): keyed on the
    folder's path, datasets 5.x keys the cache on the card's YAML (schema, row counts and sizes), and a folder
    rebuilt in place with the same counts and sizes would give the earlier build's rows."""
    where = folder / config
    if where.is_symlink():
        raise Unreadable(f"{where} is a symbolic link: a dataset folder's configs must be folders inside it")
    if not where.is_dir():
        return {}
    files: dict[str, list[str]] = {}
    for entry in sorted(os.scandir(where), key=lambda e: e.name):
        match = SHARD_NAME.fullmatch(entry.name)
        if not match:
            continue
        path = where / entry.name
        if entry.is_symlink() or not entry.is_file(follow_symlinks=False):
            raise Unreadable(f"{path} is {'a symbolic link' if entry.is_symlink() else 'not a regular file'}: a "
                             "dataset folder's parquet files must be regular files inside it")
        if not _SPLIT.fullmatch(match["split"]):
            raise Unreadable(f"{path}: {match['split']!r} is not a split name (letters, digits and _)")
        check_shard(path, columns)
        # absolute: datasets would join a relative path to the folder once more
        files.setdefault(match["split"], []).append(str(path.absolute()))
    return files


def check_shard(path: Path, columns) -> None:
    """Unreadable unless `path`'s footer is bounded and reads, its `huggingface` schema metadata decodes as
    `datasets` will decode it, and it has every one of `columns`."""
    import datasets
    import pyarrow.parquet as pq

    footer = _read_regular(path, 8, "a parquet file", tail=True)
    if len(footer) < 8 or footer[4:] != b"PAR1":
        raise Unreadable(f"{path} is not a parquet file (no PAR1 footer)")
    if int.from_bytes(footer[:4], "little") > MAX_FOOTER_BYTES:
        raise Unreadable(f"{path}: its parquet footer is {int.from_bytes(footer[:4], 'little'):,} bytes, more than "
                         f"the {MAX_FOOTER_BYTES:,} a parquet file of `medbanana build` can have")
    try:
        schema = pq.read_schema(path)
        datasets.Features.from_arrow_schema(schema)
    except Exception as exc:  # noqa: BLE001 - pyarrow, json and datasets raise many kinds on a hostile footer
        problem = " ".join(str(exc).split())[:200]
        raise Unreadable(f"{path}: its parquet metadata cannot be read ({exc.__class__.__name__}: {problem})") \
            from None
    missing = sorted(set(columns) - set(schema.names))
    if missing:
        raise Unreadable(f"{path} lacks the columns {missing}: not a medbanana parquet file, or one written by an "
                         "older medbanana; rebuild it with `medbanana build`")


def _read_regular(path: Path, most: int, what: str, tail: bool = False) -> bytes:
    """At most `most` bytes of `path` (its last ones with `tail`), opened without following a link or blocking on
    a FIFO; Unreadable for a link, a special file, or a file larger than `most` (unless `tail`)."""
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        raise Unreadable(f"{path} is missing: not a folder written by `medbanana build`") from None
    except OSError as exc:
        raise Unreadable(f"{path}: {what} cannot be opened ({exc.strerror}; a symbolic link is refused)") from None
    with open(fd, "rb") as fh:
        info = os.fstat(fh.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise Unreadable(f"{path}: {what} is not a regular file")
        if tail:
            fh.seek(max(0, info.st_size - most))
        elif info.st_size > most:
            raise Unreadable(f"{path}: {what} is {info.st_size:,} bytes, more than the {most:,} read")
        return fh.read(most)


class _StrictLoader(yaml.SafeLoader):
    """A SafeLoader (no `!!python` tags) that also refuses duplicate keys, as datasets does."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key, _ in node.value:
            if isinstance(key, yaml.ScalarNode):
                if key.value in seen:
                    raise UsageError(f"the key {key.value[:80]!r} twice, line {key.start_mark.line + 2}")
                seen.add(key.value)
        return super().construct_mapping(node, deep=deep)
