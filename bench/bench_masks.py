"""Benchmark the per-edit masks (generation/masks.py): how well `edit_mask` finds what the simulator drew, and what
the masks cost a build.

    python bench/bench_masks.py                       # a demo run at 1024 px (2 normal, 1 diseased source per class)
    python bench/bench_masks.py --size 512 --repeat 7  # smaller images: the build does less besides the masks
    python bench/bench_masks.py --run /tmp/bench-masks  # reuse (or keep) the demo folder

1. Quality: every attempt image of a simulator run (`medbanana demo` sources and run, not built) gets its edit mask
   from source and edit, as `build --source-images` computes it; the IoU with the mask the simulator recorded
   drawing (`details.drawn_mask`, generation/backends/simulator/truth.py) is summarised per modality and direction:
   median over focal findings (a body in a bounded region: not dots, lines, a haze over the whole fundus or diffuse
   oedema) and over all. Target (issue 32): median >= 0.6 for focal findings.
2. Cost: milliseconds per attempt image (the task's edit masks and its region, one thread): what the run spends
   when it writes each image and stores its masks (medbanana-masks/, next to a 10-30 s API call). Then the build of
   the same run with its sources (one process, as `medbanana demo` builds), in a child process each, built twice
   there and the second build timed (a release-sized build pays a process's cold start once, not per task),
   alternating: with the masks the run stored (the build copies them), with them computed at build time (the run's
   masks folder set aside: a released run, or one from before masks were stored), and without masks; the masks'
   share of build time. Target (issue 32): <= 20 %, for a run of ours (stored masks).
3. Check: milliseconds generation/mask_check.py takes per stored mask (part of the stored masks' build time above).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

_CHILD = """
import shutil, sys, time
from pathlib import Path
from medbanana.builder import partition
from medbanana.builder.build import build
run, sources, out, with_masks = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]), sys.argv[4] == "1"
if not with_masks:  # the build exactly as it is, the masks left out
    partition.MASK_CONFIGS = frozenset()
for _ in range(2):  # the second build is timed: the first pays the process's cold start (code, caches) once
    shutil.rmtree(out, ignore_errors=True)
    t = time.perf_counter()
    build([run], out, source_images=sources, quiet=True)
print(time.perf_counter() - t)
"""


def focal(disease: str) -> bool:
    from medbanana.generation.backends.simulator.lesions import SPECS

    spec = SPECS[disease]
    return spec.body and spec.max_share <= 0.9


def quality(run: Path, sources: Path) -> tuple[dict, list[float]]:
    """(modality, direction) -> {focal: [IoU], all: [IoU]}; seconds per task of `task_masks`, per image."""
    import io

    import numpy as np
    from PIL import Image

    from medbanana.generation.masks import task_masks
    from medbanana.generation.backends.simulator.truth import read_drawn_mask
    from medbanana.generation.records import decode_rgb
    from medbanana.generation.rundir import layout

    scores: dict = defaultdict(lambda: {"focal": [], "all": []})
    per_image = []
    for _, _, folder in layout.find_output_dirs(run):
        for record in json.loads((folder / layout.ALL_CONVERSATIONS).read_text()).values():
            source = {"bytes": (sources / record["source_path"]).read_bytes(), "path": None}
            rounds = [r for r in record["rounds"] if r.get("image")]
            images = {r["image"]: {"bytes": (run / r["image"]).read_bytes(), "path": r["image"]} for r in rounds}
            start = time.perf_counter()
            found = task_masks(images, source, record["modality"], record["disease"])
            per_image.append((time.perf_counter() - start) / max(1, len(images)))
            for r in rounds:
                edit = decode_rgb(images[r["image"]]["bytes"])
                truth = read_drawn_mask((r.get("edit_result") or {}).get("details"), edit.shape[1::-1])
                value = found.edits.get(r["image"])
                if truth is None or value is None:
                    continue
                mask = np.asarray(Image.open(io.BytesIO(value["bytes"]))) > 127
                union = (mask | truth).sum()
                iou = 1.0 if union == 0 else float((mask & truth).sum() / union)
                key = (record["modality"], record["task"])
                scores[key]["all"].append(iou)
                if focal(record["disease"]):
                    scores[key]["focal"].append(iou)
    return scores, per_image


VARIANTS = ("stored", "computed", "none")  # masks the run stored; computed at build time; no masks


def build_times(run: Path, sources: Path, repeat: int) -> dict[str, list[float]]:
    from medbanana.generation.rundir import layout

    stored, aside = run / layout.MASKS, run.parent / (layout.MASKS + ".aside")
    if not stored.is_dir():
        raise SystemExit(f"{run} has no {layout.MASKS}/: the run stored no masks")
    times: dict[str, list[float]] = {variant: [] for variant in VARIANTS}
    with tempfile.TemporaryDirectory(prefix="bench-masks-") as tmp:
        for _ in range(repeat):
            for variant in VARIANTS:
                if variant == "computed":
                    stored.rename(aside)
                try:
                    out = subprocess.run([sys.executable, "-c", _CHILD, str(run), str(sources), f"{tmp}/ds",
                                          "0" if variant == "none" else "1"], capture_output=True, text=True,
                                         check=True)
                finally:
                    if aside.exists():
                        aside.rename(stored)
                times[variant].append(float(out.stdout.split()[-1]))
    return times


def check_cost(run: Path) -> list[float]:
    """Seconds generation/mask_check.py takes per mask the run stored, as `build` checks each before using it
    (chunks and CRCs, the size, then the decoded pixels all 0 or 255)."""
    from medbanana.generation.mask_check import header_size, mask_problem
    from medbanana.generation.rundir import layout

    times = []
    for path in sorted((run / layout.MASKS).rglob("*.png")):
        data = path.read_bytes()
        size = header_size(data)
        start = time.perf_counter()
        assert mask_problem(data, size) is None, path
        times.append(time.perf_counter() - start)
    return times


def _median(values: list[float]) -> str:
    return f"{statistics.median(values):.3f}" if values else "–"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", type=Path, help="demo folder to write or reuse (default: a temporary one)")
    parser.add_argument("--size", type=int, default=1024, help="image side: 1024 as `medbanana demo` and `prepare` make")
    parser.add_argument("--normal", type=int, default=2)
    parser.add_argument("--diseased", type=int, default=1)
    parser.add_argument("--repeat", type=int, default=7, help="builds timed with and without masks (each)")
    args = parser.parse_args(argv)
    from medbanana.demo import run_demo

    with tempfile.TemporaryDirectory(prefix="bench-masks-demo-") as tmp:
        folder = args.run or Path(tmp) / "demo"
        run_demo(folder, n_normal=args.normal, n_diseased=args.diseased, size=args.size, quiet=True,
                 build_dataset=False)
        run, sources = folder / "run", folder / "sources"
        scores, per_image = quality(run, sources)
        print(f"edit_mask vs the simulator's drawn mask (IoU), {args.size} px demo run, every attempt image:")
        print(f"{'modality':<12} {'direction':<9} {'focal n':>7} {'focal median':>12} {'all n':>6} {'all median':>10}")
        for (modality, direction), s in sorted(scores.items()):
            print(f"{modality:<12} {direction:<9} {len(s['focal']):>7} {_median(s['focal']):>12} {len(s['all']):>6} "
                  f"{_median(s['all']):>10}")
        every_focal = [v for s in scores.values() for v in s["focal"]]
        print(f"all focal findings: n {len(every_focal)}, median IoU {_median(every_focal)} (target >= 0.6)")
        print(f"cost: {1000 * statistics.median(per_image):.1f} ms per attempt image (median; mean "
              f"{1000 * statistics.fmean(per_image):.1f} ms), edit masks and the task's region, one thread: spent "
              "by the run when it writes each image")
        checks = check_cost(run)
        print(f"check: {1000 * statistics.median(checks):.2f} ms per stored mask (median of {len(checks)}; mean "
              f"{1000 * statistics.fmean(checks):.2f} ms), what `build` spends checking each before it is used")
        times = build_times(run, sources, args.repeat)
        medians = {variant: statistics.median(values) for variant, values in times.items()}
        without = medians["none"]
        print(f"build with sources, one process (medians of {args.repeat}): {without:.2f} s without masks; "
              f"{medians['stored']:.2f} s with the masks the run stored: they add "
              f"{(medians['stored'] - without) / without:.1%} (target <= 20 %); {medians['computed']:.2f} s with "
              f"masks computed at build time (a released run's): they add {(medians['computed'] - without) / without:.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
