"""`medbanana generate` against the fake Gemini server, SIGKILLed again and again, then finished.

The run must end as if it had never been interrupted: every task finished exactly once, records and images in
one-to-one correspondence, every JSON file whole, and the request cache must have kept the fake from being paid
twice for calls that completed (only calls in flight at a kill may be made again).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fake_runs import mimic_sources, use_fake_gemini
from medbanana.cli import main
from medbanana.generation.rundir import layout
from medbanana.generation.testing.fake_gemini import FakeGemini
from medbanana.generation.sources.scan import scan_sources
from medbanana.generation.rundir.store import read_journal

KEY = "crash-test-key-51d0c7a2"
CONCURRENCY = 4
KILLS = 11


@pytest.fixture
def sources(tmp_path) -> Path:
    return mimic_sources(tmp_path / "sources", "MIMIC_crash", size=256)


def _command(sources: Path, out: Path) -> list[str]:
    return [sys.executable, "-m", "medbanana", "generate", "--sources", str(sources), "--out", str(out),
            "--backend", "gemini", "--concurrency", str(CONCURRENCY), "--max-rounds", "3", "--timeout", "20",
            "--retry-base-delay", "0.01", "-q"]


def _journal_lines(out: Path) -> int:
    return len(read_journal(out / layout.JOURNAL))


@pytest.mark.slow
def test_sigkilled_gemini_runs_resume_without_loss_duplicates_or_paying_twice(sources, tmp_path):
    rng = random.Random(7)
    with FakeGemini(engine="echo", latency=0.01) as fake:
        env = {**os.environ, "GEMINI_API_KEY": KEY, "GOOGLE_GEMINI_BASE_URL": fake.base_url,
               "PYTHONUNBUFFERED": "1"}
        reference = tmp_path / "reference"  # in this process: it only needs to count the calls
        with pytest.MonkeyPatch.context() as patch:
            use_fake_gemini(patch, fake, KEY)
            assert main(_command(sources, reference)[3:]) == 0
        uninterrupted_calls = fake.count()
        fake.reset()

        out, kills = tmp_path / "run", 0
        for _ in range(KILLS + 3):  # a few spare starts in case a run finishes before its kill point
            if kills == KILLS:
                break
            target = _journal_lines(out) + rng.randint(1, 4)
            proc = subprocess.Popen(_command(sources, out), env=env, stdout=subprocess.DEVNULL,
                                    stderr=subprocess.DEVNULL)
            deadline = time.monotonic() + 30
            while proc.poll() is None and time.monotonic() < deadline:
                if _journal_lines(out) >= target:
                    time.sleep(rng.uniform(0, 0.02))  # not always right after a journal write
                    proc.send_signal(signal.SIGKILL)
                    kills += 1
                    break
                time.sleep(0.003)
            proc.wait()
        final = subprocess.run(_command(sources, out), env=env, capture_output=True, text=True)
        interrupted_calls = fake.count()

    assert final.returncode == 0, final.stderr
    assert kills == KILLS, "the run finished before it could be killed often enough; make it longer"
    tasks = scan_sources(sources)
    finished = [e["uid"] for e in read_journal(out / layout.JOURNAL) if e["type"] == "task"]
    assert sorted(finished) == sorted(t.uid for t in tasks)  # every task finished, and exactly once

    for path in out.rglob("*.json"):  # configuration, stats, materialised files, cached responses
        json.loads(path.read_text(encoding="utf-8"))
    recorded, keys = set(), []
    for _, _, folder in layout.find_output_dirs(out):
        conversations = json.loads((folder / layout.ALL_CONVERSATIONS).read_text())
        progress = json.loads((folder / layout.PROGRESS).read_text())
        assert set(conversations) == set(progress)
        keys += list(conversations)
        for record in conversations.values():
            assert record["status"] in ("success", "failed")
            assert [r["round"] for r in record["rounds"]] == list(range(1, len(record["rounds"]) + 1))
            for rnd in record["rounds"]:
                assert (out / rnd["image"]).is_file()
                recorded.add(rnd["image"])
    assert sorted(keys) == sorted(t.key for t in tasks)
    assert {p.relative_to(out).as_posix() for p in out.rglob("*.jpeg")} == recorded

    # The interrupted run ends where the uninterrupted one did, and paid again only for calls cut off in flight.
    for _, _, folder in layout.find_output_dirs(reference):
        assert (json.loads((folder / layout.PROGRESS).read_text())
                == json.loads((out / folder.name / layout.PROGRESS).read_text()))
    assert uninterrupted_calls <= interrupted_calls <= uninterrupted_calls + kills * CONCURRENCY
