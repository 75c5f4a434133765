"""The Batch runner's request and results files (RUN_DIR/medbanana-cache/batches/, each can be gigabytes) do not
outlive the run that needs them: a results file goes when reading it ends, however it ends; Ctrl-C in the middle of
a download leaves no partial file; and what a `kill -9` leaves is removed by the next run when it opens the
directory, before it reads that job again, and that run ends with the records of an uninterrupted one.

The CLI runs in its own process against the fake Gemini server of this one; requests over the inline limit travel
as files, so the jobs' results come back as files too; a download is held halfway (headers and half the bytes
sent) for as long as the test needs the client to sit in the middle of it.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from fake_runs import mimic_sources
from medbanana.generation.backends.gemini_transport import ResultsFile
from medbanana.generation.backends.http import CallFailure
from medbanana.generation.testing import fake_gemini
from test_gemini_batch import _essentials, _job_shapes, _run, _wait_for, env  # noqa: F401 (env: a fixture)


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> Path:
    # 24 tasks with ~0.7 MB sources: each step's requests (~22 MB of base64, twice that for the judge) are over
    # the 19 MB inline limit, so they are uploaded and their results downloaded as files, as in a large run
    return mimic_sources(tmp_path_factory.mktemp("batch-files") / "sources", "MIMIC_files", size=768)


class _HalfSent:
    """A socket that sends the first answer's headers and half its body, then waits for `go` (the rest follows,
    to nobody if the client is gone)."""

    def __init__(self, sock, stalled: threading.Event, go: threading.Event):
        self._sock, self._stalled, self._go = sock, stalled, go

    def sendmsg(self, buffers) -> int:
        head, body = buffers
        half = len(body) // 2
        self._sock.sendall(head)
        self._sock.sendall(memoryview(body)[:half])
        self._stalled.set()
        self._go.wait(timeout=120)
        return len(head) + half

    def __getattr__(self, name):
        return getattr(self._sock, name)


class _DownloadGate:
    def __init__(self):
        self.armed, self.stalled, self.go = False, threading.Event(), threading.Event()

    def arm(self) -> None:
        """Hold the next results download halfway."""
        self.go.set()  # a download held before finishes (to a client that is gone)
        self.armed, self.stalled, self.go = True, threading.Event(), threading.Event()

    def open(self) -> None:
        self.armed = False
        self.go.set()


@pytest.fixture
def held_downloads(monkeypatch):
    gate = _DownloadGate()
    send = fake_gemini._Handler.send_payload

    def send_payload(handler, status, payload, headers=None):
        if gate.armed and status == 200 and handler.path.partition("?")[0].endswith(":download"):
            gate.armed = False
            sock = handler.connection
            handler.connection = _HalfSent(sock, gate.stalled, gate.go)
            try:
                return send(handler, status, payload, headers)
            finally:
                handler.connection = sock
        return send(handler, status, payload, headers)

    monkeypatch.setattr(fake_gemini._Handler, "send_payload", send_payload)
    yield gate
    gate.open()


def _results_files(work: Path) -> list[Path]:
    return sorted(work.glob("*.results.jsonl"))


@pytest.mark.slow
def test_no_results_file_outlives_an_interrupted_or_killed_batch_run(echo_gemini, sources, tmp_path, env,
                                                                   held_downloads):
    _run(echo_gemini, sources, tmp_path / "reference", batch={}, max_rounds=2)
    reference_shapes = _job_shapes(echo_gemini)
    assert any(job.from_file for job in echo_gemini.batches.created())  # the setting this test is about
    echo_gemini.reset()
    out = tmp_path / "run"
    work = out / "medbanana-cache" / "batches"
    command = [sys.executable, "-m", "medbanana", "generate", "--sources", str(sources), "--out", str(out),
               "--backend", "gemini", "--batch", "--poll-interval", "0.02", "--max-rounds", "2", "--max-attempts", "3",
               "-q"]

    def start_held() -> subprocess.Popen:
        """A run, stopped in the middle of its first results download (the partial file on disk)."""
        held_downloads.arm()
        proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        _wait_for(lambda: held_downloads.stalled.is_set() and _results_files(work), proc, seconds=120)
        return proc

    # Ctrl-C mid-download: the run stops as interrupted, and the partial file goes with it
    proc = start_held()
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and b"interrupted" in err
    assert not _results_files(work)

    # kill -9 at the same point leaves the partial file behind ...
    proc = start_held()
    proc.kill()
    proc.wait()
    stale = _results_files(work)
    assert len(stale) == 1
    job = "batches/" + stale[0].name.removeprefix("batches-").removesuffix(".results.jsonl")
    assert job in json.loads((out / "medbanana-batches.json").read_text())["jobs"]  # still to be read

    # ... until the next run opens the directory, with --batch (below) or without it (here, on a copy)
    local = tmp_path / "resumed-without-batch"
    shutil.copytree(out, local)
    done = subprocess.run([*command[:command.index("--out") + 1], str(local), "--backend", "gemini", "--max-rounds", "2", "-q"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "1 request or results files of a killed --batch run removed" in done.stdout
    assert not list((local / "medbanana-cache" / "batches").glob("*.jsonl"))

    # with --batch: gone before that run polls the job (held RUNNING for now)
    held_downloads.open()
    echo_gemini.batches.hold(first=int(job.rsplit("-", 1)[1]))
    polls = echo_gemini.batches.polls[job]
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _wait_for(lambda: echo_gemini.batches.polls[job] > polls, proc, seconds=120)
    assert not stale[0].exists()
    echo_gemini.batches.release()
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err.decode()[-2000:]
    assert _essentials(out) == _essentials(tmp_path / "reference")
    assert _job_shapes(echo_gemini) == reference_shapes  # the job was read again, not submitted again
    assert not list(work.glob("*.jsonl"))  # no request or results file left at all


def _response(text: str) -> dict:
    return {"candidates": [{"content": {"role": "model", "parts": [{"text": text}]}, "finishReason": "STOP"}]}


@pytest.mark.parametrize("how", ["to the end", "closed early", "never read", "a torn line"])
def test_a_results_file_is_removed_when_reading_it_ends(tmp_path, how):
    path = tmp_path / "batches-x.results.jsonl"
    lines = [{"key": "a", "response": _response("first")}, {"key": "b", "error": {"code": 429, "message": "slow"}},
             {"key": "c", "response": _response("third")}]
    text = "\n".join(json.dumps(line) for line in lines) + "\n"
    path.write_text(text + ('{"key": "d", "resp' if how == "a torn line" else ""))
    results = ResultsFile(path)
    if how == "to the end":
        items = list(results)
        assert [k for k, _ in items] == ["a", "b", "c"] and items[2][1].text == "third"
        assert isinstance(items[1][1], CallFailure) and items[1][1].retryable
    elif how == "closed early":
        assert next(results)[1].text == "first" and path.exists()
        results.close()
    elif how == "never read":
        results.close()
    else:
        with pytest.raises(ValueError):
            list(results)
    assert not path.exists()
