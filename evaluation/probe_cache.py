"""Per-image probe features kept in the evaluation folder, so that an interrupted `eval --separability` resumes.

``OUT/medbanana-cache/probe-features.bin`` is append-only. A record is a header line ``KEY RAW CONTROLLED\\n``
(RAW, CONTROLLED: the lengths of the two vectors), the vectors as little-endian float32, and ``\\n``, written in one
write as each image's features arrive. KEY is the sha256 of the image's content hash, the feature set (weight-free
or the embedder's spec), that feature set's code version, the analysis size and the JPEG quality: a change of any of
them is a miss, never a stale hit. Unreadable images are not stored (asked again on the next run).

Opening reads the headers (seeking past the bodies) and stops at the first record that is torn or not one of ours;
a kill mid-write leaves at most the last record torn, and the file is cut back to the end of the last whole record
before anything is appended, so what the next run appends is read back. One writer at a time: `eval` holds its
output folder's lock. Entries of other settings stay in the file; deleting it only costs recomputation.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np

CACHE_NAME = "probe-features.bin"  # under OUT/medbanana-cache/
_FLOAT = np.dtype("<f4")
_MAX_HEADER = 200


def content_digest(data: bytes) -> str:
    """What identifies an image in a key: the sha256 of its bytes (a rewrite with the same size and time stamp
    still misses)."""
    return hashlib.sha256(data).hexdigest()


def feature_key(digest: str, feature_set: str, version: int, size: int, quality: int) -> str:
    fields = {"image": digest, "features": feature_set, "version": version, "size": size, "quality": quality}
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()


class FeatureCache:
    """(raw, controlled) float32 vectors by key, in one append-only file; counts what it served and stored."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        self._index, end = _read_index(self._fd)
        if end < os.fstat(self._fd).st_size:
            os.ftruncate(self._fd, end)  # drop a torn last record so later appends stay readable
        self._end = end
        self.reused = 0
        self.stored = 0

    def __len__(self) -> int:
        return len(self._index)

    def __contains__(self, key: str) -> bool:
        return key in self._index

    def keys(self) -> frozenset[str]:
        return frozenset(self._index)

    def get(self, key: str) -> tuple[np.ndarray, np.ndarray] | None:
        entry = self._index.get(key)
        if entry is None:
            return None
        offset, n_raw, n_controlled = entry
        body = os.pread(self._fd, (n_raw + n_controlled) * _FLOAT.itemsize, offset)
        values = np.frombuffer(body, _FLOAT).astype(np.float32)
        self.reused += 1
        return values[:n_raw], values[n_raw:]

    def put(self, key: str, raw: np.ndarray, controlled: np.ndarray) -> None:
        raw, controlled = np.asarray(raw, _FLOAT).ravel(), np.asarray(controlled, _FLOAT).ravel()
        header = f"{key} {raw.size} {controlled.size}\n".encode("ascii")
        os.lseek(self._fd, self._end, os.SEEK_SET)
        # one write per record: a kill tears at most this one, which the next open cuts away
        written = os.write(self._fd, header + raw.tobytes() + controlled.tobytes() + b"\n")
        self._index[key] = (self._end + len(header), raw.size, controlled.size)
        self._end += written
        self.stored += 1

    def close(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)


def _read_index(fd: int) -> tuple[dict[str, tuple[int, int, int]], int]:
    """key -> (body offset, raw length, controlled length) for each whole record, and where the last one ends."""
    size = os.fstat(fd).st_size
    index: dict[str, tuple[int, int, int]] = {}
    end = 0
    while end < size:
        head = os.pread(fd, _MAX_HEADER, end)
        line, newline, _ = head.partition(b"\n")
        try:
            key, n_raw, n_controlled = line.decode("ascii").split()
            n_raw, n_controlled = int(n_raw), int(n_controlled)
        except (UnicodeDecodeError, ValueError):
            break
        if not newline or len(key) != 64 or n_raw < 0 or n_controlled < 0:
            break
        body = end + len(line) + 1
        record_end = body + (n_raw + n_controlled) * _FLOAT.itemsize + 1
        if record_end > size or os.pread(fd, 1, record_end - 1) != b"\n":
            break
        index[key] = (body, n_raw, n_controlled)
        end = record_end
    return index, end
