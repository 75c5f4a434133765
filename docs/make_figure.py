"""The picture on the README and the documentation's front page, made from the offline demo.

    python docs/make_figure.py                    # a fresh default demo in a temporary folder
    python docs/make_figure.py --demo demo-run    # a demo you ran: `medbanana demo --out demo-run`
    python docs/make_figure.py --demo demo-run --out /tmp/grid.png

One row per modality (chest X-ray, brain MRI, fundus), five tiles each: the source, a rejected attempt (round 1), the
accepted edit, its `edit_mask` and its `region_mask`. The row's task is, among the modality's *add* tasks accepted
after a rejected round 1 (its `dpo_pairs` rows), the one whose edit changed the most pixels, ties broken by uid. No
text is drawn (the caption says what the tiles are), so the picture depends on the demo's images alone, and
tests/test_docs_commands.py regenerates it from a fresh demo and compares it with the committed one.
"""

from __future__ import annotations

import argparse
import io
import tempfile
from pathlib import Path

import numpy as np
from PIL import Image

FIGURE = Path(__file__).resolve().parent / "images" / "demo-grid.png"
MODALITIES = ("chest_xray", "brain_mri", "fundus")
TILE = 192  # pixels a side
GAP = 4


def _decoded(value) -> Image.Image:
    return Image.open(io.BytesIO(value["bytes"])).convert("RGB")


def chosen_rows(dataset: Path) -> list[tuple[dict, dict]]:
    """(dpo_pairs row, sft row) per modality: the task shown in that modality's row of the picture."""
    from medbanana.loaders import load_medbanana

    pairs = load_medbanana(dataset, "dpo_pairs", decode_images=False)
    sft = load_medbanana(dataset, "sft", decode_images=False)
    accepted = {row["uid"]: row for row in sft}
    picked = []
    for modality in MODALITIES:
        candidates = [row for row in pairs if row["modality"] == modality and row["task"] == "add"
                      and row["rejected_round"] == 1
                      and row["rejected_image"] is not None and row["uid"] in accepted
                      and accepted[row["uid"]]["edit_mask"] is not None]
        if not candidates:
            raise ValueError(f"{dataset}: no {modality} task accepted after a rejected round 1 (is it the demo?)")

        def most_changed_first(row: dict) -> tuple[int, str]:
            mask = np.asarray(Image.open(io.BytesIO(accepted[row["uid"]]["edit_mask"]["bytes"])))
            return -int((mask > 0).sum()), row["uid"]

        best = min(candidates, key=most_changed_first)
        picked.append((best, accepted[best["uid"]]))
    return picked


def figure(dataset: Path) -> Image.Image:
    rows = chosen_rows(dataset)
    width = 5 * TILE + 4 * GAP
    height = len(rows) * TILE + (len(rows) - 1) * GAP
    canvas = Image.new("RGB", (width, height), "white")
    for r, (pair, accepted) in enumerate(rows):
        tiles = [pair["source_image"], pair["rejected_image"], pair["chosen_image"], accepted["edit_mask"],
                 accepted["region_mask"]]
        for c, value in enumerate(tiles):
            tile = _decoded(value).resize((TILE, TILE), Image.Resampling.LANCZOS)
            canvas.paste(tile, (c * (TILE + GAP), r * (TILE + GAP)))
    return canvas


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--demo", type=Path, help="a folder written by `medbanana demo --out` (default: run a fresh "
                                              "default demo in a temporary folder)")
    ap.add_argument("--out", type=Path, default=FIGURE, help=f"the PNG to write (default {FIGURE})")
    args = ap.parse_args(argv)
    if args.demo is None:
        from medbanana.demo import run_demo

        with tempfile.TemporaryDirectory(prefix="medbanana-figure-") as tmp:
            run_demo(Path(tmp) / "demo-run", quiet=True)
            picture = figure(Path(tmp) / "demo-run" / "dataset")
    else:
        picture = figure(args.demo / "dataset")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    picture.save(args.out, optimize=True)
    print(f"wrote {args.out} ({picture.width}×{picture.height})")


if __name__ == "__main__":
    main()
