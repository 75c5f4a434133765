"""One writer per directory: an exclusive `flock` on FOLDER/medbanana.lock, held while a command writes there.

The kernel drops the lock when its holder's file is closed or the process dies (kill -9 included), so a crashed
run never leaves a stale lock to clean up. A second process is refused at once (no waiting) with the holder's pid,
host, start time and command, which the holder writes into the file. Readers may take the lock shared: they are
refused while a writer holds it, and a writer is refused while they read. Whoever releases the lock last removes the
file, while still holding it exclusively (a reader first tries to turn its shared lock into that), so a finished
command leaves none; a file left by a killed process only says who held it last. Every taker therefore checks,
after locking, that the file it locked is still the one at the path, and locks the one there if not: without that, a
process that opened the file just before it was removed would hold a lock nobody else can see. `flock` also covers
NFS on Linux (emulated with byte-range locks there). A writer opens the lock file only when it is a regular file
with one name, never through a symbolic link, never blocking (`files.open_owned`: a folder from elsewhere may hold a
link or a hard link to a file outside it, which the holder's line would overwrite, or a FIFO, whose open would
block): anything else there is refused with one line, and left as it is; a reader locks through a symbolic link,
read-only, and removes nothing. A reader of a folder it may not write (read-only inputs) locks the file if there is
one, and creates nothing. The command line recorded is scrubbed (secrets.py: keys, a URL's `user:password@`), and
so is the holder's when quoted, which is also escaped (`printable`): no escape sequence or second line of a file
written elsewhere reaches the terminal.

    with hold_lock(run_dir, "run directory"):   # LockHeld (exit code 75) when another process holds it
        ...
    with hold_lock(out, "dataset folder", beside=True):   # a folder replaced by renaming a new one in
    with hold_lock(out, "run directory") as lock, lend(lock):   # code called here may lock `out` again
    with hold_for_command(out, "run directory"):   # the same for a whole command, taken first (generate)
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import shlex
import socket
import sys
import time
from contextlib import contextmanager, suppress
from pathlib import Path

from ..files import UnsafeFile, open_owned
from ..secrets import scrub
from ..failures import UsageError

LOCK_NAME = "medbanana.lock"


class LockHeld(RuntimeError):
    """Another process holds the folder's lock (the message names it)."""


_LENT: dict[Path, "DirLock"] = {}  # lock file -> the exclusive lock this process lends (see `lend`)


def _command() -> str:
    argv = list(sys.argv) or ["?"]
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if Path(argv[0]).name == "medbanana" or (spec and spec.name.partition(".")[0] == "medbanana"):
        argv[0] = "medbanana"  # the script or `python -m medbanana`, not the path to either
    return scrub(shlex.join(argv))[:500]  # options may carry an endpoint's URL with a password or token in it


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


def _holder(fd: int) -> str:
    """Who holds the lock, from what the last exclusive holder wrote, as one phrase."""
    try:
        info = json.loads(os.pread(fd, 8192, 0) or b"{}")
    except (OSError, ValueError):
        info = {}
    if not isinstance(info, dict) or not isinstance(info.get("pid"), int):  # readers write nothing
        return "another process that has not said who it is (a medbanana command reading it, or one starting)"
    if info.get("host") == socket.gethostname() and not _alive(info["pid"]):
        # the writer named in the file is gone, so the holders are readers (shared locks write nothing)
        return "another medbanana process reading it"
    since = info.get("since")
    since = time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(since)) if isinstance(since, (int, float)) else "?"
    # scrubbed: a file written elsewhere (or by an older version) may hold a secret in its command; escaped: it may
    # hold escape sequences or a line break that would forge the terminal's next line
    return printable(scrub(f"pid {info['pid']} on host {info.get('host', '?')} since {since} "
                           f"({info.get('command', '?')})"))


def printable(text: str) -> str:
    """`text` with every character that is not printable (control characters, escape sequences' ESC, line and
    paragraph separators, bidirectional overrides) and the backslash written as a Python escape: one line, shown
    as it is written."""
    if text.isprintable() and "\\" not in text:
        return text
    return "".join(c if c.isprintable() and c != "\\" else c.encode("unicode_escape").decode("ascii") for c in text)


class DirLock:
    """The lock of one folder; `acquire()` raises LockHeld instead of waiting. Prefer `hold_lock`."""

    def __init__(self, folder: Path, what: str = "folder", *, shared: bool = False, beside: bool = False):
        self.folder, self.what, self.shared, self.beside = Path(folder), what, shared, beside
        # beside: for a folder replaced by a rename (a build made next to it): a lock inside would go with it
        self.path = self.folder.parent / f".{self.folder.name}.{LOCK_NAME}" if beside else self.folder / LOCK_NAME
        self._fd: int | None = None
        self._borrowed = False
        self._removable = True  # the lock file is this process's to remove on release (not a link, a folder it writes)

    def acquire(self) -> "DirLock":
        """Lock, or raise LockHeld. Whoever releases last removes the lock file while still holding it, so a taker
        checks after locking that the file it locked is still the one at the path, and locks again if not."""
        while True:
            if self._borrowed or self._fd is not None:
                return self
            lender = _LENT.get(self.path.resolve())
            if lender is not None and lender.held and not self.shared:
                self._borrowed = True  # the lender holds it for this process: nothing to take, nothing to release
                return self
            fd = self._open()
            if fd is None:  # a reader of a folder it may not write, with no lock file: nothing to lock
                return self
            self._lock(fd)
            try:
                if os.path.samestat(os.fstat(fd), os.stat(self.path)):
                    break
            except FileNotFoundError:
                pass
            os.close(fd)  # locked a file its last holder removed meanwhile: lock the one at the path now
        if not self.shared:
            info = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.time(), "what": self.what,
                    "command": _command()}
            os.ftruncate(fd, 0)
            os.pwrite(fd, (json.dumps(info) + "\n").encode("utf-8"), 0)
        self._fd = fd
        return self

    def _lock(self, fd: int) -> None:
        """flock `fd` without waiting; LockHeld naming the holder (the fd closed) when another process has it."""
        try:
            fcntl.flock(fd, (fcntl.LOCK_SH if self.shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
        except OSError as exc:
            who = _holder(fd)
            os.close(fd)
            if exc.errno not in (errno.EWOULDBLOCK, errno.EACCES, errno.EAGAIN):  # ENOLCK: no lock service
                raise UsageError(f"cannot lock {self.path} ({exc.strerror}): its file system offers no "
                                   f"locks, so one writer per folder cannot be ensured there") from None
            doing = "written" if self.shared else "used"
            raise LockHeld(f"{self.folder} ({self.what}) is being {doing} by {who}; wait for it to end or stop "
                           f"it (the lock goes with that process), or use another folder") from None

    def _open(self) -> int | None:
        """The lock file, created if need be (never truncated before the lock is ours), by `files.open_owned`: a
        writer refuses a symbolic link, a hard link, a FIFO or a folder there (UnsafeFile, one line). A reader
        that may not create the file, or finds a symbolic link, opens what is there read-only, a regular file only
        (None when nothing is: it creates nothing in an input it may not write)."""
        if not self.shared:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        self._removable = True
        try:
            return open_owned(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except UnsafeFile as exc:
            if not self.shared or not exc.symlink:
                raise
        except OSError as exc:
            if not self.shared or exc.errno not in (errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOENT):
                raise
        self._removable = False  # not ours to remove: a link, or a file in a folder this process may not write
        try:
            return open_owned(self.path, os.O_RDONLY, follow=True)
        except FileNotFoundError:
            return None

    def release(self) -> None:
        """Unlock; the last holder (an exclusive one, or a reader that can make its lock exclusive) removes the
        lock file first, while holding it, so that nothing is left once the command ends."""
        self._borrowed = False
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:
            if self._removable:
                if self.shared:  # other readers still holding it keep it: this fails, and the last one removes it
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                if os.path.samestat(os.fstat(fd), os.lstat(self.path)):
                    os.unlink(self.path)  # takers that opened it meanwhile see it gone after locking (acquire)
        except OSError:  # another reader holds it, or it is gone: theirs to remove
            pass
        finally:
            os.close(fd)  # closing drops the flock

    @property
    def held(self) -> bool:
        return self._fd is not None or self._borrowed


@contextmanager
def hold_lock(folder: Path, what: str = "folder", *, shared: bool = False, beside: bool = False):
    """Hold FOLDER's lock for the `with` block: exclusive to write (the folder is created), shared to read.
    Raises LockHeld at once when another process holds it in a conflicting way. With beside=True the lock file
    is FOLDER/../.NAME.medbanana.lock, for a folder that is replaced by renaming a new one into place; the writer
    removes it when done, so nothing is left beside the folder."""
    lock = DirLock(folder, what, shared=shared, beside=beside).acquire()
    try:
        yield lock
    finally:
        lock.release()


@contextmanager
def lend(lock: DirLock):
    """Inside the block, an exclusive lock of the same folder taken in this process shares `lock` (held
    exclusive) instead of being refused: for a command that holds a folder for a whole job and calls code that
    locks it again (the Ray driver holds --out while its shards run, then merges into it). Other processes are
    refused as ever; outside the block, this process is too."""
    if not lock.held or lock.shared:
        raise UsageError("only an exclusive lock that is held can be lent")
    key = lock.path.resolve()
    _LENT[key] = lock
    try:
        yield lock
    finally:
        _LENT.pop(key, None)


@contextmanager
def hold_for_command(folder: Path, what: str, *, create: bool = True):
    """FOLDER's exclusive lock for a whole command, taken before anything slow (imports, reading inputs, making
    clients), so that a second writer is refused at once; lent to the code it calls, which locks FOLDER again. With
    `create` False, a folder that does not exist is not made (nor locked): the command's own check says what is
    wrong. A folder made here and left empty (a command refused on its options) is removed again."""
    folder = Path(folder)
    if not create and not folder.is_dir():
        yield
        return
    made = not folder.exists()
    try:
        with hold_lock(folder, what) as lock, lend(lock):
            yield
    finally:
        if made:
            with suppress(OSError):  # not empty: the command wrote into it
                folder.rmdir()
