"""Power of the separability probe at its analysis size, on alterations planted in real images.

Every released sample image (../shared/samples, 1024² JPEGs) is paired with an altered copy saved as an editor
returns it (JPEG quality 95): a Gaussian blur of radius 1.5, a 2x down-up resample (bicubic), or nothing but the
re-save. Per modality and alteration the probe compares originals with altered copies (a pair is a group) at each
analysis size, and the bench prints

* AUROC and p on all the modality's pairs, controlled (both sides re-encoded alike) and raw;
* power: the share of `--subsets` random subsets of `--pairs` pairs in which the controlled p is below 0.05;
* the feature cost per image (one process) at each setting.

A setting is SIZE (the whole image at SIZE², no detail view) or SIZE+DETAIL (plus a SIZE² crop of the centre at
DETAIL², `--probe-detail`).

    .venv/bin/python bench/bench_probe_power.py --settings 256 512 1024 256+1024
"""

from __future__ import annotations

import argparse
import io
import time
from pathlib import Path

import numpy as np
from medbanana.evaluation.probe_features import FeatureSettings, image_features
from medbanana.evaluation.probe_statistics import probe
from PIL import Image, ImageFilter

SAMPLES = Path(__file__).resolve().parents[2] / "shared" / "samples"  # beside the clone, as tests/paths.py finds it
MODALITIES = {"Brain-MRI": "brain MRI", "Chest-XRay": "chest X-ray", "Fundus": "fundus"}


def altered(data: bytes, how: str) -> bytes:
    with Image.open(io.BytesIO(data)) as im:
        im = im.convert("RGB")
        if how == "blur 1.5":
            im = im.filter(ImageFilter.GaussianBlur(1.5))
        elif how == "resample 2x":
            im = im.resize((im.width // 2, im.height // 2), Image.Resampling.BICUBIC).resize(
                im.size, Image.Resampling.BICUBIC)
        buffer = io.BytesIO()
        im.save(buffer, "JPEG", quality=95)
        return buffer.getvalue()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=Path, default=SAMPLES, help=f"folder of real images (default {SAMPLES})")
    parser.add_argument("--settings", nargs="+", default=["256", "512", "1024", "256+1024"],
                        help="SIZE or SIZE+DETAIL, to compare (default 256 512 1024 256+1024)")
    parser.add_argument("--pairs", type=int, default=12, help="pairs in a power subset (default 12)")
    parser.add_argument("--subsets", type=int, default=20, help="random subsets per cell for power (default 20)")
    args = parser.parse_args()
    images = {name: [p.read_bytes() for p in sorted(args.samples.glob(f"{name}-*/*/*.jp*g"))] for name in MODALITIES}
    alterations = ("blur 1.5", "resample 2x", "re-save q95")
    copies = {(name, how): [altered(d, how) for d in images[name]] for name in MODALITIES for how in alterations}
    print(f"{sum(map(len, images.values()))} images of {args.samples}; power: {args.subsets} subsets of "
          f"{args.pairs} pairs, p < 0.05 (99 permutations)")
    for setting in args.settings:
        size, _, detail = setting.partition("+")
        settings = FeatureSettings(size=int(size), detail=int(detail or 0))
        start, computed = time.process_time(), 0
        features = {}
        for name in MODALITIES:
            features[name] = [image_features(d, settings) for d in images[name]]
            computed += len(images[name])
        cost = 1000 * (time.process_time() - start) / computed  # CPU time: the machine may be shared
        for key, datas in copies.items():
            features[key] = [image_features(d, settings) for d in datas]
        print(f"\n--probe-size {settings.size} --probe-detail {settings.detail}: {cost:.1f} ms per image "
              "(features: CPU time, one process)")
        for name, label in MODALITIES.items():
            n = len(images[name])
            groups, labels = np.tile(np.arange(n), 2), np.repeat([0, 1], n)
            for how in alterations:
                line = []
                for which, index in (("controlled", 1), ("raw", 0)):
                    x = np.stack([f[index] for f in features[name] + features[(name, how)]])
                    result = probe(x, labels, groups, bootstrap=0, permutations=199)
                    line.append(f"{which} {result.auroc:.3f} (p {result.p_value:.3f})")
                    if which == "controlled":
                        rng = np.random.default_rng(0)
                        hits = 0
                        for _ in range(args.subsets):
                            chosen = rng.choice(n, min(args.pairs, n), replace=False)
                            rows = np.concatenate([chosen, n + chosen])
                            hits += probe(x[rows], labels[rows], groups[rows], bootstrap=0,
                                          permutations=99).p_value < 0.05
                        line.append(f"power {hits / args.subsets:.2f}")
                print(f"  {label:12s} {how:12s} n={n:3d}: " + ", ".join(line))


if __name__ == "__main__":
    main()
