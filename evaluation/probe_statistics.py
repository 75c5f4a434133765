"""The separability probe's statistics: a grouped cross-validated linear probe, its AUROC, a refit bootstrap interval
and a grouped permutation test.

**The probe.** A linear discriminant (LDA) on standardised features: pooled within-class covariance with a ridge
(`RIDGE`, the features are strongly correlated and may outnumber the images), and equal class priors, so an image's
score is a log-likelihood ratio that does not depend on how many images of each class a fold's training part holds
(a fitted intercept does: with unbalanced folds it pushes pooled out-of-fold AUROC below 0.5 when nothing separates
the classes). Folds are whole groups (a source and every edit made from it), dealt to `FOLDS` folds by a seeded
shuffle that never looks at the labels, so the permutation test below can keep them fixed.

Why a discriminant rather than a logistic regression: it is fitted in closed form, and a relabelling changes only
the class means (Sherman-Morrison on the fixed total covariance), so hundreds of permutations and refits cost
milliseconds on 10,000 images.

**The interval.** `BOOTSTRAP` draws of whole groups with replacement; in each draw the cross-validation is repeated
(every fold refitted on the drawn data), so the spread includes the variability of fitting, not only of scoring.
Each side's reach is the draws' 2.5 or 97.5 percentile measured from their median, laid around the estimate (a
draw holds about 63 % distinct groups and fits a weaker model, which shifts the draws, not their spread): the
estimate always lies inside. Near 0.5 those draws overstate the spread (a draw treats the sample's own chance
difference between the classes as real, and refits on it), and by chance the draws can also fall narrow. The
permutation AUROCs below give the estimate's exact spread when nothing separates the classes (and a wider one than
its spread when something does: AUROC varies less towards 1), so each side is bounded by that null's reach, and the
side towards 0.5 reaches 0.5 unless the estimate lies outside the null's central 95 %: the interval excludes 0.5
exactly when a two-sided 5 % permutation test rejects. bench/bench_probe_calibration.py measures the result on
real images split at random.

**The p-value** answers "separable at all?": labels are permuted `PERMUTATIONS` times the way the design allows under
no difference (shuffled inside each group, and whole groups' label counts exchanged between groups of one size),
the whole cross-validation is rerun on each, and p = (1 + permutations whose AUROC reaches the observed one) /
(1 + permutations). One-sided: an AUROC below 0.5 is chance, not a finding.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from scipy.stats import rankdata

FOLDS = 5
RIDGE = 0.1  # added to the standardised features' within-class covariance (1.0 on its diagonal)
BOOTSTRAP = 200  # refit draws for the interval (each a full cross-validation)
PERMUTATIONS = 199  # p-values in steps of 1/200


def auroc(scores: np.ndarray, labels: np.ndarray) -> float | None:
    """Area under the ROC curve (Mann-Whitney, ties counted half); None without both classes."""
    labels = np.asarray(labels).astype(bool)
    n_pos, n_neg = int(labels.sum()), int((~labels).sum())
    if not n_pos or not n_neg:
        return None
    ranks = rankdata(scores)
    return float((ranks[labels].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def _aurocs(scores: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """AUROC of each column of `scores` against the same column of `labels` (both (n, k), both classes present)."""
    ranks = rankdata(scores, axis=0)
    positive = labels.sum(axis=0)
    return ((ranks * labels).sum(axis=0) - positive * (positive + 1) / 2) / (positive * (len(labels) - positive))


def group_folds(groups: np.ndarray, folds: int = FOLDS, seed: int = 0) -> np.ndarray:
    """Each row's fold: groups (in order of first appearance) shuffled with `seed` and dealt round-robin."""
    _, first, inverse = np.unique(groups, return_index=True, return_inverse=True)
    by_appearance = np.argsort(np.argsort(first))  # group index -> its rank of first appearance
    dealt = np.empty(len(first), int)
    dealt[np.random.default_rng(seed).permutation(len(first))] = np.arange(len(first)) % folds
    return dealt[by_appearance][inverse]


def out_of_fold_scores(features: np.ndarray, labels: np.ndarray, fold: np.ndarray,
                       weights: np.ndarray | None = None) -> np.ndarray:
    """Out-of-fold log-likelihood ratios (edit vs real) of every row, for every column of `labels` ((n,) or (n, k)
    label sets scored on the same folds). `weights` are row multiplicities (a bootstrap draw; 0 = not drawn)."""
    x = np.nan_to_num(np.asarray(features, np.float64), nan=0.0, posinf=0.0, neginf=0.0)
    y = np.asarray(labels, np.float64)
    y = y[:, None] if y.ndim == 1 else y
    w = np.ones(len(x)) if weights is None else np.asarray(weights, np.float64)
    scores = np.zeros(y.shape)
    for k in np.unique(fold):
        train = (fold != k) & (w > 0)
        total = w[train].sum()
        if total < 3:
            continue  # nothing to fit: chance
        wt, yt = w[train], y[train]
        mean = wt @ x[train] / total
        scale = np.sqrt(wt @ (x[train] - mean) ** 2 / total)
        scale[scale < 1e-12] = 1.0  # a constant feature stays 0
        z = (x[train] - mean) / scale
        weighted = z * wt[:, None]
        scatter = weighted.T @ z  # total scatter about the mean: the same for every label set
        ones = wt @ yt
        zeros = total - ones
        sums = weighted.T @ yt  # (d, k): class-1 sums; class 0's are their negatives (z sums to 0)
        with np.errstate(divide="ignore", invalid="ignore"):
            mu1, mu0 = sums / ones, -sums / zeros
        delta = mu1 - mu0
        a = scatter / (total - 2) + RIDGE * np.eye(len(mean))
        a_delta = np.linalg.solve(a, np.nan_to_num(delta))
        # within-class covariance = A - c delta delta^T, inverted by Sherman-Morrison
        c = ones * zeros / (total * (total - 2))
        coef = a_delta / (1 - c * (delta * a_delta).sum(axis=0))
        intercept = -(coef * (mu0 + mu1) / 2).sum(axis=0)
        both = (ones > 0) & (zeros > 0)
        test = fold == k
        scores[test] = np.where(both, ((x[test] - mean) / scale) @ np.nan_to_num(coef) + np.nan_to_num(intercept), 0)
    return scores if np.ndim(labels) > 1 else scores[:, 0]


def permuted_labels(labels: np.ndarray, groups: np.ndarray, count: int, seed: int = 0) -> np.ndarray:
    """(n, count) relabellings that are as likely as the observed labels when the classes do not differ: each
    group's count of 1s goes to a random group of the same size, then lands on random members of it."""
    labels = np.asarray(labels).astype(int)
    _, g = np.unique(groups, return_inverse=True)
    sizes = np.bincount(g)
    ones = np.bincount(g, weights=labels).astype(int)
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    same_size = [np.flatnonzero(sizes == s) for s in np.unique(sizes)]
    rng = np.random.default_rng(seed)
    out = np.empty((len(labels), count), int)
    for column in range(count):
        moved = ones.copy()
        for members in same_size:
            moved[members] = ones[rng.permutation(members)]
        order = np.lexsort((rng.random(len(labels)), g))  # rows by group, shuffled inside each group
        rank = np.empty(len(labels), int)
        rank[order] = np.arange(len(labels)) - starts[g[order]]
        out[:, column] = rank < moved[g]
    return out


@dataclass
class ProbeResult:
    auroc: float | None
    low: float | None
    high: float | None
    p_value: float | None
    scores: np.ndarray = field(repr=False)  # out-of-fold probability of "edit" at equal priors


def probe(features: np.ndarray, labels: np.ndarray, groups: np.ndarray, *, folds: int = FOLDS,
          bootstrap: int = BOOTSTRAP, permutations: int = PERMUTATIONS, seed: int = 0) -> ProbeResult:
    """Grouped cross-validated AUROC, its refit-bootstrap 95 % interval and its permutation p-value."""
    labels, groups = np.asarray(labels).astype(int), np.asarray(groups)
    if len(np.unique(groups)) < 2 or len(np.unique(labels)) < 2:
        return ProbeResult(None, None, None, None, np.full(len(labels), np.nan))
    fold = group_folds(groups, min(folds, len(np.unique(groups))), seed)
    label_sets = np.column_stack([labels, permuted_labels(labels, groups, permutations, seed)])
    scores = out_of_fold_scores(features, label_sets, fold)
    values = _aurocs(scores, label_sets)
    estimate = float(values[0])
    p_value = float((1 + np.sum(values[1:] >= estimate - 1e-12)) / (1 + permutations)) if permutations else None
    below, above = refit_interval(features, labels, groups, fold, estimate, draws=bootstrap, seed=seed)
    if permutations >= 39:  # enough for 2.5 % tails: the interval agrees with the null (module docstring)
        # outside [null_low, null_high] exactly when a one-sided p (either side) is at most 2.5 %
        tail, null = int(0.025 * (permutations + 1)), np.sort(values[1:])
        null_low, null_high = null[tail - 1], null[permutations - tail]
        null_below, null_above = max(0.0, null_high - 0.5), max(0.0, 0.5 - null_low)
        # the side towards 0.5 reaches it unless the null is rejected there, and never beyond the null's reach
        toward_up, toward_down = estimate >= 0.5, estimate < 0.5
        below = max(below, null_below) if toward_up and estimate <= null_high else min(below, null_below)
        above = max(above, null_above) if toward_down and estimate >= null_low else min(above, null_above)
    low, high = max(0.0, estimate - below), min(1.0, estimate + above)
    return ProbeResult(estimate, low, high, p_value, 1 / (1 + np.exp(-np.clip(scores[:, 0], -50, 50))))


def refit_interval(features: np.ndarray, labels: np.ndarray, groups: np.ndarray, fold: np.ndarray, estimate: float,
                   *, draws: int = BOOTSTRAP, seed: int = 0) -> tuple[float, float]:
    """How far a 95 % interval reaches below and above `estimate`, from `draws` group-bootstrap draws, each
    cross-validated anew: the draws' 2.5 and 97.5 percentiles measured from their median (see the module
    docstring). Infinite when no draw holds both classes."""
    _, g = np.unique(groups, return_inverse=True)
    rng = np.random.default_rng(seed + 1)
    values = []
    for _ in range(draws):
        weights = np.bincount(rng.integers(0, g.max() + 1, g.max() + 1), minlength=g.max() + 1)[g]
        chosen = np.repeat(np.arange(len(labels)), weights)
        value = auroc(out_of_fold_scores(features, labels, fold, weights)[chosen], labels[chosen])
        if value is not None:
            values.append(value)
    if not values:
        return np.inf, np.inf
    low, middle, high = np.percentile(values, [2.5, 50, 97.5])
    return float(middle - low), float(high - middle)
