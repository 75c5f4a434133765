"""`generate --workers N`: the calls spread over worker processes, the run directory written by the parent alone.

Against the fake Gemini server's echo engine (deterministic verdicts), a run with two workers must end exactly like
a run in one process; killing the parent must leave no worker calling the API, and rerunning must resume.
"""

from __future__ import annotations

import doctest
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fake_runs import mimic_sources, use_fake_gemini
from medbanana.cli import main
from medbanana.generation.rundir import layout
from medbanana.generation.failures import EXIT_INFRASTRUCTURE, WorkerCrashed
from medbanana.generation.runners import processes as workers
from medbanana.generation.testing.fake_gemini import FakeGemini
from medbanana.generation.runners.generate import BackendSpec
from medbanana.generation.sources.scan import scan_sources
from medbanana.generation.rundir.store import read_journal

KEY = "workers-test-key-9e41"


@pytest.fixture
def sources(tmp_path) -> Path:
    return mimic_sources(tmp_path / "sources", "MIMIC_w", disease="Pleural_Effusion", per_class=3, disease_seed=20)


def _args(sources: Path, out: Path, *extra: str) -> list[str]:
    return ["generate", "--sources", str(sources), "--out", str(out), "--backend", "gemini", "--concurrency", "4", "--max-rounds", "3",
            "--timeout", "20", "--retry-base-delay", "0.01", "-q", *extra]


def _outcomes(run_dir: Path) -> dict:
    """key -> (status, rounds, instructions) over every output folder."""
    result = {}
    for _, _, folder in layout.find_output_dirs(run_dir):
        for key, record in json.loads((folder / layout.ALL_CONVERSATIONS).read_text()).items():
            result[key] = (record["status"], len(record["rounds"]), [r["instruction"] for r in record["rounds"]])
    return result


def test_shares_doctest():
    assert doctest.testmod(workers).failed == 0


@pytest.mark.slow
def test_two_workers_end_like_one_process_and_count_their_calls(sources, tmp_path, monkeypatch):
    with FakeGemini(engine="echo", latency=0.01) as fake:
        use_fake_gemini(monkeypatch, fake, KEY)
        assert main(_args(sources, tmp_path / "one")) == 0
        single_calls = fake.count()
        fake.reset()
        assert main(_args(sources, tmp_path / "two", "--workers", "2")) == 0
        worker_calls = fake.count()

    one, two = tmp_path / "one", tmp_path / "two"
    assert _outcomes(two) == _outcomes(one) and len(_outcomes(two)) == len(scan_sources(sources))
    assert worker_calls == single_calls
    stats = json.loads((two / layout.STATS).read_text())
    assert stats["api_calls"] == worker_calls and stats["cache_hits"] == 0  # counted in the workers, summed here
    finished = [e["uid"] for e in read_journal(two / layout.JOURNAL) if e["type"] == "task"]
    assert len(finished) == len(set(finished)) == len(scan_sources(sources))
    images = {p.relative_to(two).as_posix() for p in two.rglob("*.jpeg")}
    recorded = {r["image"] for records in map(lambda f: json.loads((f / layout.ALL_CONVERSATIONS).read_text()),
                                              (f for _, _, f in layout.find_output_dirs(two)))
                for rec in records.values() for r in rec["rounds"]}
    assert images == recorded and images


def test_each_worker_gets_its_share_of_the_rate_limits(tmp_path, monkeypatch):
    monkeypatch.setenv("GEMINI_API_KEY", KEY)
    spec = BackendSpec("gemini", dict.fromkeys(("writer", "editor", "judge"), "gemini"),
                       gemini={"rpm": 120.0, "tpm": 1e6, "base_url": "http://127.0.0.1:9"})
    writer, _, judge = spec.build(tmp_path, share=3)
    assert writer.transport is judge.transport
    assert writer.transport.rpm == 40.0 and writer.transport.tpm == pytest.approx(1e6 / 3)
    assert spec.build(tmp_path)[0].transport.rpm == 120.0


def test_workers_refuse_the_batch_api(sources, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("GEMINI_API_KEY", KEY)
    assert main(_args(sources, tmp_path / "run", "--workers", "2", "--batch")) == 2
    assert "--workers is for API backends" in capsys.readouterr().err


@pytest.mark.slow
def test_killing_the_parent_stops_its_workers_and_a_rerun_resumes(sources, tmp_path):
    out = tmp_path / "run"
    command = [sys.executable, "-m", "medbanana", *_args(sources, out, "--workers", "2")]
    with FakeGemini(engine="echo", latency=0.05) as fake:
        env = {**os.environ, "GEMINI_API_KEY": KEY, "GOOGLE_GEMINI_BASE_URL": fake.base_url}
        for _ in range(2):
            before = len(read_journal(out / layout.JOURNAL))
            proc = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            deadline = time.monotonic() + 60
            while len(read_journal(out / layout.JOURNAL)) < before + 2 and time.monotonic() < deadline:
                assert proc.poll() is None, "the run ended before it could be killed"
                time.sleep(0.01)
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            time.sleep(1.0)  # a worker that noticed its parent is gone has exited by now
            calls = fake.count()
            time.sleep(0.5)
            assert fake.count() == calls, "a worker kept calling the API after its parent was killed"
        final = subprocess.run(command, env=env, capture_output=True, text=True)

    assert final.returncode == 0, final.stderr
    finished = [e["uid"] for e in read_journal(out / layout.JOURNAL) if e["type"] == "task"]
    assert sorted(finished) == sorted(t.uid for t in scan_sources(sources))
    for _, _, folder in layout.find_output_dirs(out):
        for record in json.loads((folder / layout.ALL_CONVERSATIONS).read_text()).values():
            assert [r["round"] for r in record["rounds"]] == list(range(1, len(record["rounds"]) + 1))
            assert all((out / r["image"]).is_file() for r in record["rounds"])


@pytest.mark.slow
def test_a_worker_that_dies_stops_the_run_with_a_clear_error_and_a_rerun_resumes(sources, tmp_path, monkeypatch):
    import multiprocessing
    import threading

    from medbanana.generation.runners.generate import generate
    from medbanana.generation.runners.session import RunOptions

    monkeypatch.setenv("GEMINI_API_KEY", KEY)
    out = tmp_path / "run"
    with FakeGemini(engine="echo", latency=0.05) as fake:
        spec = BackendSpec("gemini", dict.fromkeys(("writer", "editor", "judge"), "gemini"),
                           gemini={"base_url": fake.base_url, "timeout": 20, "max_attempts": 2})
        options = RunOptions(concurrency=4, max_rounds=3, workers=2, quiet=True)

        def kill_a_worker() -> None:
            deadline = time.monotonic() + 60
            while (not any(e["type"] == "task" for e in read_journal(out / layout.JOURNAL))
                   and time.monotonic() < deadline):
                time.sleep(0.01)
            multiprocessing.active_children()[0].kill()

        killer = threading.Thread(target=kill_a_worker)
        killer.start()
        with pytest.raises(WorkerCrashed, match="rerun the same command to resume"):
            generate(sources, out, spec=spec, options=options)
        killer.join()
        summary = generate(sources, out, spec=spec, options=options)
    assert summary.statuses["success"] + summary.statuses["failed"] == len(scan_sources(sources))
    assert summary.skipped >= 1  # what finished before the crash was kept


def _workers_of(parent: int) -> list[int]:
    """The `--workers` processes of `parent` (spawned children; not multiprocessing's resource tracker)."""
    children = Path(f"/proc/{parent}/task/{parent}/children").read_text().split()
    return [int(pid) for pid in children
            if b"resource_tracker" not in Path(f"/proc/{pid}/cmdline").read_bytes()]


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="finds the workers through /proc (Linux)")
def test_a_worker_killed_by_the_system_ends_the_cli_with_the_infrastructure_exit_code(sources, tmp_path):
    """Not 2 (a user error) nor a traceback: one line, exit code 4, and the rerun resumes to 0."""
    out = tmp_path / "run"
    command = [sys.executable, "-m", "medbanana", *_args(sources, out, "--workers", "2")]
    with FakeGemini(engine="echo", latency=0.05) as fake:
        env = {**os.environ, "GEMINI_API_KEY": KEY, "GOOGLE_GEMINI_BASE_URL": fake.base_url}
        proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 60
        while not any(e["type"] == "task" for e in read_journal(out / layout.JOURNAL)):
            assert proc.poll() is None and time.monotonic() < deadline, "the run ended before a worker was killed"
            time.sleep(0.01)
        os.kill(_workers_of(proc.pid)[0], signal.SIGKILL)  # as the kernel's OOM killer would
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == EXIT_INFRASTRUCTURE == 4, err
        err = "".join(line for line in err.splitlines(True) if "of unknown data use" not in line)  # destinations.py
        first, *rest = err.strip().splitlines()  # the run's first line names the backends, then the one error line
        assert first.startswith("medbanana generate: writer gemini") and len(rest) == 1, err
        assert "ended (exit code -9)" in rest[0] and "rerun the same command" in rest[0], err
        rerun = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
        assert rerun.returncode == 0, rerun.stderr
