"""Every command the README and the pages under docs/ show runs as written.

- Every `medbanana ...` command of a shell block parses with the real parser (an unknown option, a missing argument
  or a misspelt command fails), and every option it names is one that command's `--help` shows in full (argparse
  would accept an abbreviation).
- Every `medbanana ...` line of a synopsis (a ```text block, where `[--opt N]` and `a|b` are notation) names a
  command that exists, and options its `--help` shows.
- The blocks marked `<!-- test: run -->` run as written, page by page, in one folder that holds the demo the README's
  set-up command makes (`medbanana demo --out demo-run`, run once for this module): offline, no key.
- The demo prints what the README shows, and the README's picture is the one docs/make_figure.py makes from it.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from medbanana.cli import build_parser, command_paths
from paths import ROOT

PAGES = ["README.md"] + sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").rglob("*.md")
                               if "_fragments" not in p.parts)
FENCE = re.compile(r"^(?P<marker><!-- test: [^>]*-->\n)?```(?P<lang>\w*)[^\n]*\n(?P<body>.*?)^```", re.M | re.S)
SHELL = {"bash", "sh", "shell", "console"}
OPERATORS = {"&&", "||", ";", "|", "&"}
OPTION = re.compile(r"(?<![\w-])--[a-z0-9][\w-]*")
DEMO = "medbanana demo --out demo-run"
SET_BY_SLURM = {"SLURM_ARRAY_TASK_ID": "0"}  # what the scheduler sets in the job-array recipe (docs/scaling.md)


def blocks(page: str) -> list[tuple[str, str, str]]:
    """(language, marker, body) of every fenced block of the page."""
    text = (ROOT / page).read_text(encoding="utf-8")
    return [(m["lang"], (m["marker"] or "").strip(), m["body"]) for m in FENCE.finditer(text)]


def logical_lines(body: str) -> list[str]:
    return [line for line in re.sub(r"\\\n\s*", " ", body).splitlines() if line.strip()]


def shell_commands(line: str) -> list[list[str]]:
    """The simple commands of a shell line (split at &&, ||, ;, | and &), comments dropped."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    commands: list[list[str]] = [[]]
    for token in lexer:
        if token in OPERATORS:
            commands.append([])
        else:
            commands[-1].append(token)
    return [c for c in commands if c]


def with_variables(line: str, body: str) -> str:
    """The line with the shell variables its block assigns (`N=4`, `export A=x B=y`) and Slurm's set; any other
    `$NAME` stays as written (a path the user chooses)."""
    values = dict(SET_BY_SLURM)
    for match in re.finditer(r"^(?:export )?((?:\w+=\S+ ?)+)", body, re.M):
        values.update(pair.split("=", 1) for pair in match[1].split())
    return re.sub(r"\$\{?(\w+)\}?", lambda m: values.get(m[1], m[0]), line)


def shown_commands(kind: str) -> list[tuple[str, str]]:
    """(page, line) of every `medbanana` command in shell blocks ("shell") or synopses ("synopsis")."""
    found = []
    for page in PAGES:
        for lang, _, body in blocks(page):
            if (lang in SHELL) != (kind == "shell") or lang not in SHELL | {"text", ""}:
                continue
            if kind == "shell":
                for line in logical_lines(body):
                    found += [(page, shlex.join(c)) for c in shell_commands(with_variables(line, body))
                              if c[0] == "medbanana"]
                continue
            for line in logical_lines(body):
                line = line.split(" # ")[0].rstrip()  # a synopsis' comment
                if re.match(r"\s*(\$ )?medbanana ", line):
                    found.append((page, line.strip().removeprefix("$ ")))
                elif found and found[-1][0] == page and re.match(r"\s+[\[-]", line):  # its continuation line
                    found[-1] = (page, f"{found[-1][1]} {line.strip()}")
    return found


def help_of(words: tuple[str, ...]) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
        build_parser().parse_args([*words, "--help"])
    return out.getvalue()


def command_words(argv: list[str]) -> tuple[str, ...]:
    """The words naming the (sub)command at the start of argv: ("export", "medebench") of `export medebench X`."""
    known = set(command_paths(build_parser()))
    words: tuple[str, ...] = ()
    for word in argv:
        first = word.split("|")[0]  # a synopsis' `a|b|c` alternatives
        if (*words, first) not in known:
            break
        words = (*words, first)
    return words


def unknown_options(argv: list[str]) -> list[str]:
    words = command_words(argv)
    shown = set(OPTION.findall(help_of(words)))
    return [option for option in OPTION.findall(" ".join(argv[len(words):])) if option not in shown]


def test_the_pages_show_commands_of_every_kind():
    assert len(shown_commands("shell")) > 30 and len(shown_commands("synopsis")) > 8
    runnable = [page for page in PAGES for _, marker, _ in blocks(page) if marker == "<!-- test: run -->"]
    assert len(runnable) > 10 and "README.md" in runnable


@pytest.mark.parametrize("page,line", shown_commands("shell"))
def test_every_shell_command_parses_with_the_real_parser(page, line, capsys):
    argv = shlex.split(line)[1:]
    try:
        build_parser().parse_args(argv)
    except SystemExit as exit_:
        pytest.fail(f"{page}: `{line}` does not parse (exit {exit_.code}): {capsys.readouterr().err.strip()}")
    assert not unknown_options(argv), f"{page}: `{line}` names options its --help does not show"


@pytest.mark.parametrize("page,line", shown_commands("synopsis"))
def test_every_synopsis_names_a_command_and_its_options(page, line):
    argv = line.split()[1:]
    assert command_words(argv), f"{page}: `{line}` names no medbanana command"
    assert not unknown_options(argv), f"{page}: `{line}` names options its --help does not show"


def test_a_misspelt_option_or_command_is_caught():
    """The checks above can fail: an abbreviation argparse accepts, an unknown option, an unknown command."""
    assert unknown_options(["build", "run", "--out", "x", "--source", "s"]) == ["--source"]
    assert unknown_options(["generate", "--sources", "s", "--no-such-option"]) == ["--no-such-option"]
    assert command_words(["buidl", "run"]) == ()
    assert command_words(["export", "medebench", "DATASET"]) == ("export", "medebench")


# ----------------------------------------------------------------------------------- the runnable blocks


def setup_command() -> str:
    """The README's set-up command: the first shell block, one line, ending with the demo."""
    lang, _, body = blocks("README.md")[0]
    (line,) = logical_lines(body)
    assert lang in SHELL and line.endswith("&& " + DEMO), line
    return line


def run_env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("GEMINI_API_KEY", "GOOGLE_API_KEY", "OPENAI_API_KEY")}
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])  # medbanana, python
    env["HF_HUB_OFFLINE"] = "1"  # the documented offline commands never need the network
    return env


@pytest.fixture(scope="module")
def docs_demo(tmp_path_factory) -> tuple[Path, str]:
    """A folder holding `demo-run/` made by the README's set-up command's demo, and what the demo printed."""
    root = tmp_path_factory.mktemp("docs")
    demo = shell_commands(setup_command())[-1]
    done = subprocess.run(demo, cwd=root, env=run_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return root, done.stdout


def runnable(page: str) -> list[tuple[str, str]]:
    return [(lang, body) for lang, marker, body in blocks(page) if marker == "<!-- test: run -->"]


@pytest.mark.slow
@pytest.mark.parametrize("page", [page for page in PAGES if runnable(page)])
def test_marked_blocks_run_as_written(page, docs_demo):
    root, _ = docs_demo
    for lang, body in runnable(page):
        assert lang in SHELL | {"python"}, f"{page}: a runnable block in {lang!r}"
        argv = ["bash", "-euo", "pipefail", "-c", body] if lang in SHELL else [sys.executable, "-c", body]
        done = subprocess.run(argv, cwd=root, env=run_env(), capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, f"{page}: this block failed (exit {done.returncode}):\n{body}\n" \
                                     f"{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
        assert "Traceback" not in done.stderr, f"{page}:\n{body}\n{done.stderr[-3000:]}"


@pytest.mark.slow
def test_the_demo_prints_what_the_readme_shows(docs_demo):
    _, printed = docs_demo
    (shown,) = [body for _, marker, body in blocks("README.md") if marker == "<!-- test: demo output -->"]
    seconds = re.compile(r"in \d+\.\d+ s$", re.M)
    assert seconds.search(shown) and seconds.search(printed)
    assert seconds.sub("in … s", printed).strip() == seconds.sub("in … s", shown).strip()


@pytest.mark.slow
def test_the_readme_picture_is_the_one_a_fresh_demo_gives(docs_demo):
    root, _ = docs_demo
    sys.path.insert(0, str(ROOT / "docs"))
    try:
        import make_figure
    finally:
        sys.path.remove(str(ROOT / "docs"))
    assert "docs/images/demo-grid.png" in (ROOT / "README.md").read_text()
    fresh = np.asarray(make_figure.figure(root / "demo-run" / "dataset"), dtype=np.int16)
    committed = np.asarray(Image.open(make_figure.FIGURE).convert("RGB"), dtype=np.int16)
    assert fresh.shape == committed.shape, "the picture's layout changed: run python docs/make_figure.py"
    differing = (np.abs(fresh - committed).max(axis=2) > 2).mean()  # JPEG decoders may differ by a level or two
    assert differing < 0.001, f"{differing:.1%} of the pixels differ from a fresh demo's: run python docs/make_figure.py"
