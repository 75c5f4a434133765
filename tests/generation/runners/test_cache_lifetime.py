"""The request cache keeps a task's answers only while a resume may ask for them: real `medbanana generate` runs
against the fake Gemini server, in one process and with worker processes (whose answers the parent drops)."""

from __future__ import annotations

import os

import pytest

from fake_runs import mimic_sources, use_fake_gemini
from medbanana.cli import main
from medbanana.generation.backends.response_cache import ResponseCache, answers_of_task, drop_task_answers, task_tag
from medbanana.generation.rundir import layout
from medbanana.generation.rundir.store import read_journal
from medbanana.generation.testing.fake_gemini import FakeGemini

KEY = "cache-lifetime-key-5d1e"


def _generate(*argv) -> int:
    return main(["generate", "--backend", "gemini", "--max-rounds", "2", "--max-attempts", "1", "--concurrency", "2",
                 "-q", *map(str, argv)])


@pytest.mark.slow
@pytest.mark.parametrize("workers", [1, 2])
def test_answers_of_ended_tasks_leave_the_cache_and_an_api_failed_tasks_stay_for_its_retry(workers, tmp_path,
                                                                                          monkeypatch):
    sources = mimic_sources(tmp_path / "sources", "MIMIC_cache", per_class=2)
    out, cache = tmp_path / "run", tmp_path / "run" / "medbanana-cache" / "gemini"
    with FakeGemini(engine="echo", faults=["500:first=1,role=judge"]) as fake:  # one task ends api_failed
        use_fake_gemini(monkeypatch, fake, KEY)
        assert _generate("--sources", sources, "--out", out, "--diseases", "Pneumothorax", "--directions", "add",
                         "--workers", workers) == 3
        records = {e["uid"]: e["record"] for e in read_journal(out / layout.JOURNAL) if e["type"] == "task"}
        failed = [uid for uid, record in records.items() if record["status"] == "api_failed"]
        assert len(records) == 2 and len(failed) == 1 and records[failed[0]]["error"]["step"] == "verify_image"
        assert os.listdir(cache / "tasks") == [f"{task_tag(failed[0])}.log"]  # the ended task's answers are gone
        assert list(cache.glob("answers-*.log")) == []  # and no answer was kept outside a task
        assert len(ResponseCache(cache).answers()) == 2  # the api_failed task's writer and editor answers

        fake.reset()
        assert _generate("--retry-failed", out, "--sources", sources, "--workers", workers) == 0
        assert fake.calls[0].role == "judge"  # round 1's instruction and edit were not paid for again
        assert fake.count("writer") <= 1 and fake.count("editor") <= 1  # at most a second round's
    assert os.listdir(cache / "tasks") == []


def test_a_task_s_answers_are_kept_apart_and_dropped_whole(tmp_path):
    root = tmp_path / "medbanana-cache"
    cache = ResponseCache(root / "gemini")
    cache.put_json("k-outside", "{}")
    uid = "MIMIC/add/n 0 ü-Pneumothorax"  # a uid names files after sources: any characters
    with answers_of_task(uid):
        cache.put_json("k-task", '{"a": 1}')
        cache.forget("k-outside")  # a forget made within a task is the task's too
    log = root / "gemini" / "tasks" / f"{task_tag(uid)}.log"
    assert log.is_file() and list(log.parent.iterdir()) == [log]
    reread = ResponseCache(root / "gemini")  # another process's view: both logs read
    assert reread.read("k-task") == '{"a": 1}' and reread.read("k-outside") is None
    assert drop_task_answers(root, [uid, "never-ran"]) == 1
    assert not log.exists()
    reread = ResponseCache(root / "gemini")
    assert reread.read("k-task") is None and reread.read("k-outside") == "{}"  # the forget went with its task
    assert cache.read("k-task") is None  # an index that still names a dropped answer: a miss, not an error


def test_a_resumed_task_appends_after_a_record_torn_by_a_kill(tmp_path):
    cache_dir = tmp_path / "gemini"
    with answers_of_task("t1"):
        ResponseCache(cache_dir).put_json("k1", "one")
    log = cache_dir / "tasks" / f"{task_tag('t1')}.log"
    whole = log.read_bytes()
    log.write_bytes(whole + b"k2 100 123\npart of an answ")  # the process was killed mid-write
    with answers_of_task("t1"):  # the task resumed, in another process
        ResponseCache(cache_dir).put_json("k3", "three")
    reread = ResponseCache(cache_dir)
    assert (reread.read("k1"), reread.read("k2"), reread.read("k3")) == ("one", None, "three")
    assert log.read_bytes().startswith(whole) and b"part of" not in log.read_bytes()


def test_a_link_at_a_task_s_log_is_neither_written_through_nor_followed_when_dropped(tmp_path):
    root, elsewhere = tmp_path / "medbanana-cache", tmp_path / "elsewhere.log"
    elsewhere.write_text("not the cache's")
    (root / "gemini" / "tasks").mkdir(parents=True)
    (root / "gemini" / "tasks" / f"{task_tag('t1')}.log").symlink_to(elsewhere)
    cache = ResponseCache(root / "gemini")
    with answers_of_task("t1"), pytest.warns(UserWarning, match="left out, never opened: .* is a symbolic link"):
        cache.put_json("k", "{}")
    assert elsewhere.read_text() == "not the cache's"  # the answer went to the process's own log instead
    with pytest.warns(UserWarning, match="left out, never opened"):
        assert ResponseCache(root / "gemini").read("k") == "{}"
    assert drop_task_answers(root, ["t1"]) == 1  # the link goes, what it points to stays
    assert elsewhere.read_text() == "not the cache's"
    assert not (root / "gemini" / "tasks" / f"{task_tag('t1')}.log").is_symlink()


def test_a_hard_link_at_a_task_s_log_or_a_link_at_tasks_is_not_written_through(tmp_path):
    outside = tmp_path / "outside.log"
    outside.write_bytes(b"")
    hard = tmp_path / "hard" / "gemini"
    (hard / "tasks").mkdir(parents=True)
    os.link(outside, hard / "tasks" / f"{task_tag('t1')}.log")  # one file, two names: writing it changes both
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    linked = tmp_path / "linked" / "gemini"
    linked.mkdir(parents=True)
    (linked / "tasks").symlink_to(elsewhere, target_is_directory=True)
    for cache_dir in (hard, linked):
        with answers_of_task("t1"):
            ResponseCache(cache_dir).put_json("k", "{}")
        assert ResponseCache(cache_dir).read("k") == "{}"  # kept in the process's own log
        assert len(list(cache_dir.glob("answers-*.log"))) == 1
    assert outside.read_bytes() == b"" and os.listdir(elsewhere) == []
