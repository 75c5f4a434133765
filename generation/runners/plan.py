"""`medbanana plan`: what a run will cost and how long it will take, before it starts.

Every figure is (expected, low, high). With a pilot (pilot.py) the expected value is the pilot's mean per task
times the planned tasks, and the interval a 90 % prediction interval: a Bayesian bootstrap over the pilot's tasks
plus one pseudo-task spread over every possible number of rounds (so it widens when the pilot is small, and a
pilot that saw no slow task cannot rule one out), each replicate then drawing the planned number of tasks from it,
within each direction when the pilot has at least MIN_STRATUM tasks of each (add and remove differ). Without one
the figures follow the documented assumptions, and the interval is the least and most
a run can make under them: every task accepted in round 1, every task running all its rounds.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from ..costs import ROLES
from ..pricing import PriceTable
from ..records import DEFAULT_CONCURRENCY, DEFAULT_MAX_ROUNDS, Task
from .pilot import (ASSUMED_ACCEPT_RATE, ASSUMED_BATCH_JOB_SECONDS, ASSUMED_SECONDS, ASSUMED_TOKENS, Pilot,
                    TaskSample, assumed_samples)

LEVEL = 0.90
REPLICATES = 2000
MIN_STRATUM = 5
EXACT_DRAWS = 200  # up to this many planned tasks per stratum, each replicate draws them one by one
PRIOR_TASKS = 1.0  # the weight, in pilot tasks, of the pseudo-task spread over every possible number of rounds
JOBS_PER_ROUND = 3  # --batch: the writer, editor and judge calls of a round go out as one job each

# columns of a sample's figures
ROUNDS, CALLS, INPUT, OUTPUT, SECONDS, USD = 0, 1, 4, 7, 10, 11
WIDTH = 14


@dataclass(frozen=True)
class PlanSetting:
    """What the plan is for: each role's backend and model (role -> {"backend", "model"}), prices, and how the run
    would go."""

    backends: dict
    prices: PriceTable
    max_rounds: int = DEFAULT_MAX_ROUNDS
    batch: bool = False
    concurrency: int = DEFAULT_CONCURRENCY
    rpm: float | None = None
    tpm: float | None = None


@dataclass
class Plan:
    tasks: int
    kinds: list[dict]
    basis: str  # "pilot" | "assumptions"
    figures: dict  # name -> (expected, low, high)
    unpriced: list[str]
    setting: PlanSetting
    limited_by: str = ""
    notes: list[str] = field(default_factory=list)
    basis_detail: dict = field(default_factory=dict)

    def interval(self, name: str) -> dict:
        expected, low, high = self.figures[name]
        return {"expected": expected, "low": low, "high": high}

    def models(self) -> dict[str, list[str]]:
        """model -> the roles it plays."""
        out: dict[str, list[str]] = {}
        for role in ROLES:
            out.setdefault(_model(self.setting.backends, role), []).append(role)
        return out


def _model(backends: dict, role: str) -> str:
    made = backends.get(role) if isinstance(backends.get(role), dict) else {}
    return str(made.get("model") or made.get("backend") or "?")


def _backend(backends: dict, role: str) -> str:
    made = backends.get(role) if isinstance(backends.get(role), dict) else {}
    return str(made.get("backend") or "")


def _figures(sample: TaskSample, setting: PlanSetting) -> tuple[np.ndarray, set[str]]:
    """A sample's row of figures, and the models it used that have no price."""
    row = np.zeros(WIDTH)
    unpriced = set()
    row[ROUNDS], row[SECONDS] = sample.rounds, sample.seconds
    for i, role in enumerate(ROLES):
        row[CALLS + i], row[INPUT + i], row[OUTPUT + i] = sample.calls[i], sample.input_tokens[i], sample.output_tokens[i]
        usage = {"input_tokens": sample.input_tokens[i], "output_tokens": sample.output_tokens[i]}
        usd = 0.0 if not any(usage.values()) else setting.prices.cost(
            _backend(setting.backends, role), _model(setting.backends, role), usage, calls=max(sample.calls[i], 1),
            batch=setting.batch)
        if usd is None:
            unpriced.add(_model(setting.backends, role))
        row[USD + i] = usd or 0.0
    return row, unpriced


def estimate(tasks: list[Task], setting: PlanSetting, pilot: Pilot | None = None, seed: int = 0) -> Plan:
    """The plan for running `tasks`: from the pilot's samples, or from the assumptions."""
    kinds = Counter((t.dataset, t.direction, t.disease) for t in tasks)
    n_tasks = len(tasks)
    notes: list[str] = []
    if pilot is not None:
        samples = pilot.samples
        rows, unpriced = _rows(samples, setting)
        totals, expected, limits = _bootstrap(tasks, samples, rows, seed, setting.max_rounds)
        basis, detail = "pilot", _pilot_detail(pilot, setting, notes)
        passes = max(s.rounds for s in samples)
    else:
        samples = assumed_samples(setting.max_rounds)
        rows, unpriced = _rows(samples, setting)
        weights = np.array([s.weight for s in samples])
        expected = n_tasks * (weights @ rows)
        totals = n_tasks * np.stack([rows.min(axis=0), rows.max(axis=0)])  # the bounds
        limits = None
        basis, detail = "assumptions", _assumptions(setting)
        passes = setting.max_rounds
    figures = {}
    for i, role in enumerate(ROLES):
        figures[f"calls.{role}"] = _triple(expected[CALLS + i], totals[:, CALLS + i], limits)
    figures["calls"] = _triple(expected[CALLS:CALLS + 3].sum(), totals[:, CALLS:CALLS + 3].sum(axis=1), limits)
    figures["rounds"] = _triple(expected[ROUNDS], totals[:, ROUNDS], limits)
    plan_models = {}
    for i, role in enumerate(ROLES):
        plan_models.setdefault(_model(setting.backends, role), []).append(i)
    for model, idx in plan_models.items():
        for name, column in (("input", INPUT), ("output", OUTPUT), ("usd", USD)):
            cols = [column + i for i in idx]
            figures[f"{name}.{model}"] = _triple(expected[cols].sum(), totals[:, cols].sum(axis=1), limits)
    figures["usd"] = _triple(expected[USD:USD + 3].sum(), totals[:, USD:USD + 3].sum(axis=1), limits)
    seconds, limited_by = _wall_time(n_tasks, expected, totals, limits, setting, plan_models, passes)
    figures["seconds"] = seconds
    kinds_list = [{"dataset": d, "direction": r, "disease": s, "tasks": n} for (d, r, s), n in sorted(kinds.items())]
    return Plan(n_tasks, kinds_list, basis, figures, sorted(unpriced), setting, limited_by, notes, detail)


def _rows(samples: list[TaskSample], setting: PlanSetting) -> tuple[np.ndarray, set[str]]:
    rows, unpriced = [], set()
    for sample in samples:
        row, missing = _figures(sample, setting)
        rows.append(row)
        unpriced |= missing
    return np.array(rows).reshape(len(rows), WIDTH), unpriced


def _triple(expected: float, draws: np.ndarray, limits) -> tuple[float, float, float]:
    """(expected, low, high): the draws' quantiles (a bootstrap), or, without limits, their min and max (bounds)."""
    if limits is None:
        return float(expected), float(draws.min()), float(draws.max())
    low, high = np.quantile(draws, limits)
    return float(expected), float(min(low, expected)), float(max(high, expected))


def _bootstrap(tasks: list[Task], samples: list[TaskSample], rows: np.ndarray, seed: int, max_rounds: int):
    """(replicate totals, expected totals, quantile levels): strata by direction when every planned direction has
    MIN_STRATUM pilot tasks, else one. The expected totals are the planned tasks times the pilot's means. Each
    replicate weighs the stratum's pilot tasks by a Bayesian bootstrap (Dirichlet(1, ..., 1) weights) together with
    PRIOR_TASKS pseudo-task spread over every number of rounds a task can take (`_prior_atoms`), so that a small or
    uniform pilot cannot rule out the outcomes it happened not to see; then it draws the planned tasks from that
    weighted pilot (one by one up to EXACT_DRAWS, else by the normal approximation of their sum)."""
    rng = np.random.default_rng(seed)
    planned = Counter(t.direction for t in tasks)
    by_direction = {d: [i for i, s in enumerate(samples) if s.direction == d] for d in planned}
    if not all(len(ix) >= MIN_STRATUM for ix in by_direction.values()):
        by_direction = {"": list(range(len(samples)))}
        planned = Counter({"": len(tasks)})
    totals = np.zeros((REPLICATES, WIDTH))
    expected = np.zeros(WIDTH)
    for direction, index in by_direction.items():
        x, count = rows[index], planned[direction]
        expected += count * x.mean(axis=0)
        if count == 0:
            continue
        atoms = np.vstack([x, _prior_atoms(x, max_rounds)])
        shapes = np.r_[np.ones(len(x)), np.full(len(atoms) - len(x), PRIOR_TASKS / (len(atoms) - len(x)))]
        weights = rng.gamma(shapes, size=(REPLICATES, len(atoms)))
        weights /= weights.sum(axis=1, keepdims=True)
        if count <= EXACT_DRAWS:
            cumulative = np.cumsum(weights, axis=1)
            picks = np.stack([np.searchsorted(cumulative[b], rng.random(count) * cumulative[b, -1])
                              for b in range(REPLICATES)])
            totals += atoms[np.minimum(picks, len(atoms) - 1)].sum(axis=1)
        else:
            mean = weights @ atoms
            spread = np.sqrt(np.maximum(weights @ atoms ** 2 - mean ** 2, 0))
            totals += count * mean + math.sqrt(count) * spread * rng.standard_normal((REPLICATES, 1))
    totals = np.maximum(totals, 0)
    return totals, expected, [(1 - LEVEL) / 2, (1 + LEVEL) / 2]


def _prior_atoms(x: np.ndarray, max_rounds: int) -> np.ndarray:
    """A task of k rounds for k = 1..max_rounds, each round at the pilot's mean figures per round."""
    per_round = x.sum(axis=0) / max(x[:, ROUNDS].sum(), 1)
    return np.stack([k * per_round for k in range(1, max_rounds + 1)])


def _wall_time(n_tasks: int, expected, totals, limits, setting: PlanSetting, models: dict, passes: int):
    """Seconds from start to end: the rounds' work spread over the tasks in flight, or the --rpm / --tpm limits
    of the busiest model, whichever is slower; with --batch, one job per role per round pass (assumed
    turnaround). Returns the (expected, low, high) seconds and what limits them."""
    if setting.batch:
        low, exp, high = (passes * JOBS_PER_ROUND * s for s in ASSUMED_BATCH_JOB_SECONDS)
        return (exp, low, high), f"Batch API turnaround (assumed {ASSUMED_BATCH_JOB_SECONDS[1] / 60:.0f} min a job)"
    in_flight = max(1, min(setting.concurrency, n_tasks))

    def wall(figures: np.ndarray) -> tuple[np.ndarray, list[str]]:
        figures = np.atleast_2d(figures)
        candidates = [("the calls' latency at --concurrency %d" % setting.concurrency, figures[:, SECONDS] / in_flight)]
        for model, idx in models.items():
            if setting.rpm:
                calls = figures[:, [CALLS + i for i in idx]].sum(axis=1)
                candidates.append((f"--rpm {setting.rpm:g} on {model}", calls / setting.rpm * 60))
            if setting.tpm:
                tokens = figures[:, [INPUT + i for i in idx] + [OUTPUT + i for i in idx]].sum(axis=1)
                candidates.append((f"--tpm {setting.tpm:g} on {model}", tokens / setting.tpm * 60))
        stacked = np.stack([c[1] for c in candidates])
        return stacked.max(axis=0), [candidates[i][0] for i in stacked.argmax(axis=0)]

    expected_wall, why = wall(expected)
    draws, _ = wall(totals)
    return _triple(expected_wall[0], draws, limits), why[0]


def _assumptions(setting: PlanSetting) -> dict:
    return {"accept_rate_per_round": ASSUMED_ACCEPT_RATE,
            "tokens_per_call": {r: {"input": i, "output": o} for r, (i, o) in ASSUMED_TOKENS.items()},
            "seconds_per_call": dict(ASSUMED_SECONDS), "max_rounds": setting.max_rounds,
            "interval": "bounds: every task accepted in round 1 .. every task running all its rounds"}


def _pilot_detail(pilot: Pilot, setting: PlanSetting, notes: list[str]) -> dict:
    n = len(pilot.samples)
    rounds = Counter(s.rounds for s in pilot.samples if s.accepted)
    if pilot.max_rounds is not None and pilot.max_rounds < setting.max_rounds:
        notes.append(f"the pilot ran at most {pilot.max_rounds} rounds a task, the plan {setting.max_rounds}: "
                     "tasks it failed would have taken more rounds")
    for role in ROLES:
        was, now = _model(pilot.backends, role), _model(setting.backends, role)
        if pilot.backends.get(role) and was != now:
            notes.append(f"the pilot's {role} was {was}, the plan's is {now}: its tokens are taken as they are")
    if pilot.filled:
        notes.append(f"the pilot recorded no usage for {', '.join(pilot.filled)}: assumed "
                     + ", ".join(f"{ASSUMED_TOKENS[r][0]:,} in / {ASSUMED_TOKENS[r][1]:,} out tokens a {r} call"
                                 for r in pilot.filled))
    if n < 30:
        notes.append(f"the pilot has {n} finished tasks: the interval is wide; 30 or more make it useful")
    return {"run": str(pilot.run_dir), "tasks": n, "statuses": pilot.statuses,
            "success_rounds": {str(k): v for k, v in sorted(rounds.items())},
            "interval": f"{LEVEL:.0%} prediction interval: a Bayesian bootstrap over the pilot's tasks ({REPLICATES} "
                        f"replicates, with {PRIOR_TASKS:g} pseudo-task over every possible number of rounds)"}


def destinations(spec, backends: dict, tasks, sources) -> list[dict]:
    """Where the run's requests would go (generation/destinations.py: each destination's host or model path and
    class), each with the models and roles it serves, the data-use classes of the tasks' sources sent there (from
    the sources' manifest), and `refused`: why the gate would stop the run, when it would."""
    from ..destinations import DestinationRefused, classes_of, destinations as places_of, gate, sources_data_use

    places = places_of(spec.roles, gemini=spec.gemini, openai=spec.openai, diffusers=spec.diffusers)
    classes = classes_of({task.dataset for task in tasks}, sources_data_use(sources))
    out = []
    for place in places:
        entry = place.to_json(classes)
        models: dict[str, list[str]] = {}
        for role in place.roles:
            models.setdefault(_model(backends, role), []).append(role)
        entry["models"] = [{"model": m, "roles": r} for m, r in models.items()]
        try:
            entry["warnings"] = gate([place], classes, "plan")
        except DestinationRefused as exc:
            entry["refused"] = str(exc)
        out.append(entry)
    return out
