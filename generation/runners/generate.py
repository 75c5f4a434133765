"""From command-line style options to a finished run: pick backends, find tasks, run, and the offline demo."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, replace
from pathlib import Path

from .. import backends
from ..rundir import layout
from ..rundir.provenance import DEFAULT_SOURCE_TYPE
from .local import RunOptions, RunSummary, describe_backends, run
from ..sources.scan import Selection, SourceLayoutError, scan_sources
from ..rundir.store import read_journal
from ..taxonomy import DIRECTIONS

API_KEY_VARS = ("GEMINI_API_KEY", "GOOGLE_API_KEY")


def default_backend() -> str:
    """gemini when an API key is set and the backend is installed, else the offline simulator."""
    if any(os.environ.get(v) for v in API_KEY_VARS) and "gemini" in backends.REGISTRY:
        return "gemini"
    return "simulator"


def make_backends(backend: str, writer: str | None = None, editor: str | None = None, judge: str | None = None,
                  options: dict[str, dict] | None = None):
    """(writer, editor, judge): each role's backend name defaults to `backend`; options per role."""
    options = options or {}
    names = {"writer": writer or backend, "editor": editor or backend, "judge": judge or backend}
    return tuple(backends.create(role, names[role], **options.get(role, {})) for role in backends.ROLES)


def gemini_options(out: Path, roles: dict[str, str], *, writer_model=None, editor_model=None, judge_model=None,
                   rpm: float | None = None, tpm: float | None = None, timeout: float = 180.0,
                   max_attempts: int = 6,
                   retry_base_delay: float = 2.0, image_aware_writer: bool = True,
                   base_url: str | None = None) -> dict[str, dict]:
    """Constructor options for the roles that use gemini: one shared transport (one rate limit per model, one
    request cache under the run directory, so a resumed run never pays twice for a finished call)."""
    if "gemini" not in roles.values():
        return {}
    from ..backends.gemini_transport import GeminiTransport

    transport = GeminiTransport(base_url=base_url, timeout=timeout, max_attempts=max_attempts, rpm=rpm, tpm=tpm,
                                retry_base_delay=retry_base_delay, cache_dir=Path(out) / "medbanana-cache" / "gemini")
    models = {"writer": writer_model, "editor": editor_model, "judge": judge_model}
    options = {}
    for role, name in roles.items():
        if name == "gemini":
            options[role] = {"transport": transport, **({"model": models[role]} if models[role] else {})}
    if roles["writer"] == "gemini":
        options["writer"]["image_aware"] = image_aware_writer
    return options


def open_options(out: Path, roles: dict[str, str], *, base_url: str | None = None, model: str | None = None,
                 writer_model: str | None = None, judge_model: str | None = None, editor_model: str | None = None,
                 structured_output: str = "json_schema", rpm: float | None = None, timeout: float = 180.0,
                 max_attempts: int = 6, retry_base_delay: float = 2.0, image_aware_writer: bool = True,
                 diffusers: dict | None = None) -> dict[str, dict]:
    """Constructor options for the roles that use the open backends: `openai` (writer, judge; one shared
    transport, key from OPENAI_API_KEY, one request cache under the run directory) and `diffusers` (editor;
    `diffusers` holds DiffusersEditor's options)."""
    options: dict[str, dict] = {}
    openai_roles = [role for role in ("writer", "judge") if roles.get(role) == "openai"]
    if openai_roles:
        from ..backends.openai_compatible import OpenAITransport

        transport = OpenAITransport(base_url=base_url, timeout=timeout, max_attempts=max_attempts, rpm=rpm,
                                    retry_base_delay=retry_base_delay,
                                    cache_dir=Path(out) / "medbanana-cache" / "openai")
        models = {"writer": writer_model or model, "judge": judge_model or model}
        for role in openai_roles:
            if not models[role]:
                raise ValueError(f"the openai {role} needs a model: --openai-model (or --{role}-model), as the "
                                 f"server at {transport.base_url or 'api.openai.com'} names it")
            options[role] = {"transport": transport, "model": models[role]}
        if "writer" in options:
            options["writer"]["image_aware"] = image_aware_writer
        if "judge" in options:
            options["judge"]["structured_output"] = structured_output
    if roles.get("editor") == "diffusers":
        options["editor"] = {"model": editor_model, **(diffusers or {})}
    return options


@dataclass(frozen=True)
class BackendSpec:
    """How to make the three backends, in plain values (picklable: each worker process builds its own).

    `gemini` and `open` are keywords of `gemini_options` and `open_options`; roles maps role -> backend name."""

    backend: str
    roles: dict[str, str]
    gemini: dict = field(default_factory=dict)
    open: dict = field(default_factory=dict)

    def build(self, out: Path, share: int = 1):
        """(writer, editor, judge); with share > 1 this is one of `share` processes, each allowed 1/share of
        the client-side rate limits (--rpm, --tpm) so that together they keep to them."""
        def part(options: dict) -> dict:
            return {k: (v / share if k in ("rpm", "tpm") and v else v) for k, v in options.items()}
        options = gemini_options(out, self.roles, **part(self.gemini))
        options.update(open_options(out, self.roles, **part(self.open)))
        return make_backends(self.backend, **self.roles, options=options)


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
    tasks = scan_sources(sources, selection, modality)
    if limit:
        tasks = tasks[:limit]
    if known is not None:
        tasks = [t for t in tasks if t.uid in known]
    if not tasks:
        raise SourceLayoutError(f"no source images under {sources} match the selection "
                                f"(modalities={sorted(selection.modalities) or 'all'}, "
                                f"diseases={sorted(selection.diseases) or 'all'}, directions={list(selection.directions)})")
    if spec is not None:  # built here with workers too: to record them, and to fail on bad options before any spawn
        writer, editor, judge = spec.build(out)
    else:
        writer, editor, judge = make_backends(backend, **(roles or {}), options=backend_options)
    described = describe_backends(writer, editor, judge)
    if {"gemini", "openai"} & {d["backend"] for d in described.values()}:  # both use generation/prompts
        from ..backends.gemini import prompt_versions

        extra_config = {**(extra_config or {}), "prompts": prompt_versions()}
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
    path = Path(run_dir) / layout.RUN_CONFIG
    if not path.exists():
        raise FileNotFoundError(f"{run_dir} is not a medbanana run directory (no {layout.RUN_CONFIG})")
    return json.loads(path.read_text())


def run_demo(out: Path, *, n_normal: int = 2, n_diseased: int = 1, concurrency: int = 2, seed: int = 0,
             size: int = 1024, quiet: bool = False, build_dataset: bool = True) -> RunSummary:
    """Synthesise sources for all three modalities (no download, no key), generate with the simulator, and build
    the Hugging Face dataset folder OUT/dataset (sources attached: they are synthetic, so redistributable)."""
    from ..backends.simulator.phantoms import write_demo_sources
    from ..rundir.store import atomic_write_json

    out = Path(out)
    sources, run_dir = out / "sources", out / "run"
    manifest = sources / layout.SOURCES_MANIFEST
    if not manifest.exists():  # a rerun resumes on the same sources
        provenance = write_demo_sources(sources, n_normal=n_normal, n_diseased=n_diseased, size=size, seed=seed)
        atomic_write_json(manifest, provenance)
    summary = generate(sources, run_dir, backend="simulator",
                       options=RunOptions(concurrency=concurrency, seed=seed, quiet=quiet),
                       extra_config={"demo": {"n_normal": n_normal, "n_diseased": n_diseased, "size": size}})
    run_manifest = run_dir / layout.SOURCES_MANIFEST
    if not run_manifest.exists():
        run_manifest.write_bytes(manifest.read_bytes())
    if build_dataset:
        from ...builder.build import build

        summary.dataset = build([run_dir], out / "dataset", source_images=sources, quiet=quiet)
        summary.dataset_dir = out / "dataset"
    return summary
