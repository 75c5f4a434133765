"""The folder a build writes (`--out`): what it may replace, its lock, and publishing it by rename.

A build is staged beside `--out` (`.NAME.building-PID`) and renamed into place, so the lock cannot live inside
`--out`: it would be renamed away with the old folder, published with the new one, and a second build would lock
a different file. It lives beside it, `.NAME.medbanana.lock` in the parent, held from the first check of `--out`
until the previous build is removed, then removed; builds into other folders of the same parent do not contend.

The swap never leaves `--out` missing: the new build and the old one trade places in one atomic rename (Linux
`renameat2(RENAME_EXCHANGE)`), the old one is renamed `.NAME.previous-PID` and removed. Killed at any point, `--out`
is the old build or the new one, and the next build (under the lock) removes what is left: staging folders, and
previous builds. Where the file system cannot exchange, `--out` is renamed aside first, so a kill between the two
renames leaves no `--out` until the next build, which renames the previous build back before anything else.

A build replaces only what builds write (`OWN_FILES`, the config folders' parquet shards). Anything else in
`--out`, and an input run inside `--out` or holding it, is refused before anything is written or deleted.
"""

from __future__ import annotations

import errno
import os
import re
import sys
import warnings
from collections.abc import Callable, Iterable
from contextlib import ExitStack, contextmanager
from pathlib import Path

from ..rundir.lock import hold_lock
from .configs import PUBLISHED_CONFIGS
from .folder import BUILD_INFO, CARD, FIGURE
from .manifest import MANIFEST

OWN_FILES = frozenset({BUILD_INFO, CARD, MANIFEST, FIGURE})
_SHOWN = 5  # unknown entries named in the refusal


def _leftovers(out: Path, kind: str) -> list[Path]:
    """The folders `.NAME.{kind}-PID` builds of `out` make beside it (kind: building, previous)."""
    pattern = re.compile(rf"\.{re.escape(out.name)}\.{kind}-\d+")
    return sorted(p for p in out.parent.iterdir() if pattern.fullmatch(p.name) and p.is_dir() and not p.is_symlink())


def remove_stale_staging(out: Path) -> list[Path]:
    """Remove the staging folders (`.NAME.building-PID`) that killed builds of `out` left beside it; call it holding
    the write lock of `out`, so that none of them belongs to a running build. Returns what was removed."""
    import shutil

    stale = _leftovers(out, "building")
    for path in stale:
        shutil.rmtree(path)
    return stale


def finish_interrupted_swap(out: Path, remove: Callable[[Path], None] | None = None) -> list[Path]:
    """What a build killed while swapping left, holding the write lock of `out`: with no `out` (killed between the
    two renames of a file system that cannot exchange), the previous build goes back into place; any other
    previous build is removed as a replaced build is (`remove`, default `remove_build`). Returns the previous
    builds found."""
    previous = _leftovers(out, "previous")
    if previous and not os.path.lexists(out):
        previous[-1].rename(out)  # one build at a time (the lock): there is one such folder
    for folder in previous:
        if folder.is_dir():
            (remove or remove_build)(folder)
    return previous


class BuildError(Exception):
    """A build that cannot proceed, with the reason in words (defined here, raised by build.py too)."""


@contextmanager
def output_lock(out: Path, *, shared: bool = False):
    """Hold the lock of the build folder `out` (a file beside it, removed when the build ends): exclusive to build
    it, shared to read it (e.g. to upload it). Raises generation.rundir.lock.LockHeld at once when another process holds
    it in a conflicting way."""
    out = Path(out).resolve()
    with hold_lock(out, f"--out {out.name}, built and published by a rename", shared=shared, beside=True) as lock:
        yield lock


class BuildLocks(ExitStack):
    """The locks of one build, held until the `with` block ends. `read(folders)` checks the placement of input
    runs and locks them shared: refused while `generate` or `merge` writes one, and neither can start while the
    build reads. `write()` checks `out` and locks it. Refusals (BuildError, or LockHeld naming the other process)
    come before anything is written."""

    def __init__(self, out: Path):
        super().__init__()
        self.out, self._read = Path(out).resolve(), set()

    def read(self, folders: Iterable[Path]) -> None:
        folders = {Path(f).resolve() for f in folders} - self._read
        check_placement(self.out, folders)
        for folder in sorted(folders):
            self.enter_context(hold_lock(folder, "run directory", shared=True))
            self._read.add(folder)

    def write(self) -> None:
        check_out(self.out)  # before the lock too: a refusal writes nothing, not even the lock file
        self.enter_context(output_lock(self.out))  # until the previous build is removed (module docstring)
        finish_interrupted_swap(self.out)  # a killed build's: its previous build back in place, or removed
        check_out(self.out)  # again, now that no other build can change it


def run_folder(path: Path) -> Path:
    """The folder of an input as given: a records file's folder, or the directory itself."""
    path = Path(path).resolve()
    return path.parent if path.is_file() else path


def check_placement(out: Path, inputs: Iterable[Path]) -> None:
    """Refuse an input inside `out` (the build would replace it) or holding `out` (the build would write into
    the run). Paths are compared resolved, so symlinks do not hide either."""
    out = Path(out).resolve()
    for given in inputs:
        path = Path(given).resolve()
        if path == out:
            raise BuildError(f"--out {out} is the input {given}; write the build to another folder")
        if path.is_relative_to(out):
            raise BuildError(f"--out {out} holds the input {given}, which a rebuild there would delete; "
                             "write the build to another folder")
        if path.is_dir() and out.is_relative_to(path):
            raise BuildError(f"--out {out} is inside the input {given}; write the build outside the run")


def check_out(out: Path) -> None:
    """Refuse an `out` that is a file, or holds anything a build does not write: a rebuild deletes what it
    holds, so only an empty folder or an earlier build with nothing added is replaced."""
    if out.is_symlink() or (out.exists() and not out.is_dir()):
        raise BuildError(f"--out {out} is not a folder")
    if not out.is_dir() or not any(out.iterdir()):
        return
    if not (out / BUILD_INFO).is_file():
        raise BuildError(f"--out {out} is not empty and not an earlier medbanana build; choose a new folder")
    unknown = sorted(foreign_entries(out))
    if unknown:
        shown = ", ".join(unknown[:_SHOWN]) + (f" and {len(unknown) - _SHOWN} more" if len(unknown) > _SHOWN else "")
        raise BuildError(f"--out {out} holds what a build did not write: {shown}; a rebuild replaces the "
                         "folder, so move them out or choose a new folder")


def foreign_entries(out: Path) -> list[str]:
    """Entries of `out` (relative, folders ending in /) that builds do not write; symlinks are never theirs."""
    foreign = []
    for entry in out.iterdir():
        if entry.is_symlink():
            foreign.append(entry.name)
        elif entry.name in PUBLISHED_CONFIGS and entry.is_dir():
            foreign += [f"{entry.name}/{p.name}" + ("/" if p.is_dir() else "") for p in entry.iterdir()
                        if p.is_symlink() or not p.is_file() or p.suffix != ".parquet"]
        elif entry.name not in OWN_FILES or not entry.is_file():
            foreign.append(entry.name + ("/" if entry.is_dir() else ""))
    return foreign


def move_into_place(staging: Path, out: Path, remove: Callable[[Path], None] | None = None) -> None:
    """Publish `staging` as `out` by renames (module docstring); the previous build is then removed by `remove`,
    by default `remove_build`: file by file, its own files only."""
    if not out.exists():
        staging.rename(out)
        return
    previous = out.with_name(f".{out.name}.previous-{os.getpid()}")
    if exchange(staging, out):  # out is the new build now; staging names the old one
        staging.rename(previous)
    else:
        out.rename(previous)
        staging.rename(out)
    (remove or remove_build)(previous)


def exchange(a: Path, b: Path) -> bool:
    """Swap two paths in one atomic rename (Linux renameat2 RENAME_EXCHANGE); False where the C library, the kernel
    or the file system cannot."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    renameat2 = getattr(libc, "renameat2", None)  # glibc 2.28+, musl 1.2.2+
    if renameat2 is None:
        return False
    renameat2.argtypes = (ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint)
    at_fdcwd, rename_exchange = -100, 2  # <fcntl.h>, <linux/fs.h>
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):  # no such flag here (old kernel, NFS, ...)
        return False
    raise OSError(code, os.strerror(code), str(a), None, str(b))


def remove_build(folder: Path) -> None:
    """Delete the files a build writes from `folder`, then the folder if that empties it. Anything else (added
    after the check, despite it) is kept, with a warning naming where."""
    for entry in folder.iterdir():
        if entry.name in PUBLISHED_CONFIGS and entry.is_dir() and not entry.is_symlink():
            for shard in entry.glob("*.parquet"):
                if shard.is_file() and not shard.is_symlink():
                    shard.unlink()
            _rmdir_if_empty(entry)
        elif entry.name in OWN_FILES and entry.is_file() and not entry.is_symlink():
            entry.unlink()
    if not _rmdir_if_empty(folder):
        warnings.warn(f"kept {folder}: it holds files a build did not write ({', '.join(foreign_entries(folder))})",
                      stacklevel=3)


def _rmdir_if_empty(folder: Path) -> bool:
    try:
        folder.rmdir()
    except OSError:  # not empty
        return False
    return True
