"""The process pool of per-image work (generation/pools.py, runners/image_work.py): sized to the CPUs and memory this
process may use (its share under `--workers`), a task's urgent job ahead of the queued ones, a killed process
costing only the jobs it held, and a run whose pool cannot work storing every round without masks, which the
build then computes."""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from medbanana.cli import main
from medbanana.generation import pools
from medbanana.generation.rundir import layout
from medbanana.generation.rundir.store import read_journal
from medbanana.generation.runners import image_work

GIB = 2**30


def test_pool_size_is_the_share_of_cpus_bounded_by_memory():
    assert pools.pool_size(cpus=8, memory=64 * GIB) == 8
    assert pools.pool_size(2, cpus=8, memory=64 * GIB) == 4  # --workers 2: each worker's pool gets half
    assert pools.pool_size(3, cpus=8, memory=64 * GIB) == 2
    assert pools.pool_size(16, cpus=8, memory=64 * GIB) == 1  # never none
    assert pools.pool_size(cpus=8, memory=3 * pools.PROCESS_MEMORY) == 3  # memory for three processes
    assert pools.pool_size(2, cpus=8, memory=3 * pools.PROCESS_MEMORY) == 1
    assert pools.pool_size(cpus=8, memory=pools.PROCESS_MEMORY // 2) == 1


def test_available_memory_is_meminfo_lowered_by_the_cgroup_limit(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       16000000 kB\nMemAvailable:    8000000 kB\n")
    limit = tmp_path / "memory.max"
    limit.write_text("max\n")
    assert pools.available_memory(meminfo, limit) == 8000000 * 1024
    limit.write_text(f"{2 * GIB}\n")
    assert pools.available_memory(meminfo, limit) == 2 * GIB
    assert pools.available_memory(tmp_path / "absent", tmp_path / "absent") is None
    assert pools.pool_size(cpus=4, memory=pools.available_memory(meminfo, limit)) == 4
    limit.write_text(f"{pools.PROCESS_MEMORY}\n")  # a container with room for one
    assert pools.pool_size(cpus=4, memory=pools.available_memory(meminfo, limit)) == 1


def _stamp(seconds: float) -> float:
    """A job: sleeps, then says when it ended (CLOCK_MONOTONIC is the machine's, shared by processes)."""
    time.sleep(seconds)
    return time.monotonic()


@pytest.mark.slow
def test_jobs_run_in_other_processes_and_an_urgent_one_goes_before_those_queued():
    async def scenario():
        pool = pools.ImagePool(1)
        try:
            assert await pool.run(os.getpid) != os.getpid()
            queued = [asyncio.ensure_future(pool.run(_stamp, 0.3)) for _ in range(4)]
            await asyncio.sleep(0.05)  # the first is running, three wait
            urgent = asyncio.ensure_future(pool.run(_stamp, 0.0, urgent=True))
            ends = await asyncio.gather(*queued)
            ended = await urgent
        finally:
            pool.close()
        assert ends[0] < ended < min(ends[1:])  # after the running job, before every queued one

    asyncio.run(scenario())


@pytest.mark.slow
def test_a_process_is_kept_for_urgent_jobs_while_they_come(monkeypatch):
    monkeypatch.setattr(pools, "URGENT_WINDOW", 30.0)  # urgent jobs keep coming, as far as the pool can tell

    async def scenario():
        pool = pools.ImagePool(2)
        try:
            await asyncio.gather(pool.run(os.getpid), pool.run(os.getpid, urgent=True))
            queued = [asyncio.ensure_future(pool.run(_stamp, 0.4)) for _ in range(4)]
            await asyncio.sleep(0.1)  # one runs, three wait: the second process stays free
            urgent = asyncio.ensure_future(pool.run(_stamp, 0.0, urgent=True))
            ends = await asyncio.gather(*queued)
            ended = await urgent
        finally:
            pool.close()
        assert ended < min(ends)  # not behind a job that can wait
        assert ends == sorted(ends) and ends[-1] - ends[0] >= 3 * 0.4 - 0.05  # the rest one after the other

    asyncio.run(scenario())


def _started(seconds: float) -> float:
    """A job: says when it started, then sleeps."""
    started = time.monotonic()
    time.sleep(seconds)
    return started


@pytest.mark.slow
def test_once_urgent_jobs_stop_coming_the_others_get_every_process(monkeypatch):
    monkeypatch.setattr(pools, "URGENT_WINDOW", 0.3)

    async def scenario():
        pool = pools.ImagePool(2)
        try:
            await asyncio.gather(pool.run(_started, 0.2), pool.run(_started, 0.2))  # both processes up, this module in
            await asyncio.sleep(0.3)
            urgent_came = time.monotonic()
            await pool.run(_started, 0.0, urgent=True)
            first, second = await asyncio.gather(pool.run(_started, 0.8), pool.run(_started, 0.8))
            later = await asyncio.gather(*(pool.run(_started, 0.3) for _ in range(2)))  # none urgent for a while
        finally:
            pool.close()
        assert first - urgent_came < 0.25  # one process runs it at once...
        # ... the other is kept until the window after the urgent job ends, not until the first job ends (0.8 s)
        assert 0.3 - 0.02 <= second - urgent_came < 0.65
        assert abs(later[0] - later[1]) < 0.2  # side by side, not one after the other (0.3 s apart)

    asyncio.run(scenario())


@pytest.mark.slow
def test_a_pool_closed_without_waiting_ends_its_processes_by_the_next_close():
    async def scenario():
        pool = pools.ImagePool(2)
        pids = set(await asyncio.gather(*(pool.run(_pid_after, 0.2) for _ in range(2))))
        pool.close(wait=False)
        with pytest.raises(pools.PoolBroken, match="closed"):
            await pool.run(os.getpid)
        pool.close()
        return pids

    for pid in asyncio.run(scenario()):
        with pytest.raises(ProcessLookupError):  # ended and reaped: not even a zombie is left
            os.kill(pid, 0)


def _pid_after(seconds: float) -> int:
    time.sleep(seconds)
    return os.getpid()


def _raise() -> None:
    raise ValueError("the job's own error")


@pytest.mark.slow
def test_a_killed_process_costs_its_job_only_and_the_pool_is_replaced():
    async def scenario():
        pool = pools.ImagePool(1)
        try:
            first = await pool.run(os.getpid)
            with pytest.raises(ValueError, match="own error"):  # a job's exception is its caller's, pool intact
                await pool.run(_raise)
            assert await pool.run(os.getpid) == first and pool.restarts == 0
            held = asyncio.ensure_future(pool.run(time.sleep, 30))
            await asyncio.sleep(0.3)
            os.kill(first, signal.SIGKILL)  # out of memory, or a user's kill
            with pytest.raises(pools.PoolBroken):
                await asyncio.wait_for(held, 20)
            second = await pool.run(os.getpid)  # a fresh pool for the next job
            assert second != first and pool.restarts == 1
            for _ in range(pools.RESTARTS):  # killed again and again: after RESTARTS replacements it gives up
                pid = await pool.run(os.getpid)
                held = asyncio.ensure_future(pool.run(time.sleep, 30))
                await asyncio.sleep(0.3)
                os.kill(pid, signal.SIGKILL)
                with pytest.raises(pools.PoolBroken):
                    await asyncio.wait_for(held, 20)
            with pytest.raises(pools.PoolBroken, match="died"):
                await pool.run(os.getpid)
        finally:
            pool.close()
        with pytest.raises(pools.PoolBroken, match="closed"):
            await pool.run(os.getpid)

    asyncio.run(scenario())


class DyingPool(pools.ImagePool):
    """An image pool whose every process dies as it starts (killed, out of memory)."""

    def __init__(self, size: int, **_):
        super().__init__(size, initializer=os._exit, initargs=(9,))


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("pools") / "demo"
    assert main(["demo", "--out", str(out), "--normal", "1", "--diseased", "1", "--size", "128", "--max-rounds", "1",
                 "--no-build", "-q"]) == 0
    return out / "sources"


def _image_rounds(run: Path) -> list[str]:
    return [entry["round"]["image"] for entry in read_journal(run / layout.JOURNAL)
            if entry["type"] == "round" and entry["round"].get("image")]


@pytest.mark.slow
def test_a_run_whose_pool_dies_stores_every_round_without_masks_and_the_build_computes_them(sources, tmp_path,
                                                                                           monkeypatch):
    monkeypatch.setattr(image_work, "ImagePool", DyingPool)
    run = tmp_path / "run"
    code = main(["generate", "--sources", str(sources), "--out", str(run), "--backend", "simulator", "--limit", "6",
                 "--max-rounds", "2", "--geometry", "register", "-q"])
    assert code in (0, 3)
    images = _image_rounds(run)
    assert len(images) >= 6 and all((run / image).is_file() for image in images)
    records = [json.loads(line) for line in (run / layout.JOURNAL).read_text().splitlines()]
    tasks = [r["record"] for r in records if r["type"] == "task"]
    assert len(tasks) == 6 and all(t["status"] in ("success", "failed") for t in tasks)  # no task lost to the pool
    assert all("geometry" in rnd for t in tasks for rnd in t["rounds"] if rnd.get("image"))  # checked in a thread
    assert not [rel for image in images for rel in layout.mask_relpaths(image) if (run / rel).exists()]  # its cost
    out = tmp_path / "dataset"
    assert main(["build", str(run), "--out", str(out), "--source-images", str(sources), "--configs", "failed,sft",
                 "-q"]) == 0
    masks = json.loads((out / "medbanana-build.json").read_text())["stats"]["edit_masks"]
    assert masks == {"computed": len(images)}  # every mask the run could not store, made by the build


NO_GUARD = '''
from pathlib import Path
import numpy as np
from PIL import Image
from medbanana.generation.runners.generate import generate
from medbanana.generation.runners.session import RunOptions
folder = Path("sources/MIMIC_g/normal")
folder.mkdir(parents=True, exist_ok=True)
for i in range(2):
    Image.fromarray(np.full((96, 96, 3), 60 + 40 * i, np.uint8)).save(folder / f"s{i}.jpeg")
summary = generate(Path("sources"), Path("run"), limit=2, options=RunOptions(quiet=True, max_rounds=1))
print("tasks", summary.tasks)
'''


@pytest.mark.slow
def test_a_script_without_a_main_guard_is_told_and_its_call_does_not_run_again_in_the_pool(tmp_path):
    """Python runs the calling script again in each process the pool spawns: there generate stops at once with what
    to do, instead of opening the run a second time (before: a LockHeld traceback per process, and any other run
    the script names made again), and the script's own run ends with its tasks."""
    (tmp_path / "script.py").write_text(NO_GUARD)
    done = subprocess.run([sys.executable, "script.py"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "tasks 2" in done.stdout
    assert 'must do so under `if __name__ == "__main__":`' in done.stderr
    assert "LockHeld" not in done.stderr
    assert sum(e["type"] == "task" for e in read_journal(tmp_path / "run" / layout.JOURNAL)) == 2


def test_a_call_from_a_started_process_s_work_is_not_refused():
    with multiprocessing.get_context("spawn").Pool(1) as pool:  # this test module is the child's work, not its main
        assert pool.apply(pools.refuse_in_a_starting_child, ("generate",)) is None
    pools.refuse_in_a_starting_child("generate")  # nor a call in the parent
