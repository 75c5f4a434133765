"""The options `generate` shares with `demo` (the refinement loop's: rounds, concurrency, seed, acceptance,
geometry guard, the simulator's frame drift) and the argument types of both; `take_recorded_options`: what
`--retry-failed` takes from the run it retries."""

from __future__ import annotations

import argparse

from ..geometry import DEFAULT_GEOMETRY, GEOMETRY_MODES


def shard_arg(text: str) -> tuple[int, int]:
    try:
        index, count = (int(x) for x in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--shard wants i/N, e.g. 0/4, not {text!r}") from None
    if not 0 <= index < count:
        raise argparse.ArgumentTypeError(f"--shard {text}: need 0 <= i < N")
    return index, count


def whole_number(text: str, minimum: int = 1, auto: bool = False) -> int | str:
    """A whole number of at least `minimum`, or also 'auto' (`--workers`): argparse adds the option's name."""
    if auto and text == "auto":
        return text
    try:
        value = int(text)
    except ValueError:
        value = minimum - 1
    if value < minimum:
        raise argparse.ArgumentTypeError(f"want a whole number of at least {minimum}{' or auto' if auto else ''}, "
                                         f"not {text!r}")
    return value


def count_arg(text: str) -> int | str:
    return whole_number(text)


def workers_arg(text: str) -> int | str:
    return whole_number(text, auto=True)


def positive_arg(text: str) -> float:
    """A number above 0 (seconds, rates): argparse adds the option's name."""
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"want a number above 0, not {text!r}")
    return value


def _accept(text: str) -> str:
    """An acceptance policy checked when the options are read (loop.acceptance_policy), kept as its text."""
    from ..loop import acceptance_policy

    try:
        acceptance_policy(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def rate(text: str) -> float:
    """A share between 0 and 1 (`--simulator-drift`): argparse adds the option's name."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"want a share between 0 and 1, e.g. 0.3, not {text!r}")
    return value


ROLES = ("writer", "editor", "judge")
# add_run_options; generate: after --retry-failed
RUN_DEFAULTS = {"max_rounds": 5, "seed": 0, "accept": "qualified", "geometry": DEFAULT_GEOMETRY}


def take_recorded_options(args, config: dict) -> None:
    """--retry-failed: the options RUN_DIR/medbanana-run.json records (each role's backend and model, Vertex AI and
    its project and location, max rounds, seed, accept policy) for those not given, so that the retry command
    `generate` prints works as printed. Any given is kept: a different one is refused by the run directory's check,
    naming it."""
    for name in RUN_DEFAULTS:
        if getattr(args, name) is None and config.get(name) is not None:
            setattr(args, name, config[name])
    backends = config.get("backends") if isinstance(config.get("backends"), dict) else {}
    for role in ROLES:
        made = backends.get(role) if isinstance(backends.get(role), dict) else {}
        if not isinstance(made.get("backend"), str):
            continue
        if getattr(args, role) is None and args.backend is None:
            setattr(args, role, made["backend"])
        chosen = getattr(args, role) or args.backend
        model_option = f"{role}_model"
        taken_by_openai_model = chosen == "openai" and args.openai_model
        if (chosen == made["backend"] != "simulator" and made.get("model") and not taken_by_openai_model
                and getattr(args, model_option, "absent") is None):  # the simulator's models are its own
            setattr(args, model_option, made["model"])
        if (role == "editor" and chosen == made["backend"] == "simulator" and args.simulator_drift is None
                and isinstance(made.get("drift"), (int, float))):  # the simulated editor's frame drift
            args.simulator_drift = float(made["drift"])
        if chosen == made["backend"] and isinstance(vertex := made.get("vertex"), dict):  # a run on Vertex AI
            args.vertex = True
            for key in ("project", "location"):
                if getattr(args, f"vertex_{key}") is None and isinstance(vertex.get(key), str):
                    setattr(args, f"vertex_{key}", vertex[key])


def add_run_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("refinement loop")
    g.add_argument("--max-rounds", type=count_arg, default=RUN_DEFAULTS["max_rounds"],
                   help=f"rounds per task before it counts as failed (default {RUN_DEFAULTS['max_rounds']})")
    g.add_argument("--concurrency", type=count_arg, default=4, help="tasks in flight at once (default 4)")
    g.add_argument("--seed", type=int, default=RUN_DEFAULTS["seed"],
                   help=f"run seed; each attempt's seed derives from it (default {RUN_DEFAULTS['seed']})")
    g.add_argument("--accept", type=_accept, default=RUN_DEFAULTS["accept"],
                   help="acceptance policy: 'qualified' (the judge's verdict, default) or 'score>=0.7'")
    g.add_argument("--geometry", choices=GEOMETRY_MODES, default=RUN_DEFAULTS["geometry"],
                   help="an edit whose frame moved (shifted > 1 px, zoomed or stretched > 1 %%, turned > 0.5 deg "
                        "or flipped, at 1024 px): 'register' warps it back onto the source's grid before the judge, "
                        "masks and metrics, keeping the editor's image in medbanana-originals/ (rejected when too "
                        "far to warp back; default); 'reject' fails the attempt before the judge call and the writer "
                        "is told the frame moved; 'record' only records it. Every round records the measurement")
    g.add_argument("--simulator-drift", type=rate, metavar="RATE",
                   help="the offline simulator's editor moves the frame of this share of its edits as real editors "
                        "do (a 2-12 px shift, a 2-8 %% zoom, or another canvas aspect), to try the geometry guard "
                        "offline; recorded with the run's backends (default 0)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
