"""Writing files so that a kill never leaves half of one, and reading JSON Lines that a kill may have torn.

Every file the generator, `prepare` and the request caches write goes through `atomic_write_bytes`: the bytes go to
a temp file beside the target (`.NAME.tmpPID.N`: not an image suffix, so no reader mistakes it for output) and are
renamed over it, so a reader sees the old file or the new one, never a mix.

No write follows a symbolic link (a folder from another machine may hold one where medbanana writes): the temp file
is created with O_CREAT|O_EXCL|O_NOFOLLOW, so a link planted at its name is refused, and the rename replaces a link
(symbolic or hard) at the target by the file instead of writing where it points. `create_new` is for a file that
must not exist yet. A file written in place (a lock, a journal or manifest appended to) is opened by `open_owned`:
never through a symbolic link, never blocking (a FIFO), and only when it is a regular file with one name (a hard
link's writes would change the file under its other names too, wherever they are).
"""

from __future__ import annotations

import errno
import fcntl
import io
import itertools
import json
import os
import re
import stat
from pathlib import Path
from .failures import UsageError

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
    return None if stat.S_ISREG(mode) else _kind(mode)


def _kind(mode: int) -> str:
    return "not a regular file but " + next((name for test, name in _FILE_KINDS if test(mode)), "not a plain file")


def create_new(path: Path, mode: int = 0o666, flags: int = 0) -> int:
    """A write-only descriptor (plus `flags`, e.g. os.O_APPEND) of a file created here, with `mode` (less the
    umask) from the start; FileExistsError when anything is at `path`, a symbolic link included (dangling or not:
    it is not followed)."""
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC | flags, mode)


class UnsafeFile(UsageError):
    """A file medbanana would write in place, or read, that is a symbolic link (`symlink`), no regular file (a
    folder, a FIFO, a device) or, to be written, a hard link: refused in one line naming it."""

    def __init__(self, message: str, symlink: bool = False):
        super().__init__(message)
        self.symlink = symlink


_WRITE_ACCESS = os.O_WRONLY | os.O_RDWR
_NEVER_BLOCKS = os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC  # a FIFO or a terminal: opened at once, then refused


def open_owned(path: Path, flags: int = os.O_RDONLY, mode: int = 0o666, *, follow: bool = False) -> int:
    """A descriptor of the regular file at `path`, opened with `flags` (e.g. os.O_RDWR | os.O_CREAT) without
    following a symbolic link there (O_NOFOLLOW, unless `follow`) and without blocking (O_NONBLOCK: a FIFO or a
    device opens at once or fails, and is refused; the flag is cleared once the file is known to be regular).
    Opened for writing, it must also be the file's only name (st_nlink 1): writing a hard link would change the
    file under its other names too, maybe outside the folder. UnsafeFile otherwise, naming `path`; other OSErrors
    (FileNotFoundError without os.O_CREAT) as os.open raises them."""
    writing = bool(flags & _WRITE_ACCESS)
    does = "writes" if writing else "reads"
    try:
        fd = os.open(path, flags | _NEVER_BLOCKS | (0 if follow else os.O_NOFOLLOW), mode)
    except OSError as exc:
        if exc.errno == errno.ELOOP and not follow:
            raise UnsafeFile(f"{path} is a symbolic link: medbanana {does} there only a file of its own, never "
                             f"through a link (it may point anywhere); remove the link and run again",
                             symlink=True) from None
        if exc.errno in (errno.EISDIR, errno.ENXIO, errno.ENODEV, errno.ETXTBSY, errno.EAGAIN):
            raise _irregular(path, not_regular(path) or "not a regular file", does) from None
        raise
    try:
        status = os.fstat(fd)
        if not stat.S_ISREG(status.st_mode):
            raise _irregular(path, _kind(status.st_mode), does)
        if writing and status.st_nlink > 1:
            raise UnsafeFile(f"{path} is a hard link (one of {status.st_nlink} names of one file): medbanana writes "
                             f"there only a file of its own, and writing it would change the file under its other "
                             f"names too; remove it (or replace it by a copy) and run again")
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _irregular(path: Path, problem: str, does: str) -> UnsafeFile:
    return UnsafeFile(f"{path}: {problem}; medbanana {does} there only a regular file of its own: remove it and "
                      f"run again")


def open_append(path: Path):
    """`open(path, "ab")` of a file of ours (journals and manifests are appended to, not replaced), created if
    need be: `open_owned`'s refusals (a symbolic link, a hard link, a FIFO or a folder at `path`) are one line."""
    return os.fdopen(open_owned(path, os.O_RDWR | os.O_CREAT | os.O_APPEND), "ab")  # read too: a torn tail


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
        try:
            os.replace(tmp, path)
        except (IsADirectoryError, NotADirectoryError):  # a folder at the file's name: never replaced
            raise _irregular(path, not_regular(path) or "not a regular file", "writes") from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: Path, obj) -> None:
    atomic_write_bytes(path, json.dumps(obj, indent=2, ensure_ascii=False).encode("utf-8"))


def write_figure(fig, path: Path, **savefig) -> None:
    """A matplotlib figure saved as `path` by `atomic_write_bytes` (savefig itself would write through a link)."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format=Path(path).suffix.lstrip(".") or "png", **savefig)
    atomic_write_bytes(path, buffer.getvalue())


def same_bytes(a: Path, b: Path) -> bool:
    """Whether two files hold the same bytes (one file by two names, a hard link, at once); OSError if either
    cannot be read."""
    return os.path.samefile(a, b) or Path(a).read_bytes() == Path(b).read_bytes()


def read_jsonl(path: Path) -> list:
    """The lines of a JSON Lines file in order, [] when it does not exist; a line that does not parse (the last
    one, torn by a kill mid-write) is skipped. No FIFO or folder is opened (`open_owned`: UnsafeFile)."""
    try:
        with os.fdopen(open_owned(path, follow=True), "rb") as fh:
            data = fh.read()
    except FileNotFoundError:
        return []
    values = []
    for raw in data.splitlines():
        try:
            values.append(json.loads(raw))
        except json.JSONDecodeError:
            continue
    return values


def read_user_text(path: Path, named: str = "") -> str:
    """A text file the user named (a CSV of labels, a list of ids), BOM aside; one that is not UTF-8 is their
    mistake to fix: a UsageError naming it (`named`: the option it was given with, e.g. "--only ")."""
    try:
        return Path(path).read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as exc:
        raise UsageError(f"{named}{path}: not UTF-8 text ({exc})") from None
