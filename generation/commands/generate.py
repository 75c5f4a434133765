"""`medbanana generate`: command-line options -> a BackendSpec, RunOptions and a run (generation/runners/generate.py
does the work)."""

from __future__ import annotations

import sys
from pathlib import Path

from ..destinations import ZERO_RETENTION
from ..records import DEFAULT_MAX_PIXELS, GEOMETRY_MODES
from ..rundir.lock import hold_for_command
from .options import (add_backend_choice, add_model_options, add_openai_endpoint_options, add_prices_option,
                      add_rate_limits, add_selection_options, add_vertex_options, count as _count,
                      positive as _positive, workers as _workers)
from .run_options import RUN_DEFAULTS, ROLES, add_run_options, take_recorded_options
from .spending import announcer, budget_exit
from ..failures import EXIT_USAGE


def cmd_generate(args) -> int:
    if args.executor != "ray" and (args.shards or args.ray_address or args.ray_gpus_per_shard):
        print("medbanana generate: --shards, --ray-address and --ray-gpus-per-shard go with --executor ray",
              file=sys.stderr)
        return EXIT_USAGE
    if args.drop_missing_sources and not args.retry_failed:
        print("medbanana generate: --drop-missing-sources ends tasks of a run being retried; give --retry-failed "
              "RUN_DIR with it", file=sys.stderr)
        return EXIT_USAGE
    if args.retry_failed and args.out is not None and Path(args.out).resolve() != Path(args.retry_failed).resolve():
        print(f"medbanana generate: --retry-failed writes into {args.retry_failed}; leave out --out {args.out}",
              file=sys.stderr)
        return EXIT_USAGE
    out = args.retry_failed or args.out
    if out is None or (args.sources is None and not args.retry_failed):
        print("medbanana generate: --sources and --out are required (or --retry-failed RUN_DIR)", file=sys.stderr)
        return EXIT_USAGE
    with hold_for_command(Path(out), "run directory", create=not args.retry_failed):
        return _generate(args, Path(out))


def _generate(args, out: Path) -> int:
    import warnings

    from PIL import Image

    from ..backends.gemini_client import VertexTarget
    from ..backends.settings import DiffusersSettings, GeminiSettings, OpenAISettings, SimulatorSettings
    from ..rundir import layout
    from ..runners.generate import BackendSpec, default_backend, generate, run_config
    from ..runners.session import RunOptions
    from ..sources.scan import Selection

    # a source over --max-pixels is refused and recorded; Pillow's own warning about it would only repeat that
    warnings.filterwarnings("ignore", category=Image.DecompressionBombWarning)
    sources = args.sources
    if args.retry_failed:  # the run's recorded selection is used, checked against any given (runners/generate.py)
        recorded = run_config(out)
        if sources is None and recorded.get("sources_root") is None:  # else confirm.py asks for the recorded one
            print(f"medbanana generate: {Path(out) / layout.RUN_CONFIG} records no sources folder "
                  f"(sources_root); give --sources", file=sys.stderr)
            return EXIT_USAGE
        take_recorded_options(args, recorded)
    # no backend named by the user or by the run being retried: the offline default (a key in the environment or not)
    defaulted = not (args.backend or any(getattr(args, role) for role in ROLES) or args.vertex or args.vertex_project
                     or args.vertex_location)
    for name, default in RUN_DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, default)
    if args.geometry not in GEOMETRY_MODES:  # a recorded value from --retry-failed's run
        print(f"medbanana generate: --geometry {args.geometry!r} is not one of {', '.join(GEOMETRY_MODES)}",
              file=sys.stderr)
        return EXIT_USAGE
    selection = Selection.parse(args.modalities or (), args.diseases or (), args.directions or ())
    # a project alone means Vertex AI; so does the SDK's own GOOGLE_GENAI_USE_VERTEXAI, for a gemini role
    named_vertex = bool(args.vertex or args.vertex_project or args.vertex_location)  # naming Gemini on Vertex AI
    vertex = named_vertex or VertexTarget.from_environment() is not None
    backend = args.backend or ("gemini" if named_vertex else default_backend())
    if vertex and args.batch:  # Vertex AI batch prediction reads Cloud Storage or BigQuery, not inline requests
        print("medbanana generate: --batch uses the Gemini API's Batch and Files API, which Vertex AI does not "
              "offer: drop --batch or --vertex", file=sys.stderr)
        return EXIT_USAGE
    roles = {role: getattr(args, role) or backend for role in ROLES}
    shared = dict(rpm=args.rpm, timeout=args.timeout, max_attempts=args.max_attempts,
                  retry_base_delay=args.retry_base_delay, image_aware_writer=args.image_aware_writer)
    spec = BackendSpec(backend, roles, gemini=GeminiSettings(
        writer_model=args.writer_model, editor_model=args.editor_model, judge_model=args.judge_model, tpm=args.tpm,
        vertex=vertex, vertex_project=args.vertex_project,
        vertex_location=args.vertex_location, **shared), openai=OpenAISettings(
        base_url=args.openai_base_url, model=args.openai_model, writer_model=args.writer_model,
        judge_model=args.judge_model, structured_output=args.structured_output,
        zero_retention=args.attest_endpoint == ZERO_RETENTION, **shared), diffusers=DiffusersSettings(
        model=args.editor_model, steps=args.diffusers_steps, guidance_scale=args.guidance_scale,
        image_guidance_scale=args.image_guidance_scale, resolution=args.diffusers_resolution, dtype=args.dtype,
        device=args.device, batch_size=args.diffusers_batch_size, attention=args.diffusers_attention,
        attention_dir=args.save_attention), simulator=SimulatorSettings(drift=args.simulator_drift or 0.0))
    if args.simulator_drift and roles["editor"] != "simulator":
        print("medbanana generate: --simulator-drift is the offline simulator's editor option; the editor here is "
              f"{roles['editor']}", file=sys.stderr)
        return EXIT_USAGE
    from .confirm import refused_destinations  # before anything is opened or sent

    if refused := refused_destinations(args, spec, recorded if args.retry_failed else None):
        print(f"medbanana generate: {refused}", file=sys.stderr)
        return EXIT_USAGE
    one_process = bool(args.batch or roles["editor"] == "diffusers")
    if args.workers == "auto":
        if args.executor == "ray":
            print("medbanana generate: with --executor ray give --workers N: each shard task reserves N CPUs for "
                  "its N processes", file=sys.stderr)
            return EXIT_USAGE
        from ..runners.processes import auto_workers

        args.workers = 1 if one_process else auto_workers(args.concurrency, args.limit)
    if args.workers > 1 and one_process:
        print("medbanana generate: --workers is for API backends; with --batch one process submits everything, "
              "and a diffusers editor would load its model once per worker", file=sys.stderr)
        return EXIT_USAGE
    c2pa = signing_credentials(args.c2pa_cert, args.c2pa_key)
    if isinstance(c2pa, int):
        return c2pa
    from ..pricing import load_prices

    prices = load_prices(args.prices)  # a bad file: ValueError, one line
    options = RunOptions(max_rounds=args.max_rounds, concurrency=args.concurrency, seed=args.seed,
                         accept=args.accept, retry_failed=bool(args.retry_failed),
                         drop_missing_sources=args.drop_missing_sources, shard=args.shard,
                         workers=args.workers, quiet=args.quiet, max_pixels=args.max_pixels, c2pa=c2pa,
                         geometry=args.geometry)
    if args.executor == "ray":
        summary = _generate_on_ray(args, Path(sources), Path(out), selection, spec, options, prices)
        if isinstance(summary, int):
            return summary
    else:
        summary = generate(Path(sources), Path(out), selection=selection, modality=args.modality, spec=spec,
                           options=options, limit=args.limit,
                           batch={"poll_interval": args.poll_interval} if args.batch else None,
                           prices=prices, budget=args.budget, announce=announcer(defaulted, args.quiet))
    print(summary.format())
    from .exit_codes import generate_exit_code  # 3 when tasks ended api_failed, reasons on stderr

    incomplete = generate_exit_code(summary)
    return budget_exit(summary, getattr(args, "argv", None)) or incomplete


def _generate_on_ray(args, sources: Path, out: Path, selection, spec, options, prices):
    """`--executor ray`: the shards as Ray tasks, then merged into --out (runners/ray_executor.py); an exit code
    after a line on stderr for options it does not take."""
    refused = [name for name, given in (("--shard", args.shard), ("--retry-failed", args.retry_failed),
                                        ("--batch", args.batch)) if given]
    if refused:
        print(f"medbanana generate: --executor ray makes the shards itself and runs them per call; leave out "
              f"{', '.join(refused)}", file=sys.stderr)
        return EXIT_USAGE
    from ..extras import require

    try:
        require("ray", needed_for="--executor ray", extra="ray")
    except ImportError as exc:
        print(f"medbanana generate: {exc}", file=sys.stderr)
        return EXIT_USAGE
    import warnings

    from ..runners.generate import select_tasks, sent_to
    from ..runners.ray_executor import ShardJob, run_on_ray

    from ..runners.generate import spec_models

    *_, cautions = sent_to(select_tasks(sources, selection, args.modality, args.limit), sources, spec)  # and shards
    announcer(args.backend is None and not any(getattr(args, role) for role in ROLES), args.quiet)(
        spec_models(spec), None)
    for line in cautions:
        warnings.warn(line, stacklevel=2)
    job = ShardJob(sources, spec, options, selection=selection, modality=args.modality, limit=args.limit,
                   prices=prices, budget=args.budget)
    return run_on_ray(job, out, shards=args.shards, address=args.ray_address, cpus_per_shard=args.workers,
                      gpus_per_shard=args.ray_gpus_per_shard, quiet=args.quiet)


def signing_credentials(cert: Path | None, key: Path | None):
    """SigningCredentials from the options or the environment, None (no signing), or an exit code after a line on
    stderr (c2pa-python missing). Bad paths raise SigningError, a UsageError: the CLI prints it as one line."""
    from ..rundir.signing import SigningCredentials, require_c2pa

    credentials = SigningCredentials.from_options(cert, key)
    if credentials is not None:
        try:
            require_c2pa()
            import cryptography  # noqa: F401 (reads the certificate)
        except ImportError:
            print("medbanana generate: C2PA signing needs c2pa-python and cryptography: "
                  "pip install 'medbanana[c2pa]'", file=sys.stderr)
            return EXIT_USAGE
    return credentials


def register(sub) -> None:
    p = sub.add_parser("generate", help="run the refinement loop over your own sources",
                       description="Run instruction -> edit -> judge -> refine (up to --max-rounds) for every task "
                                   "under --sources and write the Med-Banana layout to --out. Sources use the original "
                                   "scripts' layout: SOURCES/{D}/normal/*.jpeg (add) and SOURCES/{D}/{Disease}/*.jpeg "
                                   "(remove), or one such {D} folder. Rerunning on the same --out skips finished tasks.")
    p.add_argument("--out", type=Path, help="run directory (created; reused to resume)")
    add_selection_options(p)
    add_backend_choice(p)
    g = p.add_argument_group(
        "cost (`medbanana plan` estimates it first)",
        "A paid backend's calls are priced with the shipped table (generation/prices.json, dated) or --prices; "
        "the first line names each role's backend and model and the estimate, the progress bar shows spend and "
        "projected total, the summary and medbanana-stats.json the tokens and USD per role and model.")
    g.add_argument("--budget", type=_positive, metavar="USD",
                   help="never spend more than this on the run directory in all (earlier invocations included): "
                        "no round starts that might pass it; finished work is kept, and the run ends with exit code "
                        "5 and the command to go on with a higher --budget")
    add_prices_option(g)
    g = p.add_argument_group("gemini backend (key from GEMINI_API_KEY or GOOGLE_API_KEY; never stored)")
    add_model_options(g)
    add_rate_limits(g)
    g.add_argument("--timeout", type=_positive, default=180.0, help="seconds per call before it is retried (default 180)")
    g.add_argument("--max-attempts", type=_count, default=6,
                   help="tries per call on 408/429/5xx/transport errors, with back-off and jitter (default 6)")
    g.add_argument("--retry-base-delay", type=float, default=2.0, metavar="SECONDS",
                   help="first back-off, doubled per retry up to 60 s; a longer Retry-After wins (default 2)")
    g.add_argument("--no-image-aware-writer", dest="image_aware_writer", action="store_false",
                   help="round 1's instruction from text only (default: the writer also sees the source image)")
    add_vertex_options(g)
    g.add_argument("--batch", action="store_true",
                   help="use the Batch API (half price, slow): each round's writer, editor and judge calls of all "
                        "pending tasks go out as one job each; rerunning resumes polling submitted jobs")
    g.add_argument("--poll-interval", type=_positive, default=30.0, metavar="SECONDS",
                   help="--batch: seconds between polls of a running job (default 30)")
    g = p.add_argument_group(
        "open backends (your own GPUs)",
        "--writer openai / --judge openai: any OpenAI-compatible chat-completions server (vLLM, SGLang, Ollama); "
        "key from OPENAI_API_KEY when the server needs one, never stored. --editor diffusers: --editor-model is a "
        "local folder or a Hugging Face id of an InstructPix2Pix-style pipeline (HF_HUB_OFFLINE=1: cache only). "
        "--rpm, --timeout, --max-attempts and --retry-base-delay apply to openai calls too.")
    add_openai_endpoint_options(g)
    g.add_argument("--structured-output", choices=("json_schema", "json_object", "none"), default="json_schema",
                   help="how the openai judge asks for its JSON verdict; a server that rejects it is asked again "
                        "in plain text, read by a tolerant parser (default json_schema)")
    g.add_argument("--diffusers-steps", type=_count, default=20, metavar="N", help="denoising steps (default 20)")
    g.add_argument("--guidance-scale", type=float, default=7.5, help="text guidance (default 7.5)")
    g.add_argument("--image-guidance-scale", type=float, default=1.5,
                   help="image guidance: higher keeps closer to the source (default 1.5)")
    g.add_argument("--diffusers-resolution", type=_count, default=512, metavar="PIXELS",
                   help="working size of the longer side; the edit is resized back to the source size (default 512)")
    g.add_argument("--diffusers-batch-size", type=_count, default=4, metavar="N",
                   help="edits per pipeline call, gathered from the tasks in flight (default 4; keep --concurrency "
                        "at least this)")
    g.add_argument("--dtype", choices=("auto", "float16", "bfloat16", "float32"), default="auto",
                   help="diffusers weights dtype (default auto: float16 on GPU, float32 on CPU)")
    g.add_argument("--device", default="auto", help="torch device for diffusers, e.g. cuda:1 (default auto)")
    g.add_argument("--diffusers-attention", action="store_true",
                   help="record the cross-attention of the disease words and its IoU with the region of interest "
                        "in each edit's details (slower: attention is computed unfused)")
    g.add_argument("--save-attention", type=Path, metavar="DIR",
                   help="also write each edit's attention heat map as a PNG overlay under DIR (implies "
                        "--diffusers-attention)")
    p.add_argument("--retry-failed", type=Path, metavar="RUN_DIR",
                   help="re-run the tasks of RUN_DIR that ended with an API error, with the selection (diseases, "
                        "modalities, directions, shard, limit) its medbanana-run.json records; other selection "
                        "options are refused. --max-rounds, --seed, --accept, --geometry and --simulator-drift default "
                        "to the recorded ones; what "
                        "names a destination (--sources, backends, models, Vertex AI project and location, base "
                        "URLs) is never taken from the run: give it as the run records it (the retry line printed "
                        "after API failures carries it). Give the signing certificate again: it is not stored")
    p.add_argument("--drop-missing-sources", action="store_true",
                   help="with --retry-failed: end for good the api_failed tasks whose source file is gone (kept in "
                        "the records with kind source_missing, their rounds too; not counted by the exit code). "
                        "Without it they are named and stay api_failed, in case the sources are only unmounted")
    p.add_argument("--workers", type=_workers, default=1, metavar="N|auto",
                   help="processes making the calls, sharing --concurrency, --rpm and --tpm (default 1). Worth it "
                        "when the client's CPU is the limit: many calls in flight to a fast endpoint; each worker "
                        "costs ~1 s to start. The run directory is written by this process alone. 'auto': one per "
                        "CPU this process may use (affinity and container quota), at most --concurrency and the "
                        "number of tasks; 1 with --batch or a diffusers editor")
    g = p.add_argument_group(
        "several machines (Ray; pip install 'medbanana[ray]')",
        "--executor ray runs the run's tasks as --shards N shards (parts of the tasks, as --shard i/N), each on "
        "the cluster into its own run directory OUT/medbanana-shards/i-of-N/ (storage every node sees), then merges "
        "them into OUT. A shard whose worker dies is retried by Ray and resumes from its journal; rerunning the same "
        "command resumes the whole job. A local cluster started for the run inherits this shell's environment; the "
        "nodes of a cluster you join need the API key in their own: keys are never sent through Ray. On a scheduler "
        "without Ray, use --shard i/N per job and `medbanana merge`.")
    g.add_argument("--executor", choices=("local", "ray"), default="local",
                   help="where the run's tasks run: this machine (default) or a Ray cluster")
    g.add_argument("--shards", type=_count, metavar="N",
                   help="--executor ray: how many shards (parts of the tasks) to run on the cluster (default: as "
                        "many as under OUT from an earlier submission, else one per slot of the cluster)")
    g.add_argument("--ray-address", metavar="auto|HOST:PORT",
                   help="--executor ray: the cluster to join; 'auto' finds the one this node is part of (default: "
                        "$RAY_ADDRESS, else a new local cluster started for this run, never one `ray start` left "
                        "running)")
    g.add_argument("--ray-gpus-per-shard", type=float, default=0, metavar="G",
                   help="--executor ray: GPUs each shard reserves (default 0, none; a diffusers editor "
                        "wants 1). Each shard also reserves as many CPUs as --workers")
    g = p.add_argument_group(
        "signed provenance (C2PA Content Credentials; pip install 'medbanana[c2pa]')",
        "With a certificate and its key, every image written (accepted and rejected) carries a signed C2PA manifest "
        "bound to its bytes: the IPTC digital source type, the model ids, the run id, task uid, round, and the "
        "SHA-256 of the instruction and of the source image (never the source itself). The run records the "
        "certificate's SHA-256 fingerprint, never the key; resume with the same certificate. `medbanana keys init "
        "DIR` makes a local CA and a signing certificate; `medbanana verify DATASET --c2pa` checks the images.")
    g.add_argument("--c2pa-cert", type=Path, metavar="CHAIN.pem",
                   help="signing certificate, then its issuers, PEM (default: $MEDBANANA_C2PA_CERT)")
    g.add_argument("--c2pa-key", type=Path, metavar="KEY.pem",
                   help="the signing certificate's private key, unencrypted PEM (default: $MEDBANANA_C2PA_KEY)")
    p.add_argument("--max-pixels", type=_count, default=DEFAULT_MAX_PIXELS, metavar="N",
                   help="a source with more pixels than this (width x height, read from its header before "
                        "decoding) ends its tasks as source errors (default %(default)s, as `prepare --max-pixels`; "
                        "Pillow itself refuses more than twice its default)")
    add_run_options(p)
    p.set_defaults(func=cmd_generate, **dict.fromkeys(RUN_DEFAULTS))  # None: given or not (--retry-failed)
