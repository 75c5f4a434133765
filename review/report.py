"""`medbanana review report`: what a review's answers say, as OUT/report.md, OUT/report.json and PNG figures.

* Coverage: items, raters, answers, how many items got K answers.
* Rubric: inter-rater agreement per dimension (percent agreement; Cohen's kappa with exactly two raters, over the
  items both answered; Fleiss' kappa over the items with the most common number of answers; Krippendorff's alpha
  over every answer) and judge vs human (the raters' majority per item against the recorded verdict: agreement,
  Cohen's kappa, confusion matrices: judge_confusion.png, agreement.png).
* Realism: detection accuracy (the guess names what was shown) and AUROC (P(edited) = 0.5 +/- confidence/10) per
  modality and overall (realism.png); resampled by source image, so a source's real and edited items stay together.

Every value comes with a seeded percentile-bootstrap 95 % interval; a statistic that is undefined for the answers at
hand (one rater, one answer value, too few items) is reported as such, with the reason.
"""

from __future__ import annotations

import json
import re
from collections import Counter, defaultdict
from dataclasses import asdict
from pathlib import Path

from ..generation.tables import Table
from ..evaluation.agreement import cohen_kappa, human_agreement
from ..generation.extras import require
from ..generation.files import atomic_write_text, write_figure
from ..generation.records import VERDICT_BOOLEANS, as_bool
from ..evaluation.probe_statistics import auroc
from .reliability import (
    MIN_UNITS_FOR_INTERVAL,
    bootstrap_interval,
    category_counts,
    edited_probability,
    fleiss_kappa,
    krippendorff_alpha,
    majority,
    pair_agreement,
    percent_agreement,
    reliability_matrix,
)
from .blinding import leakage_warning
from ..generation.dataset.review_folder import CALIBRATION, IN_TURNS, ReviewItem, StoredAnswer
from .store import ReviewStore

NEEDED_FOR = "medbanana review report"
NO_PAIRS = "no item has two answers"
ONE_VALUE = "one answer value only throughout (chance agreement is total)"
STATISTICS = {"percent_agreement": "percent agreement", "cohen_kappa": "Cohen's kappa",
              "fleiss_kappa": "Fleiss' kappa", "krippendorff_alpha": "Krippendorff's alpha"}


def write_report(folder: Path, out_dir: Path, bootstrap: int = 2000, seed: int = 0) -> Path:
    """Compute the review's statistics and write report.md, report.json and the figures into `out_dir`."""
    require("krippendorff", needed_for=NEEDED_FOR, extra="review")
    plt = _pyplot()
    store = ReviewStore.open(folder)
    settings, items, answers = store.settings, store.items(), store.answers()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    result = {"review": str(Path(folder).resolve()), "settings": asdict(settings), "bootstrap": bootstrap,
              "seed": seed, "coverage": coverage(items, answers, settings.raters_per_item)}
    lines = ["# Expert review report", "", (f"Review `{folder}`: {settings.mode} mode, {settings.raters_per_item} "
             f"rater(s) wanted per item, sampled from `{settings.source}` (seed {settings.seed}). Intervals: 95 % "
             f"percentile bootstrap, {bootstrap} resamples, seed {seed}."), "", _blinding_line(settings), "",
             sample_line(settings.design), "",
             *_coverage_lines(result["coverage"])]
    if not answers:
        lines += ["No answers yet: there is nothing to compute.", ""]
    elif settings.mode == "rubric":
        by_item = _by_item(answers)
        result["inter_rater"] = inter_rater(items, by_item, repeats=bootstrap, seed=seed)
        result["judge_vs_human"] = judge_vs_human(items, by_item, repeats=bootstrap, seed=seed)
        lines += _inter_rater_lines(result["inter_rater"], out, plt)
        lines += _judge_lines(result["judge_vs_human"], out, plt)
    else:
        result["realism"] = realism(items, answers, repeats=bootstrap, seed=seed)
        lines += _realism_lines(result["realism"], out, plt)
    atomic_write_text(out / "report.json", json.dumps(result, indent=2, ensure_ascii=False) + "\n")
    atomic_write_text(out / "report.md", re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).rstrip() + "\n")
    return out / "report.md"


# ---------------------------------------------------------------- computing

def coverage(items: list[ReviewItem], answers: list[StoredAnswer], wanted: int) -> dict:
    per_item = Counter(a.item_id for a in answers)
    with_k = Counter(per_item.get(item.item_id, 0) for item in items)
    return {"items": len(items), "answers": len(answers), "raters": len({a.rater for a in answers}),
            "raters_per_item": wanted, "items_complete": sum(per_item.get(i.item_id, 0) >= wanted for i in items),
            "items_with_k_answers": {str(k): with_k[k] for k in sorted(with_k)},
            "answers_per_rater": dict(sorted(Counter(a.rater for a in answers).items()))}


def _by_item(answers: list[StoredAnswer]) -> dict[str, list[StoredAnswer]]:
    grouped: dict[str, list[StoredAnswer]] = defaultdict(list)
    for answer in answers:
        grouped[answer.item_id].append(answer)
    return grouped


def _stat(value: float | None, interval, n: int, why: str, unit: str = "item") -> dict:
    """One statistic: value, interval, how many units it used, and why it is missing (value or interval)."""
    if value is None:
        note = why
    elif interval is None:
        note = (f"no interval: {n} {unit}(s) are too few to resample" if n < MIN_UNITS_FOR_INTERVAL
                else "no interval: no resample gave a value")
    else:
        note = None
    return {"value": value, "low": interval[0] if interval and value is not None else None,
            "high": interval[1] if interval and value is not None else None, "n": n, "note": note}


def _kappa_of_codes(pairs) -> float | None:
    """evaluation's Cohen's kappa of an N x 2 array of labels (how the bootstrap resamples pairs)."""
    return cohen_kappa(zip(pairs[:, 0].tolist(), pairs[:, 1].tolist()))


def inter_rater(items: list[ReviewItem], by_item: dict, *, repeats: int, seed: int) -> dict:
    import numpy as np

    raters = sorted({a.rater for given in by_item.values() for a in given})
    sizes = Counter(len(given) for given in by_item.values() if len(given) >= 2)
    modal = max(sizes, key=lambda k: (sizes[k], k)) if sizes else None
    out = {"raters": raters, "fleiss_answers_per_item": modal, "fleiss_items": sizes.get(modal, 0),
           "dimensions": {}}
    boot = {"repeats": repeats, "seed": seed}
    for dim in VERDICT_BOOLEANS:
        units = [[(a.rater, getattr(a.answer, dim)) for a in by_item[i.item_id] if getattr(a.answer, dim) is not None]
                 for i in items if i.item_id in by_item]
        paired = [u for u in units if len(u) >= 2]
        labels = [[label for _, label in u] for u in paired]
        shares = np.array([pair_agreement(u) for u in labels])
        entry = {"percent_agreement": _stat(percent_agreement(labels), bootstrap_interval(shares, np.mean, **boot),
                                            len(labels), NO_PAIRS)}
        if len(raters) == 2:
            pairs = [(d[raters[0]], d[raters[1]]) for u in paired if len(d := dict(u)) == 2]
            entry["cohen_kappa"] = _stat(cohen_kappa(pairs), bootstrap_interval(
                np.array(pairs, dtype=int).reshape(-1, 2), _kappa_of_codes, **boot), len(pairs),
                ONE_VALUE if pairs else "the two raters share no item")
        else:
            entry["cohen_kappa"] = _stat(None, None, 0, f"needs exactly two raters; {len(raters)} answered")
        table = np.array(category_counts([u for u in labels if len(u) == modal], [True, False]), dtype=float)
        entry["fleiss_kappa"] = _stat(fleiss_kappa(table), bootstrap_interval(table, fleiss_kappa, **boot),
                                      len(table), ONE_VALUE if len(table) else NO_PAIRS)
        matrix = reliability_matrix(paired)
        entry["krippendorff_alpha"] = _stat(krippendorff_alpha(matrix), bootstrap_interval(
            matrix.T, lambda columns: krippendorff_alpha(columns.T), **boot), len(paired),
            ONE_VALUE if paired else NO_PAIRS)
        out["dimensions"][dim] = entry
    return out


def _share_equal(pairs) -> float:
    return float((pairs[:, 0] == pairs[:, 1]).mean())


def judge_vs_human(items: list[ReviewItem], by_item: dict, *, repeats: int, seed: int) -> dict:
    """The raters' majority per item (ties left out) against the verdict the run recorded for the edit."""
    import numpy as np

    answered = [i for i in items if i.item_id in by_item]
    human = {i.item_id: {d: majority([getattr(a.answer, d) for a in by_item[i.item_id]
                                      if getattr(a.answer, d) is not None]) for d in VERDICT_BOOLEANS}
             for i in answered}
    judge = {i.item_id: {d: as_bool(i.judge.get(d)) for d in VERDICT_BOOLEANS} for i in answered if i.judge}
    compared = human_agreement(judge, human)
    out = {"items_answered": len(answered), "items_with_verdict": len(judge), "dimensions": {}}
    boot = {"repeats": repeats, "seed": seed}
    for dim in VERDICT_BOOLEANS:
        found = compared["dimensions"].get(dim)
        if found is None:
            out["dimensions"][dim] = {"edits": 0, "note": "no item has both a recorded verdict and a majority"}
            continue
        pairs = np.array([(judge[i][dim], human[i][dim]) for i in judge if judge[i][dim] is not None
                          and human[i][dim] is not None], dtype=int)
        out["dimensions"][dim] = {
            **found, "ties": sum(human[i][dim] is None for i in judge),
            "agreement": _stat(found["agreement"], bootstrap_interval(pairs, _share_equal, **boot), len(pairs), ""),
            "kappa": _stat(found["kappa"], bootstrap_interval(pairs, _kappa_of_codes, **boot), len(pairs),
                           ONE_VALUE)}
    return out


def realism(items: list[ReviewItem], answers: list[StoredAnswer], *, repeats: int, seed: int) -> dict:
    """Accuracy and AUROC per modality and overall; units for resampling are source images (pair ids)."""
    import numpy as np

    by_id = {i.item_id: i for i in items}
    records = np.array([(by_id[a.item_id].shown == "edited", a.answer.guess == by_id[a.item_id].shown,
                         edited_probability(a.answer.guess, a.answer.confidence)) for a in answers], dtype=float)
    groups: dict[str, dict[str, list[int]]] = defaultdict(lambda: defaultdict(list))
    for n, a in enumerate(answers):
        item = by_id[a.item_id]
        for name in ("all", item.modality or "unknown"):
            groups[name][item.pair_id].append(n)

    def accuracy(units) -> float:
        return float(records[np.concatenate(units), 1].mean())

    def area(units) -> float | None:
        chosen = records[np.concatenate(units)]
        return auroc(chosen[:, 2], chosen[:, 0])

    rows = []
    for name in ["all", *sorted(g for g in groups if g != "all")]:
        units = [np.array(members) for members in groups[name].values()]
        chosen = records[np.concatenate(units)]
        boot = {"repeats": repeats, "seed": seed}
        rows.append({"group": name, "answers": len(chosen), "edited": int(chosen[:, 0].sum()),
                     "real": int(len(chosen) - chosen[:, 0].sum()), "sources": len(units),
                     "accuracy": _stat(accuracy(units), bootstrap_interval(units, accuracy, **boot), len(units), "",
                                       unit="source"),
                     "auroc": _stat(area(units), bootstrap_interval(units, area, **boot), len(units),
                                    "needs answers on both real and edited images", unit="source")})
    per_rater: dict[str, list[float]] = defaultdict(list)
    for a, record in zip(answers, records):
        per_rater[a.rater].append(record[1])
    return {"groups": rows, "raters": {r: {"answers": len(v), "accuracy": sum(v) / len(v)}
                                       for r, v in sorted(per_rater.items())}}


# ---------------------------------------------------------------- writing

def _pyplot():
    matplotlib = require("matplotlib", needed_for=NEEDED_FOR, extra="review")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _cell(stat: dict, percent: bool = False) -> str:
    if stat["value"] is None:
        return "cannot be computed"
    show = (lambda v: f"{v:.1%}") if percent else (lambda v: f"{v:.3f}")
    if stat["low"] is None:
        return show(stat["value"])
    return f"{show(stat['value'])} ({show(stat['low'])} to {show(stat['high'])})"


def _notes(entries: dict[str, dict[str, dict]], names: dict[str, str]) -> list[str]:
    """One line per (statistic, reason): the dimensions it applies to."""
    grouped: dict[tuple[str, str], list[str]] = defaultdict(list)
    for dim, entry in entries.items():
        for key, label in names.items():
            if isinstance(entry.get(key), dict) and entry[key]["note"]:
                value = entry[key]["value"]
                grouped[(label, ("cannot be computed: " if value is None else "") + entry[key]["note"])].append(dim)
    return [f"- {label}, {', '.join(dims)}: {why}." for (label, why), dims in grouped.items()]


def sample_line(design: str) -> str:
    """Whether the review's labels are a calibration sample, the only kind `calibrate` states a guarantee with."""
    if design == CALIBRATION:
        return ("Sample: a calibration sample (seeded random over the judged attempts, stratified by modality and "
                "direction, each item's inclusion probability recorded): its labels give unbiased precision and "
                "yield estimates and can calibrate an acceptance rule (the `calibrate` command).")
    return (f"Sample: {design or IN_TURNS}, **not a calibration sample**: its items were not drawn at random from "
            "the judged attempts with known probabilities, so precision or approval rates computed from its labels "
            "may be biased, and the `calibrate` command states no guarantee with them; draw a calibration sample "
            "with `review SOURCE --out DIR --calibration`.")


def _blinding_line(settings) -> str:
    """How well the instructions shown told round 1 from later rounds (measured when the review was created)."""
    if settings.round_auroc is None:
        return f"Blinding: {settings.round_auroc_note or 'not measured (a review made before it was)'}."
    warning = leakage_warning(settings.round_auroc)
    return (f"Blinding: the instructions shown tell round 1 from later rounds with AUROC {settings.round_auroc:.2f} "
            f"(0.5: not at all; {settings.round_auroc_note})." + (f" **{warning}**" if warning else ""))


def _coverage_lines(c: dict) -> list[str]:
    ks = Table(["answers per item", "items"], rows=[[int(k), n] for k, n in c["items_with_k_answers"].items()])
    per_rater = Table(["rater", "answers"], rows=[[r, n] for r, n in c["answers_per_rater"].items()])
    return ["## Coverage", "", (f"{c['items']} items, {c['raters']} rater(s), {c['answers']} answers; "
            f"{c['items_complete']} of {c['items']} items have the {c['raters_per_item']} answer(s) wanted."), "",
            ks.markdown(), "", *([per_rater.markdown(), ""] if c["answers_per_rater"] else [])]


def _inter_rater_lines(result: dict, out: Path, plt) -> list[str]:
    table = Table(["dimension", "items with 2+ answers", *STATISTICS.values()])
    for dim, e in result["dimensions"].items():
        table.rows.append([dim, e["percent_agreement"]["n"], _cell(e["percent_agreement"], percent=True),
                           *(_cell(e[key]) for key in list(STATISTICS)[1:])])
    fleiss = (f"Fleiss' kappa uses the {result['fleiss_items']} item(s) with {result['fleiss_answers_per_item']} "
              "answers (the most common number of answers)" if result["fleiss_answers_per_item"]
              else "Fleiss' kappa has no item with two answers")
    lines = ["## Inter-rater agreement", "", (f"Raters: {', '.join(result['raters'])}. Percent agreement: share of "
             "agreeing rater pairs per item. Cohen's kappa: exactly two raters, items both answered. "
             f"{fleiss}. Krippendorff's alpha (nominal): every answer, missing ones allowed. Value (95 % interval)."),
             "", table.markdown(), "", *_notes(result["dimensions"], STATISTICS), ""]
    drawn = _draw_bars(plt, out / "agreement.png", "Inter-rater agreement", {
        label: [(dim, e[key]) for dim, e in result["dimensions"].items()]
        for key, label in list(STATISTICS.items())[1:]})
    return lines + ([f"![inter-rater agreement]({drawn.name})", ""] if drawn else [])


def _judge_lines(result: dict, out: Path, plt) -> list[str]:
    lines = ["## Judge vs human", "", (f"The raters' majority per item (ties left out) against the judge's recorded "
             f"verdict: {result['items_with_verdict']} of {result['items_answered']} answered items have a verdict."),
             ""]
    table = Table(["dimension", "items", "majority ties", "agreement", "Cohen's kappa", "judge stricter",
                   "judge more lenient"], formats={"judge stricter": ".1%", "judge more lenient": ".1%"})
    matrices = []
    for dim, e in result["dimensions"].items():
        if not e["edits"]:
            table.rows.append([dim, 0, None, "cannot be computed", "cannot be computed", None, None])
            continue
        c = e["confusion"]
        table.rows.append([dim, e["edits"], e["ties"], _cell(e["agreement"], percent=True), _cell(e["kappa"]),
                           c["judge_no_human_yes"] / e["edits"], c["judge_yes_human_no"] / e["edits"]])
        matrices.append((dim, c))
    notes = _notes({d: e for d, e in result["dimensions"].items() if e["edits"]}, {"agreement": "agreement",
                                                                                     "kappa": "Cohen's kappa"})
    notes += [f"- {d}: cannot be computed: {e['note']}." for d, e in result["dimensions"].items() if not e["edits"]]
    lines += [table.markdown(), "", *notes, "", "Confusion matrices (rows: judge, columns: human majority):", ""]
    for dim, c in matrices:
        matrix = Table([f"{dim}: judge \\ human", "yes", "no"],
                       rows=[["yes", c["judge_yes_human_yes"], c["judge_yes_human_no"]],
                             ["no", c["judge_no_human_yes"], c["judge_no_human_no"]]])
        lines += [matrix.markdown(), ""]
    if matrices:
        _draw_confusions(plt, out / "judge_confusion.png", matrices)
        lines += ["![judge vs human confusion matrices](judge_confusion.png)", ""]
    return lines


def _realism_lines(result: dict, out: Path, plt) -> list[str]:
    table = Table(["modality", "answers", "real", "edited", "sources", "accuracy", "AUROC"])
    for r in result["groups"]:
        table.rows.append([r["group"], r["answers"], r["real"], r["edited"], r["sources"],
                           _cell(r["accuracy"], percent=True), _cell(r["auroc"])])
    raters = Table(["rater", "answers", "accuracy"], formats={"accuracy": ".1%"},
                   rows=[[name, v["answers"], v["accuracy"]] for name, v in result["raters"].items()])
    lines = ["## Realism: can experts tell edits from real images?", "", ("Accuracy: share of answers whose guess "
             "(real or edited) names what was shown. AUROC: the answers scored P(edited) = 0.5 ± confidence/10 "
             "against the truth; 0.5 = chance (edits pass as real), 1.0 = always detected. Intervals resample "
             "whole source images."), "", table.markdown(), "",
             *_notes({r["group"]: r for r in result["groups"]}, {"accuracy": "accuracy", "auroc": "AUROC"}), "",
             "Per rater:", "", raters.markdown(), ""]
    drawn = _draw_bars(plt, out / "realism.png", "Expert detection of edits", {
        label: [(r["group"], r[key]) for r in result["groups"]] for key, label in (("accuracy", "accuracy"),
                                                                                   ("auroc", "AUROC"))}, chance=0.5)
    return lines + ([f"![realism detection]({drawn.name})", ""] if drawn else [])


def _draw_bars(plt, path: Path, title: str, series: dict[str, list[tuple[str, dict]]],
               chance: float | None = None) -> Path | None:
    """Grouped bars with interval whiskers; statistics that cannot be computed are left out. None if none can."""
    series = {label: points for label, points in series.items() if any(s["value"] is not None for _, s in points)}
    if not series:
        return None
    names = [name for name, _ in next(iter(series.values()))]
    width = 0.8 / len(series)
    fig, ax = plt.subplots(figsize=(max(6.0, 1.3 * len(names)), 3.6))
    for n, (label, points) in enumerate(series.items()):
        at = [(i + (n - (len(series) - 1) / 2) * width, s) for i, (_, s) in enumerate(points) if s["value"] is not None]
        ax.bar([x for x, _ in at], [s["value"] for _, s in at], width, label=label)
        ranged = [(x, s) for x, s in at if s["low"] is not None]
        if ranged:
            ax.errorbar([x for x, _ in ranged], [s["value"] for _, s in ranged], fmt="none", capsize=3,
                        ecolor="black", yerr=[[s["value"] - s["low"] for _, s in ranged],
                                              [s["high"] - s["value"] for _, s in ranged]])
    if chance is not None:
        ax.axhline(chance, color="grey", linestyle="--", linewidth=1, label="chance")
    ax.axhline(0, color="black", linewidth=0.6)
    ax.set_xticks(range(len(names)), names, rotation=20, ha="right")
    ax.set_title(title + " (whiskers: 95 % interval)")
    ax.legend(fontsize=8, loc="best")
    write_figure(fig, path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path


def _draw_confusions(plt, path: Path, matrices: list[tuple[str, dict]]) -> None:
    fig, axes = plt.subplots(1, len(matrices), figsize=(2.6 * len(matrices), 2.8), squeeze=False)
    for ax, (dim, c) in zip(axes[0], matrices):
        cells = [[c["judge_yes_human_yes"], c["judge_yes_human_no"]], [c["judge_no_human_yes"], c["judge_no_human_no"]]]
        ax.imshow(cells, cmap="Blues", vmin=0)
        for r in range(2):
            for k in range(2):
                dark = cells[r][k] > max(max(cells[0]), max(cells[1])) / 2
                ax.text(k, r, str(cells[r][k]), ha="center", va="center", fontsize=11,
                        color="white" if dark else "black")
        ax.set_xticks([0, 1], ["yes", "no"])
        ax.set_yticks([0, 1], ["yes", "no"])
        ax.set_xlabel("human majority")
        ax.set_ylabel("judge")
        ax.set_title(dim, fontsize=9)
    fig.tight_layout()
    write_figure(fig, path, dpi=120, bbox_inches="tight")
    plt.close(fig)
