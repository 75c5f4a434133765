"""Options that cannot mean anything are refused when they are read, in one line with exit code 2, before any folder
is made or any task runs (they used to run: `--max-rounds 0` failed every task with no attempt, `--limit 0` ran every
task, `--accept 'score>=1.5'` rejected every edit after five paid rounds)."""

from __future__ import annotations

import subprocess
import sys

import pytest

CASES = [
    (["generate", "--max-rounds", "0"], "--max-rounds: want a whole number of at least 1"),
    (["generate", "--limit", "0"], "--limit: want a whole number of at least 1"),
    (["generate", "--concurrency", "-2"], "--concurrency: want a whole number of at least 1"),
    (["generate", "--accept", "score>=1.5"], "the rubric score is between 0 and 1"),
    (["generate", "--accept", "best"], "unknown acceptance policy 'best'"),
    (["generate", "--timeout", "0"], "--timeout: want a number above 0"),
    (["generate", "--rpm", "-5"], "--rpm: want a number above 0"),
    (["generate", "--workers", "0"], "--workers: want a whole number of at least 1 or auto"),
    (["generate", "--geometry", "warp"], "--geometry: invalid choice: 'warp'"),
    (["generate", "--simulator-drift", "1.5"], "--simulator-drift: want a share between 0 and 1"),
    (["demo", "--simulator-drift", "-0.1"], "--simulator-drift: want a share between 0 and 1"),
    (["demo", "--size", "8"], "--size: want a whole number of at least 64"),
    (["demo", "--normal", "-1"], "--normal: want a whole number of at least 0"),
    (["demo", "--normal", "0", "--diseased", "0"], "leave no task to run"),
]


@pytest.mark.parametrize("argv, said", CASES, ids=[" ".join(c[0]) for c in CASES])
def test_a_meaningless_option_is_one_line_before_anything_runs(tiny_sources, tmp_path, argv, said):
    out = tmp_path / "out"
    where = ["--sources", str(tiny_sources), "--out", str(out)] if argv[0] == "generate" else ["--out", str(out)]
    result = subprocess.run([sys.executable, "-m", "medbanana", argv[0], *where, *argv[1:]], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 2
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and said in lines[0], result.stderr
    assert lines[0].startswith(f"medbanana {argv[0]}: error: ")
    assert not out.exists()


def test_an_unknown_command_is_one_line_naming_the_commands():
    result = subprocess.run([sys.executable, "-m", "medbanana", "frobnicate"], capture_output=True, text=True)
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "'generate'" in result.stderr and "--help" in result.stderr


def test_version_is_the_installed_one():
    from importlib.metadata import version

    result = subprocess.run([sys.executable, "-m", "medbanana", "--version"], capture_output=True, text=True)
    assert result.returncode == 0 and result.stdout.strip() == f"medbanana {version('medbanana')}"
