"""`medbanana export FORMAT DATASET --out DIR`: a built dataset in another benchmark's own layout, so that its
evaluation scripts run on it unmodified (`medebench`: loaders/medebench.py).

It sits beside cli.py rather than in loaders/ because importing the loaders package imports `datasets` (about half
a second), which every `medbanana` command would then pay just to build its parser."""

from __future__ import annotations

import sys
from pathlib import Path

from .generation.vocabulary import DEFAULT_THREADS, old_spelling
from .generation.failures import EXIT_OK, EXIT_USAGE


def register(sub) -> None:
    export = sub.add_parser(
        "export", help="write a built dataset in another benchmark's layout (medebench)",
        description="Write a folder made by `medbanana build` in another benchmark's own layout, so that its "
                    "evaluation scripts run on it unmodified. Formats: medebench.")
    formats = export.add_subparsers(dest="format", metavar="FORMAT", required=True)
    medebench = formats.add_parser(
        "medebench", help="MedEBench's editing/ folder: editing_metadata.json, previous/, changed/, previous_mask/",
        description="Write DIR/editing/ as MedEBench (github.com/mliuby/MedEBench) lays out its benchmark: "
                    "editing_metadata.json ({\"samples\": [{id, Organ, Task, prompt, rephrased_prompt, "
                    "detailed_prompt, previous_image, changed_image, previous_mask, url}]}) and PNG images "
                    "previous/<id>.png (the source), changed/<id>.png (the accepted edit) and previous_mask/<id>.png "
                    "(the row's edit_mask, else its region_mask; white = region of interest), one sample per sft "
                    "row of --split (default test), numbered in order; each sample keeps its medbanana uid. Rows without a source image, an "
                    "edit or a mask are skipped, counted by reason on stderr and listed in "
                    "editing/medbanana-export.json. DIR plays MedEBench's repository root: its scripts then find "
                    "the metadata at DIR/editing/editing_metadata.json and the images beside it.")
    medebench.add_argument("dataset", type=Path, metavar="DATASET", help="a folder made by `medbanana build`")
    medebench.add_argument("--out", required=True, type=Path, metavar="DIR",
                           help="output folder: new or empty (with --force, any folder, e.g. a MedEBench checkout: "
                                "its editing/ is replaced when the export is complete, the rest is kept)")
    medebench.add_argument("--split", metavar="SPLIT", default="test",
                           help="the split to export (default test: a benchmark scores held-out rows; a dataset "
                                "built without --test-fraction has none, so that is refused with the fix; "
                                "--split train exports the training rows)")
    medebench.add_argument("--source-images", type=Path, metavar="DIR",
                           help="source images for a dataset built without them (as `build --source-images`)")
    medebench.add_argument("--force", action="store_true",
                           help="write into a non-empty --out, replacing its editing/ folder")
    threads = medebench.add_argument("--threads", type=int, default=DEFAULT_THREADS, metavar="N",
                                     help="threads encoding the PNGs, the export's main cost (default: one per CPU, "
                                          "at most 4)")
    old_spelling(medebench, threads, "--workers")
    medebench.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    medebench.set_defaults(func=run_medebench)


def run_medebench(args) -> int:
    from tqdm import tqdm

    from .generation.dataset.output import BuildError
    from .loaders.medebench import REPORT, export_medebench

    bar = None

    def progress() -> None:  # the bar starts with the first row: a refused --out or dataset prints none
        nonlocal bar
        if bar is None:
            bar = tqdm(disable=args.quiet, unit="row", desc="export medebench")
        bar.update()

    try:
        summary = export_medebench(args.dataset, args.out, split=args.split, source_images=args.source_images,
                                   force=args.force, workers=args.threads, progress=progress)
    except BuildError as exc:  # a refused --out: one line, as `build` says it
        print(f"medbanana export: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    finally:
        if bar is not None:
            bar.close()
    roi = ", ".join(f"{column} {count:,}" for column, count in summary.roi.items())
    print(f"exported {summary.exported:,} of {summary.rows:,} sft rows to {summary.folder} (MedEBench layout; "
          f"ROI from {roi})")
    for reason, uids in summary.skipped.items():
        print(f"warning: skipped {len(uids):,} row(s): {reason} (e.g. {uids[0]!r}); all are listed in "
              f"{summary.folder / REPORT}", file=sys.stderr)
    return EXIT_OK
