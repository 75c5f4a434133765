"""Per-image probe features kept in the evaluation folder, so that an interrupted `eval --separability` resumes.

``OUT/medbanana-cache/probe-features/`` holds them in the request cache's append-only logs
(generation/backends/response_cache.py: a log per process, one write per record, a record torn by a kill ignored).
A record's body is the raw vector's length (uint32) and the raw and controlled vectors as little-endian float32,
written as each image's features arrive. Its key is the sha256 of the image's content hash, the feature set
(weight-free or the embedder's spec), that feature set's code version, the analysis size and the JPEG quality: a
change of any of them is a miss, never a stale hit. Unreadable images are not stored (asked again on the next run).
Entries of other settings stay; deleting the folder only costs recomputation.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

from ..generation.backends.response_cache import ResponseCache

CACHE_NAME = "probe-features"  # under OUT/medbanana-cache/
_FLOAT = np.dtype("<f4")
_LENGTH = 4  # bytes of the raw vector's length before the vectors


def content_digest(data: bytes) -> str:
    """What identifies an image in a key: the sha256 of its bytes (a rewrite with the same size and time stamp
    still misses)."""
    return hashlib.sha256(data).hexdigest()


def feature_key(digest: str, feature_set: str, version: int, size: int, quality: int, detail: int = 0) -> str:
    fields = {"image": digest, "features": feature_set, "version": version, "size": size, "quality": quality}
    if detail:  # the weight-free features' detail view (probe_features)
        fields["detail"] = detail
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()


class FeatureCache:
    """(raw, controlled) float32 vectors by key; counts what it served and stored."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self._logs = ResponseCache(self.path)
        self.reused = 0
        self.stored = 0

    def __len__(self) -> int:
        return len(self._logs.keys())

    def __contains__(self, key: str) -> bool:
        return key in self._logs

    def keys(self) -> frozenset[str]:
        return frozenset(self._logs.keys())

    def get(self, key: str) -> tuple[np.ndarray, np.ndarray] | None:
        body = self._logs.read_bytes(key)
        if body is None:
            return None
        n_raw = int.from_bytes(body[:_LENGTH], "little")
        values = np.frombuffer(body, _FLOAT, offset=_LENGTH).astype(np.float32)
        self.reused += 1
        return values[:n_raw], values[n_raw:]

    def put(self, key: str, raw: np.ndarray, controlled: np.ndarray) -> None:
        raw, controlled = np.asarray(raw, _FLOAT).ravel(), np.asarray(controlled, _FLOAT).ravel()
        self._logs.put_bytes(key, raw.size.to_bytes(_LENGTH, "little") + raw.tobytes() + controlled.tobytes())
        self.stored += 1

    def close(self) -> None:
        self._logs.close()
