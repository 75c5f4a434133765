"""The statistics of a stated guarantee: small pure functions, exact where a bound is claimed.

* **Learn-then-Test** (Angelopoulos, Bates, Candès, Jordan, Lei, 2021) with fixed-sequence testing: candidate
  acceptance rules are tested in an order fixed before the expert labels are read (strictest first); the null
  hypothesis of each is "the expert precision of what it accepts is below the target P". Its p-value is the exact
  binomial tail P(Bin(n, P) >= k) for k of n labelled accepted edits approved (`precision_p_value`), or, for labels
  drawn with unequal probabilities across strata, the level at which a Bonferroni combination of per-stratum
  Clopper-Pearson bounds reaches P (`stratified_p_value`). Testing stops at the first p-value above delta; every
  rule rejected before is safe together with probability at least 1 - delta (`fixed_sequence`).
* **Prediction-powered inference** (Angelopoulos, Bates, Fannjiang, Jordan, Zrnic, 2023) for a mean: the judge's
  label on every unit, plus a rectifier (expert label - judge label) estimated on the labelled sample, weighted by
  the inverse of each stratum's sampling fraction (Horvitz-Thompson), with the stratified variance and its finite
  population correction (`ppi_mean`).

`medbanana calibrate` (review/calibrate.py) uses the tests, the build's card (builder/acceptance.py) the interval;
tests/generation/test_guarantee.py checks them against brute force and simulation.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

NORMAL_975 = 1.959963984540054  # the standard normal's 97.5 % quantile: two-sided 95 % intervals
# ppi_mean's variance floor: half an observation at each extreme of the rectifier. Without it a stratum whose labels
# all agree with the judge has no spread, and the interval collapses (bench/bench_calibration.py: 41-90 % coverage of
# the run's own acceptance without, 97-100 % with it, intervals about 15 % wider)
PSEUDO = 0.5


def binomial_tail(k: int, n: int, p: float) -> float:
    """P(X >= k) for X ~ Binomial(n, p), exact.

    >>> binomial_tail(3, 3, 0.5), binomial_tail(0, 5, 0.3), binomial_tail(6, 5, 0.3)
    (0.125, 1.0, 0.0)
    """
    if k <= 0:
        return 1.0
    if k > n:
        return 0.0
    from scipy.stats import binom

    return float(binom.sf(k - 1, n, p))


def precision_p_value(approved: int, labelled: int, target: float) -> float:
    """The p-value of "precision < target" after `approved` of `labelled` accepted edits drawn at random were
    approved: P(Bin(labelled, target) >= approved), at most alpha with probability at most alpha when the
    precision is below the target (the binomial tail grows with p).

    >>> round(precision_p_value(20, 20, 0.9), 4)  # 0.9 ** 20
    0.1216
    """
    return binomial_tail(approved, labelled, target)


def min_labels(target: float, delta: float) -> int:
    """The fewest labelled accepted edits that can pass the test at all (every one approved): target^n <= delta.

    >>> min_labels(0.9, 0.1), min_labels(0.8, 0.05)
    (22, 14)
    """
    return max(1, math.ceil(math.log(delta) / math.log(target) - 1e-12))


def clopper_pearson_lower(k: int, n: int, alpha: float) -> float:
    """The one-sided (1 - alpha) Clopper-Pearson lower bound of a proportion after k successes in n (0 for k = 0):
    the p at which P(Bin(n, p) >= k) = alpha.

    >>> round(clopper_pearson_lower(20, 20, 0.1), 4)  # 0.1 ** (1 / 20)
    0.8913
    """
    if n <= 0 or k <= 0:
        return 0.0
    if alpha >= 1:
        return 1.0
    from scipy.stats import beta

    return float(beta.ppf(alpha, k, n - k + 1))


def clopper_pearson(k: int, n: int, level: float = 0.95) -> tuple[float, float]:
    """The two-sided Clopper-Pearson interval of a proportion (0, 1 for n = 0).

    >>> [round(x, 4) for x in clopper_pearson(0, 10)]
    [0.0, 0.3085]
    """
    if n <= 0:
        return 0.0, 1.0
    from scipy.stats import beta

    tail = (1 - level) / 2
    low = 0.0 if k == 0 else float(beta.ppf(tail, k, n - k + 1))
    high = 1.0 if k == n else float(beta.ppf(1 - tail, k + 1, n - k))
    return low, high


@dataclass(frozen=True)
class StratumCount:
    """One sampling stratum's part of an accepted set: its share of the accepted edits (known exactly, from the
    judge's verdicts on all of them) and how many of its labelled accepted edits the experts approved."""

    weight: float
    approved: int
    labelled: int


def stratified_lower_bound(strata: Sequence[StratumCount], alpha: float) -> float:
    """A (1 - alpha) lower bound of the precision sum_h weight_h * p_h: each stratum's Clopper-Pearson bound at
    alpha / H (H strata of positive weight; Bonferroni), weighted. A stratum without labels contributes 0.

    >>> stratified_lower_bound([StratumCount(1.0, 20, 20)], 0.1) == clopper_pearson_lower(20, 20, 0.1)
    True
    """
    live = [s for s in strata if s.weight > 0]
    if not live:
        return 0.0
    return sum(s.weight * clopper_pearson_lower(s.approved, s.labelled, alpha / len(live)) for s in live)


def stratified_p_value(strata: Sequence[StratumCount], target: float) -> float:
    """The smallest alpha at which `stratified_lower_bound` reaches `target` (1 when none does): at most alpha with
    probability at most alpha when the precision is below the target. Bisection, rounded up.

    >>> one = [StratumCount(1.0, 18, 20)]
    >>> abs(stratified_p_value(one, 0.7) - precision_p_value(18, 20, 0.7)) < 1e-6
    True
    """
    if stratified_lower_bound(strata, 1.0) < target:
        return 1.0
    low, high = 0.0, 1.0
    for _ in range(50):
        middle = (low + high) / 2
        if stratified_lower_bound(strata, middle) >= target:
            high = middle
        else:
            low = middle
    return high


def fixed_sequence(p_values: Sequence[float], delta: float) -> int:
    """How many hypotheses, tested in the order given, are rejected at level `delta`: testing stops at the first
    p-value above it. The family-wise error rate is at most delta whatever the order, if the order is fixed before
    the data that give the p-values.

    >>> fixed_sequence([0.01, 0.04, 0.2, 0.01], 0.05)
    2
    """
    rejected = 0
    for p in p_values:
        if p > delta:
            break
        rejected += 1
    return rejected


def labels_needed(approved: int, labelled: int, target: float, delta: float, limit: int = 1_000_000) -> int | None:
    """The labelled accepted edits at which the approval rate seen so far (approved / labelled) would pass the test
    at `delta`; None when that rate is not above the target (more labels alone would not help) or when more than
    `limit` would be needed.

    >>> labels_needed(10, 10, 0.9, 0.1)  # all approved: min_labels
    22
    >>> labels_needed(8, 10, 0.9, 0.1) is None
    True
    """
    if labelled <= 0 or approved / labelled <= target:
        return None
    rate = approved / labelled

    def passes(n: int) -> bool:
        return precision_p_value(math.ceil(rate * n - 1e-9), n, target) <= delta

    high = max(1, labelled)
    while not passes(high):
        if high > limit:
            return None
        high *= 2
    low = 0
    while high - low > 1:  # the tail at a fixed rate falls with n (up to the rounding of rate * n)
        middle = (low + high) // 2
        low, high = (low, middle) if passes(middle) else (middle, high)
    return high


@dataclass(frozen=True)
class PPIStratum:
    """One sampling stratum: `size` units in all (N_h), `accepted` of them in the set whose mean is wanted, and the
    rectifier of each labelled unit: expert label - judge label inside the set, 0 outside it."""

    size: int
    accepted: int
    rectifiers: Sequence[float]


@dataclass(frozen=True)
class Interval:
    estimate: float
    low: float
    high: float
    standard_error: float
    labels: int  # labelled units of the strata


def ppi_mean(accepted: int, judge_total: float, strata: Sequence[PPIStratum], level: float = 0.95,
             pseudo: float = PSEUDO) -> Interval | None:
    """The prediction-powered estimate of the share of `accepted` units an expert approves, with its interval:

        theta = (judge_total + sum_h N_h * mean_h(rectifier)) / accepted
        var   = sum_h N_h^2 (1 - m_h / N_h) s_h^2 / m_h / accepted^2

    `judge_total` is the judge's labels summed over all accepted units; each stratum's labelled units are a simple
    random sample of it (m_h of N_h). The rectifier mean is unbiased for the judge's error in the stratum, so the
    estimate is unbiased whatever the judge's quality; a better judge only narrows the interval. s_h^2 is taken
    over the sample with `pseudo` extra observations at -1 and +1 (the rectifier's extremes; a floor, so that a
    sample with no disagreement at all gives an interval, not a point; they do not move the estimate). None when a stratum holding accepted units
    has fewer than two labels (its error could not be estimated).

    >>> s = PPIStratum(size=100, accepted=50, rectifiers=[0.0] * 18 + [-1.0, 1.0])
    >>> r = ppi_mean(50, 40, [s])
    >>> r.estimate, r.low < 0.8 < r.high
    (0.8, True)
    """
    if accepted <= 0:
        return None
    total, variance, labels = float(judge_total), 0.0, 0
    for stratum in strata:
        m = len(stratum.rectifiers)
        labels += m
        if stratum.accepted and m < 2:
            return None
        if not m:
            continue
        mean = sum(stratum.rectifiers) / m
        total += stratum.size * mean
        squares = sum((d - mean) ** 2 for d in stratum.rectifiers) + pseudo * ((1 - mean) ** 2 + (1 + mean) ** 2)
        spread = squares / (m - 1 + 2 * pseudo)
        variance += stratum.size ** 2 * max(0.0, 1 - m / stratum.size) * spread / m
    from scipy.stats import norm

    estimate = total / accepted
    error = math.sqrt(variance) / accepted
    z = NORMAL_975 if level == 0.95 else float(norm.ppf(0.5 + level / 2))
    return Interval(estimate, max(0.0, estimate - z * error), min(1.0, estimate + z * error), error, labels)
