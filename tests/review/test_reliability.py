"""review/reliability.py: Fleiss' kappa on the textbook table, alpha against the krippendorff package, the
bootstrap's reproducibility, AUROC with ties, and the module's doctests."""

import doctest
import itertools

import krippendorff
import numpy as np
import pytest
from medbanana.review import reliability
from medbanana.evaluation.probe_statistics import auroc
from medbanana.review.reliability import (
    bootstrap_interval,
    category_counts,
    edited_probability,
    fleiss_kappa,
    krippendorff_alpha,
    majority,
    percent_agreement,
    reliability_matrix,
)

# Fleiss (1971)'s worked example as given in Wikipedia's "Fleiss' kappa" article: 10 subjects, 14 raters each,
# 5 categories; published P-bar = 0.378, P_e = 0.213, kappa = 0.210.
FLEISS_TABLE = [[0, 0, 0, 0, 14], [0, 2, 6, 4, 2], [0, 0, 3, 5, 6], [0, 3, 9, 2, 0], [2, 2, 8, 1, 1],
                [7, 7, 0, 0, 0], [3, 2, 6, 3, 0], [2, 5, 3, 2, 2], [6, 5, 2, 1, 0], [0, 2, 2, 3, 7]]


def test_doctests_pass():
    result = doctest.testmod(reliability)
    assert result.attempted >= 8 and result.failed == 0


def test_fleiss_kappa_on_the_textbook_table():
    kappa = fleiss_kappa(FLEISS_TABLE)
    assert kappa == pytest.approx(0.210, abs=5e-4)  # the published value
    # and by the definition, computed here from the table with plain loops: mean pairwise agreement per subject
    # against the agreement expected from the category shares
    n, subjects = 14, len(FLEISS_TABLE)
    p_bar = sum(sum(c * (c - 1) for c in row) / (n * (n - 1)) for row in FLEISS_TABLE) / subjects
    p_e = sum((sum(row[j] for row in FLEISS_TABLE) / (subjects * n)) ** 2 for j in range(5))
    assert (round(p_bar, 3), round(p_e, 3)) == (0.378, 0.213)
    assert kappa == pytest.approx((p_bar - p_e) / (1 - p_e))


def test_fleiss_kappa_edge_cases():
    assert fleiss_kappa([[3, 0], [3, 0]]) is None  # one category only: chance agreement is total
    assert fleiss_kappa([]) is None and fleiss_kappa([[1, 0], [0, 1]]) is None  # no rows / one rater per item
    with pytest.raises(ValueError, match="same number of raters"):
        fleiss_kappa([[2, 0], [1, 2]])
    assert fleiss_kappa([[2, 0], [0, 2]]) == pytest.approx(1.0)
    assert category_counts([["y", "y", "n"]], ["y", "n"]) == [[2, 1]]


def test_alpha_is_the_krippendorff_package_on_the_same_data():
    # four raters, six units, some labels missing; built here as the package's raters x units array by hand
    table = {"ann": [1, 0, 1, None, 1, 0], "ben": [1, 0, 0, 1, 1, None], "cy": [None, 0, 1, 1, 0, 0],
             "dee": [1, None, None, 1, 1, 1]}
    data = np.array([[np.nan if v is None else v for v in row] for row in table.values()], dtype=float)
    expected = krippendorff.alpha(reliability_data=data, level_of_measurement="nominal")
    units = [[(rater, bool(row[u])) for rater, row in reversed(table.items()) if row[u] is not None]
             for u in range(6)]
    assert krippendorff_alpha(reliability_matrix(units)) == pytest.approx(expected)
    assert krippendorff_alpha(reliability_matrix([[("a", 1), ("b", 1)], [("a", 1)]])) is None  # one value only
    assert krippendorff_alpha(reliability_matrix([[("a", 1)], [("b", 0)]])) is None  # no unit with two labels


def test_bootstrap_is_seeded_and_contains_the_estimate():
    rng = np.random.default_rng(5)
    shares = rng.random(40)
    first = bootstrap_interval(shares, np.mean, repeats=400, seed=3)
    assert first == bootstrap_interval(shares, np.mean, repeats=400, seed=3)
    assert first != bootstrap_interval(shares, np.mean, repeats=400, seed=4)
    assert first[0] < shares.mean() < first[1]
    # a list of units is resampled as a list; resamples where the statistic is undefined are skipped
    units = [[1, 1], [1, 0], [0, 0], [1, 1, 0], [0, 1]] * 4
    low, high = bootstrap_interval(units, percent_agreement, repeats=300, seed=0)
    assert low <= percent_agreement(units) <= high
    assert bootstrap_interval(shares[:4], np.mean) is None  # too few units
    assert bootstrap_interval(shares, lambda _: None) is None


def test_auroc_with_ties_is_the_mann_whitney_count():
    scores = np.array([0.9, 0.6, 0.6, 0.4, 0.6, 0.1, 0.4])
    truth = np.array([1, 1, 0, 1, 0, 0, 0])
    wins = sum((a > b) + 0.5 * (a == b) for (a, ta), (b, tb) in itertools.product(zip(scores, truth), repeat=2)
               if ta == 1 and tb == 0)
    assert auroc(scores, truth) == pytest.approx(wins / (3 * 4))
    assert auroc(scores, np.ones(7)) is None


def test_edited_probability_and_majority():
    assert [edited_probability("edited", c) for c in (1, 5)] == [0.6, 1.0]
    assert [edited_probability("real", c) for c in (1, 5)] == [0.4, 0.0]
    with pytest.raises(ValueError, match="confidence 1-5"):
        edited_probability("edited", 0)
    assert majority([False, True, False]) is False and majority([True, False]) is None
