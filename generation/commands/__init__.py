"""The generation stage's commands: `generate`, `merge`, `plan`, `taxonomy`, `prepare` and `keys` (`demo`, which also
builds, is above the stages: medbanana/demo.py). Each module turns arguments into a stage's options and its result
into lines and an exit code; the work is in the stage."""

from . import generate, keys, merge, plan, prepare, taxonomy


def register(sub) -> None:
    """Add the subcommands, in the order `medbanana --help` lists them."""
    for command in (plan, generate, merge, taxonomy, prepare, keys):
        command.register(sub)
