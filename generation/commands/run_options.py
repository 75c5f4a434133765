"""The options `generate` shares with `demo`: the refinement loop's (rounds, concurrency, seed, acceptance, the
geometry guard, the simulator's frame drift), their defaults, and `take_recorded_options`: what `--retry-failed`
takes from the run it retries (never what names a destination: confirm.py)."""

from __future__ import annotations

import argparse

from ..acceptance import DEFAULT_ACCEPT
from ..records import DEFAULT_CONCURRENCY, DEFAULT_GEOMETRY, DEFAULT_MAX_ROUNDS, GEOMETRY_MODES
from .options import count

ROLES = ("writer", "editor", "judge")
# add_run_options' defaults; generate applies them after --retry-failed took the recorded ones
RUN_DEFAULTS = {"max_rounds": DEFAULT_MAX_ROUNDS, "seed": 0, "accept": DEFAULT_ACCEPT, "geometry": DEFAULT_GEOMETRY}


def _accept(text: str) -> str:
    """An acceptance rule checked when the options are read (generation/acceptance.py), kept as its text; a
    POLICY.json made by `medbanana calibrate` gives its rule (the run records the rule, not the file)."""
    from ..acceptance import rule_option

    try:
        return rule_option(text)[0]
    except (ValueError, FileNotFoundError) as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def rate(text: str) -> float:
    """A share between 0 and 1 (`--simulator-drift`): argparse adds the option's name."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"want a share between 0 and 1, e.g. 0.3, not {text!r}")
    return value


def take_recorded_options(args, config: dict) -> None:
    """--retry-failed: the options RUN_DIR/medbanana-run.json records that choose no destination (max rounds, seed,
    accept policy, geometry guard, the simulated editor's frame drift) for those not given. Any given is kept: a
    different one is refused by the run directory's check, naming it. What names a destination (sources, backends,
    models, Vertex AI, base URLs) is never taken from the run: the command line must give it as the run records it
    (confirm.py)."""
    for name in RUN_DEFAULTS:
        if getattr(args, name) is None and config.get(name) is not None:
            setattr(args, name, config[name])
    backends = config.get("backends") if isinstance(config.get("backends"), dict) else {}
    editor = backends.get("editor") if isinstance(backends.get("editor"), dict) else {}
    chosen = getattr(args, "editor", None) or getattr(args, "backend", None)
    if (chosen == editor.get("backend") == "simulator" and getattr(args, "simulator_drift", 0) is None
            and isinstance(editor.get("drift"), (int, float))):
        args.simulator_drift = float(editor["drift"])


def add_run_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("refinement loop")
    g.add_argument("--max-rounds", type=count, default=RUN_DEFAULTS["max_rounds"],
                   help=f"rounds per task before it counts as failed (default {RUN_DEFAULTS['max_rounds']})")
    g.add_argument("--concurrency", type=count, default=DEFAULT_CONCURRENCY,
                   help=f"tasks in flight at once (default {DEFAULT_CONCURRENCY})")
    g.add_argument("--seed", type=int, default=RUN_DEFAULTS["seed"],
                   help=f"run seed; each attempt's seed derives from it (default {RUN_DEFAULTS['seed']})")
    g.add_argument("--accept", type=_accept, default=RUN_DEFAULTS["accept"],
                   help="acceptance policy: 'qualified' (the judge's verdict, default), 'score>=0.7', another rule "
                        "(docs/calibration.md), or a POLICY.json made by `medbanana calibrate` (its rule is recorded)")
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
