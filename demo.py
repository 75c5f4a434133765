"""`medbanana demo`, the offline demo: synthetic sources for all three modalities, a simulator run over them, and
the dataset built from it (no download, no key). It spans two stages (generation, then the builder), so it lives
above both, beside cli.py."""

from __future__ import annotations

import json
import sys
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

from .generation.commands.options import whole_number
from .generation.commands.run_options import add_run_options
from .generation.destinations import MANIFEST, SYNTHETIC, manifest_row
from .generation.files import atomic_write_bytes, atomic_write_json
from .generation.acceptance import DEFAULT_ACCEPT
from .generation.records import DEFAULT_GEOMETRY, DEFAULT_MAX_ROUNDS
from .generation.rundir import layout
from .generation.failures import EXIT_OK, EXIT_USAGE, UsageError

if TYPE_CHECKING:
    from .generation.runners.session import RunSummary

MIN_SIZE = 64  # the phantoms' anatomy and lesions are drawn in proportion; below this they are a few pixels


def run_demo(out: Path, *, n_normal: int = 2, n_diseased: int = 1, concurrency: int = 2, seed: int = 0,
             size: int = 1024, quiet: bool = False, build_dataset: bool = True,
             max_rounds: int = DEFAULT_MAX_ROUNDS, accept: str = DEFAULT_ACCEPT, geometry: str = DEFAULT_GEOMETRY,
             drift: float = 0.0) -> RunSummary:
    """Synthesise sources for all three modalities (no download, no key), generate with the simulator, and build
    the Hugging Face dataset folder OUT/dataset (sources attached: they are synthetic, so redistributable).
    `geometry` is the geometry guard's mode, `drift` the share of the simulated editor's edits whose frame moves.

    Rerunning on the same OUT resumes; other source options (--normal, --diseased, --size) than the folder was made
    with are refused (UsageError), since its sources are kept and the run would silently be the old one."""
    from .generation.backends.simulator.phantoms import write_demo_sources
    from .generation.runners.generate import generate  # here: every command's parser imports this module
    from .generation.runners.session import RunOptions

    out = Path(out)
    sources, run_dir = out / "sources", out / "run"
    manifest = sources / layout.SOURCES_MANIFEST
    demo = {"n_normal": n_normal, "n_diseased": n_diseased, "size": size}
    _check_out(out)
    _check_same_demo(run_dir, demo)
    if not (out / MARK).exists():  # first, so that a demo interrupted at once is still one this command resumes
        atomic_write_json(out / MARK, {"made_by": "medbanana demo", **demo})
    if not manifest.exists():  # a rerun resumes on the same sources
        provenance = write_demo_sources(sources, n_normal=n_normal, n_diseased=n_diseased, size=size, seed=seed)
        atomic_write_json(manifest, provenance)
    if not (sources / MANIFEST).exists():  # the phantoms' data-use class, as `prepare` records one
        rows = json.loads(manifest.read_text(encoding="utf-8"))
        atomic_write_bytes(sources / MANIFEST, "".join(
            manifest_row(r["dataset"], r["path"], SYNTHETIC, label=r.get("label")) for r in rows).encode("utf-8"))
    summary = generate(sources, run_dir, backend="simulator",
                       backend_options={"editor": {"drift": drift}} if drift else None,
                       options=RunOptions(concurrency=concurrency, seed=seed, quiet=quiet, max_rounds=max_rounds,
                                          accept=accept, geometry=geometry),
                       extra_config={"demo": demo})
    run_manifest = run_dir / layout.SOURCES_MANIFEST
    if not run_manifest.exists():
        run_manifest.write_bytes(manifest.read_bytes())
    if build_dataset:
        from .builder.build import build

        summary.dataset = build([run_dir], out / "dataset", source_images=sources, quiet=quiet)
        summary.dataset_dir = out / "dataset"
    return summary


_DEMO_OPTIONS = {"n_normal": "--normal", "n_diseased": "--diseased", "size": "--size"}
MARK = "medbanana-demo.json"  # what makes a folder the demo's own: it writes into no other non-empty one


def _check_out(out: Path) -> None:
    """--out is new, empty, or a demo's (its MARK; before there was one, its run's or sources' demo records): a
    UsageError otherwise, since the demo would write its folders among the user's files."""
    if out.is_symlink() or (out.exists() and not out.is_dir()):
        raise UsageError(f"--out {out} is not a folder; choose a new one")
    held = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    if not held or (out / MARK).is_file() or (out / "sources" / layout.SOURCES_MANIFEST).is_file():
        return
    try:
        made = json.loads((out / "run" / layout.RUN_CONFIG).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        made = None
    if not (isinstance(made, dict) and made.get("demo")):
        raise UsageError(f"--out {out} is not empty ({len(held)} entr{'y' if len(held) == 1 else 'ies'}, e.g. "
                         f"{held[0]}) and was not made by `medbanana demo`; give a new or empty folder")


def _check_same_demo(run_dir: Path, demo: dict) -> None:
    config = run_dir / layout.RUN_CONFIG
    if not config.is_file():
        return
    made = json.loads(config.read_text(encoding="utf-8")).get("demo") or {}
    diffs = [f"{_DEMO_OPTIONS[k]} (was {made[k]}, now {v})" for k, v in demo.items() if k in made and made[k] != v]
    if diffs:
        raise UsageError(f"{run_dir.parent} is a demo made with other options: {', '.join(diffs)}; give those "
                         "options again to resume it, or another --out for a new demo")


def cmd_demo(args) -> int:
    if not args.normal and not args.diseased:
        print("medbanana demo: error: --normal 0 and --diseased 0 leave no task to run", file=sys.stderr)
        return EXIT_USAGE
    summary = run_demo(args.out, n_normal=args.normal, n_diseased=args.diseased, concurrency=args.concurrency,
                       seed=args.seed, size=args.size, quiet=args.quiet, build_dataset=args.build,
                       max_rounds=args.max_rounds, accept=args.accept, geometry=args.geometry,
                       drift=args.simulator_drift or 0.0)
    print(summary.format())
    print(f"sources (synthetic phantoms and skimage's retina photograph): {Path(args.out) / 'sources'}")
    return EXIT_OK


def register(sub) -> None:
    p = sub.add_parser("demo", help="offline end-to-end demo: synthetic sources -> simulator run (no key, no download)",
                       description="Synthesise chest X-ray, brain MRI and fundus sources (normal and diseased), run "
                                   "the full refinement loop with the offline simulator, and write DIR/sources, "
                                   "DIR/run (the Med-Banana layout) and DIR/dataset (the Hugging Face dataset "
                                   "folder, all five configs). Rerunning on the same DIR resumes.")
    p.add_argument("--out", type=Path, required=True,
                   help="output folder: new or empty (an earlier demo's folder resumes it; any other non-empty "
                        "folder is refused)")
    p.add_argument("--normal", type=partial(whole_number, minimum=0), default=2,
                   help="normal sources per modality (add tasks; default 2)")
    p.add_argument("--diseased", type=partial(whole_number, minimum=0), default=1,
                   help="diseased sources per target (remove tasks; default 1)")
    p.add_argument("--size", type=partial(whole_number, minimum=MIN_SIZE), default=1024,
                   help=f"source image size in pixels (default 1024, at least {MIN_SIZE})")
    p.add_argument("--no-build", dest="build", action="store_false",
                   help="stop after the run (default: also build the Hugging Face dataset folder DIR/dataset)")
    add_run_options(p)
    p.set_defaults(func=cmd_demo, concurrency=2)
