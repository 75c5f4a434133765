"""The `medbanana` command: each stage registers its own subcommands — prepare, generate, merge, taxonomy, keys
(generation/commands/), build, verify, upload (builder/commands.py), eval, judge-agreement, stats
(evaluation/commands.py), review (review/commands.py), demo (demo.py, above the stages it spans) and export
(export.py: loaders/ would import `datasets` for every command) — and `main`
turns what they raise into one line and an exit code."""

from __future__ import annotations

import argparse
import sys
import warnings

EPILOG = "Run `medbanana COMMAND --help` for each command's options. Docs: README.md and ARCHITECTURE.md."


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

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


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


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # as given: a command that prints how to go on
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    from .generation.extras import MissingExtra
    from .generation.rundir.lock import EXIT_LOCKED, LockHeld

    warnings.showwarning = _one_line_warning
    try:
        return args.func(args)
    except MissingExtra as exc:  # an optional dependency this command needs: the extra to install, not a traceback
        print(f"medbanana {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except LockHeld as exc:  # another process writes (or reads) that folder: not this command's fault
        print(f"medbanana {args.command}: {exc}", file=sys.stderr)
        return EXIT_LOCKED
    except (ValueError, FileNotFoundError, RuntimeError) as exc:
        # user errors (unknown disease, bad layout, another run's folder): one clear line, non-zero exit
        from .generation.secrets import scrub  # a message may quote an endpoint's answer

        print(f"medbanana {args.command}: error: {scrub(str(exc))}", file=sys.stderr)
        code = getattr(exc, "exit_code", None)  # WorkerCrashed: 4, a process of the run died
        return code if isinstance(code, int) else 2
    except KeyboardInterrupt:
        print("interrupted: finished tasks are kept; run the same command again to resume", file=sys.stderr)
        return 130
    except Exception:  # a bug or an unforeseen failure: its traceback, scrubbed (it may quote an endpoint's answer)
        import traceback

        from .generation.secrets import scrub

        print(scrub(traceback.format_exc()), file=sys.stderr, end="")
        return 1


if __name__ == "__main__":
    sys.exit(main())
