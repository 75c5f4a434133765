"""Optional dependencies: import one where a feature needs it, or fail there with the pip extra that installs it."""

from __future__ import annotations

import importlib


def require(*modules: str, needed_for: str, extra: str):
    """The imported modules (one, or a tuple), or ImportError: "NEEDED_FOR needs ...: pip install 'medbanana[EXTRA]'".

    >>> require("json", needed_for="reading", extra="core").__name__
    'json'
    """
    try:
        loaded = tuple(importlib.import_module(name) for name in modules)
    except ImportError as exc:
        raise ImportError(f"{needed_for} needs {' and '.join(modules)}: pip install 'medbanana[{extra}]'") from exc
    return loaded[0] if len(loaded) == 1 else loaded
