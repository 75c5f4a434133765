"""The review report's statistics: small pure functions over labels, each None where it is undefined.

A *unit* is what a rater labels once (a review item); its labels are the answers it got, one per rater. Percent
agreement is the share of agreeing rater pairs within a unit, averaged over units with two labels or more (Fleiss'
P-bar; for two raters, the share of units they agree on). Cohen's kappa (two raters) is evaluation/agreement.py's;
Fleiss' kappa takes an items x categories count table with the same number of raters per item; Krippendorff's alpha
(nominal, missing labels allowed) is the `krippendorff` package's. Intervals are percentile bootstraps over units,
seeded. AUROC (Mann-Whitney, ties counted half) is evaluation/probe_statistics.py's.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Hashable, Sequence

from ..generation.extras import require

__all__ = ["bootstrap_interval", "category_counts", "edited_probability", "fleiss_kappa", "krippendorff_alpha",
           "majority", "pair_agreement", "percent_agreement", "reliability_matrix"]

MIN_UNITS_FOR_INTERVAL = 5  # fewer units than this give a bootstrap "interval" that means nothing


def majority(labels: Sequence[Hashable]) -> Hashable | None:
    """The most frequent label; None for no labels or a tie for first place.

    >>> majority([True, True, False]), majority([True, False]), majority([])
    (True, None, None)
    """
    ranked = Counter(labels).most_common(2)
    if not ranked or (len(ranked) == 2 and ranked[0][1] == ranked[1][1]):
        return None
    return ranked[0][0]


def pair_agreement(labels: Sequence[Hashable]) -> float | None:
    """Share of agreeing pairs among one unit's labels; None for fewer than two labels.

    >>> pair_agreement([1, 1, 0]), pair_agreement([1])
    (0.3333333333333333, None)
    """
    n = len(labels)
    if n < 2:
        return None
    return sum(c * (c - 1) for c in Counter(labels).values()) / (n * (n - 1))


def percent_agreement(units: Sequence[Sequence[Hashable]]) -> float | None:
    """pair_agreement averaged over the units with two labels or more; None when there is none.

    >>> percent_agreement([[1, 1], [1, 0], [0, 0, 0], [1]])  # 1, 0, 1 (the single label is left out)
    0.6666666666666666
    >>> percent_agreement([[1], []]) is None
    True
    """
    shares = [share for labels in units if (share := pair_agreement(labels)) is not None]
    return sum(shares) / len(shares) if shares else None


def category_counts(units: Sequence[Sequence[Hashable]], categories: Sequence[Hashable]) -> list[list[int]]:
    """The items x categories table Fleiss' kappa reads: how many raters gave each category to each unit.

    >>> category_counts([[True, True, False], [False, False, False]], [True, False])
    [[2, 1], [0, 3]]
    """
    return [[sum(label == c for label in labels) for c in categories] for labels in units]


def fleiss_kappa(counts) -> float | None:
    """Fleiss' kappa of an items x categories count table (a list of rows or an array) whose rows all sum to the
    same number of raters n >= 2; None without rows or when chance agreement is total (one category only).
    ValueError for uneven rows.

    >>> round(fleiss_kappa([[2, 0], [0, 2], [1, 1], [2, 0]]), 4)  # P-bar 0.75, p = (5/8, 3/8)
    0.4667
    """
    import numpy as np

    counts = np.asarray(counts, dtype=float)
    if counts.ndim != 2 or not len(counts):
        return None
    totals = np.unique(counts.sum(axis=1))
    if len(totals) != 1:
        raise ValueError(f"Fleiss' kappa needs the same number of raters per item, got {totals.astype(int).tolist()}")
    n = totals[0]
    if n < 2:
        return None
    shares = counts.sum(axis=0) / counts.sum()
    observed = float(((counts * counts).sum(axis=1) - n).mean() / (n * (n - 1)))
    expected = float((shares * shares).sum())
    if math.isclose(expected, 1.0):
        return None
    return (observed - expected) / (1 - expected)


def reliability_matrix(units: Sequence[Sequence[tuple[str, Hashable]]]):
    """The raters x units array `krippendorff` reads from (rater, label) pairs per unit: labels coded 0, 1, ... in
    sorted order, NaN where a rater did not label a unit.

    >>> reliability_matrix([[("a", "no"), ("b", "yes")], [("b", "no")]]).tolist()
    [[0.0, nan], [1.0, 0.0]]
    """
    import numpy as np

    values = sorted({label for labels in units for _, label in labels}, key=repr)
    raters = sorted({rater for labels in units for rater, _ in labels})
    code = {v: float(i) for i, v in enumerate(values)}
    row = {r: i for i, r in enumerate(raters)}
    data = np.full((len(raters), len(units)), np.nan)
    for column, labels in enumerate(units):
        for rater, label in labels:
            data[row[rater], column] = code[label]
    return data


def krippendorff_alpha(matrix) -> float | None:
    """Krippendorff's alpha, nominal, of a raters x units array (NaN = missing; see reliability_matrix) through the
    `krippendorff` package; None when no unit has two labels or only one label value occurs in those that do.

    >>> units = [[("a", 1), ("b", 1)], [("a", 0), ("b", 0), ("c", 0)], [("a", 1), ("c", 0)], [("b", 1)]]
    >>> krippendorff_alpha(reliability_matrix(units))
    0.5
    """
    import numpy as np

    krippendorff = require("krippendorff", needed_for="medbanana review report", extra="review")
    matrix = np.asarray(matrix, dtype=float)
    if matrix.ndim != 2:
        return None
    pairable = matrix[:, (~np.isnan(matrix)).sum(axis=0) >= 2]
    if pairable.size == 0 or len(np.unique(pairable[~np.isnan(pairable)])) < 2:
        return None
    value = float(krippendorff.alpha(reliability_data=pairable, level_of_measurement="nominal"))
    return None if math.isnan(value) else value


def bootstrap_interval(units, statistic: Callable, *, repeats: int = 2000, seed: int = 0,
                       level: float = 0.95) -> tuple[float, float] | None:
    """Percentile interval of `statistic` over `repeats` resamples of the units drawn with replacement (seeded):
    a numpy array is resampled along its first axis (fast), anything else as a list. Resamples where the statistic
    is undefined (None) are skipped. None for fewer than MIN_UNITS_FOR_INTERVAL units or when no resample gives a
    value.

    >>> import numpy as np
    >>> low, high = bootstrap_interval(np.array([0, 1] * 10), np.mean, repeats=500, seed=1)
    >>> 0.25 < low < 0.5 < high < 0.75
    True
    >>> bootstrap_interval([1, 2, 3], np.mean) is None
    True
    """
    import numpy as np

    n = len(units)
    if n < MIN_UNITS_FOR_INTERVAL or repeats < 1:
        return None
    draws = np.random.default_rng(seed).integers(0, n, size=(repeats, n))
    values = []
    for drawn in draws:
        value = statistic(units[drawn] if isinstance(units, np.ndarray) else [units[i] for i in drawn])
        if value is not None and not math.isnan(value):
            values.append(float(value))
    if not values:
        return None
    tail = 100 * (1 - level) / 2
    low, high = np.percentile(values, [tail, 100 - tail])
    return float(low), float(high)


def edited_probability(guess: str, confidence: int) -> float:
    """A realism answer as a score for AUROC: P(edited) = 0.5 +/- confidence/10 (confidence 1-5; 5 = certain).

    >>> edited_probability("edited", 5), edited_probability("real", 1)
    (1.0, 0.4)
    """
    if guess not in ("real", "edited") or not 1 <= confidence <= 5:
        raise ValueError(f"a realism answer is real/edited with confidence 1-5, not {guess!r}/{confidence!r}")
    return round(0.5 + (confidence if guess == "edited" else -confidence) / 10, 10)
