"""The card's "Cost to make this dataset": tokens per role and model as the runs recorded them for every attempt
built, priced with the shipped price table (generation/prices.json, dated) at standard rates."""

from __future__ import annotations

from ..generation.costs import ROLES
from ..generation.pricing import load_prices
from .stats import BuildStats


def cost_lines(stats: BuildStats) -> list[dict]:
    """One entry per (role, model): steps, input and output tokens, USD (None: the model has no price)."""
    prices = load_prices()
    pairs = sorted({(role, model) for (role, model, _) in stats.tokens}, key=lambda p: (ROLES.index(p[0]), p[1]))
    out = []
    for role, model in pairs:
        tokens = {kind: stats.tokens[(role, model, kind)] for kind in ("steps", "input", "output")}
        used = {"input_tokens": tokens["input"], "output_tokens": tokens["output"]}
        usd = 0.0 if not (tokens["input"] or tokens["output"]) else prices.cost("", model, used,
                                                                               calls=max(tokens["steps"], 1))
        out.append({"role": role, "model": model, **tokens, "usd": None if usd is None else round(usd, 4)})
    return out


def cost_json(stats: BuildStats) -> dict:
    lines = cost_lines(stats)
    return {"usd": round(sum(line["usd"] or 0 for line in lines), 4),
            "unpriced_models": sorted({line["model"] for line in lines if line["usd"] is None}),
            "prices_read_on": load_prices().read_on, "lines": lines}


def cost_note(stats: BuildStats, escape) -> str:
    """The section's Markdown; `escape` makes a data value inert (card.md_escape)."""
    lines = cost_lines(stats)
    if not any(line["input"] or line["output"] for line in lines):
        return ("The runs recorded no token usage for the attempts built: made offline (the simulator, a local "
                "editor), or by a version of medbanana that did not record it.")
    rows = "\n".join(f"| {line['role']} | {escape(line['model'])} | {line['steps']:,} | {line['input']:,} | "
                     f"{line['output']:,} | {_usd(line['usd'])} |" for line in lines)
    total = cost_json(stats)
    unpriced = (f" Models without a price in the table, left out of the total: "
                f"{', '.join(escape(m) for m in total['unpriced_models'])}." if total["unpriced_models"] else "")
    return ("| role | model | steps | input tokens | output tokens | USD |\n|---|---|---:|---:|---:|---:|\n" + rows
            + f"\n\nAbout **{total['usd']:,.2f} USD** at the standard prices read on {total['prices_read_on']} "
            "(medbanana's generation/prices.json, which names its sources), thinking tokens counted as output; rounds "
            "made through the Batch API cost half of that, and failed calls whose answers carried no usage are not "
            f"counted.{unpriced}")


def _usd(value: float | None) -> str:
    return "no price" if value is None else f"{value:,.2f}"
