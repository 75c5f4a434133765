"""Writing files so that a kill never leaves half of one, and reading JSON Lines that a kill may have torn.

Every file the generator, `prepare` and the request caches write goes through `atomic_write_bytes`: the bytes go to
a temp file beside the target (`.NAME.tmpPID.N`: not an image suffix, so no reader mistakes it for output) and are
renamed over it, so a reader sees the old file or the new one, never a mix.
"""

from __future__ import annotations

import itertools
import json
import os
import re
from pathlib import Path

TEMP_NAME = re.compile(r"^\..+\.tmp\d+(\.\d+)?$")  # what atomic_write_bytes leaves behind when killed mid-write
_serial = itertools.count()  # two writes of one path in one process (threads) never share a temp file


def atomic_write_bytes(path: Path, data: bytes) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}.{next(_serial)}")
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: Path, obj) -> None:
    atomic_write_bytes(path, json.dumps(obj, indent=2, ensure_ascii=False).encode("utf-8"))


def same_bytes(a: Path, b: Path) -> bool:
    """Whether two files hold the same bytes (one file by two names, a hard link, at once); OSError if either
    cannot be read."""
    return os.path.samefile(a, b) or Path(a).read_bytes() == Path(b).read_bytes()


def read_jsonl(path: Path) -> list:
    """The lines of a JSON Lines file in order, [] when it does not exist; a line that does not parse (the last
    one, torn by a kill mid-write) is skipped."""
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        return []
    values = []
    for raw in data.splitlines():
        try:
            values.append(json.loads(raw))
        except json.JSONDecodeError:
            continue
    return values
