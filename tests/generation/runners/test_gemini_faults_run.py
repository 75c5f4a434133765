"""One whole `medbanana generate` run per fault kind of the fake Gemini server.

Whatever the fault, the run loses no task: every task has exactly one finished record, each error is recorded
with its kind (api_failures.json `kind` for API errors, `edit_result.error` for editor refusals), and the API key
appears nowhere under the run directory nor in what the command printed. It exits 0 when every task finished
(accepted or failed), 3 when some ended api_failed.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from conftest import write_jpeg
from fake_runs import mimic_sources, use_fake_gemini
from medbanana.cli import main
from medbanana.generation.rundir import layout
from medbanana.generation.sources.scan import scan_sources
from medbanana.generation.rundir.store import read_journal

KEY = "faults-run-key-9c2e71f4"  # distinctive, so that a leak is found by grep
MAX_ROUNDS = 2


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> Path:
    return mimic_sources(tmp_path_factory.mktemp("faults") / "sources", "MIMIC_faults")


@pytest.fixture
def generate(echo_gemini, sources, tmp_path, monkeypatch, capfd):
    """Run `medbanana generate` against the fake with `faults`; returns (exit code, run dir, printed text)."""
    use_fake_gemini(monkeypatch, echo_gemini, KEY)
    out = tmp_path / "run"

    def go(faults=(), *extra, latency=0.0):
        echo_gemini.reset(faults)
        echo_gemini.latency = latency
        argv = ["generate", "--sources", str(sources), "--out", str(out), "--backend", "gemini", "--diseases", "Pneumothorax",
                "Pleural_Effusion", "--max-rounds", str(MAX_ROUNDS), "--concurrency", "3", "--max-attempts", "3",
                "--retry-base-delay", "0.01", "--timeout", "1", "-q", *extra]
        code = main(argv)
        captured = capfd.readouterr()
        return code, out, captured.out + captured.err

    yield go
    echo_gemini.latency = 0.0


def _records(run_dir: Path, sources: Path) -> dict[str, dict]:
    """uid -> finished record, after checking that no task was lost or finished twice (a task finishes again
    only when --retry-failed re-runs it after an API error; the last record counts)."""
    tasks = {t.uid for t in scan_sources(sources) if t.disease in ("Pneumothorax", "Pleural_Effusion")}
    finished = [e["record"] for e in read_journal(run_dir / layout.JOURNAL) if e["type"] == "task"]
    records = {r["uid"]: r for r in finished}
    assert set(records) == tasks
    redone = Counter(r["uid"] for r in finished if r["status"] == "api_failed" and r is not records[r["uid"]])
    assert Counter(r["uid"] for r in finished) == Counter(tasks) + redone
    progress, failures = {}, []
    for _, _, folder in layout.find_output_dirs(run_dir):
        progress.update(json.loads((folder / layout.PROGRESS).read_text()))
        failures += json.loads((folder / layout.API_FAILURES).read_text())
    assert progress == {r["key"]: r["status"] for r in records.values()}
    assert sorted(f["task"] for f in failures) == sorted(r["key"] for r in records.values()
                                                         if r["status"] == "api_failed")
    for failure in failures:  # api_failures.json carries the kind the record carries
        record = next(r for r in records.values() if r["key"] == failure["task"])
        assert failure["kind"] == record["error"]["kind"] and failure["step"] == record["error"]["step"]
    return records


def _assert_key_absent(run_dir: Path, printed: str) -> None:
    assert KEY not in printed
    leaked = [p for p in run_dir.rglob("*") if p.is_file() and KEY.encode() in p.read_bytes()]
    assert not leaked


# (fault specs, the api_failed kind every task must end with, or None when every task must finish judged)
# Tasks start together, so the first calls belong to different tasks: with first=4 and 3 tasks in flight no call
# fails 3 times (--max-attempts 3), and with first=2 no verdict fails 3 times (2 re-asks).
RECOVERED = [
    ["429:first=4,retry_after=0.02"],
    ["500:first=4"],
    ["503:first=2"],
    ["hang:first=2,hang=3"],  # past the 1 s timeout, retried
    ["malformed_json:first=2"],  # re-asked
    ["truncated_json:first=2"],
    ["torn_body:first=4"],  # a 200 cut off halfway: retried like a 5xx
]
API_FAILED = [
    (["429:role=writer,retry_after=0.02"], "rate_limited", "generate_prompt"),
    (["500:role=judge"], "server_error", "verify_image"),
    (["503:role=editor"], "server_error", "edit_image"),
    (["hang:role=judge,hang=3"], "timeout", "verify_image"),
    (["truncated_json"], "unparseable_verdict", "verify_image"),
    (["malformed_json"], "unparseable_verdict", "verify_image"),
    (["torn_body:role=editor"], "bad_response", "edit_image"),
    (["safety:role=writer"], "safety", "generate_prompt"),
]
REFUSED = [  # editor refusals: a round without image or verdict, the refusal's kind in edit_result.error
    (["text_only"], "text_only"),
    (["no_image"], "no_image"),
    (["truncated_image"], "truncated_image"),
    (["safety:role=editor"], "safety"),
    (["image_safety"], "image_safety"),
    (["invalid_argument:role=editor"], "invalid_argument"),  # the fake echoes the key in this error
]


@pytest.mark.slow
@pytest.mark.parametrize("faults", RECOVERED, ids=lambda f: f[0])
def test_transient_faults_are_absorbed(generate, echo_gemini, sources, faults):
    code, run_dir, printed = generate(faults)
    assert code == 0
    records = _records(run_dir, sources)
    assert {r["status"] for r in records.values()} <= {"success", "failed"}
    assert sum(1 for c in echo_gemini.calls if c.fault) >= 2  # the faults did strike
    _assert_key_absent(run_dir, printed)


@pytest.mark.slow
@pytest.mark.parametrize("faults, kind, step", API_FAILED, ids=lambda f: f[0] if isinstance(f, list) else "")
def test_persistent_faults_are_recorded_and_retry_failed_finishes_the_tasks(generate, sources, faults, kind, step):
    # a hang costs the whole timeout per try: fewer tries, and every task at once
    extra = ["--max-attempts", "2", "--concurrency", "6"] if faults[0].startswith("hang") else []
    code, run_dir, printed = generate(faults, *extra)
    assert code == 3  # tasks ended api_failed: the documented exit code
    records = _records(run_dir, sources)
    assert {(r["status"], r["error"]["kind"], r["error"]["step"]) for r in records.values()} == {
        ("api_failed", kind, step)}
    assert "errors" in printed and kind in printed
    _assert_key_absent(run_dir, printed)

    code, _, printed = generate([], "--retry-failed", str(run_dir))  # the fault is gone
    assert code == 0
    assert {r["status"] for r in _records(run_dir, sources).values()} <= {"success", "failed"}
    _assert_key_absent(run_dir, printed)


@pytest.mark.parametrize("faults, kind", REFUSED, ids=lambda f: f[0] if isinstance(f, list) else "")
def test_editor_refusals_are_rounds_with_their_kind(generate, sources, faults, kind):
    code, run_dir, printed = generate(faults)
    assert code == 0
    records = _records(run_dir, sources)
    for record in records.values():
        assert record["status"] == "failed" and len(record["rounds"]) == MAX_ROUNDS
        for rnd in record["rounds"]:
            assert rnd["edit_result"]["success"] is False and rnd["verification"] is None
            assert rnd["edit_result"]["error"].startswith(f"{kind}: ") and not rnd["image"]
    assert not list(run_dir.rglob("*.jpeg"))
    _assert_key_absent(run_dir, printed)


@pytest.mark.slow
def test_latency_slows_nothing_down_but_the_clock(generate, echo_gemini, sources):
    code, run_dir, printed = generate([], latency=0.05)
    assert code == 0
    records = _records(run_dir, sources)
    assert {r["status"] for r in records.values()} <= {"success", "failed"}
    rounds = sum(len(r["rounds"]) for r in records.values())
    assert echo_gemini.count("writer") == echo_gemini.count("editor") == echo_gemini.count("judge") == rounds
    _assert_key_absent(run_dir, printed)


def test_a_source_cut_off_mid_image_is_a_source_error_before_any_call(echo_gemini, tmp_path, monkeypatch, capfd):
    use_fake_gemini(monkeypatch, echo_gemini, KEY)
    good = write_jpeg(tmp_path / "sources" / "MIMIC_cut" / "normal" / "whole.jpeg", 3, size=256)
    (good.parent / "cut.jpeg").write_bytes(good.read_bytes()[: len(good.read_bytes()) // 2])  # header intact
    echo_gemini.reset()
    argv = ["generate", "--sources", str(tmp_path / "sources"), "--out", str(tmp_path / "run"), "--backend", "gemini", "--diseases",
            "Pneumothorax", "--max-rounds", "1", "-q"]
    assert main(argv) == 3  # a source error is an api_failed task
    capfd.readouterr()
    progress = json.loads((tmp_path / "run" / "MIMIC_cut-edit" / layout.PROGRESS).read_text())
    (failure,) = json.loads((tmp_path / "run" / "MIMIC_cut-edit" / layout.API_FAILURES).read_text())
    assert progress["cut-Pneumothorax"] == "api_failed" and progress["whole-Pneumothorax"] in ("success", "failed")
    assert (failure["task"], failure["step"], failure["kind"]) == ("cut-Pneumothorax", "load_source", "source_error")
    assert echo_gemini.count() == 3  # one round of the whole source's task; nothing was sent for the cut one


@pytest.mark.slow
def test_answers_with_fields_a_newer_api_added_are_read_not_retried(generate, echo_gemini, sources):
    """The SDK's types forbid unknown fields: an API that adds one must not turn every answer into a retry."""
    code, run_dir, printed = generate(["new_fields"])
    assert code == 0
    records = _records(run_dir, sources)
    assert {r["status"] for r in records.values()} <= {"success", "failed"}
    assert echo_gemini.calls and all(c.fault == "new_fields" for c in echo_gemini.calls)
    rounds = sum(len(r["rounds"]) for r in records.values())
    assert len(echo_gemini.calls) == 3 * rounds  # writer, editor and judge once a round: nothing asked twice
