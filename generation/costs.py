"""Tokens and USD of a run, from the usage its records keep for each round's writer, editor and judge calls.

One reader of a journalled round's usage (`round_steps`, tolerant of older runs that kept no editor usage and of
malformed values), one tally per role and model (`Tally`), and one report (`cost_report`): the run's summary and
medbanana-stats.json, `medbanana plan --pilot` and the budget of `generate --budget` all count through here.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from .pricing import PriceTable

ROLES = ("writer", "editor", "judge")


def tokens_of(usage) -> tuple[int, int] | None:
    """(input, output with thinking) tokens of a recorded usage dict, None when it holds no usable counts."""
    if not isinstance(usage, dict):
        return None
    counts = []
    for key in ("input_tokens", "output_tokens", "thinking_tokens"):
        value = usage.get(key, 0)
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 10**9:
            return None
        counts.append(value)
    return counts[0], counts[1] + counts[2]


def _tries(details) -> int:
    tries = details.get("tries") if isinstance(details, dict) else None
    return tries if isinstance(tries, int) and not isinstance(tries, bool) and 1 <= tries <= 100 else 1


def round_steps(raw: dict) -> Iterator[tuple[str, tuple[int, int] | None, int]]:
    """(role, (input, output) tokens or None when not recorded, calls) for each backend step a journalled round
    made: the writer's, the editor's, and the judge's when the edit gave an image to judge."""
    usage = raw.get("usage") if isinstance(raw.get("usage"), dict) else {}
    edit = raw.get("edit_result") if isinstance(raw.get("edit_result"), dict) else {}
    verification = raw.get("verification") if isinstance(raw.get("verification"), dict) else None
    yield "writer", tokens_of(usage.get("writer")), 1
    yield "editor", tokens_of(usage.get("editor")), _tries(edit.get("details"))
    if verification is not None:
        yield "judge", tokens_of(usage.get("judge")), _tries(verification.get("details"))


def rounds_of(record: dict) -> list[dict]:
    rounds = record.get("rounds") if isinstance(record, dict) else None
    return [r for r in rounds if isinstance(r, dict)] if isinstance(rounds, list) else []


@dataclass
class RoleTally:
    steps: int = 0
    calls: int = 0
    measured: int = 0  # steps whose usage the records hold
    input_tokens: int = 0
    output_tokens: int = 0  # thinking included

    def add(self, tokens: tuple[int, int] | None, calls: int = 1) -> None:
        self.steps += 1
        self.calls += calls
        if tokens is not None:
            self.measured += 1
            self.input_tokens += tokens[0]
            self.output_tokens += tokens[1]


@dataclass
class Tally:
    """Steps, calls and tokens per role over rounds."""

    roles: dict[str, RoleTally] = field(default_factory=lambda: {role: RoleTally() for role in ROLES})

    def add_round(self, raw: dict) -> None:
        for role, tokens, calls in round_steps(raw):
            self.roles[role].add(tokens, calls)

    def add_records(self, records: Iterable[dict]) -> "Tally":
        for record in records:
            for raw in rounds_of(record):
                self.add_round(raw)
        return self


@dataclass(frozen=True)
class CostLine:
    role: str
    backend: str
    model: str
    steps: int
    calls: int
    input_tokens: int
    output_tokens: int
    usd: float | None  # None: the model has no price
    measured: int = 0


@dataclass(frozen=True)
class CostReport:
    lines: tuple[CostLine, ...]
    batch: bool = False
    prices: dict = field(default_factory=dict)

    @property
    def usd(self) -> float:
        """The priced part; `unpriced` names what it leaves out."""
        return sum(line.usd or 0.0 for line in self.lines)

    @property
    def unpriced(self) -> list[str]:
        return sorted({line.model for line in self.lines if line.usd is None})

    def as_dict(self) -> dict:
        return {"usd": round(self.usd, 4), "unpriced_models": self.unpriced, "batch": self.batch,
                "prices": self.prices,
                "roles": {line.role: {"backend": line.backend, "model": line.model, "steps": line.steps,
                                      "calls": line.calls, "input_tokens": line.input_tokens,
                                      "output_tokens": line.output_tokens,
                                      "usd": None if line.usd is None else round(line.usd, 4)}
                          for line in self.lines}}


def cost_lines(cost: dict, spent_now: float | None = None) -> list[str]:
    """Lines of tokens and USD per role and model, then the total naming any model without a price (a
    CostReport's as_dict, as medbanana-stats.json keeps it)."""
    lines = ["  tokens and cost of the run's recorded rounds:"]
    for role, line in cost["roles"].items():
        usd = "no price" if line["usd"] is None else f"{line['usd']:.2f} USD"
        names = ascii(f"{line['backend']} {line['model']}")[1:-1]  # from a run file: no control characters
        lines.append(f"    {role:<7} {names}: {line['input_tokens']:,} in, "
                     f"{line['output_tokens']:,} out, {line['calls']:,} calls, {usd}")
    unpriced = (f" + the calls of {ascii(', '.join(cost['unpriced_models']))[1:-1]} (no price: give --prices FILE)"
                if cost["unpriced_models"] else "")
    batch = " at Batch API prices" if cost.get("batch") else ""
    now = f"; this invocation {spent_now:.2f} USD" if spent_now is not None else ""
    lines.append(f"    total   {cost['usd']:.2f} USD{unpriced}{batch}{now}")
    return lines


def cost_report(tally: Tally, backends: dict, prices: PriceTable, batch: bool = False) -> CostReport:
    """Each role's tokens priced with its backend's model (`backends`: role -> {"backend", "model"}, as
    medbanana-run.json records them). A role whose calls used no tokens costs nothing."""
    lines = []
    for role in ROLES:
        made = backends.get(role) if isinstance(backends.get(role), dict) else {}
        backend, model = str(made.get("backend") or ""), str(made.get("model") or "")
        t = tally.roles[role]
        usage = {"input_tokens": t.input_tokens, "output_tokens": t.output_tokens}
        usd = 0.0 if not (t.input_tokens or t.output_tokens) else prices.cost(backend, model, usage,
                                                                            calls=max(t.calls, 1), batch=batch)
        lines.append(CostLine(role, backend, model, t.steps, t.calls, t.input_tokens, t.output_tokens, usd,
                              t.measured))
    return CostReport(tuple(lines), batch, prices.describe())


def step_cost(prices: PriceTable, backend: str, model: str, tokens: tuple[int, int] | None, calls: int = 1,
              batch: bool = False) -> float | None:
    """USD of one step's recorded tokens (0 when none were recorded)."""
    if tokens is None or not any(tokens):
        return 0.0
    return prices.cost(backend, model, {"input_tokens": tokens[0], "output_tokens": tokens[1]}, calls=calls,
                       batch=batch)
