"""From command-line style options to a finished run: pick backends (BackendSpec), find tasks, run."""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path

from .. import backends
from ..backends.settings import DiffusersSettings, GeminiSettings, OpenAISettings, SimulatorSettings
from ..prompts import PROMPT_NAMES, prompt_versions
from ..rundir import layout, schema
from ..records import Task
from ..rundir.provenance import DEFAULT_SOURCE_TYPE
from .local import RunOptions, RunSummary, describe_backends, run
from ..sources.scan import Selection, SourceLayoutError, scan_sources
from ..rundir.store import read_journal
from ..taxonomy import DIRECTIONS

API_KEY_VARS = ("GEMINI_API_KEY", "GOOGLE_API_KEY")


def default_backend() -> str:
    """gemini when an API key is set, else the offline simulator."""
    return "gemini" if any(os.environ.get(v) for v in API_KEY_VARS) else "simulator"


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


def prompts_used(*made) -> dict[str, str]:
    """The versions of the generation/prompts the backends fill in (each says which in `prompts`)."""
    used = {name for backend in made for name in getattr(backend, "prompts", ())}
    return prompt_versions([name for name in PROMPT_NAMES if name in used])


def generate(sources: Path, out: Path, *, selection: Selection | None = None, modality: str | None = None,
             backend: str = "simulator", roles: dict[str, str | None] | None = None,
             backend_options: dict[str, dict] | None = None, options: RunOptions | None = None,
             limit: int | None = None, extra_config: dict | None = None, batch: dict | None = None,
             spec: BackendSpec | None = None) -> RunSummary:
    """Run every selected task; `batch` (options of batch.run_batch, e.g. poll_interval) uses the Batch API.

    Backends come from `spec`, or from `backend` / `roles` / `backend_options`; `options.workers` > 1 (which
    needs a spec) spreads the tasks over that many processes."""
    selection = selection or Selection()
    options = options or RunOptions()
    if options.workers > 1 and (spec is None or batch is not None):
        raise ValueError("workers > 1 needs a BackendSpec (each process builds its own backends) and no batch: "
                         "the Batch API has nothing to share out")
    known = None  # with retry_failed: the run's task uids, when its recorded selection cannot tell them
    if options.retry_failed:
        recorded, known = retry_selection(out, selection=selection, modality=modality, shard=options.shard,
                                          limit=limit)
        selection, modality, limit = _selection_of(recorded), recorded.get("modality"), recorded.get("limit")
        options = replace(options, shard=tuple(recorded["shard"]) if recorded.get("shard") else None)
    tasks = select_tasks(sources, selection, modality, limit, known, allow_none=options.retry_failed)
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
    if batch is not None:
        from .batch import run_batch

        return run_batch(tasks, out, writer, editor, judge, options, config, **batch)
    if options.workers > 1:
        from .processes import run_in_workers

        return run_in_workers(tasks, out, spec, options, config)
    return run(tasks, out, writer, editor, judge, options, config)


def select_tasks(sources: Path, selection: Selection, modality: str | None, limit: int | None,
                 known: set[str] | None = None, allow_none: bool = False) -> list[Task]:
    """The run's tasks before its shard is taken: the selection's, the first `limit`, those in `known` when given;
    SourceLayoutError when none is left, unless `allow_none` (a retry, whose sources may all be gone)."""
    tasks = scan_sources(sources, selection, modality)[:limit or None]
    if known is not None:
        tasks = [t for t in tasks if t.uid in known]
    if not tasks and not allow_none:
        raise SourceLayoutError(f"no source images under {sources} match the selection "
                                f"(modalities={sorted(selection.modalities) or 'all'}, "
                                f"diseases={sorted(selection.diseases) or 'all'}, directions={list(selection.directions)})")
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
        raise ValueError(f"{run_dir}/{layout.RUN_CONFIG} records no selection; rerun the original command "
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
        raise ValueError(f"--retry-failed {run_dir} re-runs the tasks of the selection that run recorded; "
                         f"{'; '.join(differs)}: leave these options out, or start a new run with --out")
    known = None
    if "shard" not in recorded or "limit" not in recorded or config.get("merged_from"):
        known = {entry["uid"] for entry in read_journal(Path(run_dir) / layout.JOURNAL)}
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
    if (config := schema.read_run_config(run_dir)) is None:
        raise FileNotFoundError(f"{run_dir} is not a medbanana run directory (no {layout.RUN_CONFIG})")
    return config
