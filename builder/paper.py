"""The paper's Table 1, Table 2 (with the most frequent failure reasons) and Figure 3, from a build's statistics.

The dataset card embeds them (`card_section`, `save_figure3`) and `medbanana stats` writes them to files.

Table 1: per modality x direction, the diseases, successes, failures, tasks stopped by API failures, success rate
(successes / (successes + failures)) and the average round of success. Table 2: the pass rate of each rubric
dimension over all judged attempts, with its weight; then the most frequent failure reasons (clauses of the
verdict texts of rejected attempts).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from ..generation.extras import require
from ..generation.files import write_figure
from ..generation.outcomes import TaskStatus
from ..generation.records import RUBRIC_WEIGHTS
from ..generation.dataset.folder import FIGURE
from .stats import BuildStats
from ..generation.tables import Table

EVAL_EXTRA = "pip install 'medbanana[eval]'"
TOP_REASONS = 10
DIMENSION_NAMES = {"compliance": "instruction compliance", "structure_reasonable": "structural plausibility",
                   "looks_realistic": "realism", "fidelity_preserved": "fidelity preservation",
                   "qualified": "qualified (all pass)"}
DIMENSION_WEIGHTS = {"compliance": RUBRIC_WEIGHTS["has_disease"], **{k: RUBRIC_WEIGHTS[k] for k in
                     ("structure_reasonable", "looks_realistic", "fidelity_preserved")}}


# ---------------------------------------------------------------- tables

def table1(stats: BuildStats) -> Table:
    groups: dict[tuple, Counter] = {}
    diseases: dict[tuple, set] = {}
    for (modality, direction, disease, status), n in stats.tasks.items():
        groups.setdefault((modality, direction), Counter())[status] += n
        diseases.setdefault((modality, direction), set()).add(disease)
    table = Table(["modality", "direction", "diseases", "success", "failed", "api_failed", "success rate",
                   "avg rounds (success)"], formats={"success rate": ".1%", "avg rounds (success)": ".2f"})
    round_sums, round_counts = Counter(), Counter()  # over successful tasks whose round is known
    for (modality, direction, r), n in stats.success_rounds.items():
        if r is not None:
            round_sums[(modality, direction)] += n * r
            round_counts[(modality, direction)] += n

    def row(label: tuple, counts: Counter, disease_count: int, round_sum: int, round_n: int) -> list:
        decided = counts[TaskStatus.SUCCESS] + counts[TaskStatus.FAILED]
        return [*label, disease_count, *(counts[status] for status in TaskStatus),
                counts[TaskStatus.SUCCESS] / decided if decided else None, round_sum / round_n if round_n else None]

    for key in sorted(groups):
        table.rows.append(row(key, groups[key], len(diseases[key]), round_sums[key], round_counts[key]))
    all_diseases = {(m, d) for (m, _t), ds in diseases.items() for d in ds}
    table.rows.append(row(("total", ""), sum(groups.values(), Counter()), len(all_diseases),
                          sum(round_sums.values()), sum(round_counts.values())))
    return table


def table2(stats: BuildStats) -> Table:
    table = Table(["dimension", "weight", "pass rate", "passed", "judged attempts"],
                  formats={"weight": ".0%", "pass rate": ".1%"})
    for name, (passes, judged) in stats.dimension_counts().items():
        table.rows.append([DIMENSION_NAMES[name], DIMENSION_WEIGHTS.get(name), passes / judged if judged else None,
                           passes, judged])
    return table


def failure_reasons_table(stats: BuildStats, top: int = TOP_REASONS) -> Table:
    passes, judged = stats.dimension_counts()["qualified"]
    rejected = judged - passes
    table = Table(["rank", "failure reason (normalised verdict clause)", "rejected attempts", "share of rejected"],
                  formats={"share of rejected": ".1%"})
    for rank, (reason, n) in enumerate(stats.top_failure_reasons(top), start=1):
        table.rows.append([rank, reason, n, n / rejected if rejected else None])
    return table


# ---------------------------------------------------------------- figure

def require_matplotlib():
    return require("matplotlib.figure", needed_for="Figure 3", extra="eval").Figure


PANEL_TITLES = ("(a) Tasks by modality and direction", "(b) Rounds to success", "(c) Outcomes per disease",
                "(d) Pass rate per rubric dimension")


def figure3(stats: BuildStats):
    """The four-panel figure as a matplotlib Figure (no pyplot state)."""
    Figure = require_matplotlib()
    fig = Figure(figsize=(15, 11), layout="constrained")
    (a, b), (c, d) = fig.subplots(2, 2, gridspec_kw={"width_ratios": [1, 1.2]})
    for ax, title in zip((a, b, c, d), PANEL_TITLES):
        ax.set_title(title, loc="left", fontsize=11)
    groups: dict[tuple, Counter] = {}
    per_disease: dict[tuple, Counter] = {}
    for (modality, direction, disease, status), n in stats.tasks.items():
        groups.setdefault((modality, direction), Counter())[status] += n
        per_disease.setdefault((modality, disease), Counter())[status] += n
    _outcome_bars(a, [f"{m}\n{t}" for m, t in sorted(groups)], [groups[k] for k in sorted(groups)], vertical=True)
    a.set_ylabel("tasks")
    rounds = Counter()
    for (_m, _t, r), n in stats.success_rounds.items():
        if r is not None:
            rounds[r] += n
    if rounds:
        xs = list(range(1, max(rounds) + 1))
        bars = b.bar(xs, [rounds[x] for x in xs], color="#4c72b0")
        total = sum(rounds.values())
        b.bar_label(bars, labels=[f"{rounds[x] / total:.0%}" for x in xs], fontsize=9)
        b.set_xticks(xs)
    _no_data(b, not rounds)
    b.set_xlabel("round of the accepted edit")
    b.set_ylabel("accepted tasks")
    keys = sorted(per_disease)
    _outcome_bars(c, [f"{d} ({m})" for m, d in keys], [per_disease[k] for k in keys], vertical=False)
    c.set_xlabel("tasks (add and remove)")
    dims = [(DIMENSION_NAMES[n], p / j) for n, (p, j) in stats.dimension_counts().items() if j]
    if dims:
        bars = d.bar(range(len(dims)), [100 * v for _n, v in dims], color="#55a868")
        d.bar_label(bars, labels=[f"{v:.1%}" for _n, v in dims], fontsize=9)
        d.set_xticks(range(len(dims)), [n.replace(" ", "\n", 1) for n, _v in dims], fontsize=9)
        d.set_ylim(0, 105)
    _no_data(d, not dims)
    d.set_ylabel("% of judged attempts")
    return fig


def _outcome_bars(ax, labels: list[str], counts: list[Counter], *, vertical: bool) -> None:
    """Stacked success / failed / api_failed bars."""
    positions = list(range(len(labels)))
    bottom = [0] * len(labels)
    draw = ax.bar if vertical else ax.barh
    for status, color in ((TaskStatus.SUCCESS, "#4c72b0"), (TaskStatus.FAILED, "#dd8452"),
                          (TaskStatus.API_FAILED, "#8c8c8c")):
        values = [c[status] for c in counts]
        if any(values):
            extent = {"bottom": bottom} if vertical else {"left": bottom}
            draw(positions, values, label=status, color=color, **extent)
            bottom = [x + y for x, y in zip(bottom, values)]
    if labels:
        (ax.set_xticks if vertical else ax.set_yticks)(positions, labels, fontsize=8 if vertical else 7)
        if vertical:  # room above the bars for the legend (zero-height segments pin autoscaling to the tallest)
            ax.set_ylim(0, 1.15 * max(bottom))
            ax.legend(fontsize=8, loc="upper right")
        else:  # beside the axes: any corner inside would cover the end of some disease's bar
            ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    if not vertical:
        ax.invert_yaxis()
    _no_data(ax, not labels)


def _no_data(ax, empty: bool) -> None:
    if empty:
        ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes, color="grey")


def save_figure3(stats: BuildStats, path: Path) -> Path:
    path = Path(path)
    write_figure(figure3(stats), path, dpi=110)
    return path


# ---------------------------------------------------------------- outputs

def card_section(stats: BuildStats, figure: str | None = FIGURE) -> str:
    """Markdown with Table 1, Table 2, the failure reasons and (when `figure` names the saved PNG, relative to
    the markdown file) Figure 3: what the dataset card and `stats`' report.md embed."""
    parts = ["### Table 1: tasks per modality and direction", "",
             "Success rate = successes / (successes + failures); tasks stopped by API failures are counted apart. "
             "Average rounds over successful tasks.", "", table1(stats).markdown(), "",
             "### Table 2: rubric dimensions over all judged attempts", "", table2(stats).markdown(), "",
             f"Most frequent failure reasons (top {TOP_REASONS}; clauses of the verdict texts of rejected attempts, "
             "numbers and parenthesised details removed):", ""]
    reasons = failure_reasons_table(stats)
    parts += [reasons.markdown() if reasons.rows else "(no rejected attempts with a reason)", ""]
    if figure:
        parts += [f"![Figure 3: success counts by modality and direction; rounds to success; outcomes per disease; "
                  f"pass rate per rubric dimension]({figure})", ""]
    return "\n".join(parts)
