"""`generate --workers auto`: one worker process per CPU this process may use (affinity, container quota), at most
--concurrency and the number of tasks; and the options that go with --executor ray only."""

from __future__ import annotations

import os
import sys

import pytest

from fake_runs import mimic_sources, use_fake_gemini
from medbanana.cli import main
from medbanana.generation.rundir.store import read_journal
from medbanana.generation.rundir import layout
from medbanana.generation.runners import processes
from medbanana.generation.testing.fake_gemini import FakeGemini

KEY = "workers-auto-key-77b1"


@pytest.mark.parametrize("cpu_max, quota", [("max 100000\n", None), ("150000 100000\n", 2), ("50000 100000\n", 1)])
def test_available_cpus_is_the_affinity_lowered_by_the_cgroup_quota(tmp_path, cpu_max, quota):
    (tmp_path / "cpu.max").write_text(cpu_max)
    mask = len(os.sched_getaffinity(0))
    assert processes.available_cpus(tmp_path / "cpu.max") == (min(mask, quota) if quota else mask)
    assert processes.available_cpus(tmp_path / "absent") == mask  # no cgroup v2 file: the mask alone


@pytest.mark.slow
@pytest.mark.parametrize("concurrency", [1, 4])
def test_workers_auto_spawns_one_worker_per_cpu_capped_by_concurrency(tmp_path, monkeypatch, concurrency):
    sources = mimic_sources(tmp_path / "sources", "MIMIC_auto", disease="Pleural_Effusion", per_class=1)
    spawned = []

    class CountedWorker(processes._Worker):  # the real worker process, counted as it starts
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            spawned.append(self.process.pid)

    monkeypatch.setattr(processes, "_Worker", CountedWorker)
    with FakeGemini(engine="echo") as fake:
        use_fake_gemini(monkeypatch, fake, KEY)
        assert main(["generate", "--sources", str(sources), "--out", str(tmp_path / "run"), "--workers", "auto",
                     "--backend", "gemini", "--limit", "3", "--concurrency", str(concurrency), "--max-rounds", "2", "-q"]) == 0
    expected = processes.auto_workers(concurrency, tasks=3)
    assert expected == min(len(os.sched_getaffinity(0)), concurrency, 3)
    assert len(spawned) == (expected if expected > 1 else 0)  # one worker runs in this process, unspawned
    finished = [e["uid"] for e in read_journal(tmp_path / "run" / layout.JOURNAL) if e["type"] == "task"]
    assert len(finished) == len(set(finished)) == 3


def test_workers_option_is_documented_and_checked(capsys, tmp_path):
    with pytest.raises(SystemExit) as exited:
        main(["generate", "--help"])
    assert exited.value.code == 0
    assert "'auto': one per CPU this process may use" in " ".join(capsys.readouterr().out.split())
    for bad in ("0", "many"):
        with pytest.raises(SystemExit) as exited:
            main(["generate", "--sources", str(tmp_path), "--out", str(tmp_path / "r"), "--workers", bad])
        assert exited.value.code == 2
        assert "--workers" in capsys.readouterr().err


@pytest.mark.parametrize("extra, message", [
    (["--workers", "auto", "--executor", "ray"], "with --executor ray give --workers N"),
    (["--shards", "2"], "go with --executor ray"),
    (["--executor", "ray", "--shard", "0/2"], "leave out --shard"),
])
def test_ray_options_out_of_place_are_refused_in_one_line(tiny_sources, tmp_path, capsys, extra, message):
    code = main(["generate", "--sources", str(tiny_sources), "--out", str(tmp_path / "run"), "--backend",
                 "simulator", "-q", *extra])
    assert code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_executor_ray_without_ray_installed_names_the_extra(tiny_sources, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # what `import ray` meets when it is not installed
    code = main(["generate", "--sources", str(tiny_sources), "--out", str(tmp_path / "run"), "--backend",
                 "simulator", "-q", "--executor", "ray", "--shards", "2"])
    assert code == 2
    assert "--executor ray needs ray: pip install 'medbanana[ray]'" in capsys.readouterr().err
