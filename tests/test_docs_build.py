"""The documentation site builds with `mkdocs build --strict` (as CI would: README's test command runs this), with
its two generated pages holding what the code has: every command's `--help` and `medbanana.loaders`' docstrings."""

from __future__ import annotations

import html
import os
import re
import subprocess
import sys

import pytest
from paths import ROOT

from medbanana.cli import build_parser, command_paths


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    try:
        import material  # noqa: F401 - the theme mkdocs.yml names
        import mkdocs  # noqa: F401
    except ImportError:
        pytest.fail("mkdocs and mkdocs-material are not installed: pip install -e '.[dev]'")
    out = tmp_path_factory.mktemp("site")
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)], cwd=ROOT,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"}, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return out


def test_the_site_builds_strict_with_every_page(site):
    pages = sorted(p.relative_to(ROOT / "docs").with_suffix("") for p in (ROOT / "docs").rglob("*.md")
                   if "_fragments" not in p.parts)
    assert len(pages) >= 15
    for page in pages:  # every page is rendered (and the nav lists it: an omitted one fails the strict build)
        built = site / ("index.html" if page.name == "index" else page / "index.html")
        assert built.is_file(), page
    assert (site / "images" / "demo-grid.png").is_file()


def test_the_cli_reference_is_every_commands_help(site):
    page = html.unescape((site / "reference" / "cli" / "index.html").read_text(encoding="utf-8"))
    for words in command_paths(build_parser()):
        assert f"usage: {' '.join(('medbanana', *words))}" in page, words
    assert "--drop-missing-sources" in page and "medbanana review export REVIEW_DIR" in page


def test_the_loaders_reference_is_the_docstrings(site):
    import inspect

    import medbanana.loaders as loaders

    page = (site / "reference" / "loaders" / "index.html").read_text(encoding="utf-8")
    text = " ".join(html.unescape(re.sub(r"<[^>]+>", "", page)).split())  # the page's words, markup left out
    for name in loaders.__all__:
        first_line = inspect.getdoc(getattr(loaders, name)).splitlines()[0]
        assert " ".join(first_line.replace("`", "").split()) in text, name
