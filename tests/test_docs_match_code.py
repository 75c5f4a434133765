"""What the README, the pages under docs/, ARCHITECTURE.md and docstrings say about the code is checked against it:
every repository file they name exists, every link of the README leads to a file, every `medbanana` subcommand they
show is one the CLI has, and the loading builder's docstring example runs as written. (tests/test_docs_commands.py
runs the commands themselves.)"""

from __future__ import annotations

import re
import textwrap

import pytest
from paths import ROOT

DOCS = ("README.md", "ARCHITECTURE.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").rglob("*.md")))
# a path inside the repository: a known top-level folder, then names; written in backticks or after "see"
REPO_PATH = re.compile(r"(?<![\w./-])((?:generation|builder|evaluation|review|loaders|dpo|bench|tests|docs)/[\w./-]*\w)")


def repository_paths(text: str) -> set[str]:
    found = set()
    for match in REPO_PATH.finditer(text):
        path = match.group(1)
        if "*" in path or "{" in path or path.endswith((".parquet", ".jpeg", ".jpg", ".png")):
            continue
        found.add(path)
    return found


def test_the_path_pattern_finds_what_the_docs_name():
    named = {doc: repository_paths((ROOT / doc).read_text(encoding="utf-8")) for doc in DOCS}
    assert len(named["ARCHITECTURE.md"]) > 5 and sum(map(len, named.values())) > 40, \
        "the pattern found too few paths to be checking anything"
    assert "docs/make_figure.py" in named["README.md"] and "bench/extras_sizes.py" in named["docs/install.md"]


@pytest.mark.parametrize("doc", DOCS)
def test_every_repository_file_the_docs_name_exists(doc):
    text = (ROOT / doc).read_text(encoding="utf-8")
    missing = sorted(p for p in repository_paths(text) if not (ROOT / p).exists() and not (ROOT / (p + ".py")).exists())
    assert not missing, f"{doc} names files that are not in the repository: {missing}"


def test_every_link_of_the_readme_leads_to_a_file():
    """The README is read on the forge, not in the built site (whose links `mkdocs build --strict` checks)."""
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", (ROOT / "README.md").read_text(encoding="utf-8"))
    local = [link for link in links if "://" not in link]
    assert len(local) > 10 and "docs/images/demo-grid.png" in local
    assert not [link for link in local if not (ROOT / link).is_file()]


def test_the_code_names_no_moved_module():
    """Messages and reports that name a module of ours name one that exists (the simulator's scores moved once)."""
    stale = []
    for path in ROOT.rglob("*.py"):
        if ".venv" in path.parts or "tests" in path.parts:
            continue
        for match in re.finditer(r"medbanana/((?:generation|builder|evaluation|review|loaders|dpo)/[\w/]+\.py)",
                                 path.read_text(encoding="utf-8")):
            if not (ROOT / match.group(1)).is_file():
                stale.append(f"{path.relative_to(ROOT)}: {match.group(0)}")
    assert not stale, stale


def test_every_subcommand_the_docs_show_exists(capsys):
    from medbanana.cli import build_parser

    code = "\n".join(block for doc in DOCS  # the docs' code blocks
                     for block in re.findall(r"(?ms)^```[^\n]*\n(.*?)^```", (ROOT / doc).read_text(encoding="utf-8")))
    shown = set(re.findall(r"(?m)^\s*(?:\$ )?medbanana ([a-z][a-z-]+)", code))
    assert len(shown) > 10, "too few `medbanana COMMAND` lines found in the docs"
    unknown = []
    for command in sorted(shown):
        with pytest.raises(SystemExit) as exit_:  # --help exits 0; an unknown command is a usage error (2)
            build_parser().parse_args([command, "--help"])
        if exit_.value.code != 0:
            unknown.append(command)
    capsys.readouterr()
    assert not unknown, f"the docs show commands the CLI does not have: {unknown}"


def test_the_loading_builder_docstring_example_runs_as_written(demo_run_root, monkeypatch):
    """The example in medbanana_50k.py, run in a folder holding `demo-run/` as `medbanana demo` leaves it."""
    from medbanana import medbanana_50k

    example = re.search(r"\n\n((?:    .*\n|\n)+)", medbanana_50k.__doc__)[1]
    monkeypatch.chdir(demo_run_root)
    scope: dict = {}
    exec(textwrap.dedent(example), scope)  # noqa: S102 - the docstring's own example, as a user would paste it
    assert scope["ds"].num_rows > 0 and "chosen_image" in scope["ds"].column_names
