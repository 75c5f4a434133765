"""The retry command `generate` prints after API failures works as printed: `--retry-failed RUN_DIR` takes the
run's recorded max rounds, seed and accept policy for those not given, and the printed line itself carries what
names a destination (sources, backends, models, Vertex AI's project and location), which a retry must give.

Both commands run as a user runs them: the `medbanana` script in a subprocess, against the fake Gemini server on
127.0.0.1, the second one split from the line the first one printed.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from fake_runs import mimic_sources
from service_account import service_account_file
from medbanana.generation.rundir import layout
from medbanana.generation.rundir.store import read_journal
from medbanana.generation.sources.scan import scan_sources
from medbanana.generation.testing.fake_gemini import FakeGemini

KEY = "retry-printed-key-71b0"
JUDGE = "judge-model-of-the-run"


def _finished(run_dir: Path) -> dict[str, dict]:
    return {e["uid"]: e["record"] for e in read_journal(run_dir / layout.JOURNAL) if e["type"] == "task"}


def _retry_as_printed(stderr: str, out: Path, env: dict, fake: FakeGemini, options: list[str]) -> None:
    """Run the retry command the first run printed (split from its line), on a fake with a fresh log; the line
    holds `options` (the run's destinations) after the run directory."""
    printed = next(line for line in stderr.splitlines() if line.startswith("retry them with: "))
    command = shlex.split(printed.removeprefix("retry them with: ").partition(" (")[0])
    assert command == ["medbanana", "generate", "--retry-failed", str(out), *options]
    fake.reset()
    retry = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert retry.returncode == 0, retry.stderr


@pytest.mark.slow
def test_the_printed_retry_command_takes_the_runs_options_and_finishes_the_failed_tasks(tmp_path):
    sources = mimic_sources(tmp_path / "sources", "MIMIC_retry", disease="Pleural_Effusion", per_class=1)
    out = tmp_path / "run"
    with FakeGemini(engine="echo", faults=["500:role=writer,first=2"]) as fake:
        env = {**os.environ, "GEMINI_API_KEY": KEY, "GOOGLE_GEMINI_BASE_URL": fake.base_url,
               "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
        first = subprocess.run(
            ["medbanana", "generate", "--sources", str(sources), "--out", str(out), "--backend", "gemini",
             "--max-rounds", "3", "--seed", "11", "--accept", "score>=0.7", "--judge-model", JUDGE,
             "--max-attempts", "1", "--concurrency", "1", "--timeout", "20", "-q"],
            env=env, capture_output=True, text=True, timeout=300)
        assert first.returncode == 3, first.stderr
        failed = {uid for uid, r in _finished(out).items() if r["status"] == "api_failed"}
        assert len(failed) == 2
        config = (out / layout.RUN_CONFIG).read_bytes()

        _retry_as_printed(first.stderr, out, env, fake, ["--sources", str(sources), "--backend", "gemini",
                                                         "--judge-model", JUDGE])
        judged_by = {call.model for call in fake.calls if call.role == "judge"}

    finished = _finished(out)
    assert set(finished) == {t.uid for t in scan_sources(sources)}
    assert not any(r["status"] == "api_failed" for r in finished.values())
    assert all(len(finished[uid]["rounds"]) <= 3 for uid in failed)
    assert judged_by == {JUDGE}  # the recorded judge model, not the default one
    assert (out / layout.RUN_CONFIG).read_bytes() == config  # the same run: max rounds, seed, accept, models
    recorded = json.loads(config)
    assert (recorded["max_rounds"], recorded["seed"], recorded["accept"]) == (3, 11, "score>=0.7")


@pytest.mark.slow
def test_the_printed_retry_command_of_a_vertex_run_calls_vertex_ai_again(tmp_path):
    """A run on Vertex AI records its project and location; the retry goes there, not to the Gemini API (whose key
    and base URL are set too, so a retry that forgot --vertex would reach the fake on the Gemini API's path)."""
    sources = mimic_sources(tmp_path / "sources", "MIMIC_retry", disease="Pleural_Effusion", per_class=1)
    out = tmp_path / "run"
    with FakeGemini(engine="echo", faults=["500:role=writer,first=1"]) as fake:
        env = {name: value for name, value in os.environ.items() if not name.startswith(("GOOGLE_", "GEMINI_"))}
        env.update(GEMINI_API_KEY=KEY, GOOGLE_GEMINI_BASE_URL=fake.base_url, GOOGLE_VERTEX_BASE_URL=fake.base_url,
                   GOOGLE_APPLICATION_CREDENTIALS=str(service_account_file(tmp_path, f"{fake.base_url}/token")),
                   PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
        first = subprocess.run(
            ["medbanana", "generate", "--sources", str(sources), "--out", str(out), "--vertex-project", "proj-r",
             "--vertex-location", "europe-west4", "--max-rounds", "2", "--max-attempts", "1", "--concurrency", "1",
             "--timeout", "20", "-q"], env=env, capture_output=True, text=True, timeout=300)
        assert first.returncode == 3, first.stderr
        failed = {uid for uid, r in _finished(out).items() if r["status"] == "api_failed"}
        assert len(failed) == 1

        _retry_as_printed(first.stderr, out, env, fake, ["--sources", str(sources), "--backend", "gemini",
                                                         "--vertex-project", "proj-r", "--vertex-location",
                                                         "europe-west4"])
        calls = [(call.path.split("/models/")[0], call.credential.split("-token-")[0]) for call in fake.calls]

    assert calls and set(calls) == {("projects/proj-r/locations/europe-west4/publishers/google", "Bearer fake-access")}
    assert not any(r["status"] == "api_failed" for r in _finished(out).values())
    recorded = json.loads((out / layout.RUN_CONFIG).read_text())["backends"]
    assert {made["vertex"]["project"] for made in recorded.values()} == {"proj-r"}
