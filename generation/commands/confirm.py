"""`generate --retry-failed RUN_DIR`: a run file never chooses where requests go or what is loaded.

What RUN_DIR/medbanana-run.json records of where the run sent its images and what it loaded (the sources folder,
each role's backend and model, Vertex AI's project and location, an OpenAI-compatible base URL, an attested
endpoint) is written out as the command-line options that name them (`recorded_options`). A retry must give each
of them itself; those it does not give, or gives otherwise, are named in one line (exit 2) before anything is sent.
The retry command `generate` prints after API failures carries them, so it works as printed.
"""

from __future__ import annotations

import shlex

from ..destinations import ROLES, ZERO_RETENTION, destinations, printable, vertex_on


def recorded_options(config: dict) -> list[tuple[str, str | None]]:
    """(option, value or None for a flag) naming the run's destinations as `config` (a medbanana-run.json, or the
    same view of a command line, `command_view`) records them; values that are not text are left out."""
    options: list[tuple[str, str | None]] = []
    if isinstance(config.get("sources_root"), str):
        options.append(("--sources", config["sources_root"]))
    made = config.get("backends") if isinstance(config.get("backends"), dict) else {}
    made = {role: made[role] for role in ROLES if isinstance(made.get(role), dict)
            and isinstance(made[role].get("backend"), str)}
    names = {role: m["backend"] for role, m in made.items()}
    if len(set(names.values())) == 1 and len(names) == len(ROLES):
        options.append(("--backend", names["writer"]))
    else:
        options += [(f"--{role}", name) for role, name in names.items()]
    models = {role: m["model"] for role, m in made.items() if isinstance(m.get("model"), str) and m["model"]
              and m["backend"] != "simulator" and m["model"] != _default_model(m["backend"], role)}
    options += [(f"--{role}-model", model) for role, model in models.items()]
    vertex = next((m["vertex"] for m in made.values() if isinstance(m.get("vertex"), dict)), None)
    if vertex is not None:
        project, location = vertex.get("project"), vertex.get("location")
        if isinstance(project, str) and isinstance(location, str):
            options += [("--vertex-project", project), ("--vertex-location", location)]
        else:
            options.append(("--vertex", None))  # express mode: an API key, no project
    for entry in config.get("destinations") or () if isinstance(config.get("destinations"), list) else ():
        if isinstance(entry, dict) and entry.get("backend") == "openai":
            if isinstance(entry.get("url"), str) and entry["url"]:
                options.append(("--openai-base-url", entry["url"]))
            if entry.get("attested") is True:
                options.append(("--attest-endpoint", ZERO_RETENTION))
    return options


def _default_model(backend: str, role: str) -> str | None:
    if backend != "gemini":
        return None
    from ..backends.gemini import DEFAULT_EDITOR_MODEL, DEFAULT_TEXT_MODEL

    return DEFAULT_EDITOR_MODEL if role == "editor" else DEFAULT_TEXT_MODEL


def command_view(args, spec) -> dict:
    """What this command line (parsed `args`, its BackendSpec) would record, in medbanana-run.json's shape."""
    from ..backends.gemini_client import VertexTarget

    backends = {}
    for role in ROLES:
        name = spec.roles[role]
        model = {"gemini": getattr(args, f"{role}_model", None) or _default_model("gemini", role),
                 "openai": getattr(args, f"{role}_model", None) or args.openai_model,
                 "diffusers": args.editor_model}.get(name)
        backends[role] = {"backend": name, "model": model}
        if name == "gemini" and vertex_on(spec.gemini):
            backends[role]["vertex"] = VertexTarget(args.vertex_project, args.vertex_location).describe()
    places = destinations(spec.roles, gemini=spec.gemini, openai=spec.openai, diffusers=spec.diffusers)
    return {"sources_root": str(args.sources) if args.sources is not None else None, "backends": backends,
            "destinations": [place.to_json() for place in places]}


def unconfirmed(config: dict, view: dict) -> list[str]:
    """The options the run records (`config`) that the command line (`view`, command_view) does not give as
    recorded; --sources only has to be given (the sources may have moved)."""
    given = recorded_options(view)
    given_names = {name for name, _ in given}
    missing = []
    for name, value in recorded_options(config):
        if (name, value) not in given and not (name == "--sources" and name in given_names):
            missing.append(name)
    return missing


def shown(options: list[tuple[str, str | None]]) -> str:
    """Options as one line to type (values quoted for a shell, control characters escaped)."""
    return " ".join(name if value is None else f"{name} {shlex.quote(printable(value))}" for name, value in options)


def refusal(run_dir, config: dict, missing: list[str]) -> str:
    """The one line that names what a retry must confirm."""
    return (f"--retry-failed {printable(run_dir)}: a run file never chooses where requests go or what is loaded; "
            f"{', '.join(missing)} as the run records {'them' if len(missing) > 1 else 'it'} must be given on the "
            f"command line. The run records: {shown(recorded_options(config))}. Check each value, then give them "
            f"(nothing was sent)")


def refused_destinations(args, spec, recorded: dict | None) -> str | None:
    """Why `generate` may not go on with these destinations (one line), or None: they are well formed
    (destinations.py raises DestinationRefused), an attested endpoint is one, and a retry gives what its run
    records (`recorded`, its medbanana-run.json; None for a new run)."""
    view = command_view(args, spec)
    if args.attest_endpoint and not any(place["attested"] for place in view["destinations"]):
        return (f"--attest-endpoint {ZERO_RETENTION} attests a remote OpenAI-compatible endpoint (--writer/--judge "
                "openai with --openai-base-url); this command sends to none")
    if recorded is not None and (missing := unconfirmed(recorded, view)):
        return refusal(args.retry_failed, recorded, missing)
    return None
