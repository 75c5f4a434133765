"""Calibration of the separability probe's interval and p-value when there is nothing to find.

The released sample images (../shared/samples, 110 JPEGs of 1024²) are split at random into two "classes" many
times; every split is probed as `eval --separability` probes a comparison (features computed once, at the CLI's
`--probe-size` and `--probe-detail`; the probe's folds, refit bootstrap and permutation test on each split).
Two designs:

* single: every image its own group, half of the images labelled 1 (as the real-vs-real row);
* pairs: images paired at random, each pair a group holding one image of each label (as a source and its edit).

A calibrated probe's 95 % interval excludes 0.5 in about 5 % of the splits (target 0.03–0.07) and its p-value falls
below 0.05 in at most about 5 % of them.

    .venv/bin/python bench/bench_probe_calibration.py --splits 200
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
from medbanana.evaluation.probe_features import PROBE_DETAIL, PROBE_SIZE, FeatureSettings, image_features
from medbanana.evaluation.probe_statistics import BOOTSTRAP, PERMUTATIONS, probe

SAMPLES = Path(__file__).resolve().parents[2] / "shared" / "samples"  # beside the clone, as tests/paths.py finds it


def null_splits(n: int, design: str, rng: np.random.Generator):
    """(labels, groups) of one random split of n images."""
    order = rng.permutation(n)
    labels, groups = np.zeros(n, int), np.zeros(n, int)
    if design == "single":
        labels[order[:n // 2]] = 1
        groups[:] = np.arange(n)
    else:
        pairs = n // 2
        groups[order[:2 * pairs]] = np.repeat(np.arange(pairs), 2)
        labels[order[:2 * pairs]] = np.tile([0, 1], pairs)
        groups[order[2 * pairs:]] = pairs  # an odd image out: its own group, label 0
    return labels, groups


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=Path, default=SAMPLES, help=f"folder of real images (default {SAMPLES})")
    parser.add_argument("--splits", type=int, default=200, help="random splits per design (default 200)")
    parser.add_argument("--probe-size", type=int, default=PROBE_SIZE, help=f"view size (default {PROBE_SIZE})")
    parser.add_argument("--probe-detail", type=int, default=PROBE_DETAIL,
                        help=f"detail view scale (default {PROBE_DETAIL}; 0: none)")
    parser.add_argument("--bootstrap", type=int, default=BOOTSTRAP, help=f"refit draws (default {BOOTSTRAP})")
    parser.add_argument("--permutations", type=int, default=PERMUTATIONS,
                        help=f"permutations (default {PERMUTATIONS})")
    args = parser.parse_args()
    paths = sorted(args.samples.rglob("*.jp*g"))
    if len(paths) < 20:
        raise SystemExit(f"bench_probe_calibration: need at least 20 images under {args.samples}, found {len(paths)}")
    start = time.perf_counter()
    settings = FeatureSettings(size=args.probe_size, detail=args.probe_detail)
    features = [image_features(p.read_bytes(), settings) for p in paths]
    print(f"{len(paths)} images of {args.samples}: features ({args.probe_size}², detail {args.probe_detail}) in "
          f"{time.perf_counter() - start:.1f} s")
    for design in ("single", "pairs"):
        rng = np.random.default_rng({"single": 1, "pairs": 2}[design])
        found = {"raw": [], "controlled": []}
        start = time.perf_counter()
        for split in range(args.splits):
            labels, groups = null_splits(len(paths), design, rng)
            for which, index in (("raw", 0), ("controlled", 1)):
                result = probe(np.stack([f[index] for f in features]), labels, groups, bootstrap=args.bootstrap,
                               permutations=args.permutations, seed=split)
                found[which].append((result.auroc, result.low, result.high, result.p_value))
        seconds = time.perf_counter() - start
        print(f"\n{design}: {args.splits} null splits, {args.bootstrap} refit draws and {args.permutations} "
              f"permutations each ({1000 * seconds / (2 * args.splits):.0f} ms per probe)")
        for which, rows in found.items():
            values = np.array(rows, float)
            estimate, low, high, p = values.T
            excluded = np.mean((low > 0.5) | (high < 0.5))
            inside = np.mean((low <= estimate) & (estimate <= high))
            print(f"  {which:10s} interval excludes 0.5: {excluded:.3f} (target 0.03-0.07; above {np.mean(low > 0.5):.3f}"
                  f", below {np.mean(high < 0.5):.3f}); p < 0.05: {np.mean(p < 0.05):.3f} (target <= 0.05); "
                  f"AUROC mean {estimate.mean():.3f}, sd {estimate.std():.3f}; mean half-width "
                  f"{np.mean((high - low) / 2):.3f}; estimate inside its interval: {inside:.0%}")


if __name__ == "__main__":
    main()
