"""`generate --workers N`: each worker's image pool (generation/pools.py) gets its share of the machine, so that N
workers never start more pool processes than one process's pool would (at least one each)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from fake_runs import mimic_sources
from medbanana.generation.pools import pool_size
from medbanana.generation.testing.fake_gemini import FakeGemini

KEY = "worker-pools-key-51aa"


def _spawned(process: psutil.Process) -> list[psutil.Process]:
    """`process`'s children but multiprocessing's resource tracker (ended ones left out)."""
    found = []
    for child in process.children():
        try:
            if "resource_tracker import main" not in " ".join(child.cmdline()):
                found.append(child)
        except psutil.Error:  # ended meanwhile
            pass
    return found


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads the process tree through /proc (Linux)")
def test_each_workers_pool_is_sized_to_its_share(tmp_path):
    sources = mimic_sources(tmp_path / "sources", "MIMIC_p", disease="Pleural_Effusion", per_class=1, disease_seed=3)
    command = [sys.executable, "-m", "medbanana", "generate", "--sources", str(sources), "--out", str(tmp_path / "run"),
               "--backend", "gemini", "--workers", "2", "--concurrency", "4", "--max-rounds", "1", "--timeout", "20",
               "-q"]
    with FakeGemini(engine="echo", latency=1.0) as fake:
        env = {**os.environ, "GEMINI_API_KEY": KEY, "GOOGLE_GEMINI_BASE_URL": fake.base_url}
        proc = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        try:
            parent, seen = psutil.Process(proc.pid), {}
            deadline = time.monotonic() + 60
            while len(seen) < 2 or any(n < pool_size(2) for n in seen.values()):
                assert proc.poll() is None and time.monotonic() < deadline, f"the workers' pools never all started: {seen}"
                for worker in _spawned(parent):
                    seen[worker.pid] = max(seen.get(worker.pid, 0), len(_spawned(worker)))
                time.sleep(0.05)
            _, err = proc.communicate(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert proc.returncode == 0, err
    assert sorted(seen.values()) == [pool_size(2)] * 2  # each worker's share: never a whole machine's pool each
