"""Two ways a run used to break against a server that answers oddly (issue 14, items 8 and 9).

The openai judge's json_schema fallback must reach requests that were already in flight when the server's first
400 arrived, so that a concurrent run against a server without structured output loses no task. A `--batch` run
whose status answers are malformed must end with its tasks recorded as api_failed, not poll until it is killed.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from conftest import write_jpeg
from medbanana.cli import main
from medbanana.generation.rundir import layout
from medbanana.generation.runners.batch import JOBS_FILE
from medbanana.generation.testing.fake_gemini import FakeGemini
from medbanana.generation.testing.fake_openai import FakeOpenAI
from medbanana.generation.backends.openai_compatible import OpenAIJudge
from medbanana.generation.records import EditedImage, SourceImage, Task, encode_jpeg

MODEL = "Qwen/Qwen2.5-VL-7B-Instruct"
CONCURRENCY = 8
LATENCY = 0.5  # seconds the fake holds each answer: longer than the editor staggers the judge requests by, so
#               that several are in flight together
MAX_ATTEMPTS = 3
RUN_TIMEOUT = 60  # seconds; the runs below take a few


def _sources(root: Path, count: int) -> Path:
    for i in range(count):
        write_jpeg(root / "MIMIC_x" / "normal" / f"n{i}.jpeg", i, size=64)
        write_jpeg(root / "MIMIC_x" / "Pneumothorax" / f"p{i}.jpeg", 100 + i, size=64)
    return root


def _schema_calls(fake: FakeOpenAI) -> int:
    return sum(1 for c in fake.calls if c.role == "judge" and c.response_format == "json_schema")


# ---------------------------------------------------------------- item 8: the json_schema fallback

@pytest.fixture(scope="module")
def openai_fake():
    pytest.importorskip("openai", reason="the openai backend needs `pip install 'medbanana[openai]'`")
    with FakeOpenAI() as server:
        yield server


@pytest.mark.slow
def test_judgements_in_flight_when_json_schema_is_refused_are_each_reasked_in_plain_text(openai_fake, tmp_path):
    openai_fake.reset(structured_output=False, latency=LATENCY)
    gray = np.full((64, 64, 3), 90, np.uint8)
    (tmp_path / "p.jpeg").write_bytes(encode_jpeg(gray))
    source = SourceImage(tmp_path / "p.jpeg")
    edited = EditedImage(data=encode_jpeg(gray + 20))
    task = Task("cxr_demo", "chest_xray", "Pneumothorax", "add", source.path)
    judge = OpenAIJudge(model=MODEL, base_url=openai_fake.base_url, timeout=10.0, max_attempts=2)

    async def judgements():  # one event loop: all CONCURRENCY requests go out before the first 400 comes back
        together = await asyncio.gather(*(judge.judge(task, source, edited, "Add a pneumothorax.")
                                          for _ in range(CONCURRENCY)))
        return together, await judge.judge(task, source, edited, "Add a pneumothorax.")

    together, later = asyncio.run(judgements())
    assert all("response_format rejected" in v.details["structured_output_fallback"] for v in together)
    assert {v.details["structured_output"] for v in together + [later]} == {"none"}
    assert "structured_output_fallback" not in later.details  # asked without the format from the start
    # each request that went out with the format was refused once and asked once more; none after that
    assert _schema_calls(openai_fake) == CONCURRENCY
    assert openai_fake.count("judge") == 2 * CONCURRENCY + 1


@pytest.mark.slow
def test_a_concurrent_run_against_a_server_without_json_schema_finishes_every_task(openai_fake, tmp_path, capsys):
    openai_fake.reset(structured_output=False, latency=LATENCY)
    sources, run_dir = _sources(tmp_path / "sources", CONCURRENCY // 2), tmp_path / "run"
    code = main(["generate", "--sources", str(sources), "--out", str(run_dir), "--diseases", "Pneumothorax",
                 "--writer", "openai", "--judge", "openai", "--editor", "simulator",
                 "--openai-base-url", openai_fake.base_url, "--openai-model", MODEL,
                 "--concurrency", str(CONCURRENCY), "--max-rounds", "1", "--timeout", "10", "-q"])
    assert code == 0, capsys.readouterr().err
    stats = json.loads((run_dir / layout.STATS).read_text())
    assert stats["api_failed"] == 0 and stats["success"] + stats["failed"] == CONCURRENCY
    judged = Counter(c.response_format for c in openai_fake.calls if c.role == "judge")
    # several judgements overlapped the first 400 (the race this is about), and at most one per slot asked
    assert 2 <= judged["json_schema"] <= CONCURRENCY and judged[""] == CONCURRENCY


# ---------------------------------------------------------------- item 9: malformed batch status answers

@pytest.fixture(scope="module")
def gemini_fake():
    with FakeGemini(engine="echo") as server:
        yield server


@pytest.fixture
def gemini_env(gemini_fake, monkeypatch):
    monkeypatch.setenv("GEMINI_API_KEY", "polling-test-key-8c2e41")
    monkeypatch.setenv("GOOGLE_GEMINI_BASE_URL", gemini_fake.base_url)
    return {**os.environ, "PYTHONUNBUFFERED": "1"}


def _failures(run_dir: Path) -> list[dict]:
    return [f for path in sorted(run_dir.rglob(layout.API_FAILURES)) for f in json.loads(path.read_text())]


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:BATCH_STATE_WIBBLING is not a valid JobState")  # the SDK's, on "state"
@pytest.mark.parametrize("how, problem", [
    ("json", "JSONDecodeError"),
    ("state", "unknown state 'BATCH_STATE_WIBBLING'"),
    ("fields", "no state in the answer"),
    ("output", "succeeded without results"),
])
def test_malformed_batch_status_answers_end_in_recorded_errors(gemini_fake, gemini_env, tmp_path, how, problem):
    sources, run_dir = _sources(tmp_path / "sources", 1), tmp_path / "run"
    gemini_fake.reset()
    gemini_fake.batches.garble(how)
    command = [sys.executable, "-m", "medbanana", "generate", "--sources", str(sources), "--out", str(run_dir),
               "--diseases", "Pneumothorax", "--backend", "gemini", "--batch", "--poll-interval", "0.02", "--max-rounds", "1",
               "--max-attempts", str(MAX_ATTEMPTS), "--retry-base-delay", "0.01", "-q"]
    # a subprocess, so that polling without end is a failed test rather than a hung one
    finished = subprocess.run(command, env=gemini_env, capture_output=True, text=True, timeout=RUN_TIMEOUT,
                              check=False)
    assert "Traceback" not in finished.stderr, finished.stderr
    failures = _failures(run_dir)
    assert len(failures) == 2 and {f["kind"] for f in failures} == {"bad_response"}
    assert all("batches/fake-1" in f["error"] and problem in f["error"] for f in failures)
    assert json.loads((run_dir / layout.STATS).read_text())["api_failed"] == 2
    # bounded: MAX_ATTEMPTS malformed polls in a row (each of those retried by the transport when it does not
    # parse), and the job given up rather than submitted again
    assert len(gemini_fake.batches.created()) == 1
    assert gemini_fake.batches.polls["batches/fake-1"] <= MAX_ATTEMPTS * (MAX_ATTEMPTS if how == "json" else 1)
    jobs = json.loads((run_dir / JOBS_FILE).read_text())["jobs"]
    assert jobs["batches/fake-1"]["state"] == "MALFORMED_STATUS"

    # a glitch shorter than that is not fatal: the run polls on and finishes every task
    gemini_fake.reset()
    gemini_fake.batches.garble(how, first=MAX_ATTEMPTS - 1)
    again = tmp_path / "again"
    assert main([*command[3:command.index("--out") + 1], str(again), *command[command.index("--out") + 2:]]) == 0
    stats = json.loads((again / layout.STATS).read_text())
    assert stats["api_failed"] == 0 and stats["success"] + stats["failed"] == 2


@pytest.mark.slow
def test_a_torn_results_file_is_fetched_again_and_one_torn_every_time_ends_in_recorded_errors(gemini_fake,
                                                                                              gemini_env, tmp_path):
    """Results files (requests over the inline limit) cut short in their last line, as a transfer behind a proxy
    may be: the job's results are downloaded again; torn every time, the job is given up after max_attempts with
    its unanswered requests recorded as bad_response, and no results file is left."""
    from medbanana.generation.runners.generate import BackendSpec, generate
    from medbanana.generation.runners.session import RunOptions
    from medbanana.generation.sources.scan import Selection

    sources = _sources(tmp_path / "sources", 2)
    spec = BackendSpec("gemini", {"writer": "gemini", "editor": "gemini", "judge": "gemini"},
                       gemini={"max_attempts": MAX_ATTEMPTS, "retry_base_delay": 0.01})

    def run(out: Path, torn: int):
        gemini_fake.reset()
        gemini_fake.batches.tear_downloads(torn)
        return generate(sources, out, selection=Selection.parse(diseases=["Pneumothorax"]), spec=spec,
                        options=RunOptions(max_rounds=1, quiet=True),
                        batch={"poll_interval": 0.02, "inline_limit": 1})  # every step's requests go as a file

    summary = run(tmp_path / "glitch", torn=MAX_ATTEMPTS - 1)
    assert summary.statuses["api_failed"] == 0 and summary.statuses["success"] + summary.statuses["failed"] == 4
    assert gemini_fake.batches._tear_left == 0  # the torn downloads happened, and were fetched again
    assert len(gemini_fake.batches.created()) == 3  # one job per step (write, edit, judge): none submitted again

    summary = run(tmp_path / "torn", torn=10**6)
    # each step's job is given up; the answers on the torn file's whole lines are used, the last request fails
    failures = _failures(tmp_path / "torn")
    assert summary.statuses["api_failed"] == len(failures) == 3
    assert {f["kind"] for f in failures} == {"bad_response"} and {f["step"] for f in failures} == {
        "generate_prompt", "edit_image", "verify_image"}
    assert all("do not parse" in f["error"] and "JSONDecodeError" in f["error"] for f in failures)
    jobs = json.loads((tmp_path / "torn" / JOBS_FILE).read_text())["jobs"]
    assert [job["state"] for job in jobs.values()] == ["MALFORMED_STATUS"] * 3
    assert [p.name for p in (tmp_path / "torn").rglob("*.jsonl")] == [layout.JOURNAL]  # no results file left
