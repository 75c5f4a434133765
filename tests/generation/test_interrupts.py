"""Ctrl-C, as a terminal sends it (SIGINT to the whole process group), of commands that start processes of their own:
one "interrupted" line and exit code 130, no traceback from the command or any of its children, whenever it lands.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from medbanana.generation.rundir import layout

pytestmark = pytest.mark.skipif(not hasattr(os, "killpg"), reason="process groups are POSIX")


def _children(pid: int) -> list[int]:
    """The processes `pid` started that are alive (Linux: /proc)."""
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*/children"):
        found += [int(p) for p in task.read_text().split()]
    return found


def _interrupt(argv: list[str], ready, timeout: float = 120) -> subprocess.CompletedProcess:
    """Start `medbanana ARGV` as a terminal would, in a process group of its own; once `ready(process)` holds, send
    SIGINT to the group (every process in it, as Ctrl-C does) and return what the command printed."""
    env = {**os.environ, "GEMINI_API_KEY": "", "GOOGLE_API_KEY": ""}
    process = subprocess.Popen([sys.executable, "-m", "medbanana", *argv], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
    deadline = time.monotonic() + timeout
    while not ready(process):
        assert process.poll() is None, f"ended before it was interrupted: {process.communicate()}"
        assert time.monotonic() < deadline, "never got ready"
        time.sleep(0.05)
    os.killpg(process.pid, signal.SIGINT)
    out, err = process.communicate(timeout=timeout)
    return subprocess.CompletedProcess(process.args, process.returncode, out, err)


def _journalled(run_dir: Path):
    return lambda process: (run_dir / layout.JOURNAL).is_file() and (run_dir / layout.JOURNAL).stat().st_size > 0


def _assert_clean(result: subprocess.CompletedProcess) -> None:
    assert result.returncode == 130, result.stderr
    assert "Traceback" not in result.stderr and "KeyboardInterrupt" not in result.stderr, result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith("interrupted: ")


@pytest.mark.slow
def test_ctrl_c_of_generate_with_workers_while_they_start_and_while_they_run(tiny_sources, tmp_path):
    argv = ["generate", "--sources", str(tiny_sources), "--backend", "simulator", "--workers", "2", "-q"]
    # the workers were spawned a moment ago: they are still importing (a second or more), when a worker's own
    # SIGINT handling would come too late
    spawned: dict[int, float] = {}

    def starting_up(process) -> bool:
        if len(_children(process.pid)) >= 2:
            spawned.setdefault(process.pid, time.monotonic())
        return process.pid in spawned and time.monotonic() - spawned[process.pid] > 0.3

    _assert_clean(_interrupt([*argv, "--out", str(tmp_path / "starting")], starting_up))
    running = _interrupt([*argv, "--out", str(tmp_path / "running")], _journalled(tmp_path / "running"))
    _assert_clean(running)
    assert (tmp_path / "running" / layout.JOURNAL).stat().st_size  # what finished is kept


@pytest.mark.slow
def test_ctrl_c_of_demo_while_its_run_writes_images(tmp_path):
    """The demo's run computes each image's masks in a process of its own, started at the first image."""
    out = tmp_path / "demo"
    result = _interrupt(["demo", "--out", str(out), "--size", "128", "-q"], _journalled(out / "run"))
    _assert_clean(result)


def test_ctrl_c_while_the_command_line_is_still_being_read(tmp_path):
    """Ctrl-C before any command runs (the parser imports every stage's commands): the same one line."""
    started = time.monotonic()
    result = _interrupt(["demo", "--out", str(tmp_path / "d"), "-q"], lambda p: time.monotonic() - started > 0.3)
    # before Python runs any of it, SIGINT's default action ends the process silently (-SIGINT)
    assert "Traceback" not in result.stderr and result.returncode in (130, -signal.SIGINT), result.stderr
    assert not (tmp_path / "d" / "run").exists()
