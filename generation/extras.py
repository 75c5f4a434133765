"""Optional dependencies: import one where a feature needs it, or fail there with the pip extra that installs it."""

from __future__ import annotations

import importlib
import importlib.util


class MissingExtra(ImportError):
    """An optional dependency is not installed; the message names the pip extra. The CLI and the recipes show it as
    one line (exit 2), where any other ImportError (a bug) keeps its traceback."""


def install_hint(extra: str) -> str:
    """How to install an extra, from PyPI or from a clone of the repository.

    >>> install_hint("train")
    "pip install 'medbanana[train]' (from a clone: pip install '.[train]')"
    """
    return f"pip install 'medbanana[{extra}]' (from a clone: pip install '.[{extra}]')"


def require(*modules: str, needed_for: str, extra: str):
    """The imported modules (one, or a tuple), or MissingExtra: "NEEDED_FOR needs ...: pip install 'medbanana[EXTRA]'".

    >>> require("json", needed_for="reading", extra="core").__name__
    'json'
    """
    try:
        loaded = tuple(importlib.import_module(name) for name in modules)
    except ImportError as exc:
        raise _missing(modules, needed_for, extra) from exc
    return loaded[0] if len(loaded) == 1 else loaded


def check_installed(*modules: str, needed_for: str, extra: str) -> None:
    """MissingExtra, as `require` says it, unless each module can be found; none is imported (an import may read
    settings, such as a temp folder, that the caller sets only later).

    >>> check_installed("json", needed_for="reading", extra="core")
    """
    if any(importlib.util.find_spec(name) is None for name in modules):
        raise _missing(modules, needed_for, extra)


def _missing(modules: tuple[str, ...], needed_for: str, extra: str) -> MissingExtra:
    return MissingExtra(f"{needed_for} needs {' and '.join(modules)}: {install_hint(extra)}")
