"""The run's source cache (runners/local.py): a source that many tasks start on at once is read and checked once, and
one that cannot be read fails every task that waits on it, then is read anew by the next."""

from __future__ import annotations

import asyncio
import threading

import pytest

from conftest import write_jpeg
from medbanana.generation.runners import local


def test_tasks_starting_together_on_a_source_read_it_once(tmp_path, monkeypatch):
    path = write_jpeg(tmp_path / "a.jpeg")
    reads, read_source = [], local.read_source

    def counted(*args):
        reads.append(threading.current_thread().name)
        return read_source(*args)

    monkeypatch.setattr(local, "read_source", counted)

    async def scenario():
        cache = local.SourceCache()
        first = await asyncio.gather(*(cache.read(path) for _ in range(30)))  # a run's first wave: 30 at once
        later = await cache.read(path)
        return first, later

    first, later = asyncio.run(scenario())
    assert len(reads) == 1 and reads[0] != threading.main_thread().name  # once, off the event loop
    assert all(source is first[0] for source in first) and later is first[0]


def test_an_unreadable_source_fails_every_waiting_task_and_is_read_again_next_time(tmp_path):
    path = tmp_path / "b.jpeg"
    path.write_bytes(b"\xff\xd8 not a whole JPEG")

    async def scenario():
        cache = local.SourceCache()
        results = await asyncio.gather(*(cache.read(path) for _ in range(5)), return_exceptions=True)
        write_jpeg(path)  # fixed meanwhile
        return results, await cache.read(path)

    results, fixed = asyncio.run(scenario())
    assert all(isinstance(r, ValueError) and "not a readable image" in str(r) for r in results)
    assert fixed.path == path and fixed.data == path.read_bytes()


def test_a_task_cancelled_while_waiting_does_not_cancel_the_read_of_the_others(tmp_path):
    path = write_jpeg(tmp_path / "c.jpeg")

    async def scenario():
        cache = local.SourceCache()
        waiting = [asyncio.ensure_future(cache.read(path)) for _ in range(3)]
        await asyncio.sleep(0)
        waiting[0].cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting[0]
        return await asyncio.gather(*waiting[1:])

    sources = asyncio.run(scenario())
    assert sources[0] is sources[1] and sources[0].path == path
