"""The generation stage's commands: `demo`, `generate`, `merge`, `taxonomy`, `prepare` and `keys`. Each module
turns arguments into a stage's options and its result into lines and an exit code; the work is in the stage."""

from . import demo, generate, keys, prepare, taxonomy


def register(sub) -> None:
    """Add the subcommands, in the order `medbanana --help` lists them."""
    for command in (demo, generate, taxonomy, prepare, keys):
        command.register(sub)
