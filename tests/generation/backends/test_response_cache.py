"""The answer cache: appended logs, one per process, that survive kills and are read back by the next process."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from medbanana.generation.backends.response_cache import ResponseCache


def _body(i: int) -> str:
    return '{"answer": %d, "text": "%s"}' % (i, "é" * (i % 50) + "x" * (1000 * (i % 7)))


def test_answers_are_read_back_by_the_next_process_and_forgets_outrank_older_answers(tmp_path):
    first = ResponseCache(tmp_path)
    key, other = ResponseCache.hash({"model": "m", "messages": [1]}), ResponseCache.hash({"model": "m"})
    assert key == ResponseCache.hash({"messages": [1], "model": "m"}) and first.read(key) is None
    assert key not in first
    first.put_json(key, '{"a": 1}')
    first.put_json(other, '{"b": "line\\nbreak"}\n  pretty\n')  # answers may hold raw newlines (pretty JSON)
    assert key in first and first.read(key) == '{"a": 1}'
    first.close()
    second = ResponseCache(tmp_path)  # a later process: reads the first one's log
    assert second.read(other) == '{"b": "line\\nbreak"}\n  pretty\n' and second.read(key) == '{"a": 1}'
    second.forget(key)
    assert key not in second and second.read(key) is None
    second.close()
    third = ResponseCache(tmp_path)
    assert key not in third and third.read(other) is not None  # the forget (newer) wins over the first log's answer
    third.put_json(key, '{"a": 2}')
    assert ResponseCache(tmp_path).read(key) == '{"a": 2}'  # asked again: the newest record wins
    assert sorted(p.name.split("-")[0] for p in tmp_path.iterdir()) == ["answers"] * 3  # one log per writer


def test_an_answer_that_is_not_text_is_no_answer(tmp_path):
    cache = ResponseCache(tmp_path)
    key = ResponseCache.hash({"x": 1})
    cache._append(key, b"\xff\xfe not text")
    assert cache.read(key) is None and ResponseCache(tmp_path).read(key) is None


def test_the_earlier_layout_of_a_file_per_answer_is_still_read_and_forgotten(tmp_path):
    key = ResponseCache.hash({"old": True})
    (tmp_path / key[:2]).mkdir()
    (tmp_path / key[:2] / f"{key}.json").write_text('{"old": 1}')
    cache = ResponseCache(tmp_path)
    assert key in cache and cache.read(key) == '{"old": 1}' and cache.answers() == {key: '{"old": 1}'}
    cache.forget(key)
    assert key not in cache and not (tmp_path / key[:2] / f"{key}.json").exists()


_WRITER = """
import sys
from medbanana.generation.backends.response_cache import ResponseCache
sys.path.insert(0, sys.argv[2])
from test_response_cache import _body
cache = ResponseCache(sys.argv[1])
for i in range(10**6):
    cache.put_json(ResponseCache.hash({"i": i}), _body(i))
    if i == 50:  # 51 answers written whatever the load: the test counts more than 40
        print("writing", flush=True)
"""


@pytest.mark.slow
def test_a_process_killed_while_appending_leaves_only_whole_answers(tmp_path):
    writers = [subprocess.Popen([sys.executable, "-c", _WRITER, str(tmp_path), os.path.dirname(__file__)],
                                stdout=subprocess.PIPE, text=True) for _ in range(2)]
    for writer in writers:  # two processes append at once, as --workers 2 does, and are killed mid-run
        assert writer.stdout.readline().strip() == "writing"
    time.sleep(0.3)
    for writer in writers:
        writer.send_signal(signal.SIGKILL)
        writer.wait()
    cache = ResponseCache(tmp_path)
    answers = cache.answers()
    numbers = {key: json.loads(text)["answer"] for key, text in answers.items()}
    assert len(answers) > 40 and all(key == ResponseCache.hash({"i": i}) and answers[key] == _body(i)
                                     for key, i in numbers.items())
    cache.put_json("k", "after")  # the next process appends to a log of its own, past the torn ones
    assert ResponseCache(tmp_path).read("k") == "after" and len(ResponseCache(tmp_path).answers()) == len(answers) + 1


def test_a_record_torn_by_a_crash_is_ignored_and_the_ones_before_it_kept(tmp_path):
    cache = ResponseCache(tmp_path)
    for i in range(3):
        cache.put_json(f"k{i}", _body(i + 5))
    cache.close()
    (log,) = tmp_path.iterdir()
    whole = log.read_bytes()
    for cut in (len(whole) - 1, len(whole) - 3, len(whole) - len(_body(7)) - 2):  # the last record, torn
        log.write_bytes(whole[:cut])
        assert ResponseCache(tmp_path).answers() == {"k0": _body(5), "k1": _body(6)}
    log.write_bytes(whole[:cut] + b"garbage that is no header\n")
    assert ResponseCache(tmp_path).answers() == {"k0": _body(5), "k1": _body(6)}
