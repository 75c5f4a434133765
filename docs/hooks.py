"""MkDocs hooks (mkdocs.yml `hooks:`): the pages written from the code each time the site is built, so that they
cannot go stale.

- reference/cli.md: what `medbanana ... --help` prints, for every command and subcommand the parser has (and the
  two forms of `medbanana review` that have their own help).
- reference/loaders.md: `medbanana.loaders`' public functions (its `__all__`) with their signatures and docstrings.

Both import medbanana, so build the site where the package is importable (the development install).
"""

from __future__ import annotations

import contextlib
import inspect
import io
import os
import re

from mkdocs.structure.files import File

CLI_PAGE = "reference/cli.md"
LOADERS_PAGE = "reference/loaders.md"
HELP_WIDTH = "100"  # argparse wraps at $COLUMNS: fixed, so the page does not depend on the terminal that builds it


def on_files(files, config):
    for uri, content in ((CLI_PAGE, cli_reference()), (LOADERS_PAGE, loaders_reference())):
        files.append(File.generated(config, uri, content=content))
    return files


# --------------------------------------------------------------------------------------------------- CLI


def help_text(words: tuple[str, ...]) -> str:
    """What `medbanana WORDS --help` prints."""
    from medbanana.cli import build_parser

    out = io.StringIO()
    saved = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = HELP_WIDTH
    try:
        with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
            build_parser().parse_args([*words, "--help"])
    finally:
        if saved is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = saved
    return out.getvalue()


def documented_commands() -> list[tuple[str, ...]]:
    from medbanana.cli import build_parser, command_paths
    from medbanana.review.commands import VERBS  # `review export` / `review report`: forms, not subparsers

    paths = command_paths(build_parser())
    at = paths.index(("review",)) + 1
    return paths[:at] + [("review", verb) for verb in VERBS] + paths[at:]


def cli_reference() -> str:
    parts = ["# Command-line reference\n",
             "Every `medbanana` command's `--help`, as the installed version prints it (this page is generated from "
             "the parsers each time the documentation is built). Exit codes are on [their own page](../exit-codes.md)."
             "\n"]
    for words in documented_commands():
        name = " ".join(("medbanana", *words))
        parts.append(f"## `{name}`\n\n```text\n{help_text(words).rstrip()}\n```\n")
    return "\n".join(parts)


# ----------------------------------------------------------------------------------------------- loaders


def markdown_docstring(doc: str | None) -> str:
    """A docstring as Markdown: doctest paragraphs become Python code blocks, indented paragraphs text blocks, and
    the rest (already written with Markdown's backticks) stays as it is."""
    out = []
    for paragraph in re.split(r"\n\s*\n", inspect.cleandoc(doc or "")):
        lines = paragraph.splitlines()
        if lines and lines[0].lstrip().startswith(">>>"):
            out.append("```pycon\n" + inspect.cleandoc(paragraph) + "\n```")
        elif lines and all(line.startswith((" ", "\t")) for line in lines):
            out.append("```text\n" + inspect.cleandoc(paragraph) + "\n```")
        else:
            out.append(paragraph)
    return "\n\n".join(out)


class _Written(str):
    """An annotation as the code writes it (`from __future__ import annotations` keeps them as text)."""

    def __repr__(self) -> str:
        return str(self)


def signature(function) -> inspect.Signature:
    sig = inspect.signature(function)
    params = [p.replace(annotation=_Written(p.annotation)) if isinstance(p.annotation, str) else p
              for p in sig.parameters.values()]
    returns = sig.return_annotation
    return sig.replace(parameters=params,
                       return_annotation=_Written(returns) if isinstance(returns, str) else returns)


def loaders_reference() -> str:
    import medbanana.loaders as loaders

    parts = ["# `medbanana.loaders`\n",
             "Generated from the code's docstrings each time the documentation is built.\n",
             markdown_docstring(loaders.__doc__)]
    for name in loaders.__all__:
        function = getattr(loaders, name)
        module = function.__module__.replace("medbanana.loaders.", "").replace("medbanana.loaders", "")
        where = f" (in `medbanana.loaders.{module}`)" if module else ""
        parts.append(f"## `{name}`\n\n```python\n{name}{signature(function)}\n```\n\n"
                     f"Importable as `from medbanana.loaders import {name}`{where}.\n\n"
                     f"{markdown_docstring(function.__doc__)}")
    modules = {getattr(loaders, name).__module__ for name in loaders.__all__}
    for module_name in sorted(modules - {"medbanana.loaders"}):
        module = __import__(module_name, fromlist=["_"])
        parts.append(f"## Module `{module_name}`\n\n{markdown_docstring(module.__doc__)}")
    return "\n\n".join(parts) + "\n"
