"""Writing files so that a kill never leaves half of one, and reading JSON Lines that a kill may have torn.

Every file the generator, `prepare` and the request caches write goes through `atomic_write_bytes`: the bytes go to
a temp file beside the target (`.NAME.tmpPID.N`: not an image suffix, so no reader mistakes it for output) and are
renamed over it, so a reader sees the old file or the new one, never a mix.

No write follows a symbolic link (a folder from another machine may hold one where medbanana writes): the temp file
is created with O_CREAT|O_EXCL|O_NOFOLLOW, so a link planted at its name is refused, and the rename replaces a link
at the target by the file instead of writing where it points. `create_new` is for a file that must not exist yet.
"""

from __future__ import annotations

import errno
import itertools
import json
import os
import re
import stat
from pathlib import Path

TEMP_NAME = re.compile(r"^\..+\.tmp\d+(\.\d+)?$")  # what atomic_write_bytes leaves behind when killed mid-write
_serial = itertools.count()  # two writes of one path in one process (threads) never share a temp file


_FILE_KINDS = ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISSOCK, "a socket"),
               (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))
MISSING = "no such file"


def not_regular(path: Path) -> str | None:
    """Why `path` (a symlink followed) is no regular file (`MISSING`, a name that cannot be looked up, or the kind
    of file it is), or None; from stat alone, because opening a FIFO or a device blocks or has effects."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return MISSING
    except OSError as exc:
        return f"cannot be looked up ({exc.strerror or exc})"
    if stat.S_ISREG(mode):
        return None
    return "not a regular file but " + next((name for test, name in _FILE_KINDS if test(mode)), "not a plain file")


def create_new(path: Path, mode: int = 0o666, flags: int = 0) -> int:
    """A write-only descriptor (plus `flags`, e.g. os.O_APPEND) of a file created here, with `mode` (less the
    umask) from the start; FileExistsError when anything is at `path`, a symbolic link included (dangling or not:
    it is not followed)."""
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC | flags, mode)


def open_append(path: Path):
    """`open(path, "ab")` that never writes through a symbolic link at `path` (journals and manifests are appended
    to, not replaced): a link there is refused with one line (ValueError), whatever it points to."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise ValueError(f"{path} is a symbolic link; medbanana appends only to a file of its own there "
                             "(remove the link)") from None
        raise
    return os.fdopen(fd, "ab")


def atomic_write_bytes(path: Path, data: bytes, mode: int = 0o666) -> None:
    """Write `data` to `path` by a temp file renamed over it (a symbolic link at `path` is replaced, not followed);
    `mode` (less the umask) is the file's from its creation, e.g. 0o600 for a private key."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}.{next(_serial)}")
    fd = create_new(tmp, mode)  # FileExistsError for anything at that name: not ours to write or remove
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
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
