"""What the API transports (gemini_transport.py, openai_compatible.py) share, written once.

* `Transport`: the base of both: per-call timeout, bounded retries with back-off and jitter (Retry-After
  honoured), client-side limits and the response cache. A run makes its own transport, and with it its own
  limiters: two runs, or a run and an evaluation, in one process never share a quota; the roles that share one
  transport share each model's quota.
* `CallFailure` and the classification of a failed call that is not specific to one client library.
* `ResponseCache` (response_cache.py): completed answers on disk, by a hash of their request.
* `ask_until_usable` / `drive`: the exchange that asks again, with a note, while an answer cannot be used, and the
  driver that sends its requests and drops the cached answers of an exchange that ended in an APIError.
"""

from __future__ import annotations

import asyncio
import collections
import email.utils
import json
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Awaitable, Callable, Generator, TypeVar

import pydantic

from .base import APIError
from .guard import refused_in
from .response_cache import ResponseCache
from ..prompts import reask_note
from ..records import Usage
from ..secrets import scrub
from ..failures import UsageError

# Exception modules of the HTTP stacks the clients may use; their errors are network trouble, worth a retry.
_TRANSPORT_MODULES = {"httpx", "httpx2", "httpcore", "httpcore2", "aiohttp", "anyio", "h11", "ssl"}
Req, Ans, T = TypeVar("Req"), TypeVar("Ans"), TypeVar("T")
STATUS_KINDS = {400: "invalid_argument", 401: "unauthenticated", 403: "permission_denied", 404: "not_found",
                422: "invalid_argument"}


# ---------------------------------------------------------------- limits

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
            raise UsageError(f"rpm must be positive, not {rpm}")
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
            raise UsageError(f"tpm must be positive, not {tpm}")
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


class ModelLimits:
    """One transport's client-side quotas: a request limiter and a token budget per model, made on first use."""

    def __init__(self, rpm: float | None = None, tpm: float | None = None):
        self.rpm, self.tpm = rpm, tpm
        self._requests: dict[str, RateLimiter] = {}
        self._tokens: dict[str, TokenLimiter] = {}

    def requests(self, model: str) -> RateLimiter | None:
        if not self.rpm:
            return None
        return self._requests.setdefault(model, RateLimiter(self.rpm))

    def tokens(self, model: str) -> TokenLimiter | None:
        if not self.tpm:
            return None
        return self._tokens.setdefault(model, TokenLimiter(self.tpm))


# ---------------------------------------------------------------- failures

@dataclass
class CallFailure:
    """What went wrong with one HTTP call, classified."""

    kind: str
    message: str
    retryable: bool
    retry_after: float | None = None


def parse_retry_after(value: str | None) -> float | None:
    """Seconds from a Retry-After header: delta-seconds or an HTTP date."""
    if not value:
        return None
    value = value.strip()
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        return max(0.0, email.utils.parsedate_to_datetime(value).timestamp() - time.time())
    except (TypeError, ValueError):
        return None


def failure_for_status(code: int, message: str, retry_after: float | None) -> CallFailure:
    """An HTTP error status as a kind: 408, 429 and 5xx are retried; other 4xx are permanent."""
    if code == 429:
        return CallFailure("rate_limited", message, True, retry_after)
    if code == 408:
        return CallFailure("timeout", message, True, retry_after)
    if code >= 500:
        return CallFailure("server_error", message, True, retry_after)
    return CallFailure(STATUS_KINDS.get(code, "client_error"), message, False)


def classify_common(exc: BaseException) -> CallFailure:
    """A failed call's exception that no client library owns as a kind: timeouts, network errors and bodies that
    do not parse are retried; anything else is a programming error and re-raised. An answer guard.py refused (a
    redirect to another host, an answer over the size limit), also wrapped by a client library, is not retried."""
    if refused := refused_in(exc):
        return CallFailure(refused.kind, str(refused), False)
    if isinstance(exc, TimeoutError) or "Timeout" in type(exc).__name__:  # ours, or the HTTP stack's
        return CallFailure("timeout", "no answer within the per-call timeout", True)
    from_stack = type(exc).__module__.split(".")[0] in _TRANSPORT_MODULES
    if from_stack and isinstance(exc, ValueError) and not isinstance(exc, OSError):  # aiohttp's InvalidURL: a bad
        return CallFailure("client_error", f"{type(exc).__name__}: {exc}", False)  # base URL, no retry will help
    if isinstance(exc, OSError) or from_stack:
        return CallFailure("transport", f"{type(exc).__name__}: {exc}", True)
    # a 200 whose body is torn, garbled or not a response at all
    if isinstance(exc, (json.JSONDecodeError, UnicodeDecodeError, pydantic.ValidationError)):
        return CallFailure("bad_response", f"{type(exc).__name__}: {exc}", True)
    raise exc


# ---------------------------------------------------------------- transport

class Transport:
    """Timeout, retries, limits and cache around one client library's calls (subclasses make the calls).

    Options: timeout (seconds per call), max_attempts, retry_base_delay, retry_max_delay, cache_dir, rpm and tpm
    (per model), sleep (an awaitable, for tests), jitter_seed.
    """

    cache_type = ResponseCache

    def __init__(self, *, timeout: float = 180.0, max_attempts: int = 6, retry_base_delay: float = 2.0,
                 retry_max_delay: float = 60.0, cache_dir: str | Path | None = None, rpm: float | None = None,
                 tpm: float | None = None, sleep=asyncio.sleep, jitter_seed: int | None = None,
                 secrets: tuple[str, ...] = ()):
        self.timeout = timeout
        self.retry = RetryPolicy(max_attempts=max_attempts, base_delay=retry_base_delay, max_delay=retry_max_delay)
        self.limits = ModelLimits(rpm, tpm)  # this transport's own: see the module docstring
        self.cache = self.cache_type(Path(cache_dir)) if cache_dir else None
        self._secrets = secrets
        self._sleep = sleep
        self._rng = random.Random(jitter_seed)
        self.network_calls = 0
        self.cache_hits = 0

    @property
    def rpm(self) -> float | None:
        return self.limits.rpm

    @property
    def tpm(self) -> float | None:
        return self.limits.tpm

    def redact(self, text: str) -> str:
        return scrub(text, self._secrets)

    def error(self, failure: CallFailure, what: str) -> APIError:
        return APIError(failure.kind, f"{what}: {self.redact(failure.message)[:600]}")

    async def call_with_retries(self, what: str, make_call, classify: Callable[[BaseException], CallFailure], *,
                                timeout: float | None = None, limiter: RateLimiter | None = None):
        """`await make_call()` under the per-call timeout, retried with back-off while `classify` says the failure
        is retryable; APIError(kind) when it cannot succeed. `what` names the call in messages."""
        attempt = 0
        while True:
            attempt += 1
            if limiter:
                await limiter.acquire(self._sleep)
            self.network_calls += 1
            try:
                async with asyncio.timeout(timeout or self.timeout):
                    return await make_call()
            except Exception as exc:  # classified below; programming errors are re-raised by classify
                failure = classify(exc)
            if not failure.retryable or attempt == self.retry.max_attempts:
                gave_up = f": gave up after {attempt} attempts; last" if failure.retryable else ""
                raise APIError(failure.kind, f"{what}{gave_up}: {self.redact(failure.message)[:600]}")
            await self._sleep(self.retry.delay(attempt - 1, failure.retry_after, self._rng))

    async def limited_call(self, model: str, make_call, classify: Callable[[BaseException], CallFailure],
                           tokens_used: Callable[[T], int]) -> T:
        """One call to `model` under its request and token limits, with retries; `tokens_used(result)` is what
        the call counts against the token budget."""
        tokens = self.limits.tokens(model)
        if tokens:
            await tokens.acquire(self._sleep)
        result = await self.call_with_retries(model, make_call, classify, limiter=self.limits.requests(model))
        if tokens:
            tokens.record(tokens_used(result))
        return result


# ---------------------------------------------------------------- asking until an answer is usable

Exchange = Generator[Req, Ans, T]  # yields requests, is sent their answers (or has an APIError thrown in)


def add_usage(total: Usage, more: Usage) -> Usage:
    return Usage(total.input_tokens + more.input_tokens, total.output_tokens + more.output_tokens,
                 total.thinking_tokens + more.thinking_tokens)


def unusable(what: str, model: str, tries: int, problem: str) -> APIError:
    return APIError(f"unparseable_{what}", f"{model}: no usable {what} after {tries} tries; last: {problem}")


def ask_until_usable(request_for: Callable[[str | None], Req], usage_of: Callable[[Ans], Usage],
                     text_of: Callable[[Ans], str], parse, *, what: str, model: str, max_reasks: int):
    """Exchange returning (parsed, the last answer, total usage, calls made).

    `request_for(note)` is the request, with the re-ask note when there is one; `text_of(answer)` is the text to
    parse, or raises APIError for a refusal (asking again would not help). An answer that `parse` rejects with a
    ValueError is asked again up to `max_reasks` times; then APIError(unparseable_WHAT).
    """
    usage, note, tries, problem = Usage(), None, 1 + max_reasks, ""
    for number in range(1, tries + 1):
        answer = yield request_for(note)
        usage = add_usage(usage, usage_of(answer))
        text = text_of(answer)
        try:
            return parse(text), answer, usage, number
        except ValueError as exc:
            problem = f"{type(exc).__name__}: {str(exc)[:200]}"
        note = reask_note(problem, number, tries)
    raise unusable(what, model, tries, problem)


async def drive(exchange: Exchange[Req, Ans, T], call: Callable[[Req], Awaitable[Ans]],
                forget: Callable[[Req], None], heavy: Callable[[Ans], bool] | None = None) -> T:
    """Drive an exchange call by call.

    When it ends in an APIError, the answers it got are dropped from the request cache (`forget`): they were
    unusable (a refusal, an unparseable verdict), and `--retry-failed` must ask again rather than replay them.
    Answers of an exchange that ended well stay, so a resumed run replays them without paying twice.
    An answer for which `heavy(answer)` is true (an image to decode or re-encode) is sent in on a worker thread,
    so that the event loop keeps the other calls moving meanwhile.
    """
    answered: list[Req] = []
    try:
        request = next(exchange)
        while True:
            try:
                answer = await call(request)
            except APIError as exc:
                request = exchange.throw(exc)
            else:
                answered.append(request)
                if heavy is not None and heavy(answer):
                    ended, request = await asyncio.to_thread(_send, exchange, answer)
                    if ended:
                        return request
                else:
                    request = exchange.send(answer)
    except StopIteration as done:
        return done.value
    except APIError:
        for request in answered:
            forget(request)
        raise


def _send(exchange: Exchange, answer) -> tuple[bool, object]:
    """(True, the result) when the exchange returned, else (False, its next request): a StopIteration cannot
    cross from a thread into an awaiting coroutine."""
    try:
        return False, exchange.send(answer)
    except StopIteration as done:
        return True, done.value
