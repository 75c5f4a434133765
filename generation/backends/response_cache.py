"""Completed API answers on disk, by the sha256 of their request: what lets a resumed run skip what it paid for.
(The probes keep their per-image features in the same kind of logs: evaluation/probe_cache.py.)

Each process appends to a log of its own, `DIR/answers-<time_ns>-<pid>.log`, opened once: a record is a header line
`KEY LENGTH TIME_NS\\n`, the answer's UTF-8 bytes and `\\n`, in one write. A file per answer (the earlier layout,
`DIR/ab/KEY.json`, still read) cost a create and a rename per call, about 1.5 ms of CPU of an editor call's ~6 ms.
Forgetting a key appends a record of length -1. When a process opens the cache it reads every log's headers
(seeking past the bodies); the newest record of a key wins, so a forget in one process outranks an older answer in
another. A record torn by a kill (the last of its log) is ignored: its process is gone, so nothing is appended to
that log again. Answers that other processes write after the index is read are not seen: processes of one run
work on different tasks. A log is created new (O_EXCL|O_NOFOLLOW): a symbolic link at its name is refused, never
followed; the folder itself may be a link (a cache placed on another disk). A log read back is opened without
following a link or blocking (files.open_owned): one that is a symbolic link, a FIFO or a folder is left out with a
warning, never opened.

A run's task has a log of its own (`answers_of_task`, which the runners enter around each task): `DIR/tasks/<tag>.log`,
held open while the task runs in this process (a resumed task appends to it, after cutting a torn last record), and
`drop_task_answers` removes it once the run has journalled the task succeeded or failed, when no resume can ask for
its answers again; an api_failed task's stays, for --retry-failed. So the cache holds the answers of the tasks in
flight and of the api_failed ones, not a second copy of every image a run made (an edit's answer carries its image
in base64: 4/3 of the image's bytes).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import stat
import threading
import time
import warnings
import weakref
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from ..files import UnsafeFile, create_new, open_owned

LOG_GLOB = "answers-*.log"
TASKS = "tasks"  # DIR/tasks/<tag>.log: one task's answers
_CACHES: "weakref.WeakSet[ResponseCache]" = weakref.WeakSet()  # this process's caches: a task's end closes its logs
_TASK: ContextVar[str | None] = ContextVar("medbanana_answers_task", default=None)  # the tag answers go under


def task_tag(uid: str) -> str:
    """The name of a task's log: a uid names files after its sources (any characters), a tag is hex."""
    return hashlib.sha256(uid.encode("utf-8")).hexdigest()[:32]


@contextlib.contextmanager
def answers_of_task(uid: str):
    """Within it, in this context (and the asyncio tasks started from it), every cache of this process appends the
    answers it is given to the task's own log, which it closes as the context ends."""
    tag = task_tag(uid)
    token = _TASK.set(tag)
    try:
        yield
    finally:
        _TASK.reset(token)
        for cache in list(_CACHES):
            cache.end_task(tag)


def drop_task_answers(cache_root: Path, uids: Iterable[str]) -> int:
    """Remove the logs of the tasks `uids` from every cache under `cache_root` (a run's medbanana-cache/, one
    folder per backend): call only once their end is journalled. A link at a log's name is removed, never followed.
    Returns how many logs went."""
    names, removed = {f"{task_tag(uid)}.log" for uid in uids}, 0
    if not names or not _real_folder(cache_root):
        return 0
    for backend in os.scandir(cache_root):
        folder = Path(backend.path) / TASKS
        if not backend.is_dir(follow_symlinks=False) or not _real_folder(folder):
            continue
        for name in names if len(names) < 64 else names.intersection(os.listdir(folder)):
            try:
                (folder / name).unlink()
                removed += 1
            except (FileNotFoundError, IsADirectoryError, PermissionError):  # gone, or a folder: nothing of ours
                continue
    return removed


def _real_folder(path: Path) -> bool:
    """Whether `path` is a folder itself, not a link to one."""
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except FileNotFoundError:
        return False


@dataclass(frozen=True)
class _Entry:
    log: Path
    offset: int  # of the body
    length: int  # -1: forgotten
    stamp: int  # time.time_ns() when written: the newest record of a key wins


class ResponseCache:
    """Completed answers named by the sha256 of their request payload. The API key is not part of a payload, so
    it never reaches a name or a file."""

    def __init__(self, directory: Path):
        self.directory = Path(directory)
        self._index: dict[str, _Entry] | None = None  # read at first use: a cache that is never asked costs nothing
        self._legacy = False  # whether the directory holds an earlier layout's files (read with the index)
        self._log: Path | None = None
        self._fd: int | None = None
        self._task_fds: dict[str, int] = {}  # tag -> its log, open while the task runs here
        self._lock = threading.Lock()
        _CACHES.add(self)

    @staticmethod
    def hash(payload: dict) -> str:
        return hashlib.sha256(json.dumps(payload, sort_keys=True, separators=(",", ":")).encode()).hexdigest()

    def __contains__(self, key: str) -> bool:
        entry = self._entries().get(key)
        return entry.length >= 0 if entry is not None else self._legacy and self._legacy_path(key).exists()

    def read(self, key: str) -> str | None:
        """The stored text, None when there is none (or it is not text: asked again and replaced)."""
        data = self.read_bytes(key)
        try:
            return data.decode("utf-8") if data is not None else None
        except UnicodeDecodeError:
            return None

    def read_bytes(self, key: str) -> bytes | None:
        """The stored bytes, None when there are none."""
        entry = self._entries().get(key)
        if entry is None and not self._legacy:  # (a miss on every new call: no file to look for)
            return None
        try:
            if entry is None:
                with os.fdopen(open_owned(self._legacy_path(key)), "rb") as fh:
                    return fh.read()
            if entry.length < 0:
                return None
            with os.fdopen(open_owned(entry.log), "rb") as fh:
                fh.seek(entry.offset)
                return fh.read(entry.length)
        except (FileNotFoundError, UnsafeFile):  # a FIFO, a folder or a link where an answer was: none
            return None

    def put_json(self, key: str, body: str) -> None:
        """Store an answer's JSON text as it is (no re-serialisation: one append)."""
        self._append(key, body.encode("utf-8"))

    def put_bytes(self, key: str, body: bytes) -> None:
        self._append(key, body)

    def forget(self, key: str) -> None:
        self._legacy_path(key).unlink(missing_ok=True)
        if key in self._entries():
            self._append(key, None)

    def keys(self) -> set[str]:
        """Every key with something stored (an earlier layout's files too)."""
        entries = self._entries()
        return ({key for key, entry in entries.items() if entry.length >= 0}
                | {p.stem for p in self.directory.glob("??/*.json") if p.stem not in entries})

    def answers(self) -> dict[str, str]:
        """Every stored answer by key (for inspection and tests; reads every body)."""
        return {key: text for key in sorted(self.keys()) if (text := self.read(key)) is not None}

    # ------------------------------------------------------------ the logs

    def _legacy_path(self, key: str) -> Path:
        return self.directory / key[:2] / f"{key}.json"

    def _append(self, key: str, body: bytes | None) -> None:
        stamp = time.time_ns()
        header = f"{key} {-1 if body is None else len(body)} {stamp}\n".encode()
        with self._lock:
            index = self._entries()
            if (tag := _TASK.get()) is not None and (fd := self._task_fd(tag)) is not None:
                offset = os.fstat(fd).st_size + len(header)
                os.write(fd, header + (body or b"") + b"\n")
                index[key] = _Entry(self.directory / TASKS / f"{tag}.log", offset, -1 if body is None else len(body),
                                    stamp)
                return
            if self._fd is None:
                self.directory.mkdir(parents=True, exist_ok=True)
                self._log = self.directory / f"answers-{stamp}-{os.getpid()}.log"
                # a new file: anything already at the name (a link to a file elsewhere) is refused, not followed
                self._fd = create_new(self._log, 0o644, os.O_APPEND)
            offset = os.fstat(self._fd).st_size + len(header)
            os.write(self._fd, header + (body or b"") + b"\n")  # one write: a kill leaves at most one torn record
            index[key] = _Entry(self._log, offset, -1 if body is None else len(body), stamp)

    def _task_fd(self, tag: str) -> int | None:
        """The task's log, open for appending (made, or opened as a file of ours with a torn last record cut off);
        None where a link or anything but a regular file of ours stands in the way: the answer then goes to this
        process's log."""
        if tag in self._task_fds:
            return self._task_fds[tag]
        folder = self.directory / TASKS
        self.directory.mkdir(parents=True, exist_ok=True)  # the cache folder itself may be a link (another disk)
        with contextlib.suppress(FileExistsError):
            folder.mkdir()
        if not _real_folder(folder):
            return None
        log = folder / f"{tag}.log"
        try:
            fd = create_new(log, 0o644, os.O_APPEND)
        except FileExistsError:  # the task ran before (a resume, a retry): its log goes on
            try:
                fd = open_owned(log, os.O_WRONLY | os.O_APPEND)
                # a record torn by a kill would hide every record after it: cut it
                os.ftruncate(fd, max((e.offset + max(e.length, 0) + 1 for _, e in _read_headers(log)), default=0))
            except (UnsafeFile, OSError):
                return None
        self._task_fds[tag] = fd
        return fd

    def end_task(self, tag: str) -> None:
        """Close the task's log (`answers_of_task` calls it as the task's context ends)."""
        with self._lock:
            fd = self._task_fds.pop(tag, None)
            if fd is not None:
                os.close(fd)

    def _entries(self) -> dict[str, _Entry]:
        if self._index is None:
            index: dict[str, _Entry] = {}
            logs = [*self.directory.glob(LOG_GLOB), *self.directory.glob(f"{TASKS}/*.log")]
            for log in sorted(logs, key=lambda path: path.name):
                try:
                    records = list(_read_headers(log))
                except UnsafeFile as exc:  # no log of ours: never opened (a FIFO would block), left out
                    warnings.warn(f"request cache: left out, never opened: {exc}", stacklevel=2)
                    continue
                for key, entry in records:
                    if key not in index or entry.stamp >= index[key].stamp:
                        index[key] = entry
            self._index = index
            # an earlier layout's answers, one file each in folders named by the key's first two characters
            self._legacy = any(folder.is_dir() for folder in self.directory.glob("??"))
        return self._index

    def close(self) -> None:
        with self._lock:
            for fd in [self._fd, *self._task_fds.values()]:
                if fd is not None:
                    os.close(fd)
            self._fd, self._task_fds = None, {}

    def __del__(self):
        for fd in [getattr(self, "_fd", None), *getattr(self, "_task_fds", {}).values()]:
            if fd is not None:
                os.close(fd)


def _read_headers(log: Path):
    """(key, entry) for each whole record of one log, in order; stops at a torn or foreign record. The log is
    opened as a file of ours (files.open_owned: UnsafeFile for a symbolic link, a FIFO or a folder)."""
    with os.fdopen(open_owned(log), "rb") as fh:
        size = os.fstat(fh.fileno()).st_size
        while True:
            header = fh.readline(200)
            try:
                key, length, stamp = header.decode("ascii").split()
                length, stamp = int(length), int(stamp)
            except (UnicodeDecodeError, ValueError):
                return
            offset = fh.tell()
            end = offset + max(length, 0)
            if end + 1 > size:
                return
            fh.seek(end)
            if fh.read(1) != b"\n":
                return
            yield key, _Entry(log, offset, length, stamp)
