"""`medbanana plan`: generate's selection and backend options -> what the run would cost and how long it would take
(runners/plan.py does the estimate), as text or one JSON object. Nothing is called."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from ..records import DEFAULT_CONCURRENCY, DEFAULT_MAX_ROUNDS
from .options import (add_backend_choice, add_model_options, add_openai_endpoint_options, add_prices_option,
                      add_rate_limits, add_selection_options, add_vertex_options, count)
from .spending import describe_roles, shown, usd_range
from ..failures import EXIT_OK, EXIT_USAGE


def cmd_plan(args) -> int:
    from ..backends.gemini_client import VertexTarget
    from ..backends.settings import DiffusersSettings, GeminiSettings, OpenAISettings
    from ..destinations import ZERO_RETENTION
    from ..pricing import load_prices
    from ..runners.generate import BackendSpec, default_backend, select_tasks, spec_models
    from ..runners.pilot import finished_records, pilot_samples
    from ..runners.plan import PlanSetting, destinations, estimate
    from ..runners.session import in_shard
    from ..sources.scan import Selection

    if args.sources is None:
        print("medbanana plan: --sources is required (the folder `generate --sources` would read)", file=sys.stderr)
        return EXIT_USAGE
    selection = Selection.parse(args.modalities or (), args.diseases or (), args.directions or ())
    named_vertex = bool(args.vertex or args.vertex_project or args.vertex_location)  # as generate decides it
    backend = args.backend or ("gemini" if named_vertex else default_backend())
    roles = {role: getattr(args, role) or backend for role in ("writer", "editor", "judge")}
    spec = BackendSpec(backend, roles, gemini=GeminiSettings(
        writer_model=args.writer_model, editor_model=args.editor_model, judge_model=args.judge_model,
        vertex=named_vertex or VertexTarget.from_environment() is not None, vertex_project=args.vertex_project,
        vertex_location=args.vertex_location), openai=OpenAISettings(
        base_url=args.openai_base_url, model=args.openai_model, writer_model=args.writer_model,
        judge_model=args.judge_model, zero_retention=args.attest_endpoint == ZERO_RETENTION),
        diffusers=DiffusersSettings(model=args.editor_model))
    described = spec_models(spec)
    prices = load_prices(args.prices)
    tasks = [t for t in select_tasks(args.sources, selection, args.modality, args.limit) if in_shard(t, args.shard)]
    if args.out is not None:  # a run to resume: what it finished is not run again
        done = finished_records(args.out)
        tasks = [t for t in tasks if t.uid not in done]
    setting = PlanSetting(described, prices, args.max_rounds, args.batch, args.concurrency, args.rpm, args.tpm)
    pilot = pilot_samples(args.pilot, args.max_rounds) if args.pilot is not None else None
    plan = estimate(tasks, setting, pilot, seed=args.seed)
    places = destinations(spec, described, tasks, args.sources)
    if args.json:
        print(json.dumps(plan_json(plan, places), indent=1))
    else:
        print(plan_text(plan, places))
    return EXIT_OK


def plan_json(plan, places: list[dict]) -> dict:
    models = plan.models()
    return {
        "tasks": plan.tasks, "kinds": plan.kinds, "basis": plan.basis, plan.basis: plan.basis_detail,
        "backends": plan.setting.backends,
        "calls": {**plan.interval("calls"), "roles": {r: plan.interval(f"calls.{r}") for r in
                                                      ("writer", "editor", "judge")}},
        "rounds": plan.interval("rounds"),
        "tokens": {m: {"roles": roles, "input": plan.interval(f"input.{m}"), "output": plan.interval(f"output.{m}")}
                   for m, roles in models.items()},
        "usd": {**plan.interval("usd"), "models": {m: plan.interval(f"usd.{m}") for m in models},
                "unpriced_models": plan.unpriced, "batch": plan.setting.batch, "prices": plan.setting.prices.describe()},
        "seconds": {**plan.interval("seconds"), "limited_by": plan.limited_by,
                    "concurrency": plan.setting.concurrency, "rpm": plan.setting.rpm, "tpm": plan.setting.tpm},
        "destinations": places, "notes": plan.notes}


def _n(value: float) -> str:
    return f"{value:,.0f}"


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def plan_text(plan, places: list[dict]) -> str:
    def triple(name: str, show=_n) -> str:
        expected, low, high = plan.figures[name]
        return f"{show(expected)} ({show(low)} - {show(high)})"

    lines = [f"medbanana plan: {plan.tasks:,} tasks; {describe_roles(plan.setting.backends)}"]
    lines.append("tasks by dataset, direction and disease:")
    lines += [f"  {shown(k['dataset'])} {k['direction']} {shown(k['disease'])}: {k['tasks']:,}" for k in plan.kinds]
    if plan.basis == "pilot":
        d = plan.basis_detail
        lines.append(f"measured on the pilot {shown(d['run'])}: {d['tasks']:,} finished tasks; "
                     f"figures: expected ({d['interval']})")
    else:
        a = plan.basis_detail
        tokens = ", ".join(f"{r} {t['input']:,} in / {t['output']:,} out" for r, t in a["tokens_per_call"].items())
        lines.append(f"ASSUMPTIONS (no --pilot): each round accepted with probability {a['accept_rate_per_round']}; "
                     f"tokens per call {tokens}; seconds per call "
                     + ", ".join(f"{r} {s:g}" for r, s in a["seconds_per_call"].items())
                     + f"; figures: expected ({a['interval']})")
    lines.append(f"rounds  {triple('rounds')}")
    lines.append(f"calls   {triple('calls')}: "
                 + ", ".join(f"{r} {triple(f'calls.{r}')}" for r in ("writer", "editor", "judge")))
    lines.append("tokens and USD per model" + (" (Batch API prices)" if plan.setting.batch else "") + ":")
    for model, roles in plan.models().items():
        usd = "no price" if model in plan.unpriced else usd_range(plan.figures[f"usd.{model}"])
        lines.append(f"  {shown(model)} ({', '.join(roles)}): {triple(f'input.{model}')} in, "
                     f"{triple(f'output.{model}')} out tokens; {usd}")
    unpriced = (f" + the calls of {', '.join(map(shown, plan.unpriced))}: no price, give --prices FILE"
                if plan.unpriced else "")
    prices = plan.setting.prices.describe()
    lines.append(f"USD     {usd_range(plan.figures['usd'])}{unpriced}; prices read {prices['read_on']}"
                 + (f", {prices['override']} over them" if prices["override"] else ""))
    lines.append(f"time    {triple('seconds', _duration)}, limited by {plan.limited_by}")
    lines.append("destinations (where the source images would go, and their data-use classes):")
    lines += [f"  {shown(p['where'])} ({shown(p['backend'])}, {p['class']}{', attested' if p['attested'] else ''}): "
              + ", ".join(f"{shown(m['model'])} as {' and '.join(m['roles'])}" for m in p["models"])
              + f"; sent {', '.join(p['data_use']) or 'nothing'}"
              + (f"; REFUSED: {shown(p['refused'])}" if p.get("refused") else "") for p in places]
    lines += [f"note: {shown(note)}" for note in plan.notes]  # they may name what a pilot run recorded
    return "\n".join(lines)


def register(sub) -> None:
    p = sub.add_parser(
        "plan", help="what a generate run would cost and how long it would take, before it runs",
        description="Count the tasks `generate` would run with the same options, and estimate calls per role, "
                    "tokens and USD per model and wall time, each with an interval. With --pilot RUN (a finished "
                    "run, e.g. `generate --shard 0/20` for a 5 percent sample) the figures are measured on its "
                    "tasks and the interval is a 90 percent prediction interval (a Bayesian bootstrap over them); "
                    "without one they follow documented assumptions, printed as such. Nothing is called; no key is "
                    "needed. docs/plan-and-budget.md says how.")
    add_selection_options(p)
    p.add_argument("--out", type=Path, metavar="RUN_DIR", help="the run directory the run would resume: the tasks "
                                                               "it finished are left out")
    add_backend_choice(p)
    add_model_options(p)
    g = p.add_argument_group("destinations (as generate: where the requests would go)")
    add_vertex_options(g)
    add_openai_endpoint_options(g)
    p.add_argument("--max-rounds", type=count, default=DEFAULT_MAX_ROUNDS,
                   help=f"rounds per task at most (default {DEFAULT_MAX_ROUNDS})")
    p.add_argument("--concurrency", type=count, default=DEFAULT_CONCURRENCY,
                   help=f"tasks in flight at once (default {DEFAULT_CONCURRENCY})")
    add_rate_limits(p)
    p.add_argument("--batch", action="store_true", help="the run would use the Batch API (half price, slow)")
    p.add_argument("--pilot", type=Path, metavar="RUN",
                   help="a finished run of the same backends: its rounds-to-success and measured usage per role")
    add_prices_option(p)
    p.add_argument("--seed", type=int, default=0, help="the bootstrap's seed (default 0)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.set_defaults(func=cmd_plan)

