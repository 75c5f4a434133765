"""The generation stage's commands: `demo`, `generate`, `merge`, `taxonomy` and `prepare`. Each module turns
arguments into a stage's options and its result into lines and an exit code; the work is in the stage."""

from . import demo, generate, prepare, taxonomy


def register(sub) -> None:
    """Add the subcommands, in the order `medbanana --help` lists them."""
    for command in (demo, generate, taxonomy, prepare):
        command.register(sub)
