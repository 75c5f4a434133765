"""What `generate` says about money: the first line of every run (each role's backend and model, and the estimate
when one is paid), and the end of a run stopped by --budget (exit code 5 and the command that goes on)."""

from __future__ import annotations

import math
import shlex
import sys

from ..failures import EXIT_BUDGET
from ..pricing import is_paid


def describe_roles(described: dict) -> str:
    """'writer gemini gemini-2.5-pro, editor ...' (text from the options or a run file: printed escaped)."""
    return ", ".join(f"{role} {shown(d.get('backend'))} {shown(d.get('model'))}".rstrip()
                     for role, d in described.items())


def shown(value) -> str:
    """A value from the options, a run file or a folder name as printed: no control or escape character reaches
    the terminal."""
    return ascii(str(value if value is not None else ""))[1:-1]


def usd_range(figure: tuple[float, float, float]) -> str:
    expected, low, high = figure
    return f"{expected:.2f} USD ({low:.2f}-{high:.2f})"


def announcer(defaulted: bool, quiet: bool = False):
    """The `announce` of runners.generate.generate: prints the run's first line on stderr. `defaulted`: no
    backend was named, so the offline default runs (said, with how to call Gemini, when a key is set). With
    `quiet` (-q) an offline run's line is left out, unless it says that; a paid run's never is."""
    def announce(described: dict, plan) -> None:
        line = f"medbanana generate: {describe_roles(described)}"
        if not any(is_paid(str(d.get("backend"))) for d in described.values()):
            line += "; offline, nothing is paid"
            from ..runners.generate import key_is_set

            if defaulted and key_is_set():
                line += " (an API key is set, but no backend was named: --backend gemini calls Gemini, paid)"
            elif quiet:
                return
        elif plan is None:
            line += "; PAID: estimate it first with `medbanana plan` and the same options"
        else:
            basis = ("measured on this run's finished tasks" if plan.basis == "pilot"
                     else "from assumptions: `medbanana plan --pilot RUN` measures them")
            unpriced = f" + {', '.join(plan.unpriced)} (no price)" if plan.unpriced else ""
            line += (f"; PAID: {plan.tasks:,} task(s) to run, estimate {usd_range(plan.figures['usd'])}{unpriced}, "
                     f"{basis}")
        print(line, file=sys.stderr, flush=True)
    return announce


def budget_exit(summary, argv: list[str] | None = None, stream=None) -> int | None:
    """EXIT_BUDGET after the lines that say so and how to go on, when the run stopped at its budget; else None."""
    if not summary.budget_reached:
        return None
    stream = stream or sys.stderr
    spent = (summary.cost or {}).get("usd", 0.0)
    projected = summary.projected_usd or spent
    higher = max(math.ceil(projected * 1.2 * 100) / 100, math.ceil(summary.budget * 1.5 * 100) / 100)
    print(f"medbanana generate: budget reached: {spent:.2f} of {summary.budget:.2f} USD spent "
          f"({summary.spent_now:.2f} now); {summary.unfinished:,} task(s) left unfinished, what finished is kept "
          f"(exit code {EXIT_BUDGET}). Finishing them should bring the total to about {projected:.2f} USD.",
          file=stream)
    print(f"to go on: {with_budget(sys.argv[1:] if argv is None else argv, higher)}", file=stream)
    return EXIT_BUDGET


def with_budget(argv: list[str], usd: float) -> str:
    """The command line `argv` (after the program name) with --budget set to `usd`."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
            continue
        if arg == "--budget":
            skip = True
            continue
        if arg.startswith("--budget="):
            continue
        out.append(arg)
    return shlex.join(["medbanana", *out, "--budget", f"{usd:.2f}"])
