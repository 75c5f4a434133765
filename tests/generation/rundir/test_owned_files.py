"""Files medbanana writes in place (locks, the journal, `eval`'s records, caches) are its own: a hard link, a FIFO
or a folder at their names is refused in one line, never written through and never waited on (issue 37).

Each test plants the thing in a real tree as another machine (or another user) could have left it, runs the real
CLI (in a child process with a timeout wherever a FIFO could make it wait forever), and checks the exit code, the
one line, and that the file outside the folder is untouched. Files replaced by a rename (the run's JSON files) are
never written in place: a hard link at their name is replaced, its other name untouched. The lock holder's
recorded command is printed escaped.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import write_jpeg
from medbanana.cli import main
from medbanana.generation.files import UnsafeFile, open_owned
from medbanana.generation.rundir import layout
from medbanana.generation.failures import EXIT_LOCKED
from medbanana.generation.rundir.lock import LOCK_NAME

OUTSIDE = b"the user's own file, outside the folder\n"
OPTIONS = ["--backend", "simulator", "--diseases", "Pneumothorax", "--directions", "add", "--max-rounds", "1", "-q"]
NO_HANG = 120  # seconds a child process may take; a FIFO opened blocking would wait forever


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> Path:
    """A finished run and its sources, made once by the real CLI."""
    root = tmp_path_factory.mktemp("made")
    write_jpeg(root / "sources" / "MIMIC_own" / "normal" / "n0.jpeg", 1, size=48)
    assert main(["generate", "--sources", str(root / "sources"), "--out", str(root / "run"), *OPTIONS]) == 0
    return root


@pytest.fixture
def run(tmp_path, made) -> Path:
    shutil.copytree(made, tmp_path / "made", symlinks=True)
    return tmp_path / "made" / "run"


@pytest.fixture
def outside(tmp_path) -> Path:
    path = tmp_path / "outside" / "precious.txt"
    path.parent.mkdir()
    path.write_bytes(OUTSIDE)
    return path


def resume(run: Path) -> list[str]:
    return ["generate", "--sources", str(run.parent / "sources"), "--out", str(run), *OPTIONS]


def in_child(argv: list[str]) -> subprocess.CompletedProcess:
    """The real CLI in a child process that must end within NO_HANG seconds (TimeoutExpired fails the test)."""
    return subprocess.run([sys.executable, "-m", "medbanana", *argv], capture_output=True, text=True,
                          timeout=NO_HANG, check=False)


def one_line(err: str) -> str:
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


def hard_link(path: Path, outside: Path) -> None:
    path.unlink(missing_ok=True)
    os.link(outside, path)


PLANTS = {  # what is planted at a name, and the words of the refusal
    "hard link": (hard_link, "is a hard link (one of 2 names of one file)"),
    "FIFO": (lambda path, outside: os.mkfifo(path), "not a regular file but a FIFO (named pipe)"),
    "folder": (lambda path, outside: path.mkdir(), "not a regular file but a folder"),
}


def plant(path: Path, kind: str, outside: Path) -> str:
    if path.exists() and not path.is_dir():
        path.unlink()
    make, words = PLANTS[kind]
    make(path, outside)
    return words


# ---------------------------------------------------------------- locks and the journal

@pytest.mark.parametrize("kind", list(PLANTS))
def test_the_run_lock_is_refused_when_it_is_not_a_file_of_its_own(run, outside, kind):
    words = plant(run / LOCK_NAME, kind, outside)
    journal = (run / layout.JOURNAL).read_bytes()
    done = in_child(resume(run))
    assert done.returncode == 2, done.stderr
    assert f"{run / LOCK_NAME}" in one_line(done.stderr) and words in done.stderr
    assert outside.read_bytes() == OUTSIDE and (run / layout.JOURNAL).read_bytes() == journal


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(PLANTS))
def test_the_build_output_lock_is_refused_when_it_is_not_a_file_of_its_own(run, outside, kind):
    lock = run.parent / f".dataset.{LOCK_NAME}"
    words = plant(lock, kind, outside)
    done = in_child(["build", str(run), "--out", str(run.parent / "dataset"), "-q"])
    assert done.returncode == 2, done.stderr
    assert f"{lock}" in one_line(done.stderr) and words in done.stderr
    assert outside.read_bytes() == OUTSIDE and not (run.parent / "dataset").exists()


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["FIFO", "folder"])
def test_a_run_read_by_build_with_a_lock_that_is_no_file_is_refused_not_waited_on(run, outside, kind):
    words = plant(run / LOCK_NAME, kind, outside)
    done = in_child(["build", str(run), "--out", str(run.parent / "dataset"), "-q"])
    assert done.returncode == 2, done.stderr
    assert f"{run / LOCK_NAME}" in one_line(done.stderr) and words in done.stderr


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(PLANTS))
def test_a_journal_that_is_not_a_file_of_its_own_is_refused_before_anything_is_written(run, outside, kind):
    journal = run / layout.JOURNAL
    if kind == "hard link":
        outside.write_bytes(journal.read_bytes())  # a journal that reads well, whose other name is outside
    words = plant(journal, kind, outside)
    config, before = (run / layout.RUN_CONFIG).read_bytes(), outside.read_bytes()
    done = in_child(resume(run))
    assert done.returncode == 2, done.stderr
    assert f"{journal}" in one_line(done.stderr) and words in done.stderr
    assert outside.read_bytes() == before and (run / layout.RUN_CONFIG).read_bytes() == config
    assert not (run / LOCK_NAME).exists()


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["FIFO", "folder"])
def test_a_run_config_that_is_no_file_is_refused(run, outside, kind):
    words = plant(run / layout.RUN_CONFIG, kind, outside)
    for argv in (resume(run), ["generate", "--retry-failed", str(run), "-q"]):
        done = in_child(argv)
        assert done.returncode == 2, done.stderr
        assert f"{run / layout.RUN_CONFIG}" in one_line(done.stderr) and words in done.stderr


@pytest.mark.slow
def test_the_run_json_files_replace_a_hard_link_and_refuse_a_folder(run, outside, capsys):
    """The JSON files are replaced by a rename: a hard link at their name loses that name, its other name keeps
    its bytes. A folder there is refused in one line (a rename cannot replace it)."""
    folder = layout.output_dir(run, "MIMIC_own", "add")
    hard_link(folder / layout.PROGRESS, outside)
    (run / layout.JOURNAL).unlink()  # a fresh start: the task runs again, every file is written again
    assert main(resume(run)) == 0, capsys.readouterr().err
    assert outside.read_bytes() == OUTSIDE and os.stat(outside).st_nlink == 1
    assert json.loads((folder / layout.PROGRESS).read_text()) in ({"n0-Pneumothorax": "success"},
                                                                   {"n0-Pneumothorax": "failed"})

    (folder / layout.ALL_CONVERSATIONS).unlink()
    (folder / layout.ALL_CONVERSATIONS).mkdir()
    (run / layout.JOURNAL).unlink()
    capsys.readouterr()
    assert main(resume(run)) == 2
    err = one_line(capsys.readouterr().err)
    assert f"{folder / layout.ALL_CONVERSATIONS}: not a regular file but a folder" in err


def test_eval_refuses_a_records_file_that_is_a_hard_link(run, outside, tmp_path, capsys):
    """`eval`'s per-sample records are appended to: a hard link there is refused, its other name untouched."""
    out = tmp_path / "eval"
    out.mkdir()
    records = out / "samples.jsonl"
    os.link(outside, records)
    code = main(["eval", str(run), "--out", str(out), "--source-images", str(run.parent / "sources"), "-q"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert f"{records} is a hard link" in one_line(err)
    assert outside.read_bytes() == OUTSIDE


# ---------------------------------------------------------------- caches

def test_a_cache_log_that_is_a_fifo_is_left_out_with_a_warning_never_opened(tmp_path):
    """Written and read in a child process: a blocking open of the FIFO would never return."""
    cache = tmp_path / "cache"
    cache.mkdir()
    os.mkfifo(cache / "answers-1-2.log")
    script = ("import warnings; warnings.simplefilter('always');"
              "from medbanana.generation.backends.response_cache import ResponseCache;"
              f"c = ResponseCache({str(cache)!r}); c.put_json('k' * 64, '{{\"answer\": 1}}'); c.close();"
              f"c = ResponseCache({str(cache)!r}); print(sorted(c.keys())); print(c.read('k' * 64))")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=NO_HANG,
                          check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [str(["k" * 64]), '{"answer": 1}']
    assert "left out, never opened" in done.stderr and "answers-1-2.log: not a regular file but a FIFO" in done.stderr


@pytest.mark.parametrize("kind", list(PLANTS))
def test_open_owned_refuses_each_kind_for_writing_and_opens_a_file_of_its_own(tmp_path, outside, kind):
    path = tmp_path / "file"
    path.write_bytes(b"mine")
    words = plant(path, kind, outside)
    with pytest.raises(UnsafeFile, match=words.replace("(", r"\(").replace(")", r"\)")):
        os.close(open_owned(path, os.O_RDWR | os.O_APPEND))
    assert outside.read_bytes() == OUTSIDE
    own = tmp_path / "own"
    fd = open_owned(own, os.O_RDWR | os.O_CREAT | os.O_APPEND)
    try:
        os.write(fd, b"x")
        assert os.get_blocking(fd)  # O_NONBLOCK cleared: a plain file descriptor from here on
    finally:
        os.close(fd)
    assert own.read_bytes() == b"x"


# ---------------------------------------------------------------- exit code 75: who holds the lock, escaped

def test_the_lock_holder_is_printed_escaped_in_one_line(run, capsys):
    forged = "medbanana generate \x1b[2J\x1b[31mRED\nmedbanana generate: done, all fine\u2028\u202eevil\\x41"
    lock = run / LOCK_NAME
    info = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.time(), "what": "run directory",
            "command": forged}
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        os.write(fd, json.dumps(info).encode() + b"\n")
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # as the process that wrote it would hold it
        capsys.readouterr()
        assert main(resume(run)) == EXIT_LOCKED
    finally:
        os.close(fd)
    err = one_line(capsys.readouterr().err)
    assert "\x1b" not in err and "\u2028" not in err and "\u202e" not in err
    assert "\\x1b[2J\\x1b[31mRED\\nmedbanana generate: done, all fine\\u2028\\u202eevil\\\\x41" in err
    assert f"is being used by pid {os.getpid()}" in err
