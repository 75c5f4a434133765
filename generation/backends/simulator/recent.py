"""The pixel judge's measurements of the last few edits, kept so that a verdict and scores asked of the same edit
(`eval` asks both at once, in two threads) measure it once: the second caller waits for the first's result."""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Callable, Hashable

KEPT = 16  # edits; a measurement is a small dict


class RecentMeasures:
    """`get(key, measure)`: `measure()` once per key among the last KEPT keys, safe across threads."""

    def __init__(self, kept: int = KEPT):
        self.kept = kept
        self._lock = threading.Lock()
        self._slots: OrderedDict[Hashable, list] = OrderedDict()  # key -> [its lock, its measurement or None]

    def get(self, key: Hashable, measure: Callable[[], dict]) -> dict:
        with self._lock:
            slot = self._slots.pop(key, None) or [threading.Lock(), None]
            self._slots[key] = slot
            while len(self._slots) > self.kept:
                self._slots.popitem(last=False)
        with slot[0]:
            if slot[1] is None:
                slot[1] = measure()
            return dict(slot[1])
