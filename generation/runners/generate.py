"""From command-line style options to a finished run: pick backends (BackendSpec), find tasks, run."""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path
from types import SimpleNamespace
from typing import Callable

from .. import backends
from ..backends.settings import DiffusersSettings, GeminiSettings, OpenAISettings, SimulatorSettings
from ..costs import ROLES
from ..destinations import classes_of, destinations, gate, record_destinations, sources_data_use
from ..pricing import PriceTable, is_paid, load_prices
from ..prompts import PROMPT_NAMES, prompt_versions
from ..rundir import layout, schema
from ..records import Task
from ..outcomes import TaskStatus
from ..rundir.provenance import DEFAULT_SOURCE_TYPE
from .budget import RunPricing
from .local import describe_backends, run
from .session import RunOptions, RunSummary
from .pilot import finished_records, pilot_samples
from .session import in_shard
from .plan import Plan, PlanSetting, estimate
from ..sources.scan import Selection, SourceLayoutError, scan_sources
from ..rundir.journal import journal_lines
from ..taxonomy import DIRECTIONS
from ..failures import NotFound, UsageError
from ..pools import refuse_in_a_starting_child

API_KEY_VARS = ("GEMINI_API_KEY", "GOOGLE_API_KEY")
PILOT_MINIMUM = 10  # finished tasks of a resumed run that its own estimate is measured on


def default_backend() -> str:
    """The backend of a run that names none: the offline simulator, always. A paid backend runs only when named
    (--backend, a role option, or the run a --retry-failed continues), an API key in the environment or not."""
    return "simulator"


def key_is_set() -> bool:
    return any(os.environ.get(v) for v in API_KEY_VARS)


def make_backends(backend: str, writer: str | None = None, editor: str | None = None, judge: str | None = None,
                  options: dict[str, dict] | None = None):
    """(writer, editor, judge): each role's backend name defaults to `backend`; options per role."""
    options = options or {}
    names = {"writer": writer or backend, "editor": editor or backend, "judge": judge or backend}
    return tuple(backends.create(role, names[role], **options.get(role, {})) for role in backends.ROLES)


@dataclass(frozen=True)
class BackendSpec:
    """How to make the three backends, in plain values (picklable: each worker process builds its own).

    roles maps role -> backend name; each backend's settings are its own frozen dataclass (backends/settings.py;
    a dict of the same fields is taken too)."""

    backend: str
    roles: dict[str, str]
    gemini: GeminiSettings = GeminiSettings()
    openai: OpenAISettings = OpenAISettings()
    diffusers: DiffusersSettings = DiffusersSettings()
    simulator: SimulatorSettings = SimulatorSettings()

    def __post_init__(self):
        for name, kind in (("gemini", GeminiSettings), ("openai", OpenAISettings), ("diffusers", DiffusersSettings),
                           ("simulator", SimulatorSettings)):
            if isinstance(getattr(self, name), dict):
                object.__setattr__(self, name, kind(**getattr(self, name)))

    def build(self, out: Path, share: int = 1):
        """(writer, editor, judge); with share > 1 this is one of `share` processes, each allowed 1/share of
        the client-side rate limits (--rpm, --tpm) so that together they keep to them."""
        options = {}
        for settings in (self.gemini, self.openai, self.diffusers, self.simulator):
            options.update(settings.share(share).options(out, self.roles))
        return make_backends(self.backend, **self.roles, options=options)


def spec_models(spec: BackendSpec) -> dict:
    """role -> {"backend", "model"} as a run with this spec would record them, without building a backend that
    calls anything (a plan's, or a Ray driver's, description)."""
    out = {}
    for role, name in spec.roles.items():
        if name == "gemini":
            from ..backends.gemini import DEFAULT_EDITOR_MODEL, DEFAULT_TEXT_MODEL

            model = getattr(spec.gemini, f"{role}_model") or (DEFAULT_EDITOR_MODEL if role == "editor"
                                                              else DEFAULT_TEXT_MODEL)
        elif name == "openai":
            model = getattr(spec.openai, f"{role}_model", None) or spec.openai.model or ""
        elif name == "diffusers":
            model = spec.diffusers.model or ""
        else:  # the simulator, or a registered backend: made to read its model (they call nothing when made)
            model = getattr(backends.create(role, name), "model", "")
        out[role] = {"backend": name, "model": str(model)}
    return out


def prompts_used(*made) -> dict[str, str]:
    """The versions of the generation/prompts the backends fill in (each says which in `prompts`)."""
    used = {name for backend in made for name in getattr(backend, "prompts", ())}
    return prompt_versions([name for name in PROMPT_NAMES if name in used])


def generate(sources: Path, out: Path, *, selection: Selection | None = None, modality: str | None = None,
             backend: str = "simulator", roles: dict[str, str | None] | None = None,
             backend_options: dict[str, dict] | None = None, options: RunOptions | None = None,
             limit: int | None = None, extra_config: dict | None = None, batch: dict | None = None,
             spec: BackendSpec | None = None, prices: PriceTable | None = None, budget: float | None = None,
             announce: Callable[[dict, Plan | None], None] | None = None) -> RunSummary:
    """Run every selected task; `batch` (options of batch.run_batch, e.g. poll_interval) uses the Batch API.

    Backends come from `spec`, or from `backend` / `roles` / `backend_options`; `RunOptions.workers` > 1 (which
    needs a spec) spreads the tasks over that many processes. A paid backend's calls are priced with `prices` (the
    shipped table by default): spend and projection on the progress bar, and `budget` USD never passed
    (budget.py). `announce(backends, plan)` is called once the run directory is opened, before any call: the
    backends' names and models, and what the run's unfinished tasks should cost (None when nothing is paid).
    A script calls it under `if __name__ == "__main__":`: the run's processes (its image pool, `workers`) run the
    script again as they start, and a call made there stops at once with UsageError (pools.py)."""
    refuse_in_a_starting_child("medbanana's generate")
    selection = selection or Selection()
    options = options or RunOptions()
    if options.workers > 1 and (spec is None or batch is not None):
        raise ValueError("workers > 1 needs a BackendSpec (each process builds its own backends) and no batch: "
                         "the Batch API has nothing to share out")
    known = None  # with retry_failed: the uids of the run's api_failed tasks
    if options.retry_failed:
        recorded, _ = retry_selection(out, selection=selection, modality=modality, shard=options.shard, limit=limit)
        selection, modality = _selection_of(recorded), recorded.get("modality")
        # the run's api_failed tasks, wherever they sort among the sources now: no limit is recomputed over them
        limit, known = None, failed_uids(out)
        options = replace(options, shard=tuple(recorded["shard"]) if recorded.get("shard") else None)
    tasks = select_tasks(sources, selection, modality, limit, known, allow_none=options.retry_failed)
    places, classes, cautions = sent_to(tasks, sources, spec, backend, roles, backend_options)  # refused here
    extra_config = {**(extra_config or {}), "destinations": record_destinations(
        places, classes, (schema.read_run_config(out) or {}).get("destinations") if Path(out).is_dir() else None)}
    if spec is not None:  # built here with workers too: to record them, and to fail on bad options before any spawn
        writer, editor, judge = spec.build(out)
    else:
        writer, editor, judge = make_backends(backend, **(roles or {}), options=backend_options)
    described = describe_backends(writer, editor, judge)
    if prompts := prompts_used(writer, editor, judge):
        extra_config = {**(extra_config or {}), "prompts": prompts}
    config = {"backends": described, "models": {role: d["model"] for role, d in described.items()},
              "digital_source_type": getattr(editor, "digital_source_type", DEFAULT_SOURCE_TYPE),
              "sources_root": str(Path(sources).resolve()),
              "selection": {"modalities": sorted(selection.modalities), "diseases": sorted(selection.diseases),
                            "directions": list(selection.directions), "modality": modality,
                            "shard": list(options.shard) if options.shard else None, "limit": limit or None},
              **(extra_config or {})}
    if options.retry_failed:  # what the run was made of stays as recorded, whatever older format it has
        config["selection"] = recorded
    options, plan = _priced(options, described, prices, budget, batch is not None, (writer, editor, judge), tasks,
                            out)

    def on_open() -> None:  # once the folder is ours, before any call: the run's first line, then its warnings
        import warnings

        if announce is not None:
            announce(described, plan)
        for line in cautions:
            warnings.warn(line, stacklevel=2)
    if batch is not None:
        from .batch import run_batch

        return run_batch(tasks, out, writer, editor, judge, options, config, on_open=on_open, **batch)
    if options.workers > 1:
        from .processes import run_in_workers

        return run_in_workers(tasks, out, spec, options, config, on_open)
    return run(tasks, out, writer, editor, judge, options, config, on_open)


def _priced(options: RunOptions, described: dict, prices: PriceTable | None, budget: float | None, batch: bool,
            made: tuple, tasks: list[Task], out: Path) -> tuple[RunOptions, Plan | None]:
    """The options with the run's pricing (when a role is paid or a budget is given), and the estimate of what its
    unfinished tasks cost (None when nothing is paid). ValueError when a budget is given and a paid model has no
    price."""
    paid = any(is_paid(d["backend"]) for d in described.values())
    if not paid and budget is None:
        return options, None
    tries = {role: 1 + int(getattr(backend, "max_reasks", getattr(backend, "max_image_retries", 0)))
             for role, backend in zip(ROLES, made)}
    pricing = RunPricing(prices or load_prices(), described, batch, budget, tries)
    if budget is not None and (unpriced := pricing.unpriced()):
        raise UsageError(f"--budget needs a price for every paid model; {', '.join(unpriced)} has none in the "
                         f"price table: give one with --prices FILE")
    plan = estimate_todo(tasks, out, pricing, options)
    return replace(options, pricing=replace(pricing, per_task_usd=plan.figures["usd"][0] / max(plan.tasks, 1))), \
        (plan if paid else None)


def estimate_todo(tasks: list[Task], out: Path, pricing: RunPricing, options: RunOptions) -> Plan:
    """What the tasks the run directory has not finished should cost: measured on its own finished tasks when it
    has at least PILOT_MINIMUM of them (a resumed run), else from the assumptions."""
    finished = finished_records(out)
    failed = {uid for uid, record in finished.items() if record.get("status") == TaskStatus.API_FAILED}
    todo = [t for t in tasks if in_shard(t, options.shard)
            and (t.uid not in finished or (options.retry_failed and t.uid in failed))]
    setting = PlanSetting(pricing.backends, pricing.prices, options.max_rounds, pricing.batch, options.concurrency)
    pilot = pilot_samples(out, options.max_rounds) if len(finished) >= PILOT_MINIMUM else None
    return estimate(todo, setting, pilot)


def failed_uids(run_dir: Path) -> set[str]:
    """The tasks the run directory's journal last finished api_failed: all a --retry-failed may start."""
    return {uid for uid, record in finished_records(run_dir).items() if record.get("status") == TaskStatus.API_FAILED}


def sent_to(tasks: list[Task], sources: Path, spec: BackendSpec | None, backend: str = "simulator",
            roles: dict | None = None, backend_options: dict | None = None) -> tuple[list, set[str], list[str]]:
    """(the run's destinations, the data-use classes of its tasks' sources, the gate's warning lines for them):
    DestinationRefused when a class may not go to a destination (destinations.gate). The caller gives the warnings
    once the run's first line is out."""
    if spec is not None:
        places = destinations(spec.roles, gemini=spec.gemini, openai=spec.openai, diffusers=spec.diffusers)
    else:  # backends by name and options: each backend's options from the first role that plays it
        names = {role: (roles or {}).get(role) or backend for role in backends.ROLES}
        given = {name: SimpleNamespace(**(backend_options or {}).get(role, {})) for role, name in reversed(names.items())}
        places = destinations(names, gemini=given.get("gemini"), openai=given.get("openai"),
                              diffusers=given.get("diffusers"))
    classes = classes_of({task.dataset for task in tasks}, sources_data_use(sources))
    return places, set(classes), gate(places, classes)


def select_tasks(sources: Path, selection: Selection, modality: str | None, limit: int | None,
                 known: set[str] | None = None, allow_none: bool = False) -> list[Task]:
    """The run's tasks before its shard is taken: the selection's, the first `limit`, those in `known` when given;
    SourceLayoutError when none is left, unless `allow_none` (a retry, whose sources may all be gone)."""
    tasks = scan_sources(sources, selection, modality)[:limit or None]
    if known is not None:
        tasks = [t for t in tasks if t.uid in known]
    if not tasks and not allow_none:
        raise SourceLayoutError(f"no source images under {sources} match the selection (--modalities "
                                f"{' '.join(sorted(selection.modalities)) or 'all'}, --diseases "
                                f"{' '.join(sorted(selection.diseases)) or 'all'}, --directions "
                                f"{' '.join(selection.directions)})")
    return tasks


def _selection_of(recorded: dict) -> Selection:
    return Selection(set(recorded.get("modalities") or ()), set(recorded.get("diseases") or ()),
                     tuple(recorded.get("directions") or DIRECTIONS))


def retry_selection(run_dir: Path, *, selection: Selection | None = None, modality: str | None = None,
                    shard: tuple[int, int] | None = None, limit: int | None = None) -> tuple[dict, set[str] | None]:
    """For --retry-failed: the selection recorded in RUN_DIR/medbanana-run.json, and None, or the uids of the
    tasks the journal knows when that record cannot reproduce the run's task list (older runs, which recorded no
    shard or limit, and merged runs). Whatever is given must select the same (ValueError naming the difference):
    a retry re-runs tasks of the run, it never adds any."""
    config = run_config(run_dir)
    recorded = config.get("selection")
    if not isinstance(recorded, dict):
        raise UsageError(f"{run_dir}/{layout.RUN_CONFIG} records no selection; rerun the original command "
                         f"instead of --retry-failed")
    given = selection or Selection()
    differs = []
    for name, mine, theirs in (
            ("--modalities", sorted(given.modalities), sorted(recorded.get("modalities") or ())),
            ("--diseases", sorted(given.diseases), sorted(recorded.get("diseases") or ())),
            ("--directions", sorted(given.directions), sorted(recorded.get("directions") or DIRECTIONS)),
            ("--modality", modality, recorded.get("modality")),
            ("--shard", list(shard) if shard else None, recorded.get("shard")),
            ("--limit", limit, recorded.get("limit"))):
        defaulted = not mine or (name == "--directions" and mine == sorted(DIRECTIONS))
        if not defaulted and mine != theirs:
            differs.append(f"{name} {_shown(mine)} (the run has {_shown(theirs)})")
    if differs:
        raise UsageError(f"--retry-failed {run_dir} re-runs the tasks of the selection that run recorded; "
                         f"{'; '.join(differs)}: leave these options out, or start a new run with --out")
    known = None
    if "shard" not in recorded or "limit" not in recorded or config.get("merged_from"):
        known = {line.entry["uid"] for line in journal_lines(Path(run_dir) / layout.JOURNAL,
                                                             f"run directory {run_dir}")}
    return recorded, known


def _shown(value) -> str:
    if value is None:
        return "none"
    if value == []:
        return "all"
    if isinstance(value, list) and len(value) == 2 and all(isinstance(v, int) for v in value):
        return f"{value[0]}/{value[1]}"  # a shard
    return " ".join(map(str, value)) if isinstance(value, list) else str(value)


def run_config(run_dir: Path) -> dict:
    """RUN_DIR/medbanana-run.json, parsed as the run's one schema (schema.RunConfig): a field of the wrong type is a
    ValueError naming the file and the field."""
    if (config := schema.read_run_config(run_dir, strict=True)) is None:
        raise NotFound(f"{run_dir} is not a medbanana run directory (no {layout.RUN_CONFIG})")
    return config
