"""A finished command leaves no `medbanana.lock`, and removing it never lets two writers in.

The race removal opens: a process opens the lock file just before its last holder removes it, then locks that
removed file while a third process creates and locks a new one. Real processes take and release one folder's lock
in a loop, writers and readers mixed; each checks, while it holds the lock, what the others may not be doing at the
same time (a marker file made with O_EXCL), and the last one to release leaves no lock file. Then the command line:
`generate` and `build` leave none, and a second writer is still refused with exit code 75.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from medbanana.cli import main
from medbanana.generation.failures import EXIT_LOCKED
from medbanana.generation.rundir.lock import LOCK_NAME, LockHeld, hold_lock

ROUNDS = 2000  # lock-and-release cycles per process: enough that a removal lands between an open and a lock

TAKER = r"""
import os, sys
from pathlib import Path
from medbanana.generation.rundir.lock import LockHeld, hold_lock

folder, marks, rounds, role = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
me, held, broken = marks / f"reader-{os.getpid()}", 0, []
while held < rounds:
    try:
        with hold_lock(folder, "raced folder", shared=role == "reader"):
            held += 1
            if role == "writer":  # alone: no other writer's mark, no reader's
                try:
                    fd = os.open(marks / "writer", os.O_CREAT | os.O_EXCL | os.O_WRONLY)
                except FileExistsError:
                    broken.append("two writers held the lock at once")
                    continue
                os.close(fd)
                if any(p.name.startswith("reader-") for p in marks.iterdir()):
                    broken.append("a writer held the lock while a reader did")
                os.unlink(marks / "writer")
            else:
                me.touch()
                if (marks / "writer").exists():
                    broken.append("a reader held the lock while a writer did")
                me.unlink()
    except LockHeld:
        pass
print("\n".join(broken) or "ok")
sys.exit(1 if broken else 0)
"""


@pytest.mark.slow
def test_processes_racing_the_removal_of_the_lock_file_never_hold_it_together(tmp_path):
    folder, marks = tmp_path / "folder", tmp_path / "marks"
    folder.mkdir()
    marks.mkdir()
    script = tmp_path / "taker.py"
    script.write_text(TAKER)
    roles = ["writer", "writer", "writer", "reader", "reader"]
    takers = [subprocess.Popen([sys.executable, str(script), str(folder), str(marks), str(ROUNDS), role],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for role in roles]
    results = [(taker.wait(timeout=600), *taker.communicate()) for taker in takers]
    assert all(code == 0 and out.strip() == "ok" for code, out, _ in results), results
    assert list(folder.iterdir()) == []  # the last to release removed the lock file
    assert list(marks.iterdir()) == []


def test_a_reader_never_writes_into_a_folder_it_may_not_write(tmp_path):
    folder = tmp_path / "read-only"
    folder.mkdir()
    with hold_lock(folder, "run directory"):
        pass
    assert list(folder.iterdir()) == []
    (folder / LOCK_NAME).write_text("")  # as a killed writer leaves it
    folder.chmod(0o555)
    try:
        if os.access(folder, os.W_OK):  # root writes anyway: nothing to show
            return
        with hold_lock(folder, "run directory", shared=True):
            try:
                with hold_lock(folder, "run directory", shared=True):  # readers share it
                    pass
            except LockHeld:
                raise AssertionError("two readers refused each other") from None
        assert [p.name for p in folder.iterdir()] == [LOCK_NAME]  # locked as it was, not removed
    finally:
        folder.chmod(0o755)


@pytest.mark.slow
def test_a_finished_generate_leaves_no_lock_file_and_a_second_writer_is_still_refused(tiny_sources, tmp_path, capsys):
    out = tmp_path / "run"
    argv = ["generate", "--sources", str(tiny_sources), "--out", str(out), "--backend", "simulator",
            "--diseases", "Glaucoma", "--max-rounds", "2", "-q"]
    assert main(argv) == 0
    assert not (out / LOCK_NAME).exists()
    listing = sorted(p.relative_to(out) for p in out.rglob("*"))
    assert main(["build", str(out), "--out", str(tmp_path / "dataset"), "-q"]) == 0  # a reader of the run
    assert sorted(p.relative_to(out) for p in out.rglob("*")) == listing  # it created nothing it left there
    assert not any(p.name.endswith(LOCK_NAME) for p in tmp_path.iterdir())  # nor beside its --out
    capsys.readouterr()
    with hold_lock(out, "run directory"):  # as another generate writing there
        refused = subprocess.run([sys.executable, "-m", "medbanana", *argv], capture_output=True, text=True,
                                 timeout=300)
    assert refused.returncode == EXIT_LOCKED, refused.stderr
    assert f"is being used by pid {os.getpid()}" in refused.stderr
    assert not (out / LOCK_NAME).exists()
    assert main(argv) == 0  # free again: the same command resumes
    assert "ran 0" in capsys.readouterr().out and not (out / LOCK_NAME).exists()
