"""The statistics of generation/guarantee.py against brute force: exact enumeration where the distribution is small
(binomial tails, Clopper-Pearson coverage, the stratified bound's level, PPI's unbiasedness over every sample), and
simulation where it is not (fixed-sequence Learn-then-Test's error rate, PPI's interval coverage)."""

from __future__ import annotations

import itertools
import math
import random

import numpy as np
import pytest
from medbanana.generation.guarantee import (
    PPIStratum,
    StratumCount,
    binomial_tail,
    clopper_pearson,
    clopper_pearson_lower,
    fixed_sequence,
    labels_needed,
    min_labels,
    ppi_mean,
    precision_p_value,
    stratified_lower_bound,
    stratified_p_value,
)


def pmf(k: int, n: int, p: float) -> float:
    return math.comb(n, k) * p ** k * (1 - p) ** (n - k)


@pytest.mark.parametrize("n,p", [(1, 0.5), (12, 0.9), (40, 0.73), (7, 0.01)])
def test_binomial_tail_is_the_sum_of_its_terms(n, p):
    for k in range(-1, n + 2):
        brute = sum(pmf(j, n, p) for j in range(max(k, 0), n + 1))
        assert binomial_tail(k, n, p) == pytest.approx(brute, abs=1e-12)


@pytest.mark.parametrize("target", [0.8, 0.9])
@pytest.mark.parametrize("n", [10, 30, 75])
def test_the_precision_p_value_is_valid_under_every_null(target, n):
    """P(p <= alpha) <= alpha exactly, for every true precision at or below the target."""
    for true in (target, target - 0.05, target - 0.3):
        for alpha in (0.01, 0.05, 0.1, 0.3):
            rejected = sum(pmf(k, n, true) for k in range(n + 1) if precision_p_value(k, n, target) <= alpha)
            assert rejected <= alpha + 1e-12, (true, alpha, rejected)
    # and it has power: at precision 1 everything rejects once n is large enough
    assert precision_p_value(n, n, target) <= 0.1 or n < min_labels(target, 0.1)


@pytest.mark.parametrize("n", [5, 20, 60])
def test_clopper_pearson_covers_at_least_its_level(n):
    for p in np.linspace(0.02, 0.98, 25):
        below = sum(pmf(k, n, p) for k in range(n + 1) if clopper_pearson_lower(k, n, 0.1) <= p)
        assert below >= 0.9 - 1e-12
        low_high = [clopper_pearson(k, n, 0.95) for k in range(n + 1)]
        inside = sum(pmf(k, n, p) for k, (lo, hi) in enumerate(low_high) if lo <= p <= hi)
        assert inside >= 0.95 - 1e-12
    assert clopper_pearson_lower(n, n, 0.1) == pytest.approx(0.1 ** (1 / n))  # the closed form when all succeed


def test_the_stratified_bound_and_p_value_hold_their_level_exactly():
    """Two strata of unequal sampling rates: over every outcome (k1, k2), the bound exceeds the true weighted
    precision, and the p-value of a null at the boundary falls below alpha, with probability at most alpha."""
    weights, sizes = (0.7, 0.3), (8, 15)
    for p1, p2 in [(0.9, 0.6), (0.75, 0.95), (0.5, 0.99)]:
        true = weights[0] * p1 + weights[1] * p2
        for alpha in (0.05, 0.2):
            too_high = p_small = 0.0
            for k1, k2 in itertools.product(range(sizes[0] + 1), range(sizes[1] + 1)):
                prob = pmf(k1, sizes[0], p1) * pmf(k2, sizes[1], p2)
                strata = [StratumCount(weights[0], k1, sizes[0]), StratumCount(weights[1], k2, sizes[1])]
                too_high += prob * (stratified_lower_bound(strata, alpha) > true)
                p_small += prob * (stratified_p_value(strata, true) <= alpha)
            assert too_high <= alpha and p_small <= alpha + 1e-9, (p1, p2, alpha, too_high, p_small)
    single = [StratumCount(1.0, 17, 20)]
    assert stratified_p_value(single, 0.6) == pytest.approx(precision_p_value(17, 20, 0.6), abs=1e-9)


def test_fixed_sequence_stops_at_the_first_p_value_above_delta():
    assert fixed_sequence([], 0.1) == 0
    assert fixed_sequence([0.1, 0.1, 0.11, 0.0], 0.1) == 2
    assert fixed_sequence([0.5, 0.0], 0.1) == 0


def test_learn_then_test_over_thresholds_keeps_its_error_rate():
    """A population of score levels whose approval rate falls with the score: rules 'score >= level' from the
    strictest, p-values of the labelled accepted edits, the most lenient rule rejected chosen. The chosen rule's
    precision is below P in at most delta of the draws (simulated; the delta here has Monte-Carlo slack only)."""
    rng = np.random.default_rng(0)
    levels = np.array([1.0, 0.85, 0.8, 0.75, 0.65, 0.6, 0.4])
    counts = np.array([300, 80, 60, 60, 40, 120, 50])  # attempts per level
    approval = np.array([0.96, 0.9, 0.86, 0.8, 0.65, 0.5, 0.2])
    target, delta, labelled = 0.9, 0.1, 120  # "score >= 0.65" is just below the target: the hard case
    precision = np.cumsum(counts * approval) / np.cumsum(counts)  # of "score >= level"
    assert precision[0] > target > precision[-1]
    bad = 0
    draws = 1000
    for _ in range(draws):
        sampled = rng.multivariate_hypergeometric(counts, labelled)
        approved = rng.binomial(sampled, approval)
        n, k = np.cumsum(sampled), np.cumsum(approved)
        p_values = [precision_p_value(int(k[i]), int(n[i]), target) for i in range(len(levels))]
        chosen = fixed_sequence(p_values, delta) - 1
        bad += chosen >= 0 and precision[chosen] < target
    assert bad / draws <= delta + 3 * math.sqrt(delta * (1 - delta) / draws)
    assert bad / draws > 0.02, "the test never chose an unsafe rule: the simulation is not near the boundary"


def test_labels_needed_is_where_the_test_first_passes():
    assert labels_needed(10, 10, 0.9, 0.1) == min_labels(0.9, 0.1)
    n = labels_needed(19, 20, 0.8, 0.05)
    assert precision_p_value(math.ceil(0.95 * n), n, 0.8) <= 0.05 < precision_p_value(math.ceil(0.95 * (n - 1)), n - 1,
                                                                                      0.8)
    assert labels_needed(8, 10, 0.8, 0.1) is None  # the rate seen is not above the target
    assert labels_needed(0, 0, 0.8, 0.1) is None


def test_ppi_is_unbiased_over_every_stratified_sample():
    """Two strata (6 and 5 units, 3 and 2 labelled): the estimate averaged over all C(6,3) * C(5,2) samples is the
    true approval rate of the accepted units, whatever the judge says."""
    expert = [[1, 0, 1, 1, 0, 1], [0, 1, 1, 0, 1]]
    judge = [[1, 1, 1, 0, 0, 1], [1, 1, 0, 0, 1]]
    accepted = [[1, 1, 0, 1, 1, 0], [1, 0, 1, 1, 1]]
    n_accepted = sum(map(sum, accepted))
    truth = sum(e * a for es, as_ in zip(expert, accepted) for e, a in zip(es, as_)) / n_accepted
    judge_total = sum(j * a for js, as_ in zip(judge, accepted) for j, a in zip(js, as_))
    estimates = []
    for first, second in itertools.product(itertools.combinations(range(6), 3), itertools.combinations(range(5), 2)):
        strata = [PPIStratum(len(expert[h]), sum(accepted[h]),
                             [(expert[h][i] - judge[h][i]) * accepted[h][i] for i in chosen])
                  for h, chosen in enumerate((first, second))]
        found = ppi_mean(n_accepted, judge_total, strata)
        estimates.append(found.estimate)
    assert np.mean(estimates) == pytest.approx(truth, abs=1e-12)


def test_ppi_interval_covers_the_true_rate():
    """A judge right 90 % of the time on 1,000 units in three strata of unequal sampling rates; 95 % intervals
    cover the accepted units' true approval rate in at least 93 % of 1,000 samples."""
    rng = random.Random(1)
    sizes, labelled = (500, 300, 200), (40, 15, 30)
    units = []
    for h, size in enumerate(sizes):
        for _ in range(size):
            expert = rng.random() < (0.8, 0.6, 0.9)[h]
            judge = expert if rng.random() < 0.9 else not expert
            units.append((h, expert, judge, judge or rng.random() < 0.1))  # accepted: mostly what the judge passes
    accepted = [u for u in units if u[3]]
    truth = sum(u[1] for u in accepted) / len(accepted)
    judge_total = sum(u[2] for u in accepted)
    by_stratum = [[u for u in units if u[0] == h] for h in range(3)]
    covered = 0
    reps = 1000
    for _ in range(reps):
        strata = [PPIStratum(sizes[h], sum(u[3] for u in by_stratum[h]),
                             [(u[1] - u[2]) * u[3] for u in rng.sample(by_stratum[h], labelled[h])])
                  for h in range(3)]
        found = ppi_mean(len(accepted), judge_total, strata)
        covered += found.low <= truth <= found.high
    assert covered / reps >= 0.93, covered / reps


def test_ppi_needs_labels_where_there_are_accepted_units():
    assert ppi_mean(10, 8, [PPIStratum(20, 10, [0.0])]) is None
    assert ppi_mean(0, 0, [PPIStratum(20, 0, [])]) is None
    census = ppi_mean(3, 2, [PPIStratum(3, 3, [0.0, 1.0, 0.0])])  # every unit labelled: no sampling error
    assert census.estimate == 1.0 and census.low == census.high == 1.0
