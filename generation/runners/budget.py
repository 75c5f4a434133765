"""`generate --budget USD`: what a run has spent, and a limit its spending never passes.

Spent = the usage recorded in the run directory (every journalled round, from earlier invocations too) priced
with the price table, plus each step answered since. Before a round starts, its writer, editor and judge steps are
held at once (`Ledger.hold`: each role's priciest call so far, or the assumed one, times its tries); the round
starts only if spent + everything held stays within the budget, and waits while it would fit once the rounds in
flight have settled. A round once started runs to its end, so no round is cut in half; when the next one would
not fit even alone, none starts any more (`BudgetReached`), the rounds and tasks finished so far are kept, and
the run ends with EXIT_BUDGET. A step's actual cost replaces what was held
for it as soon as it is answered. With `--workers` the processes share one ledger (`SharedState`, shared memory
under a lock); Ray shards each get their part of what is left (ray_executor.py); the Batch runner holds a round
for every task of a pass before submitting it.

What the records cannot say is not counted: calls whose answers carried no usage, and calls of a round that ended
in an API error (the error carries none).
"""

from __future__ import annotations

import asyncio
import multiprocessing
from dataclasses import dataclass, field

from pathlib import Path

from ..costs import ROLES, rounds_of, round_steps, step_cost, tokens_of
from ..pricing import PriceTable
from ..rundir import layout
from ..rundir.store import read_journal
from .pilot import ASSUMED_TOKENS


class BudgetReached(BaseException):
    """No new round fits in the budget. A BaseException, so that the loop's handling of a backend's errors (which
    ends a task api_failed) lets it through to the runner, which leaves the task unfinished, to resume later."""


@dataclass(frozen=True)
class RunPricing:
    """How a run's calls are priced (plain values: workers and Ray shards get a copy). `budget` None: count only.
    `tries`: the most calls one step of each role makes (re-asks included); `per_task_usd`: the expected cost of
    a task, for the projected total until the run has measured its own."""

    prices: PriceTable
    backends: dict  # role -> {"backend", "model"}
    batch: bool = False
    budget: float | None = None
    tries: dict = field(default_factory=lambda: dict.fromkeys(ROLES, 3))
    per_task_usd: float = 0.0

    def cost(self, role: str, tokens: tuple[int, int] | None, calls: int = 1) -> float:
        made = self.backends.get(role) or {}
        usd = step_cost(self.prices, str(made.get("backend", "")), str(made.get("model", "")), tokens, calls,
                        self.batch)
        return usd or 0.0  # an unpriced model: `generate --budget` refuses to start with one

    def assumed_call(self, role: str) -> float:
        return self.cost(role, ASSUMED_TOKENS[role])

    def unpriced(self) -> list[str]:
        """The models of paid backends the table has no price for."""
        return sorted({str(made.get("model")) for role, made in self.backends.items()
                       if self.prices.cost(str(made.get("backend", "")), str(made.get("model", "")),
                                           {"input_tokens": 1}) is None})

    def recorded(self, rounds) -> float:
        """USD of journalled rounds (raw round dicts)."""
        return sum(self.cost(role, tokens, calls) for raw in rounds for role, tokens, calls in round_steps(raw))


def journal_rounds(run_dir: Path) -> list[dict]:
    """Every round a run directory's journal holds (its round lines and its task records' rounds), each once."""
    rounds: dict[tuple[str, object], dict] = {}
    for entry in read_journal(Path(run_dir) / layout.JOURNAL):
        if not isinstance(entry, dict):
            continue
        found = [entry.get("round")] if entry.get("type") == "round" else rounds_of(entry.get("record"))
        for raw in found:
            if isinstance(raw, dict):
                rounds[(str(entry.get("uid")), raw.get("round"))] = raw
    return list(rounds.values())


class SharedState:
    """The ledger's figures in shared memory, for worker processes (made with the runner's multiprocessing
    context and handed to each worker when it is started)."""

    def __init__(self, spent: float = 0.0, context=None):
        context = context or multiprocessing.get_context("spawn")
        self.lock = context.Lock()
        self._spent = context.RawValue("d", spent)
        self._held = context.RawValue("d", 0.0)
        self._stopped = context.RawValue("b", 0)

    def get(self) -> tuple[float, float, bool]:
        return self._spent.value, self._held.value, bool(self._stopped.value)

    def set(self, spent: float, held: float, stopped: bool) -> None:
        self._spent.value, self._held.value, self._stopped.value = spent, held, int(stopped)


class LocalState:
    """The same figures for a runner in one process."""

    def __init__(self, spent: float = 0.0):
        self.lock = _NoLock()
        self._values = (spent, 0.0, False)

    def get(self) -> tuple[float, float, bool]:
        return self._values

    def set(self, spent: float, held: float, stopped: bool) -> None:
        self._values = (spent, held, stopped)


class _NoLock:
    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        return None


class Ledger:
    """Spent and held USD of one run; `open_round` admits a round or stops the run for good."""

    def __init__(self, pricing: RunPricing, state: SharedState | LocalState):
        self.pricing, self.state = pricing, state
        self._holding: dict[str, dict[str, float]] = {}  # task uid -> role -> USD held for its open round
        self._priciest = {role: pricing.assumed_call(role) for role in ROLES}  # per call, in this process

    @property
    def spent(self) -> float:
        return self.state.get()[0]

    @property
    def stopped(self) -> bool:
        return self.state.get()[2]

    def hold(self) -> dict[str, float]:
        return {role: self.pricing.tries.get(role, 3) * self._priciest[role] for role in ROLES}

    def try_open(self, uid: str) -> str:
        """Hold a round of task `uid` (after releasing what its last round left): "open"; or "wait" while it fits
        the budget only once rounds in flight have settled; or "stop" when it would not fit even alone, now and
        for every later round (the run ends). Always "open" without a budget."""
        self.release(uid)
        need = self.hold()
        with self.state.lock:
            spent, held, stopped = self.state.get()
            budget = self.pricing.budget
            if budget is not None and (stopped or spent + sum(need.values()) > budget):
                self.state.set(spent, held, True)
                return "stop"
            if budget is not None and spent + held + sum(need.values()) > budget:
                return "wait" if held > 0 else "stop"
            self.state.set(spent, held + sum(need.values()), stopped)
        self._holding[uid] = need
        return "open"

    async def open_round(self, uid: str, every: float = 0.05) -> bool:
        """`try_open` until the round is open (True) or the run stops (False)."""
        while (verdict := self.try_open(uid)) == "wait":
            await asyncio.sleep(every)
        return verdict == "open"

    def settle(self, uid: str, role: str, usage, calls: int = 1) -> None:
        """A step of task `uid` was answered: its cost (from the answer's usage; nothing for an error) is spent,
        what was held for it released."""
        tokens = tokens_of(usage.__dict__) if usage is not None and hasattr(usage, "__dict__") else tokens_of(usage)
        usd = self.pricing.cost(role, tokens, calls)
        if calls:
            self._priciest[role] = max(self._priciest[role], usd / calls)
        held = self._holding.get(uid, {}).pop(role, 0.0)
        with self.state.lock:
            spent, total_held, stopped = self.state.get()
            self.state.set(spent + usd, max(0.0, total_held - held), stopped)

    def release(self, uid: str) -> None:
        """Give back what task `uid` still holds (its round ended before all three steps, or the task did)."""
        held = sum(self._holding.pop(uid, {}).values())
        if held:
            with self.state.lock:
                spent, total_held, stopped = self.state.get()
                self.state.set(spent, max(0.0, total_held - held), stopped)


def answer_usage(answer) -> tuple[object, int]:
    """(usage, calls) of a step's answer: an Instruction, EditedImage or Verdict, or an EditRefused."""
    details = getattr(answer, "details", None)
    tries = details.get("tries") if isinstance(details, dict) else None
    calls = tries if isinstance(tries, int) and tries >= 1 else 1
    return getattr(answer, "usage", None), calls


class Metered:
    """A backend whose calls a ledger admits and counts: the writer's call opens each round (`BudgetReached` when
    it does not fit); every answer is settled. Everything else is the backend's own."""

    METHODS = {"writer": "write", "editor": "edit", "judge": "judge"}

    def __init__(self, backend, role: str, ledger: Ledger):
        self._backend, self._role, self._ledger = backend, role, ledger
        setattr(self, self.METHODS[role], self._call)

    def __getattr__(self, name):
        return getattr(self._backend, name)

    async def _call(self, task, *args):
        if self._role == "writer" and not await self._ledger.open_round(task.uid):
            raise BudgetReached(task.uid)
        try:
            answer = await getattr(self._backend, self.METHODS[self._role])(task, *args)
        except Exception as exc:
            self._ledger.settle(task.uid, self._role, *answer_usage(exc))
            raise
        self._ledger.settle(task.uid, self._role, *answer_usage(answer))
        return answer


def metered(backends: tuple, ledger: Ledger | None) -> tuple:
    """(writer, editor, judge) counted by the ledger; as given without one."""
    if ledger is None:
        return backends
    return tuple(Metered(b, role, ledger) for b, role in zip(backends, ROLES))
