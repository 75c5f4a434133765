"""The `medbanana` command: each stage registers its own subcommands — prepare, generate, merge, taxonomy, keys
(generation/commands/), build, verify, upload (builder/commands.py), eval, judge-agreement, stats
(evaluation/commands.py), review and calibrate (review/commands.py, review/calibrate_command.py), demo (demo.py,
above the stages it spans) and export (export.py: loaders/ would import `datasets` for every command) — and `main`
turns what they raise into one line and an exit code."""

from __future__ import annotations

import argparse
import sys
import warnings
from os import PathLike

from .generation.failures import EXIT_FAILURE, EXIT_INTERRUPTED, EXIT_LOCKED, EXIT_USAGE, UsageError, WorkerCrashed

EPILOG = "Run `medbanana COMMAND --help` for each command's options. Docs: README.md and docs/ in the repository."


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("medbanana")
    except PackageNotFoundError:  # imported from a checkout that was never installed
        return "(not installed)"


def _one_line_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """A warning as `medbanana: warning: MESSAGE`: which of our lines raised it (Python's default) means nothing to
    a user, and the message says what to do."""
    print(f"medbanana: warning: {message}", file=file or sys.stderr)


class OneLineErrors(argparse.ArgumentParser):
    """A parser whose usage errors are one line (exit 2), pointing at --help rather than reprinting the usage;
    subcommands' parsers are of the same class (argparse makes them with the parent's)."""

    subcommands: argparse.Action | None = None  # what add_subparsers returned: its `choices` name each subcommand

    def error(self, message: str):
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")

    def add_subparsers(self, **kwargs):
        """argparse's, kept on the parser so that the docs' CLI reference and their tests can walk the commands."""
        self.subcommands = super().add_subparsers(**kwargs)
        return self.subcommands


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrors(
        prog="medbanana", epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Build, package and train on instruction-based medical image editing data (Med-Banana-50K "
                    "style): generate edits with writer -> editor -> judge refinement, then publish them as a "
                    "Hugging Face dataset.")
    parser.add_argument("--version", action="version", version=f"medbanana {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    from . import demo, export
    from .evaluation import commands as evaluation_commands
    from .generation import commands as generation_commands
    from .review import commands as review_commands

    demo.register(sub)
    export.register(sub)
    generation_commands.register(sub)
    evaluation_commands.register(sub)
    review_commands.register(sub)
    try:
        from .builder import commands as builder_commands
    except ImportError:  # the builder is part of the package; absent only in a broken install
        builder_commands = None
    if builder_commands is not None and hasattr(builder_commands, "register"):
        builder_commands.register(sub)
    return parser


def command_paths(parser: argparse.ArgumentParser, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """Every command under `parser` as the words that name it, `parser`'s own first: (), ("demo",), ("export",),
    ("export", "medebench"), ... (the docs' CLI reference and the test that docs' commands parse use it)."""
    paths = [prefix]
    action = getattr(parser, "subcommands", None)
    for name, sub in (action.choices or {}).items() if action is not None else ():
        paths += command_paths(sub, (*prefix, name))
    return paths


INTERRUPTED = "interrupted: finished tasks are kept; run the same command again to resume"


def main(argv: list[str] | None = None) -> int:
    """The `medbanana` command: its exit code (generation/failures.py's table). Ctrl-C at any moment, while the
    parser's modules are imported too, is one line and EXIT_INTERRUPTED (the command's child processes ignore it:
    generation/interrupts.py)."""
    try:
        return _run(argv)
    except KeyboardInterrupt:
        print(INTERRUPTED, file=sys.stderr)
        return EXIT_INTERRUPTED


def _run(argv: list[str] | None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # as given: a command that prints how to go on
    if not getattr(args, "func", None):
        parser.print_help()
        return EXIT_USAGE
    from .generation.extras import MissingExtra
    from .generation.rundir.lock import LockHeld

    warnings.showwarning = _one_line_warning
    try:
        return args.func(args)
    except MissingExtra as exc:  # an optional dependency this command needs: the extra to install, not a traceback
        print(f"medbanana {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except LockHeld as exc:  # another process writes (or reads) that folder: not this command's fault
        print(f"medbanana {args.command}: {exc}", file=sys.stderr)
        return EXIT_LOCKED
    except (UsageError, WorkerCrashed) as exc:
        # a user's mistake (unknown disease, bad layout, another run's folder), or a process of the run that died:
        # one clear line and the error's exit code. Any other ValueError or RuntimeError is a bug: its traceback.
        return _one_line(args.command, exc)
    except OSError as exc:
        # a file that cannot be read or written where the user pointed (a folder where a file goes, no permission):
        # one line, which names the path ("[Errno 21] Is a directory: 'PATH'"); one that names none is a failure
        # this line could not explain: its traceback, as below
        if isinstance(exc.filename, (str, bytes, PathLike)):
            return _one_line(args.command, exc)
        return _traceback()
    except Exception:
        return _traceback()


def _one_line(command: str, exc: BaseException) -> int:
    """`exc` as one line on stderr, scrubbed (a message may quote an endpoint's answer); its exit code (EXIT_USAGE
    unless it carries another: WorkerCrashed's EXIT_INFRASTRUCTURE, a process of the run died)."""
    from .generation.secrets import scrub

    print(f"medbanana {command}: error: {scrub(str(exc))}", file=sys.stderr)
    code = getattr(exc, "exit_code", None)
    return code if isinstance(code, int) else EXIT_USAGE


def _traceback() -> int:
    """A bug or an unforeseen failure: its traceback, scrubbed (it may quote an endpoint's answer); EXIT_FAILURE."""
    import traceback

    from .generation.secrets import scrub

    print(scrub(traceback.format_exc()), file=sys.stderr, end="")
    return EXIT_FAILURE


if __name__ == "__main__":
    sys.exit(main())
