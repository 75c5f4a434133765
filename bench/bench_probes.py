"""Speed of the weight-free separability probe (issue target: 10,000 images of 1024² in under 3 minutes on 2 cores).

Makes N synthetic 1024² JPEG images (N/2 "sources", N/2 "edits" with a bright blob, re-encoded at another quality)
in a folder (kept for reuse with --images), then times `run_separability` as `eval --separability` runs it —
feature extraction in worker processes (JPEG draft-mode decoding), each image's features appended to a fresh feature
cache (so nothing is reused), the grouped 5-fold probe with its refit bootstrap and permutation test
(probe_statistics), raw and controlled — and prints the figures.

    .venv/bin/python bench/bench_probes.py --n 10000 --workers 2
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
from medbanana.evaluation.inputs import Sample
from medbanana.evaluation.probe_cache import CACHE_NAME, FeatureCache
from medbanana.evaluation.probe_features import PROBE_DETAIL, PROBE_SIZE, FeatureSettings
from medbanana.evaluation.separability import run_separability
from PIL import Image


def make_pair(job: tuple[Path, int, int]) -> None:
    folder, index, size = job
    rng = np.random.default_rng(index)
    small = rng.normal(128, 40, (16, 16)).astype(np.float32)
    field = np.asarray(Image.fromarray(small, mode="F").resize((size, size), Image.Resampling.BICUBIC))
    noise = rng.normal(0, 5, (size, size)).astype(np.float32)
    source = np.clip(field + noise, 0, 255).astype(np.uint8)
    Image.fromarray(source).save(folder / f"src-{index}.jpg", quality=75)
    y, x = np.ogrid[0:size, 0:size]
    blob = 40 * np.exp(-((x - size * 0.6) ** 2 + (y - size * 0.6) ** 2) / (2 * (size * 0.08) ** 2))
    edit = np.clip(field + blob + noise * 0.7, 0, 255).astype(np.uint8)  # editors tend to smooth the noise
    Image.fromarray(np.repeat(edit[..., None], 3, axis=2)).save(folder / f"edit-{index}.jpg", quality=95)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=10_000, help="images in all (half sources, half edits)")
    parser.add_argument("--size", type=int, default=1024, help="image side in pixels (default 1024)")
    parser.add_argument("--workers", type=int, default=2, help="worker processes (default 2)")
    parser.add_argument("--probe-size", type=int, default=PROBE_SIZE, help=f"view size (default {PROBE_SIZE})")
    parser.add_argument("--probe-detail", type=int, default=PROBE_DETAIL,
                        help=f"detail view scale (default {PROBE_DETAIL}; 0: none)")
    parser.add_argument("--images", type=Path, help="folder for the images (made if missing; default: a temp dir)")
    args = parser.parse_args()
    folder = args.images or Path(tempfile.mkdtemp(prefix="bench-probes-"))
    folder.mkdir(parents=True, exist_ok=True)
    pairs = args.n // 2
    missing = [i for i in range(pairs) if not (folder / f"edit-{i}.jpg").is_file()]
    if missing:
        start = time.perf_counter()
        with ProcessPoolExecutor(max_workers=os.cpu_count()) as pool:
            list(pool.map(make_pair, [(folder, i, args.size) for i in missing], chunksize=32))
        print(f"made {2 * len(missing):,} images of {args.size}² in {time.perf_counter() - start:.1f} s ({folder})")
    samples = [Sample(id=f"e{i}", dataset="bench", modality="chest_xray", disease="Pleural_Effusion",
                      direction="add", instruction="", source=folder / f"src-{i}.jpg",
                      edited=folder / f"edit-{i}.jpg") for i in range(pairs)]
    cache = FeatureCache(Path(tempfile.mkdtemp(prefix="bench-probes-cache-")) / CACHE_NAME)
    start = time.perf_counter()
    result = run_separability(samples, settings=FeatureSettings(size=args.probe_size, detail=args.probe_detail),
                              workers=args.workers, cache=cache)
    seconds = time.perf_counter() - start
    cache.close()
    shutil.rmtree(cache.path.parent)
    images = 2 * pairs
    print(f"separability probe: {images:,} images of {args.size}² in {seconds:.1f} s with {args.workers} workers "
          f"({1000 * seconds / images:.1f} ms per image; target < 180 s for 10,000)")
    for row in result["rows"]:
        print(f"  {row['comparison']}: AUROC raw {row['auroc_raw']:.3f} (p {row['p_raw']:.3f}), controlled "
              f"{row['auroc_controlled']:.3f} (p {row['p_controlled']:.3f})")


if __name__ == "__main__":
    main()
