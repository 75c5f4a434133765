"""Client-side limits shared by the API transports: bounded retries with back-off, requests and tokens per minute.

The limiters are shared per (model, limit) within a process, so that the roles using one model share its quota;
worker processes (`workers.py`) each get a share of the limit instead.
"""

from __future__ import annotations

import asyncio
import collections
import random
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class RetryPolicy:
    """Bounded retries: `max_attempts` calls in all, back-off base * 2**n (capped) with equal jitter."""

    max_attempts: int = 6
    base_delay: float = 2.0
    max_delay: float = 60.0
    max_retry_after: float = 600.0  # a server asking for longer than this is obeyed only up to it

    def delay(self, retry_number: int, retry_after: float | None, rng: random.Random) -> float:
        cap = min(self.max_delay, self.base_delay * 2 ** retry_number)
        backoff = cap / 2 + rng.uniform(0, cap / 2)
        if retry_after is None:
            return backoff
        return max(min(retry_after, self.max_retry_after), backoff)


class RateLimiter:
    """Spaces request starts at least 60/rpm seconds apart. Slots are taken without awaiting, so it is safe
    to share between tasks and event loops."""

    def __init__(self, rpm: float, clock=time.monotonic):
        if rpm <= 0:
            raise ValueError(f"rpm must be positive, not {rpm}")
        self.rpm = rpm
        self.interval = 60.0 / rpm
        self._clock = clock
        self._next = 0.0

    def reserve(self) -> float:
        """Take the next slot; returns how long to wait for it."""
        now = self._clock()
        slot = max(now, self._next)
        self._next = slot + self.interval
        return slot - now

    async def acquire(self, sleep=asyncio.sleep) -> None:
        wait = self.reserve()
        if wait > 0:
            await sleep(wait)


class TokenLimiter:
    """Keeps the tokens used in any 60 s window under `tpm`: a call starts only while the last minute's usage
    is below the limit, and each finished call records the tokens it used (known only afterwards)."""

    def __init__(self, tpm: float, clock=time.monotonic, window: float = 60.0):
        if tpm <= 0:
            raise ValueError(f"tpm must be positive, not {tpm}")
        self.tpm, self.window, self._clock = tpm, window, clock
        self._used: collections.deque[tuple[float, int]] = collections.deque()

    def wait_time(self) -> float:
        """Seconds until the last window's usage drops below the limit (0 when it already is)."""
        now = self._clock()
        while self._used and self._used[0][0] <= now - self.window:
            self._used.popleft()
        total = sum(tokens for _, tokens in self._used)
        if total < self.tpm:
            return 0.0
        for stamp, tokens in self._used:  # oldest first: usage falls below the limit once these have expired
            total -= tokens
            if total < self.tpm:
                return stamp + self.window - now
        return self.window

    def record(self, tokens: int) -> None:
        if tokens > 0:
            self._used.append((self._clock(), int(tokens)))

    async def acquire(self, sleep=asyncio.sleep) -> None:
        # one wait, not a loop: usage is known only after calls finish, so the budget is approximate anyway
        wait = self.wait_time()
        if wait > 0:
            await sleep(wait)


_LIMITERS: dict[tuple[str, float], RateLimiter] = {}
_TOKEN_LIMITERS: dict[tuple[str, float], TokenLimiter] = {}


def shared_limiter(model: str, rpm: float) -> RateLimiter:
    """One limiter per (model, rpm) in the process: the writer and judge using one model share its quota."""
    return _LIMITERS.setdefault((model, float(rpm)), RateLimiter(rpm))


def shared_token_limiter(model: str, tpm: float) -> TokenLimiter:
    """One token budget per (model, tpm) in the process, like `shared_limiter`."""
    return _TOKEN_LIMITERS.setdefault((model, float(tpm)), TokenLimiter(tpm))
