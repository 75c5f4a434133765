"""The command line's one vocabulary (docs/concepts.md#glossary): what each parallelism option counts, the same in
every command, and the old spellings kept as hidden aliases that still work and say what to write instead.

`--workers N` is always processes, `--threads N` always threads inside one process, `--concurrency N` always tasks
(or samples) in flight at once in one process's event loop."""

from __future__ import annotations

import argparse
import os
import sys

# `--threads`' default where images are decoded or encoded (prepare, export medebench): one per CPU, at most 4
DEFAULT_THREADS = min(4, os.cpu_count() or 1)
PARALLELISM = {
    "--workers": "processes",
    "--threads": "threads",
    "--concurrency": "in flight",
}


def workers_count(text: str) -> int | str:
    """An argparse type for `--workers N|auto`: a whole number of at least 1, or 'auto' (the command picks)."""
    if text != "auto" and not (text.isdigit() and int(text) >= 1):
        raise argparse.ArgumentTypeError(f"want a whole number of at least 1 or auto, not {text!r}")
    return text if text == "auto" else int(text)


class OldSpelling(argparse.Action):
    """An option's old spelling: hidden from --help, still accepted (stored where the new spelling stores), with a
    one-line note on stderr naming the new spelling."""

    def __init__(self, option_strings, dest, *, new: str, **kwargs):
        super().__init__(option_strings, dest, **kwargs)
        self.new = new

    def __call__(self, parser, namespace, values, option_string=None):
        print(f"{parser.prog}: warning: {option_string} is the old spelling of {self.new}: it still works, but "
              f"write {self.new}", file=sys.stderr)
        setattr(namespace, self.dest, values)


def old_spelling(container, new: argparse.Action, old: str) -> None:
    """Keep `old` working as an alias of the option `new` (what `add_argument` returned), on the same parser or group:
    same destination, type and choices, hidden from --help, whose entry for `new` names it as its old spelling."""
    container.add_argument(old, action=OldSpelling, new=new.option_strings[-1], dest=new.dest, type=new.type,
                           choices=new.choices, nargs=new.nargs, metavar=new.metavar, default=argparse.SUPPRESS,
                           help=argparse.SUPPRESS)
    new.help = f"{new.help}; {old} is its old spelling"
