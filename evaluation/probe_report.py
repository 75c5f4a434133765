"""The probes' part of `medbanana eval`'s output: tables (markdown + CSV), JSON, figures (PNG), per-sample columns,
and the sections appended to report.md.

    separability.{json,md,csv}, separability.png      AUROC raw and controlled, 95 % interval, p-value, per group
    counterfactual.{json,md,csv}, counterfactual.png  per disease and direction; the figure: distributions of delta
    probe_samples.csv                                 one row per edited image: p_edit_raw, p_edit_controlled,
                                                      p_source, p_edit, delta, crossed, other_change
"""

from __future__ import annotations

import csv
import io
import json
import os
from pathlib import Path

from ..generation.files import atomic_write_text, open_owned, write_figure
from ..generation.tables import Table

FEW_SOURCES = 20
SEPARABILITY_NOTE = (
    "Separability: can a linear probe on weight-free forensics features (noise residual, high-pass, block grid, "
    "radial spectrum; raw adds file size, bits per pixel, colour spread and JPEG quantisation tables) tell real "
    "source images from edits? It is fitted in {folds}-fold cross-validation grouped by source image: every image is "
    "scored by a model that never saw its source.\n\n"
    "- **AUROC**: the chance that the probe ranks a random edit above a random real image. 0.5 = it cannot tell "
    "them apart, 1.0 = it separates them perfectly.\n"
    "- **95% CI**: the range of AUROC another sample of as many source images would plausibly give ({bootstrap} "
    "draws of source images, the probe refitted in each; it excludes 0.5 exactly when a two-sided 5% permutation "
    "test rejects). It narrows as sources are added.\n"
    "- **p**: one-sided permutation test, {permutations} relabellings that keep each source with its edits: the "
    "share whose AUROC reaches the observed one. p < 0.05 = separable beyond chance; the smallest possible p is "
    "{p_min:.3f}.\n"
    "- **n**: *real* source images, *compared* edits (in *real vs real*, the other half of the real images), "
    "*sources* the independent units the interval and p rest on.\n"
    "- *Raw* includes what the pipeline leaves (size, format, compression). *Controlled* re-encodes both sides "
    "identically ({size}² grey, JPEG quality {quality}) first: what remains is content and earlier history. "
    "*Real vs real* splits the real images at random: chance on the same data.\n\n"
    "What it cannot show: an AUROC near 0.5 or p above 0.05 does not show that edits are realistic, only that this "
    "probe finds no difference at this n (the interval's upper end is the largest separability not ruled out); a "
    "learned detector may still separate them. A high AUROC shows the edits differ in something the features "
    "measure (an added finding is such a difference), not that a reader would call them fake. Rows share their "
    "real images, so their p-values are not independent tests.")
COUNTERFACTUAL_NOTE = (
    "Counterfactual validity: classifier `{classifier}` scores source and edit. delta = mean change of the target "
    "finding's probability (add should be > 0, remove < 0); right direction = share of edits whose delta has the "
    "claimed sign; crossed = share moved across {threshold} in the claimed direction; other change = mean absolute "
    "change of the classifier's other findings (minimality: near 0 is better).")


def separability_table(result: dict) -> Table:
    columns = ["features", "modality", "direction", "comparison", "real", "compared", "sources", "AUROC raw",
               "95% CI raw", "p raw", "AUROC controlled", "95% CI controlled", "p controlled"]
    table = Table(columns, formats={"AUROC raw": ".3f", "AUROC controlled": ".3f", "p raw": ".3f",
                                    "p controlled": ".3f"})
    for row in result["rows"]:
        table.rows.append([row["features"], row["modality"], row["direction"], row["comparison"], row["real"],
                           row["compared"], row["sources"], row["auroc_raw"], _interval(row, "raw"), row["p_raw"],
                           row["auroc_controlled"], _interval(row, "controlled"), row["p_controlled"]])
    return table


def separability_reading(row: dict) -> str:
    """One row in words: what its controlled and raw figures say, with p, the interval and n."""
    def figures(which: str) -> str:
        p = row[f"p_{which}"]
        return (f"{which} AUROC {row[f'auroc_{which}']:.3f} (95% CI {_interval(row, which)}, "
                + ("no permutation test)" if p is None else f"p = {p:.3f})"))

    name = f"{row['features']} {row['modality']} {row['direction']}, {row['comparison']} ({row['sources']:,} sources)"
    if row["auroc_controlled"] is None or row["p_controlled"] is None:
        return f"{name}: too few images of one side to probe."
    found = {which: row[f"p_{which}"] is not None and row[f"p_{which}"] < 0.05 for which in ("raw", "controlled")}
    if found["controlled"]:
        verdict = "separable beyond chance even when both sides are re-encoded alike"
    elif found["raw"]:
        verdict = ("separable as stored, not once re-encoded alike: what separates them is most likely the "
                   "pipeline's own traces (size, format, compression)")
    else:
        verdict = (f"no difference found at this n; an AUROC up to {row['high_controlled']:.3f} (controlled) is "
                   "not ruled out")
    if row["comparison"] == "real vs real" and (found["raw"] or found["controlled"]):
        verdict += " — for two halves of the same real images this is a chance finding or a split along a real "\
                   "difference between sources (site, scanner): read the other rows of this modality with care"
    return f"{name}: {figures('controlled')}, {figures('raw')}: {verdict}."


def _interval(row: dict, which: str) -> str | None:
    low, high = row[f"low_{which}"], row[f"high_{which}"]
    return None if low is None else f"{low:.3f}–{high:.3f}"


def counterfactual_table(result: dict) -> Table:
    columns = ["modality", "disease", "direction", "edits", "mean delta", "right direction", "crossed",
               "other change"]
    table = Table(columns, formats={"mean delta": "+.3f", "right direction": ".1%", "crossed": ".1%",
                                    "other change": ".3f"})
    for row in result["rows"]:
        table.rows.append([row["modality"], row["disease"], row["direction"], row["edits"], row["mean_delta"],
                           row["right_direction"], row["crossed"], row["other_change"]])
    return table


def write_probe_outputs(out: Path, separability: dict | None, counterfactual: dict | None) -> list[str]:
    """Write every probe file into `out` and append the probes' sections to report.md; returns the figure notes."""
    out = Path(out)
    sections, notes = [], []
    if separability is not None:
        s = separability["settings"]
        sections += _section(out, "separability", "Separability (real vs edited)", separability,
                             separability_table, separability_figure, notes,
                             SEPARABILITY_NOTE.format(folds=s["folds"], size=s["size"], quality=s["quality"],
                                                      bootstrap=s["bootstrap"], permutations=s["permutations"],
                                                      p_min=1 / (1 + s["permutations"])))
        sections += [f"- {separability_reading(row)}" for row in separability["rows"]] + [""]
        few = sum(row["sources"] < FEW_SOURCES for row in separability["rows"])
        if few:
            sections += [(f"{few:,} rows rest on fewer than {FEW_SOURCES} source images: only a large difference "
                          "can reach p < 0.05 there (see how wide the interval is)."), ""]
        if separability["unreadable"]:
            sections += [f"{len(separability['unreadable']):,} images could not be read and were left out.", ""]
    if counterfactual is not None:
        s = counterfactual["settings"]
        sections += _section(out, "counterfactual", "Counterfactual validity", counterfactual, counterfactual_table,
                             counterfactual_figure, notes,
                             COUNTERFACTUAL_NOTE.format(classifier=s["classifier"], threshold=s["threshold"]))
        if counterfactual["not_covered"]:
            sections += ["Not scored (the classifier has no output for the disease): " + ", ".join(
                f"{d} {n:,}" for d, n in sorted(counterfactual["not_covered"].items())) + ".", ""]
    _write_sample_columns(out / "probe_samples.csv", separability, counterfactual)
    report = out / "report.md"
    existing = _read_own(report) or "# Edit evaluation\n"
    atomic_write_text(report, existing.rstrip("\n") + "\n\n" + "\n".join(sections + [f"- {n}" for n in notes]))
    return notes


def _section(out: Path, name: str, title: str, result: dict, make_table, make_figure, notes: list,
             note: str) -> list[str]:
    """Write NAME.{md,csv,json,png}; the report's lines for it (the figure's note goes to `notes`)."""
    table = make_table(result)
    table.write(out, name)
    _dump(out / f"{name}.json", result)
    notes += _figure(make_figure, result, out / f"{name}.png")
    return [f"## {title}", "", note, "", table.markdown(), ""]


def _read_own(path: Path) -> str | None:
    """The text of eval's own report at `path` (None if there is none), never read through a link or from a FIFO."""
    try:
        with os.fdopen(open_owned(path), "rb") as fh:
            return fh.read().decode("utf-8", errors="replace")
    except FileNotFoundError:
        return None


def _dump(path: Path, data: dict) -> None:
    atomic_write_text(path, json.dumps(data, indent=2, ensure_ascii=False, default=float))


def _write_sample_columns(path: Path, separability: dict | None, counterfactual: dict | None) -> None:
    rows: dict[str, dict] = {}
    for image in (separability or {}).get("images", []):
        if image["role"] != "real":
            rows.setdefault(image["id"], {"id": image["id"]}).update(
                {k: v for k, v in image.items() if k.startswith("p_edit_")})
    for record in (counterfactual or {}).get("samples", []):
        rows.setdefault(record["id"], {"id": record["id"]}).update(
            {k: record[k] for k in ("p_source", "p_edit", "delta", "crossed", "other_change")})
    columns = ["id", "p_edit_raw", "p_edit_controlled", "p_source", "p_edit", "delta", "crossed", "other_change"]
    if any("p_edit_raw_pretrained" in row for row in rows.values()):
        columns[3:3] = ["p_edit_raw_pretrained", "p_edit_controlled_pretrained"]
    buffer = io.StringIO(newline="")
    writer = csv.DictWriter(buffer, columns, restval="")
    writer.writeheader()
    writer.writerows(rows.values())
    atomic_write_text(path, buffer.getvalue())


def _figure(draw, result: dict, path: Path) -> list[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return [f"{path.name} not drawn: matplotlib missing (pip install 'medbanana[eval]')"]
    fig = draw(plt, result)
    if fig is None:
        return []
    write_figure(fig, path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return []


def separability_figure(plt, result: dict):
    rows = result["rows"]
    if not rows:
        return None
    fig, ax = plt.subplots(figsize=(max(5, 1.1 * len(rows)), 3.6))
    for offset, which, colour in ((-0.18, "raw", "tab:red"), (0.18, "controlled", "tab:blue")):
        xs = [i + offset for i in range(len(rows))]
        values = [r[f"auroc_{which}"] if r[f"auroc_{which}"] is not None else float("nan") for r in rows]
        errors = [[max(0.0, v - (r[f"low_{which}"] or v)) for v, r in zip(values, rows)],
                  [max(0.0, (r[f"high_{which}"] or v) - v) for v, r in zip(values, rows)]]
        ax.bar(xs, values, width=0.36, color=colour, label=which, yerr=errors, capsize=3)
    ax.axhline(0.5, color="grey", linestyle="--", linewidth=1)
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels([f"{r['features']}\n{r['modality']}\n{r['direction']}\n{r['comparison']}" for r in rows],
                       fontsize=6)
    ax.set_ylim(0, 1.05)
    ax.set_ylabel("AUROC (0.5 = indistinguishable)")
    ax.legend(fontsize=8)
    return fig


def counterfactual_figure(plt, result: dict):
    samples = result["samples"]
    directions = sorted({s["direction"] for s in samples})
    if not directions:
        return None
    fig, axes = plt.subplots(1, len(directions), figsize=(6 * len(directions), 3.8), squeeze=False)
    for ax, direction in zip(axes[0], directions):
        diseases = sorted({s["disease"] for s in samples if s["direction"] == direction})
        data = [[s["delta"] for s in samples if s["direction"] == direction and s["disease"] == d] for d in diseases]
        ax.boxplot(data, showfliers=True)
        ax.set_xticks(range(1, len(diseases) + 1))
        ax.set_xticklabels(diseases, rotation=45, ha="right", fontsize=7)
        ax.axhline(0, color="grey", linestyle="--", linewidth=1)
        ax.set_title(f"{direction}: change of the target probability", fontsize=9)
        ax.set_ylabel("p(edit) − p(source)")
    return fig
