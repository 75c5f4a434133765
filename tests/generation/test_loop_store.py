import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from scripted import ScriptedEditor, ScriptedJudge, ScriptedWriter, pass_round
from medbanana.generation.rundir import layout
from medbanana.generation.rundir.lock import LOCK_NAME
from medbanana.generation.loop import acceptance_policy
from medbanana.generation.records import SourceImage, Verdict
from medbanana.generation.runners.local import run
from medbanana.generation.runners.session import RunOptions
from medbanana.generation.sources.scan import scan_sources
from medbanana.generation.rundir.store import RunConfigMismatch, read_journal
from kills import kill_repeatedly
from paths import TESTS


def _task(tiny_sources, key="n0-Pneumothorax"):
    return next(t for t in scan_sources(tiny_sources) if t.key == key)


@pytest.mark.slow
@pytest.mark.parametrize("k", [1, 3, 5])
def test_success_at_round_k_keeps_k_minus_1_failed_attempts(tiny_sources, tmp_path, k):
    task = _task(tiny_sources)
    writer, editor = ScriptedWriter(), ScriptedEditor()
    run([task], tmp_path / "run", writer, editor, ScriptedJudge(lambda t: k), RunOptions(quiet=True))
    out = layout.output_dir(tmp_path / "run", task.dataset, "add")
    conv = json.loads((out / layout.ALL_CONVERSATIONS).read_text())[task.key]
    assert conv["status"] == "success" and conv["success_round"] == k and len(conv["rounds"]) == k
    assert [r["verification"]["qualified"] for r in conv["rounds"]] == [False] * (k - 1) + [True]
    failed = sorted((tmp_path / "run").glob(f"{task.dataset}-edit-failed/Pneumothorax/*.jpeg"))
    assert [p.name for p in failed] == [f"n0-Pneumothorax-edit-failed-{r}.jpeg" for r in range(1, k)]
    assert (out / "Pneumothorax" / "n0-Pneumothorax-edit.jpeg").exists()
    # every round edits the ORIGINAL source; the writer saw the full history each time
    assert set(editor.sources_seen) == {SourceImage(task.source_path).sha256}
    assert writer.histories == [[f"{task.key} instruction {i}" for i in range(1, r)] for r in range(1, k + 1)]
    assert json.loads((out / layout.PROGRESS).read_text()) == {task.key: "success"}
    assert json.loads((out / layout.FINAL_PROMPTS).read_text())[task.key]["rounds"] == k


def test_failed_task_after_max_rounds_and_failed_summary(tiny_sources, tmp_path):
    task = _task(tiny_sources, "p0-Pneumothorax")  # a remove task
    summary = run([task], tmp_path / "run", ScriptedWriter(), ScriptedEditor(), ScriptedJudge(lambda t: 99),
                  RunOptions(max_rounds=4, quiet=True))
    assert summary.statuses == {"failed": 1} and summary.failed_attempts == 4
    failed_dir = layout.failed_dir(tmp_path / "run", task.dataset, "remove")
    assert sorted(p.name for p in (failed_dir / "normal").iterdir()) == [
        f"p0-Pneumothorax-remove-failed-{r}.jpeg" for r in range(1, 5)]
    fs = json.loads((failed_dir / layout.FAILED_SUMMARY).read_text())
    assert fs[0]["task"] == "p0-Pneumothorax" and fs[0]["rounds"] == 4
    assert fs[0]["last_verification"]["qualified"] is False
    assert Path(fs[0]["final_image_path"]).name == "p0-Pneumothorax-remove-failed-4.jpeg"


@pytest.mark.slow
def test_edit_refused_is_a_recorded_round_and_api_error_keeps_the_conversation(tiny_sources, tmp_path):
    task = _task(tiny_sources)
    run([task], tmp_path / "a", ScriptedWriter(), ScriptedEditor(refuse_round=1), ScriptedJudge(lambda t: 2),
        RunOptions(quiet=True))
    conv = json.loads((layout.output_dir(tmp_path / "a", task.dataset, "add") / layout.ALL_CONVERSATIONS).read_text())
    first = conv[task.key]["rounds"][0]
    assert first["edit_result"] == {"success": False, "error": "no_image: the model answered with text only"}
    assert first["verification"] is None and conv[task.key]["status"] == "success"

    summary = run([task], tmp_path / "b", ScriptedWriter(), ScriptedEditor(api_error_round=2),
                  ScriptedJudge(lambda t: 3), RunOptions(quiet=True))
    assert summary.statuses == {"api_failed": 1} and summary.error_kinds == {"http_503": 1}
    out = layout.output_dir(tmp_path / "b", task.dataset, "add")
    (failure,) = json.loads((out / layout.API_FAILURES).read_text())
    assert failure["step"] == "edit_image" and failure["round"] == 2 and "service unavailable" in failure["error"]
    assert json.loads((out / layout.PROGRESS).read_text()) == {task.key: "api_failed"}
    assert len(json.loads((out / layout.ALL_CONVERSATIONS).read_text())[task.key]["rounds"]) == 1  # kept
    # --retry-failed resumes the kept round 1 and finishes the task
    writer = ScriptedWriter()
    summary = run([task], tmp_path / "b", writer, ScriptedEditor(), ScriptedJudge(lambda t: 3),
                  RunOptions(quiet=True, retry_failed=True))
    assert summary.statuses == {"success": 1}
    assert writer.histories[0] == [f"{task.key} instruction 1"]


def test_unreadable_source_is_a_record_and_the_run_continues(tiny_sources, tmp_path):
    bad = tiny_sources / "MIMIC_tiny" / "normal" / "broken.jpeg"
    bad.write_bytes((tiny_sources / "MIMIC_tiny" / "normal" / "n0.jpeg").read_bytes()[:200])
    (tiny_sources / "MIMIC_tiny" / "normal" / "text.jpg").write_text("not an image")
    tasks = [t for t in scan_sources(tiny_sources) if t.dataset == "MIMIC_tiny" and t.disease == "Pneumothorax"]
    summary = run(tasks, tmp_path / "run", ScriptedWriter(), ScriptedEditor(), ScriptedJudge(lambda t: 1),
                  RunOptions(quiet=True))
    assert summary.statuses == {"success": 3, "api_failed": 2} and summary.error_kinds == {"source_error": 2}
    fails = json.loads((layout.output_dir(tmp_path / "run", "MIMIC_tiny", "add") / layout.API_FAILURES).read_text())
    assert {f["image"] for f in fails} == {"broken.jpeg", "text.jpg"}
    assert all(f["step"] == "load_source" and "broken.jpeg" in f["error"] or "text.jpg" in f["error"] for f in fails)


def test_other_configuration_is_refused_without_damage(tiny_sources, tmp_path):
    task = _task(tiny_sources)
    run([task], tmp_path / "run", ScriptedWriter(), ScriptedEditor(), ScriptedJudge(), RunOptions(quiet=True))
    def files():  # the lock file names its last holder, the refused run: not the run's data
        return {p: p.read_bytes() for p in (tmp_path / "run").rglob("*") if p.is_file() and p.name != LOCK_NAME}

    before = files()
    with pytest.raises(RunConfigMismatch, match="max_rounds: was 5, now 3"):
        run([task], tmp_path / "run", ScriptedWriter(), ScriptedEditor(), ScriptedJudge(),
            RunOptions(max_rounds=3, quiet=True))
    assert files() == before


@pytest.mark.slow
def test_resuming_with_another_geometry_guard_is_refused_but_a_run_from_before_the_guard_resumes(tiny_sources,
                                                                                                 tmp_path):
    task = _task(tiny_sources)
    run([task], tmp_path / "run", ScriptedWriter(), ScriptedEditor(), ScriptedJudge(),
        RunOptions(geometry="record", quiet=True))
    with pytest.raises(RunConfigMismatch, match="geometry: was 'record', now 'register'"):
        run([task], tmp_path / "run", ScriptedWriter(), ScriptedEditor(), ScriptedJudge(),
            RunOptions(geometry="register", quiet=True))
    config_path = tmp_path / "run" / layout.RUN_CONFIG
    config = json.loads(config_path.read_text())
    del config["geometry"]  # as a run made before the guard records it
    config_path.write_text(json.dumps(config))
    run([task], tmp_path / "run", ScriptedWriter(), ScriptedEditor(), ScriptedJudge(),
        RunOptions(geometry="register", quiet=True))
    assert json.loads(config_path.read_text())["geometry"] == "register"


def test_acceptance_policies():
    v = Verdict(True, True, False, True, False, "grain", score=0.8)
    task = type("T", (), {"direction": "add"})()
    assert acceptance_policy("qualified")(v, task) is False
    assert acceptance_policy("score>=0.7")(v, task) is True
    assert acceptance_policy("score >= 0.9")(v, task) is False
    with pytest.raises(ValueError, match="unknown acceptance policy"):
        acceptance_policy("vibes")


KILL_SCRIPT = textwrap.dedent("""
    import sys
    sys.path.insert(0, {tests!r})
    from scripted import ScriptedEditor, ScriptedJudge, ScriptedWriter
    from medbanana.generation.runners.local import run
    from medbanana.generation.runners.session import RunOptions
    from medbanana.generation.sources.scan import scan_sources
    if __name__ == "__main__":  # the run's image pool spawns processes, which import this file
        tasks = scan_sources({sources!r})
        run(tasks, {out!r}, ScriptedWriter(delay=0.03), ScriptedEditor(), ScriptedJudge(),
            RunOptions(concurrency=3, quiet=True, materialize_every=0.05))
""")


@pytest.mark.slow
def test_killed_and_resumed_run_loses_and_duplicates_nothing(tiny_sources, tmp_path):
    out = tmp_path / "run"
    script = tmp_path / "go.py"
    script.write_text(KILL_SCRIPT.format(tests=str(TESTS), sources=str(tiny_sources), out=str(out)))
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    # kill at varied points: after 2..7 more journal lines each time
    kills = kill_repeatedly(lambda: subprocess.Popen([sys.executable, str(script)], env=env), out / layout.JOURNAL,
                            tries=6)
    assert subprocess.run([sys.executable, str(script)], env=env).returncode == 0
    assert kills >= 4
    tasks = scan_sources(tiny_sources)
    finished = [e for e in read_journal(out / layout.JOURNAL) if e["type"] == "task"]
    assert sorted(e["uid"] for e in finished) == sorted(t.uid for t in tasks)  # each exactly once
    recorded = set()
    for dataset, direction, path in layout.find_output_dirs(out):
        conv = json.loads((path / layout.ALL_CONVERSATIONS).read_text())
        for key, rec in conv.items():
            task = next(t for t in tasks if t.uid == rec["uid"])
            k = pass_round(task)
            assert rec["status"] == ("success" if k <= 5 else "failed")
            assert [r["round"] for r in rec["rounds"]] == list(range(1, min(k, 5) + 1))
            for r in rec["rounds"]:
                assert (out / r["image"]).exists()
                recorded.add(r["image"])
    on_disk = {p.relative_to(out).as_posix() for p in out.rglob("*.jpeg")}
    assert on_disk == recorded


@pytest.mark.slow
def test_shards_partition_the_tasks_and_merge_recombines_them(tiny_sources, tmp_path):
    from medbanana.cli import main

    tasks = scan_sources(tiny_sources)
    for i in range(3):
        run(tasks, tmp_path / f"shard{i}", ScriptedWriter(), ScriptedEditor(), ScriptedJudge(),
            RunOptions(quiet=True, shard=(i, 3)))
    counts = [sum(e["type"] == "task" for e in read_journal(tmp_path / f"shard{i}" / layout.JOURNAL))
              for i in range(3)]
    assert sum(counts) == len(tasks) and all(counts)
    assert main(["merge", *(str(tmp_path / f"shard{i}") for i in range(3)), "--out", str(tmp_path / "all")]) == 0
    whole = run(tasks, tmp_path / "single", ScriptedWriter(), ScriptedEditor(), ScriptedJudge(), RunOptions(quiet=True))
    for dataset, direction, path in layout.find_output_dirs(tmp_path / "single"):
        merged = tmp_path / "all" / path.name
        for name in (layout.PROGRESS, layout.FINAL_PROMPTS):
            assert json.loads((merged / name).read_text()) == json.loads((path / name).read_text())
    assert ({p.relative_to(tmp_path / "all") for p in (tmp_path / "all").rglob("*.jpeg")}
            == {p.relative_to(tmp_path / "single") for p in (tmp_path / "single").rglob("*.jpeg")})
    assert whole.statuses["success"] > 0
    # merging a shard twice is a conflict, reported as a clear error
    assert main(["merge", str(tmp_path / "shard0"), str(tmp_path / "shard0"), "--out", str(tmp_path / "x")]) == 2


def test_every_written_image_carries_the_synthetic_content_mark(tiny_sources, tmp_path):
    from medbanana.generation.rundir.provenance import read_mark

    task = _task(tiny_sources)
    run([task], tmp_path / "run", ScriptedWriter(), ScriptedEditor(), ScriptedJudge(lambda t: 2),
        RunOptions(quiet=True))
    config = json.loads((tmp_path / "run" / layout.RUN_CONFIG).read_text())
    images = sorted((tmp_path / "run").rglob("*.jpeg"))
    assert len(images) == 2
    for path in images:
        mark = read_mark(path.read_bytes())
        assert mark is not None and mark.run_id == config["run_id"]
        assert mark.digital_source_type == "compositeWithTrainedAlgorithmicMedia"
        assert mark.properties.get("Task") == task.uid
