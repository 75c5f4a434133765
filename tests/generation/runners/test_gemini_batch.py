"""`medbanana generate --batch` against the fake Gemini server's Batch and Files API endpoints.

A batch run makes the same calls as a concurrent run, only grouped into one job per step and round, and writes
the same run directory; over the inline limit its requests travel as an uploaded JSONL file; per-request errors
and failed jobs are retried or recorded with their kind; and a run killed while a job is running resumes polling
that job instead of submitting it again.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from fake_runs import mimic_sources, use_fake_gemini
from medbanana.cli import main
from medbanana.generation.rundir import layout
from medbanana.generation.runners.batch import JOBS_FILE
from medbanana.generation.backends.settings import GeminiSettings
from medbanana.generation.runners.generate import generate
from medbanana.generation.records import decode_rgb
from medbanana.generation.runners.session import RunOptions
from medbanana.generation.sources.scan import scan_sources
from medbanana.generation.rundir.store import read_journal

KEY = "batch-test-key-3f9d0e"
ROLES = {"writer": "gemini", "editor": "gemini", "judge": "gemini"}


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> Path:
    return mimic_sources(tmp_path_factory.mktemp("batch") / "sources", "MIMIC_batch", size=96)


@pytest.fixture
def env(echo_gemini, monkeypatch):
    use_fake_gemini(monkeypatch, echo_gemini, KEY)
    return {**os.environ, "PYTHONUNBUFFERED": "1"}


def _run(fake, sources: Path, out: Path, faults=(), *, batch: dict | None = None, max_rounds: int = 3,
         retry_failed: bool = False):
    """One whole run in this process, through pipeline.generate; batch=None is the concurrent runner."""
    fake.reset(faults)
    options = GeminiSettings(max_attempts=3, retry_base_delay=0.01, timeout=5).options(out, ROLES)
    return generate(sources, out, backend="gemini", roles=ROLES, backend_options=options, limit=None,
                    options=RunOptions(max_rounds=max_rounds, concurrency=3, quiet=True, retry_failed=retry_failed),
                    batch=None if batch is None else {"poll_interval": 0.02, **batch})


def _conversations(run_dir: Path) -> dict[str, dict]:
    found = {}
    for _, _, folder in layout.find_output_dirs(run_dir):
        found.update(json.loads((folder / layout.ALL_CONVERSATIONS).read_text()))
    return found


def _essentials(run_dir: Path) -> dict:
    """What two runs of the same tasks must agree on: outcomes, every round's instruction, verdict and image."""
    return {key: (r["status"], [(x["instruction"], x["accepted"], x["image"], x["edit_result"].get("error"),
                                 (x["verification"] or {}).get("reason")) for x in r["rounds"]],
                  (r.get("error") or {}).get("kind"))
            for key, r in _conversations(run_dir).items()}


def _job_shapes(fake) -> list[tuple[str, int]]:
    """(role, number of requests) of every batch job the fake received, in order."""
    return [(fake.role_of(job.items[0][1]), len(job.items)) for job in fake.batches.created()]


@pytest.mark.slow
def test_a_batch_run_makes_the_concurrent_runs_calls_in_one_job_per_step(echo_gemini, sources, tmp_path, env):
    _run(echo_gemini, sources, tmp_path / "concurrent")
    concurrent_calls = Counter(c.role for c in echo_gemini.calls)
    summary = _run(echo_gemini, sources, tmp_path / "batch", batch={})
    assert summary.statuses["success"] + summary.statuses["failed"] == len(scan_sources(sources))
    assert _essentials(tmp_path / "batch") == _essentials(tmp_path / "concurrent")
    assert Counter(c.role for c in echo_gemini.calls) == concurrent_calls
    assert all(c.path.startswith("batches/") for c in echo_gemini.calls)  # no call outside a batch job
    # round by round, each step's calls of every pending task in one job: writer, editor, judge
    shapes = _job_shapes(echo_gemini)
    assert [role for role, _ in shapes] == ["writer", "editor", "judge"] * (len(shapes) // 3)
    pending = [n for role, n in shapes if role == "writer"]
    assert pending[0] == len(scan_sources(sources)) and pending == sorted(pending, reverse=True)
    assert all(shapes[i][1] == shapes[i + 1][1] == shapes[i + 2][1] for i in range(0, len(shapes), 3))
    jobs = json.loads((tmp_path / "batch" / JOBS_FILE).read_text())["jobs"]
    assert len(jobs) == len(shapes) and {j["state"] for j in jobs.values()} == {"JOB_STATE_SUCCEEDED"}


@pytest.mark.slow
def test_over_the_inline_limit_requests_go_as_an_uploaded_jsonl_file(echo_gemini, sources, tmp_path, env):
    _run(echo_gemini, sources, tmp_path / "inline", batch={})
    _run(echo_gemini, sources, tmp_path / "file", batch={"inline_limit": 1000})
    jobs = echo_gemini.batches.created()
    assert jobs and all(job.from_file for job in jobs)
    assert len(echo_gemini.batches.files) == 2 * len(jobs)  # each job: the uploaded requests and its results
    assert _essentials(tmp_path / "file") == _essentials(tmp_path / "inline")
    images = sorted(p.relative_to(tmp_path / "inline") for p in (tmp_path / "inline").rglob("*.jpeg"))
    assert images and all(np.array_equal(decode_rgb((tmp_path / "inline" / i).read_bytes()),
                                         decode_rgb((tmp_path / "file" / i).read_bytes())) for i in images)
    assert not list((tmp_path / "file" / "medbanana-cache" / "batches").glob("*.jsonl"))  # removed after use


@pytest.mark.slow
@pytest.mark.parametrize("faults, check", [
    (["500:first=2", "batch_failed:first=1,role=editor", "text_only:first=1", "truncated_json:first=2"],
     "recovered"),
    (["503:role=judge"], "server_error"),
    (["truncated_json"], "unparseable_verdict"),
    (["safety:role=writer"], "safety"),
    (["image_safety"], "image_safety"),
    (["invalid_argument:role=editor"], "invalid_argument"),  # the fake echoes the key in this error
], ids=["transient", "503-judge", "truncated-json", "safety-writer", "image-safety", "invalid-argument"])
def test_faults_inside_batches_are_retried_or_recorded_with_their_kind(echo_gemini, sources, tmp_path, env, faults,
                                                                       check):
    reference = _run(echo_gemini, sources, tmp_path / "clean", batch={}, max_rounds=2)
    _run(echo_gemini, sources, tmp_path / "faulty", faults, batch={}, max_rounds=2)
    records = _conversations(tmp_path / "faulty")
    assert len(records) == reference.statuses.total() == len(scan_sources(sources))  # nothing lost
    if check == "recovered":  # retried in later jobs, re-asked, resubmitted: the clean run's results
        assert _essentials(tmp_path / "faulty") == _essentials(tmp_path / "clean")
        assert len(echo_gemini.batches.created()) > 6
    elif check in ("image_safety", "invalid_argument"):  # editor refusals: rounds without image, as when sync
        assert all(r["status"] == "failed" and all(x["edit_result"]["error"].startswith(f"{check}: ")
                                                   for x in r["rounds"]) for r in records.values())
    else:
        assert {(r["status"], r["error"]["kind"]) for r in records.values()} == {("api_failed", check)}
        failures = json.loads((tmp_path / "faulty" / "MIMIC_batch-edit" / layout.API_FAILURES).read_text())
        assert {f["kind"] for f in failures} == {check}
        # --retry-failed in batch mode asks again (the unusable answers were not kept) and finishes every task
        _run(echo_gemini, sources, tmp_path / "faulty", batch={}, max_rounds=2, retry_failed=True)
        assert _essentials(tmp_path / "faulty") == _essentials(tmp_path / "clean")
    assert not [p for p in (tmp_path / "faulty").rglob("*") if p.is_file() and KEY.encode() in p.read_bytes()]


def _wait_for(condition, proc, seconds=30.0):
    deadline = time.monotonic() + seconds
    while not condition():
        assert proc.poll() is None, "the run ended before the point it was to be killed at"
        assert time.monotonic() < deadline, "timed out waiting for the run"
        time.sleep(0.01)


def _submitted(out: Path) -> list[str]:
    try:
        jobs = json.loads((out / JOBS_FILE).read_text())["jobs"]
    except (FileNotFoundError, ValueError):
        return []
    return list(jobs)


@pytest.mark.slow
def test_a_killed_batch_run_resumes_polling_instead_of_resubmitting(echo_gemini, sources, tmp_path, env):
    _run(echo_gemini, sources, tmp_path / "reference", batch={})
    reference_shapes = _job_shapes(echo_gemini)
    echo_gemini.reset()
    out = tmp_path / "run"
    command = [sys.executable, "-m", "medbanana", "generate", "--sources", str(sources), "--out", str(out),
               "--backend", "gemini", "--batch", "--poll-interval", "0.02", "--max-rounds", "3", "--max-attempts", "3", "-q"]
    for kill_in_job in (1, 4):  # during round 1's writer job, then during round 2's writer job
        echo_gemini.batches.hold(first=kill_in_job)
        proc = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        job = f"batches/fake-{kill_in_job}"
        _wait_for(lambda job=job: job in _submitted(out) and echo_gemini.batches.polls[job] >= 2, proc)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        assert len(echo_gemini.batches.created()) == kill_in_job  # the restart polled the old jobs, submitted no copy
    echo_gemini.batches.release()
    assert main(command[3:]) == 0
    assert _job_shapes(echo_gemini) == reference_shapes  # every step's job exactly once, as in an uninterrupted run
    assert _essentials(out) == _essentials(tmp_path / "reference")
    finished = [e["uid"] for e in read_journal(out / layout.JOURNAL) if e["type"] == "task"]
    assert sorted(finished) == sorted(t.uid for t in scan_sources(sources))
    assert _submitted(out) == [job.name for job in echo_gemini.batches.created()]
