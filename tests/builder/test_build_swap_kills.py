"""A build killed with SIGKILL while it swaps the new build in for the old one (generation/dataset/output.py).

The real `medbanana build` runs in its own process; the kill lands at a real point of the swap: the process kills
itself just before, or just after, the rename that names the old build `.NAME.previous-PID` (os.rename wrapped in
that process: the window is microseconds wide, no outside timing can hit it). Whatever the point, `--out` is a
whole build, old or new, and the next build of that folder leaves nothing beside it. Where the file system cannot
exchange two folders in one rename (emulated by the same process having no exchange), `--out` is missing after a
kill between the two renames, and the next build puts the previous build back before going on.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from medbanana.cli import main

DRIVER = """
import os, signal, sys
from pathlib import Path

point, argv = sys.argv[1], sys.argv[2:]
rename = os.rename

def killing_rename(src, dst, *args, **kwargs):
    aside = ".previous-" in Path(dst).name
    if aside and point == "before-aside":
        os.kill(os.getpid(), signal.SIGKILL)
    rename(src, dst, *args, **kwargs)
    if aside and point in ("after-aside", "between-renames"):
        os.kill(os.getpid(), signal.SIGKILL)

os.rename = killing_rename
if point == "between-renames":
    from medbanana.generation.dataset import output
    output.exchange = lambda a, b: False  # a file system without RENAME_EXCHANGE
from medbanana.cli import main
sys.exit(main(argv))
"""


def _build(run: Path, out: Path, config: str, point: str | None = None) -> subprocess.CompletedProcess:
    argv = ["build", str(run), "--out", str(out), "--configs", config, "-q"]
    command = [sys.executable, "-c", DRIVER, point, *argv] if point else [sys.executable, "-m", "medbanana", *argv]
    return subprocess.run(command, capture_output=True, text=True, timeout=300)


def _beside(out: Path) -> list[str]:
    return sorted(p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}."))


@pytest.mark.slow
@pytest.mark.parametrize("point", ["before-aside", "after-aside"])
def test_a_build_killed_while_swapping_leaves_a_whole_out_and_the_next_build_cleans_up(
        builder_original_run, tmp_path, point):
    out = tmp_path / "ds"
    assert _build(builder_original_run, out, "sft").returncode == 0
    killed = _build(builder_original_run, out, "conversations", point)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert (out / "conversations").is_dir() and not (out / "sft").exists()  # the new build, whole
    assert main(["verify", str(out)]) == 0
    assert _beside(out), "the kill left nothing to clean up: it missed the swap"

    assert _build(builder_original_run, out, "sft").returncode == 0
    assert (out / "sft").is_dir() and not (out / "conversations").exists()
    assert _beside(out) == []  # no staging folder, no previous build, no lock file


@pytest.mark.slow
def test_without_an_exchange_a_kill_between_the_renames_is_repaired_by_the_next_build(builder_original_run,
                                                                                       tmp_path):
    out = tmp_path / "ds"
    assert _build(builder_original_run, out, "sft").returncode == 0
    killed = _build(builder_original_run, out, "conversations", "between-renames")
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert not os.path.lexists(out)
    previous, = [name for name in _beside(out) if ".previous-" in name]
    assert (tmp_path / previous / "sft").is_dir()  # the old build, aside

    # a build that fails after taking the lock (a run's records are torn) still puts the previous build back
    broken = tmp_path / "broken"
    shutil.copytree(builder_original_run, broken)
    (broken / "MIMIC_synthetic_cxr-edit" / "all_conversations.json").write_text('{"a": {"rounds": [{"round": "x"')
    refused = _build(broken, out, "sft")
    assert refused.returncode == 2 and "all_conversations.json" in refused.stderr, refused.stderr
    assert (out / "sft").is_dir() and main(["verify", str(out)]) == 0
    assert _build(builder_original_run, out, "conversations").returncode == 0
    assert (out / "conversations").is_dir() and _beside(out) == []
