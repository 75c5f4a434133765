"""What one task costs, per role: measured on a pilot run's finished tasks (`pilot_samples`), or assumed
(`assumed_samples`, the documented defaults `medbanana plan` prints as assumptions).

A sample is one task's rounds, calls, tokens and seconds, cut at the planned max rounds. `plan.py` resamples them
(a bootstrap over the pilot's tasks) to price a run of any size; `budget.py` takes its per-call reservations from
the same figures.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from ..costs import ROLES, rounds_of, round_steps
from ..rundir import layout, schema
from ..rundir.store import read_journal
from ..failures import UsageError

# The documented defaults for a plan without a pilot (docs/plan-and-budget.md): each one is printed as an
# assumption. Tokens per call (input, output with thinking) for a source of about 1024x1024 (Gemini counts such
# an image as about 1,100 input tokens; an output image up to 1024x1024 as 1,290), seconds per call.
ASSUMED_ACCEPT_RATE = 0.5  # a round's edit accepted, independently of the others
ASSUMED_TOKENS = {"writer": (2_000, 900), "editor": (1_400, 1_300), "judge": (3_100, 1_150)}
ASSUMED_SECONDS = {"writer": 15.0, "editor": 12.0, "judge": 20.0}
ASSUMED_BATCH_JOB_SECONDS = (300.0, 1_800.0, 86_400.0)  # low, expected, high: one Batch API job's turnaround


@dataclass(frozen=True)
class TaskSample:
    """One task's figures: per role in ROLES order."""

    direction: str
    rounds: int
    calls: tuple[int, int, int]
    input_tokens: tuple[int, int, int]
    output_tokens: tuple[int, int, int]
    seconds: float  # the rounds' wall time, added up
    accepted: bool
    weight: float = 1.0  # assumed samples: the probability of this outcome


def _sample(direction: str, rounds: list[dict], accepted: bool, fill: dict) -> TaskSample:
    calls, inputs, outputs = [0, 0, 0], [0, 0, 0], [0, 0, 0]
    seconds = 0.0
    for raw in rounds:
        for role, tokens, n in round_steps(raw):
            i = ROLES.index(role)
            tokens = tokens if tokens is not None else fill[role]  # an older run kept no editor usage
            calls[i] += n
            inputs[i] += tokens[0]
            outputs[i] += tokens[1]
        value = raw.get("seconds")
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0:
            seconds += float(value)
    return TaskSample(direction, len(rounds), tuple(calls), tuple(inputs), tuple(outputs), seconds, accepted)


@dataclass(frozen=True)
class Pilot:
    """A finished run read as samples: its tasks, the backends and max rounds it recorded, and what was
    filled in (roles whose usage it did not record, taken from the assumptions)."""

    run_dir: Path
    samples: list[TaskSample]
    backends: dict
    max_rounds: int | None
    filled: tuple[str, ...]
    statuses: dict


def finished_records(run_dir: Path) -> dict[str, dict]:
    """uid -> the last task record of the run directory's journal (none for a directory not made yet)."""
    records = {}
    for entry in read_journal(layout.inside(Path(run_dir), layout.JOURNAL, named_by=f"the run directory {run_dir}")):
        if isinstance(entry, dict) and entry.get("type") == "task" and isinstance(entry.get("record"), dict):
            records[str(entry.get("uid"))] = entry["record"]
    return records


def pilot_samples(run_dir: Path, max_rounds: int) -> Pilot:
    """Each finished task of the run in `run_dir` (its journal's last record per task) as a sample cut at
    `max_rounds` rounds. ValueError when the folder is no run, or has no finished task."""
    run_dir = Path(run_dir)
    config = schema.read_run_config(run_dir)
    if config is None:
        raise UsageError(f"--pilot {run_dir}: not a medbanana run directory (no {layout.RUN_CONFIG})")
    records = finished_records(run_dir)
    if not records:
        raise UsageError(f"--pilot {run_dir}: no finished task in its journal yet; let the pilot run finish some")
    measured = {role: [] for role in ROLES}
    for record in records.values():
        for raw in rounds_of(record):
            for role, tokens, _ in round_steps(raw):
                if tokens is not None:
                    measured[role].append(tokens)
    fill, filled = {}, []
    for role in ROLES:
        seen = measured[role]
        if seen:
            fill[role] = (sum(t[0] for t in seen) // len(seen), sum(t[1] for t in seen) // len(seen))
        else:
            fill[role] = ASSUMED_TOKENS[role]
            filled.append(role)
    samples, statuses = [], {}
    for record in records.values():
        status = str(record.get("status"))
        statuses[status] = statuses.get(status, 0) + 1
        rounds = rounds_of(record)[:max_rounds]
        accepted = any(r.get("accepted") is True for r in rounds)
        samples.append(_sample(str(record.get("task") or ""), rounds, accepted, fill))
    recorded = config.get("max_rounds")
    return Pilot(run_dir, samples, config.get("backends") if isinstance(config.get("backends"), dict) else {},
                 recorded if isinstance(recorded, int) and not isinstance(recorded, bool) else None,
                 tuple(filled), statuses)


def assumed_samples(max_rounds: int, accept_rate: float = ASSUMED_ACCEPT_RATE) -> list[TaskSample]:
    """The outcomes of a task under the assumptions, weighted by their probability: accepted in round k for
    k = 1..max_rounds, or rejected max_rounds times."""
    per_round = {role: {"usage": {"input_tokens": i, "output_tokens": o}} for role, (i, o) in ASSUMED_TOKENS.items()}
    raw = {"usage": {role: v["usage"] for role, v in per_round.items()}, "verification": {},
           "seconds": sum(ASSUMED_SECONDS.values())}
    out = []
    for k in range(1, max_rounds + 1):
        p = (1 - accept_rate) ** (k - 1) * accept_rate
        out.append(_weighted(_sample("", [raw] * k, True, {}), p))
    out.append(_weighted(_sample("", [raw] * max_rounds, False, {}), (1 - accept_rate) ** max_rounds))
    return out


def _weighted(sample: TaskSample, weight: float) -> TaskSample:
    return TaskSample(sample.direction, sample.rounds, sample.calls, sample.input_tokens, sample.output_tokens,
                      sample.seconds, sample.accepted, weight)


def step_tokens(samples: list[TaskSample]) -> dict[str, tuple[float, float]]:
    """Mean (input, output) tokens per call of each role over samples (weighted)."""
    out = {}
    for i, role in enumerate(ROLES):
        calls = sum(s.calls[i] * s.weight for s in samples)
        out[role] = ((sum(s.input_tokens[i] * s.weight for s in samples) / calls,
                      sum(s.output_tokens[i] * s.weight for s in samples) / calls) if calls else ASSUMED_TOKENS[role])
    return out

