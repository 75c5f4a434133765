"""One writer per run directory, retries that only retry, and a run directory that matches its journal after kills.

Real `medbanana generate` processes against the fake Gemini server: a second writer is refused while the first
runs and let in once it was kill -9'd; --retry-failed keeps to the recorded selection; opening a run removes what
killed writes left and continues a killed retry; and a soak of kill -9 at random moments under injected faults,
with the request cache deleted now and then and a kill during --retry-failed, ends with every task finished once
and every image on disk named by its record.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import write_jpeg
from scripted import ScriptedEditor, ScriptedJudge, ScriptedWriter
from medbanana.cli import main
from medbanana.generation.rundir import layout, mask_files
from medbanana.generation.testing.fake_gemini import FakeGemini
from medbanana.generation.failures import EXIT_LOCKED
from medbanana.generation.rundir.lock import LOCK_NAME, LockHeld, hold_lock
from medbanana.generation.rundir.provenance import mark_synthetic
from medbanana.generation.records import Attempt, EditedImage, Instruction, encode_jpeg
from medbanana.generation.runners.local import run
from medbanana.generation.runners.session import RunOptions
from medbanana.generation.sources.scan import scan_sources
from medbanana.generation.rundir.store import RunStore, read_journal

KEY = "reliability-key-4be1d07c"
DISEASES = ("Pneumothorax", "Pleural_Effusion")


def _make_sources(root: Path, normal: int = 3, diseased: int = 2) -> Path:
    for i in range(normal):
        write_jpeg(root / "MIMIC_rel" / "normal" / f"n{i}.jpeg", i, size=64)
    for i in range(diseased):
        write_jpeg(root / "MIMIC_rel" / "Pneumothorax" / f"p{i}.jpeg", 10 + i, size=64)
    return root


@pytest.fixture
def sources(tmp_path) -> Path:
    return _make_sources(tmp_path / "sources")


def _tasks(sources: Path) -> set[str]:
    return {t.uid for t in scan_sources(sources) if t.disease in DISEASES}


def _command(sources: Path, out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "medbanana", "generate", "--sources", str(sources), "--out", str(out),
            "--backend", "gemini", "--diseases", *DISEASES, "--max-rounds", "3", "--concurrency", "3", "--timeout", "5",
            "--max-attempts", "2", "--retry-base-delay", "0.01", "-q", *extra]


def _env(fake: FakeGemini) -> dict:
    return {**os.environ, "GEMINI_API_KEY": KEY, "GOOGLE_GEMINI_BASE_URL": fake.base_url, "PYTHONUNBUFFERED": "1"}


def _task_lines(out: Path) -> list[dict]:
    return [e for e in read_journal(out / layout.JOURNAL) if e["type"] == "task"]


def _holder_pid(out: Path) -> int | None:
    try:
        return json.loads((out / LOCK_NAME).read_text())["pid"]
    except (OSError, ValueError, KeyError):
        return None


def _assert_consistent(out: Path, tasks: set[str]) -> dict[str, dict]:
    """Every task finished, once (earlier lines only api_failed ones a retry superseded), the JSON files say the
    same, and the images on disk are exactly those the records name. Returns uid -> final record."""
    lines = _task_lines(out)
    final = {e["uid"]: e["record"] for e in lines}
    assert set(final) == tasks
    superseded = [e for e in lines if e["record"] is not final[e["uid"]]]
    assert all(e["record"]["status"] == "api_failed" for e in superseded)
    named, keys = set(), []
    for _, _, folder in layout.find_output_dirs(out):
        conversations = json.loads((folder / layout.ALL_CONVERSATIONS).read_text())
        keys += list(conversations)
        for record in conversations.values():
            assert record == {k: v for k, v in final[record["uid"]].items() if k not in ("key", "api_failure")}
            assert [r["round"] for r in record["rounds"]] == list(range(1, len(record["rounds"]) + 1))
            named.update(r["image"] for r in record["rounds"] if r["image"])
    assert sorted(keys) == sorted(r["key"] for r in final.values())
    on_disk = {p.relative_to(out).as_posix() for p in out.rglob("*") if p.suffix in (".jpeg", ".png")}
    masks = {rel for rel in on_disk if rel.startswith(layout.MASKS + "/")}  # each beside an image named, and no other
    assert on_disk - masks == named and {mask_files.image_of(rel) for rel in masks} <= named
    assert not (out / layout.ORPHANS).exists()  # every image was this run's own: none needed setting aside
    return final


# ---------------------------------------------------------------- one writer per directory

@pytest.mark.slow
def test_a_second_writer_is_refused_at_once_and_let_in_after_the_first_is_killed(sources, tmp_path):
    out = tmp_path / "run"
    with FakeGemini(engine="echo", latency=0.4) as fake:
        command = _command(sources, out, "--workers", "2")  # the parent holds the lock, not its workers
        first = subprocess.Popen(command, env=_env(fake), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 60
            while _holder_pid(out) != first.pid and not read_journal(out / layout.JOURNAL):
                assert first.poll() is None and time.monotonic() < deadline, "the first run never got going"
                time.sleep(0.02)
            started = time.monotonic()
            second = subprocess.run(command, env=_env(fake), capture_output=True, text=True, timeout=120)
            waited = time.monotonic() - started
            assert second.returncode == EXIT_LOCKED, second.stdout + second.stderr
            assert first.poll() is None, "the first run ended before the second was refused; make it slower"
            message = second.stderr.strip()
            assert "\n" not in message and message.startswith("medbanana generate: ")
            assert f"pid {first.pid} on host {socket.gethostname()} since " in message
            assert "medbanana generate --sources" in message and str(out) in message
            assert waited < 20  # refused on opening, not after running (Python and google-genai start in ~3 s)
        finally:
            first.send_signal(signal.SIGKILL)
            first.wait()
        third = subprocess.run(command, env=_env(fake), capture_output=True, text=True, timeout=120)
    assert third.returncode == 0, third.stderr  # the kernel dropped the dead process's lock
    assert not (out / LOCK_NAME).exists()  # the file the killed one left: taken, then removed at a clean close
    _assert_consistent(out, _tasks(sources))


@pytest.mark.slow
def test_merge_locks_its_output_and_refuses_a_shard_still_being_written(tiny_sources, tmp_path, capsys):
    tasks = scan_sources(tiny_sources)[:2]
    run(tasks, tmp_path / "shard", ScriptedWriter(), ScriptedEditor(), ScriptedJudge(), RunOptions(quiet=True))
    with hold_lock(tmp_path / "merged", "run directory"):  # another merge or generate writing there
        assert main(["merge", str(tmp_path / "shard"), "--out", str(tmp_path / "merged")]) == EXIT_LOCKED
    assert f"pid {os.getpid()}" in capsys.readouterr().err
    assert not (tmp_path / "merged" / layout.JOURNAL).exists()
    with hold_lock(tmp_path / "shard", "run directory"):  # the shard's generate still running
        assert main(["merge", str(tmp_path / "shard"), "--out", str(tmp_path / "merged")]) == EXIT_LOCKED
    assert "is being written by" in capsys.readouterr().err
    assert main(["merge", str(tmp_path / "shard"), "--out", str(tmp_path / "merged")]) == 0
    assert len(_task_lines(tmp_path / "merged")) == 2


def test_the_lock_is_exclusive_and_says_who_holds_it(tmp_path):
    with hold_lock(tmp_path / "d", "dataset folder"):
        with pytest.raises(LockHeld, match=rf"dataset folder\) is being used by pid {os.getpid()} on host "):
            with hold_lock(tmp_path / "d", "dataset folder"):
                pass
        with pytest.raises(LockHeld, match="is being written by"):  # nor may a reader look at it
            with hold_lock(tmp_path / "d", "run directory", shared=True):
                pass
    with hold_lock(tmp_path / "d", shared=True), hold_lock(tmp_path / "d", shared=True):  # readers share it
        with pytest.raises(LockHeld):
            with hold_lock(tmp_path / "d"):
                pass
    with hold_lock(tmp_path / "d"):  # free again once they are done
        pass
    with hold_lock(tmp_path / "built", "dataset folder", beside=True) as lock:  # survives renaming a new one in
        (tmp_path / "built").mkdir()
        (tmp_path / "built").rename(tmp_path / "old")
        with pytest.raises(LockHeld, match=r"built \(dataset folder\) is being used by"):
            with hold_lock(tmp_path / "built", "dataset folder", beside=True):
                pass
    assert lock.path == tmp_path / f".built.{LOCK_NAME}" and not (tmp_path / "old" / LOCK_NAME).exists()


# ---------------------------------------------------------------- --retry-failed keeps to the recorded selection

@pytest.fixture
def fake_env(monkeypatch):
    with FakeGemini(engine="echo") as fake:
        monkeypatch.setenv("GEMINI_API_KEY", KEY)
        monkeypatch.setenv("GOOGLE_GEMINI_BASE_URL", fake.base_url)
        yield fake


def _generate(*argv) -> int:
    return main(["generate", "--backend", "gemini", "--max-rounds", "2", "--max-attempts", "1", "--retry-base-delay", "0.01", "-q",
                 *map(str, argv)])


@pytest.mark.slow
def test_retry_failed_uses_the_recorded_selection_and_adds_no_task(fake_env, sources, tmp_path, capsys):
    out = tmp_path / "run"
    fake_env.reset(["500:role=judge"])  # every task ends api_failed
    assert _generate("--sources", sources, "--out", out, "--diseases", "Pneumothorax") in (0, 3)
    first = {e["uid"] for e in _task_lines(out)}
    assert len(first) == 5 and all(e["record"]["status"] == "api_failed" for e in _task_lines(out))
    recorded = json.loads((out / layout.RUN_CONFIG).read_text())["selection"]
    capsys.readouterr()

    fake_env.reset()
    assert _generate("--retry-failed", out, "--sources", sources) == 0  # no --diseases: the recorded one is used
    printed = capsys.readouterr().out
    lines = _task_lines(out)
    assert len(lines) == 2 * len(first) and {e["uid"] for e in lines} == first  # each retried once, none added
    assert f"tasks {len(first)} (ran {len(first)}, already done 0)" in printed
    assert json.loads((out / layout.RUN_CONFIG).read_text())["selection"] == recorded
    assert fake_env.count("writer") <= 2 * len(first)  # calls for these tasks only

    journal = (out / layout.JOURNAL).read_bytes()
    assert _generate("--retry-failed", out, "--sources", sources, "--diseases", "Cardiomegaly") == 2
    err = capsys.readouterr().err
    assert "--diseases Cardiomegaly (the run has Pneumothorax)" in err and err.count("\n") == 1
    assert _generate("--retry-failed", out, "--sources", sources, "--limit", "1") == 2
    assert "--limit 1 (the run has none)" in capsys.readouterr().err
    assert _generate("--retry-failed", out, "--out", tmp_path / "elsewhere") == 2
    assert (out / layout.JOURNAL).read_bytes() == journal and not (tmp_path / "elsewhere").exists()
    assert _generate("--retry-failed", out, "--diseases", "Pneumothorax", "--sources", sources) == 0  # the same


@pytest.mark.slow
def test_retry_failed_on_a_run_that_recorded_no_limit_retries_only_the_tasks_its_journal_knows(
        fake_env, sources, tmp_path, capsys):
    out = tmp_path / "run"
    fake_env.reset(["500:role=judge"])
    assert _generate("--sources", sources, "--out", out, "--diseases", "Pneumothorax", "--limit", "2") in (0, 3)
    config = json.loads((out / layout.RUN_CONFIG).read_text())
    assert config["selection"].get("limit") == 2
    del config["selection"]["limit"], config["selection"]["shard"]  # as runs made before they were recorded
    (out / layout.RUN_CONFIG).write_text(json.dumps(config))
    fake_env.reset()
    assert _generate("--retry-failed", out, "--sources", sources) == 0
    lines = _task_lines(out)
    assert len({e["uid"] for e in lines}) == 2 and len(lines) == 4
    assert "tasks 2 (ran 2" in capsys.readouterr().out


# ---------------------------------------------------------------- reconcile on open

def _jpeg(shade: int) -> bytes:
    return encode_jpeg(np.full((16, 16, 3), shade, np.uint8))


@pytest.mark.slow
def test_opening_a_run_removes_what_killed_writes_left_and_continues_a_killed_retry(tiny_sources, tmp_path):
    out = tmp_path / "run"
    tasks = [t for t in scan_sources(tiny_sources) if t.dataset == "MIMIC_tiny" and t.direction == "add"
             and t.disease == "Pneumothorax"]
    retried, other = tasks  # n0 and n1
    run([retried], out, ScriptedWriter(), ScriptedEditor(api_error_round=2), ScriptedJudge(lambda t: 99),
        RunOptions(quiet=True, max_rounds=3))
    assert _task_lines(out)[-1]["record"]["status"] == "api_failed"  # round 1 kept
    # a --retry-failed killed after journalling its round 2: a round after the task's last "task" line
    config = json.loads((out / layout.RUN_CONFIG).read_text())
    store = RunStore(out, {k: config.get(k) for k in ("max_rounds", "accept", "seed", "backends", "geometry")}).open()
    assert [a.round for a in store.history(retried)] == [1]
    instruction = f"{retried.key} instruction 2"
    verdict = asyncio.run(ScriptedJudge(lambda t: 99).judge(retried, None, None, instruction))
    store.write_attempt(retried, Attempt(2, Instruction(instruction), verdict), EditedImage(_jpeg(70)))
    store.close()  # as if killed there (the lock goes with the process; what close writes besides is replayable)
    assert [e["type"] for e in read_journal(out / layout.JOURNAL)][-2:] == ["task", "round"]

    # what else a kill leaves: this run's image renamed into place just before its journal line (its request
    # cache gone, the resumed round will decide otherwise), someone's file, and temp files of cut writes
    accepted = out / layout.accepted_image_relpath(other.dataset, "add", other.source_id, other.disease)
    accepted.parent.mkdir(parents=True, exist_ok=True)
    accepted.write_bytes(mark_synthetic(_jpeg(90), config["run_id"], config.get("models")))
    foreign = accepted.parent / "holiday.jpeg"
    foreign.write_bytes(_jpeg(40))
    temps = [accepted.parent / f".{accepted.name}.tmp4242", out / f".{layout.RUN_CONFIG}.tmp17",
             layout.output_dir(out, other.dataset, "add") / f".{layout.PROGRESS}.tmp99"]
    for path in temps:
        path.write_bytes(b"cut")

    writer = ScriptedWriter()
    summary = run(tasks, out, writer, ScriptedEditor(), ScriptedJudge(lambda t: 3 if t is retried else 99),
                  RunOptions(quiet=True, max_rounds=3))  # a plain resume, not --retry-failed
    # the killed retry's task continued from its rounds 1 and 2
    assert [f"{retried.key} instruction 1", f"{retried.key} instruction 2"] in writer.histories
    final = {e["uid"]: e["record"] for e in _task_lines(out)}
    assert final[retried.uid]["status"] == "success" and len(final[retried.uid]["rounds"]) == 3
    assert final[other.uid]["status"] == "failed" and not accepted.exists()
    assert not any(p.exists() for p in temps) and not foreign.exists()
    assert (out / layout.ORPHANS / foreign.relative_to(out)).read_bytes() == _jpeg(40)  # set aside, not deleted
    assert summary.reconciled == {"continued_tasks": 1, "orphan_images": 1, "quarantined_images": 1,
                                  "temp_files": 3}
    stats = json.loads((out / layout.STATS).read_text())
    assert stats["reconciled"] == dict(sorted(summary.reconciled.items()))
    assert "1 images of killed writes without a journal line removed" in summary.format()
    assert f"1 unknown images moved to {layout.ORPHANS}/" in summary.format()
    shutil.rmtree(out / layout.ORPHANS)
    _assert_consistent(out, {t.uid for t in tasks})


# ---------------------------------------------------------------- kill -9 soak

KILLS = 20  # the soak: kill -9 at 20 random moments under injected faults
FAULTS = ["503:rate=0.15", "malformed_json:rate=0.15", "text_only:rate=0.1", "safety:role=writer,rate=0.1"]


def _kill_when(proc: subprocess.Popen, ready, rng: random.Random, seconds: float = 30.0) -> bool:
    deadline = time.monotonic() + seconds
    while proc.poll() is None and time.monotonic() < deadline:
        if ready():
            time.sleep(rng.uniform(0, 0.01))  # not always right after a journal write
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            return True
        time.sleep(0.003)
    proc.wait()
    return False


def _continuing(out: Path) -> set[str]:
    """Tasks with rounds journalled after their last task line."""
    last: dict[str, str] = {}
    for entry in read_journal(out / layout.JOURNAL):
        last[entry["uid"]] = entry["type"]
    return {uid for uid, kind in last.items() if kind == "round"} & {e["uid"] for e in _task_lines(out)}


@pytest.mark.slow
def test_kill_9_soak_under_faults_with_a_dropped_cache_and_a_killed_retry(tmp_path):
    rng, out = random.Random(14), tmp_path / "run"
    sources = _make_sources(tmp_path / "sources", normal=8, diseased=4)  # 20 tasks, ~70 journal lines
    tasks = _tasks(sources)
    with FakeGemini(engine="echo", latency=0.02, accept_rate=0.4, faults=FAULTS) as fake:
        env, kills, dropped = _env(fake), 0, 0
        for _ in range(KILLS + 10):  # spare starts, in case a run ends before its kill point
            if kills == KILLS:
                break
            target = len(read_journal(out / layout.JOURNAL)) + rng.randint(1, 2)
            proc = subprocess.Popen(_command(sources, out), env=env, stdout=subprocess.DEVNULL,
                                    stderr=subprocess.DEVNULL)
            if _kill_when(proc, lambda target=target: len(read_journal(out / layout.JOURNAL)) >= target, rng):
                kills += 1
                if kills % 3 == 0 and (out / "medbanana-cache").exists():
                    shutil.rmtree(out / "medbanana-cache")  # resumed calls cannot repeat the killed ones' answers
                    dropped += 1
        done = subprocess.run(_command(sources, out), env=env, capture_output=True, text=True)
        assert done.returncode in (0, 3), done.stderr
        failed = {uid for uid, r in _assert_consistent(out, tasks).items() if r["status"] == "api_failed"}
        assert failed, "no task ended api_failed: nothing for --retry-failed to do; raise the safety rate"

        # --retry-failed, killed while a retried task is between rounds (every verdict a rejection meanwhile)
        fake.reset()
        # slower calls: 0.6 s or more between a retried task's rounds, for the poll to catch it under any load
        fake.judge.accept_rate, fake.latency, retry_kills = 0.0, 0.2, 0
        for _ in range(4):
            proc = subprocess.Popen(_command(sources, out, "--retry-failed", str(out)), env=env,
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            retry_kills += _kill_when(proc, lambda: bool(_continuing(out)), rng)
            if _continuing(out):
                break
        continuing = _continuing(out)
        assert continuing and retry_kills, "the retry was never caught between two rounds of a task"
        fake.judge.accept_rate, fake.latency = 0.4, 0.02
        shutil.rmtree(out / "medbanana-cache", ignore_errors=True)
        final = subprocess.run(_command(sources, out), env=env, capture_output=True, text=True)  # plain resume

    assert final.returncode in (0, 3), final.stderr
    assert kills == KILLS and dropped >= 3
    records = _assert_consistent(out, tasks)
    for uid in continuing:  # the killed retry's tasks went on from their journalled rounds, without --retry-failed
        assert records[uid]["status"] in ("success", "failed")
    for path in out.rglob("*.json"):
        json.loads(path.read_text(encoding="utf-8"))
    assert not list(out.rglob("*.tmp[0-9]*"))


@pytest.mark.slow
def test_a_merged_run_of_shards_is_retried_whole(tiny_sources, tmp_path):
    from medbanana.generation.runners.generate import retry_selection

    for i in range(2):
        assert main(["generate", "--sources", str(tiny_sources), "--out", str(tmp_path / f"shard{i}"),
                     "--shard", f"{i}/2", "--max-rounds", "1", "-q"]) in (0, 3)
    assert main(["merge", str(tmp_path / "shard0"), str(tmp_path / "shard1"), "--out", str(tmp_path / "all")]) == 0
    recorded, known = retry_selection(tmp_path / "all")
    assert recorded["shard"] is None  # not shard 0's [0, 2]: `--retry-failed` covers both shards' tasks
    assert known == {line["uid"] for i in range(2) for line in _task_lines(tmp_path / f"shard{i}")}


@pytest.mark.slow
def test_retrying_a_merged_run_continues_each_api_failed_task_after_its_merged_rounds(fake_env, sources, tmp_path,
                                                                                      capsys):
    # one task at a time and every second judge call a 500: each task's round 1 is judged (and rejected), its
    # round 2 fails, so every task of both shards ends api_failed with one round and its image kept
    fake_env.judge.accept_rate = 0.0
    fake_env.reset(["500:role=judge,rate=0.5"])
    shards = [tmp_path / f"shard{i}" for i in range(2)]
    for i, shard in enumerate(shards):
        assert _generate("--sources", sources, "--out", shard, "--diseases", "Pneumothorax", "--shard", f"{i}/2",
                         "--concurrency", "1", "--max-rounds", "3") == 3
    merged = tmp_path / "merged"
    assert main(["merge", *map(str, shards), "--out", str(merged)]) == 0
    before = {e["uid"]: e["record"] for e in _task_lines(merged)}
    assert len(before) == 5 and {r["status"] for r in before.values()} == {"api_failed"}
    assert all(len(r["rounds"]) == 1 and r["rounds"][0]["image"] for r in before.values())
    assert not any(e["type"] == "round" for e in read_journal(merged / layout.JOURNAL))  # merge writes records only

    fake_env.judge.accept_rate = 1.0
    fake_env.reset()
    capsys.readouterr()
    assert _generate("--retry-failed", merged, "--sources", sources, "--max-rounds", "3") == 0
    after = _assert_consistent(merged, set(before))  # journal, JSON files and images on disk agree, no orphans
    for uid, record in after.items():
        assert record["status"] == "success"
        assert record["rounds"][0] == before[uid]["rounds"][0]  # round 1 as merged, not written again
        assert [r["round"] for r in record["rounds"]] == [1, 2] and record["success_round"] == 2
        first = before[uid]["rounds"][0]["image"]
        assert [(shard / first).read_bytes() for shard in shards if (shard / first).exists()] == \
            [(merged / first).read_bytes()]  # the shard's image of round 1, kept
    assert fake_env.count("writer") == len(before)  # one new round per task: round 2


@pytest.mark.slow
def test_an_interrupted_merge_goes_on_and_another_record_of_a_merged_task_is_a_conflict(tiny_sources, tmp_path,
                                                                                        capsys):
    for i in range(2):
        assert main(["generate", "--sources", str(tiny_sources), "--out", str(tmp_path / f"shard{i}"),
                     "--shard", f"{i}/2", "-q"]) in (0, 3)
    shards = [str(tmp_path / f"shard{i}") for i in range(2)]
    whole, part = tmp_path / "whole", tmp_path / "part"
    assert main(["merge", *shards, "--out", str(whole)]) == 0
    assert main(["merge", *shards, "--out", str(part)]) == 0
    journal = part / layout.JOURNAL
    lines = journal.read_bytes().splitlines(keepends=True)
    assert len(lines) >= 4
    journal.write_bytes(b"".join(lines[:-3]) + lines[-3][:50])  # killed while writing the third line from the end
    capsys.readouterr()

    assert main(["merge", *shards, "--out", str(part)]) == 0
    assert f"merged 3 finished tasks ({len(lines) - 3} merged before)" in capsys.readouterr().out
    def records(out):
        return sorted((e["uid"], {k: v for k, v in e["record"].items() if k != "final_image_path"})
                      for e in _task_lines(out))
    assert records(part) == records(whole)  # each task once, as merged in one go
    _assert_consistent(part, {uid for uid, _ in records(whole)})

    lines = journal.read_bytes().splitlines(keepends=True)
    changed = json.loads(lines[0])
    changed["record"]["final_prompt"] = "another instruction"  # a consistent record, not the one the shard has
    journal.write_bytes(json.dumps(changed).encode() + b"\n" + b"".join(lines[1:]))
    before = journal.read_bytes()
    assert main(["merge", *shards, "--out", str(part)]) == 2
    assert f"task {changed['uid']} is already finished in {part}, with another record" in capsys.readouterr().err
    assert journal.read_bytes() == before


@pytest.mark.slow
def test_a_second_writer_is_refused_before_anything_slow(tmp_path):
    """`generate` takes the run directory's lock first: a second writer is refused before it imports the
    backends' client libraries or reads its sources (here a folder that does not even exist), naming the holder."""
    out = tmp_path / "run"
    code = ("import sys; from medbanana.cli import main; code = main(sys.argv[1:]); "
            "print(code, 'google.genai' in sys.modules, 'PIL.Image' in sys.modules)")
    argv = ["generate", "--sources", str(tmp_path / "no-such-sources"), "--out", str(out), "--backend", "gemini"]
    with hold_lock(out, "run directory"):
        done = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=120)
    assert done.stdout.split() == [str(EXIT_LOCKED), "False", "False"], done.stderr
    assert f"is being used by pid {os.getpid()}" in done.stderr and done.stderr.count("\n") == 1
    # refused on its options (no such sources) with no other writer: the folder it made for its lock is gone
    fresh = tmp_path / "fresh"
    done = subprocess.run([sys.executable, "-m", "medbanana", *argv[:3], "--out", str(fresh)], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2 and "no-such-sources" in done.stderr and not fresh.exists()
