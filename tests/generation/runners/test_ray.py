"""`generate --executor ray` on a real local Ray cluster (`ray start --head` on 127.0.0.1 with 2 CPUs: two shard
tasks at once), driven by the real CLI in its own process.

Each test's merged run must equal, task by task, a run of the same options in one process (statuses, rounds,
instructions, verdicts, image paths); a shard's worker killed mid-run must be retried by Ray and resume from the
shard's journal without running a finished task again; resubmitting must skip finished shards.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from fake_runs import mimic_sources, use_fake_gemini
from medbanana.cli import main
from medbanana.generation.rundir import layout
from medbanana.generation.rundir.lock import LOCK_NAME
from medbanana.generation.rundir.store import read_journal
from medbanana.generation.runners.ray_executor import MAX_RETRIES, SHARDS, shard_dir
from medbanana.generation.runners.session import in_shard
from medbanana.generation.sources.scan import scan_sources
from medbanana.generation.testing.fake_gemini import FakeGemini

pytestmark = pytest.mark.slow

pytest.importorskip("ray", reason="ray is not installed: pip install 'medbanana[ray]'")

KEY = "ray-test-key-0c3f"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def fake_gemini():
    """Started before the cluster: its workers read the server's address (and the key) from their environment,
    as a real cluster's nodes read the key from theirs."""
    with FakeGemini(engine="echo", latency=0.05) as server:
        yield server


@dataclass(frozen=True)
class Cluster:
    address: str
    env: dict  # what a driver needs to join it: the cluster's token (its own, never ~/.ray's)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, fake_gemini) -> Cluster:
    """A one-node Ray cluster with 2 CPUs, 1 GPU (declared: nothing runs on it) and token authentication. Torn down
    by ending its own process group."""
    temp = tmp_path_factory.mktemp("ray")
    token = temp / "auth_token"
    token.write_text(secrets.token_hex(32))
    auth = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token)}
    env = {**os.environ, **auth, "GEMINI_API_KEY": KEY, "GOOGLE_GEMINI_BASE_URL": fake_gemini.base_url,
           "RAY_memory_monitor_refresh_ms": "0"}  # no worker killed for memory the other tests on the host use
    env.pop("RAY_ADDRESS", None)
    port = _free_port()
    start = subprocess.Popen([str(Path(sys.executable).parent / "ray"), "start", "--head", f"--port={port}",
                              "--num-cpus=2", "--num-gpus=1", "--include-dashboard=false",
                              "--node-ip-address=127.0.0.1", f"--temp-dir={temp}", "--disable-usage-stats"],
                             env=env, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True)
    group = start.pid  # `ray start` returns; the processes it started stay in its process group
    try:
        output, _ = start.communicate(timeout=180)
        assert start.returncode == 0, output
        yield Cluster(f"127.0.0.1:{port}", auth)
    finally:
        for sig, wait in ((signal.SIGTERM, 3.0), (signal.SIGKILL, 0.0)):  # SIGTERM leaves the GCS server up
            try:
                os.killpg(group, sig)
            except ProcessLookupError:
                break
            time.sleep(wait)


def _args(sources: Path, out: Path, backend: str, *extra: str) -> list[str]:
    return ["generate", "--sources", str(sources), "--out", str(out), "--backend", backend, "--seed", "7",
            "--max-rounds", "3", "--timeout", "20", "--retry-base-delay", "0.01", "-q", *extra]


def _driver(args: list[str], cluster: Cluster) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "medbanana", *args, "--executor", "ray", "--ray-address",
                             cluster.address, "--shards", "2"], env={**os.environ, **cluster.env},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(driver: subprocess.Popen) -> str:
    out, err = driver.communicate(timeout=300)
    assert driver.returncode == 0, out + err
    return out


def _tasks(run_dir: Path) -> dict[str, tuple]:
    """uid -> (status, success round, per round: number, instruction, accepted, verdict, image path)."""
    found = {}
    for _, _, folder in layout.find_output_dirs(run_dir):
        for record in json.loads((folder / layout.ALL_CONVERSATIONS).read_text()).values():
            rounds = [(r["round"], r["instruction"], r.get("accepted"), r.get("verification"), r.get("image"))
                      for r in record["rounds"]]
            found[record["uid"]] = (record["status"], record.get("success_round"), rounds)
    return found


def _task_lines(run_dir: Path) -> list[str]:
    return [e["uid"] for e in read_journal(run_dir / layout.JOURNAL) if e["type"] == "task"]


def _check_merged_like_single(merged: Path, single: Path, count: int) -> None:
    expected = _tasks(single)
    assert len(expected) == count and {s for s, _, _ in expected.values()} >= {"success"}
    assert _tasks(merged) == expected
    assert sorted(_task_lines(merged)) == sorted(expected)  # every task finished once
    for shard in (shard_dir(merged, i, 2) for i in range(2)):
        lines = _task_lines(shard)
        assert lines and len(lines) == len(set(lines))
    images = {p.relative_to(merged).as_posix() for p in merged.rglob("*.jpeg") if SHARDS not in p.parts}
    assert images == {r[4] for _, _, rounds in expected.values() for r in rounds if r[4]}


def test_simulator_shards_on_ray_merge_like_one_process_and_a_resubmission_skips_finished_shards(cluster, tmp_path,
                                                                                                monkeypatch):
    """Relative paths everywhere (sources, out, the signing certificate and key): the driver makes them absolute
    for the cluster's workers, which start in another folder."""
    from medbanana.generation.backends.simulator.phantoms import write_demo_sources

    monkeypatch.chdir(tmp_path)  # paths relative to the driver's folder, which the cluster's workers are not in
    sources = Path("sources")
    write_demo_sources(sources, n_normal=1, n_diseased=1, size=128)
    assert main(["keys", "init", "keys"]) == 0  # images signed with a relative certificate and key too

    def args(out: Path) -> list[str]:
        return _args(sources, out, "simulator", "--limit", "6", "--concurrency", "2",
                     "--c2pa-cert", "keys/signer-chain.pem", "--c2pa-key", "keys/signer.key")

    out, single = Path("ray"), Path("single")
    assert main(args(single)) == 0
    # shard 0 was run before by hand (or by an earlier submission): only shard 1 goes to the cluster
    assert main(args(shard_dir(out, 0, 2)) + ["--shard", "0/2"]) == 0
    shard0 = (shard_dir(out, 0, 2) / layout.JOURNAL).read_bytes()

    assert "tasks 6 (ran 3, already done 3)" in _finish(_driver(args(out), cluster))
    assert (shard_dir(out, 0, 2) / layout.JOURNAL).read_bytes() == shard0
    _check_merged_like_single(out, single, 6)
    assert json.loads((out / layout.STATS).read_text())["tasks"] == 6
    assert main(["verify", "--run", str(out), "--trust", "keys/ca.pem"]) == 0  # shard 1's, signed on the cluster

    journal = (out / layout.JOURNAL).read_bytes()
    done = subprocess.run([sys.executable, "-m", "medbanana", *args(out), "--executor", "ray", "--ray-address",
                           "127.0.0.1:9"], capture_output=True, text=True, timeout=120)  # no cluster needed now
    assert done.returncode == 0, done.stderr
    assert "ran 0, already done 6" in done.stdout
    assert (out / layout.JOURNAL).read_bytes() == journal
    other = subprocess.run([sys.executable, "-m", "medbanana", *args(out), "--executor", "ray", "--shards", "3"],
                           capture_output=True, text=True, timeout=120)
    assert other.returncode == 2 and "holds 2 shards; resume with --shards 2" in other.stderr


def test_gemini_shards_on_ray_survive_a_killed_worker_without_running_a_task_twice(cluster, fake_gemini, tmp_path,
                                                                                  monkeypatch):
    sources = mimic_sources(tmp_path / "sources", "MIMIC_ray", disease="Pleural_Effusion", per_class=1)  # 12 tasks

    def args(out: Path) -> list[str]:
        return _args(sources, out, "gemini", "--concurrency", "1")

    out, single = tmp_path / "ray", tmp_path / "single"
    use_fake_gemini(monkeypatch, fake_gemini, KEY)
    assert main(args(single)) == 0
    count = len(_tasks(single))
    in_shard0 = sum(in_shard(task, (0, 2)) for task in scan_sources(sources))

    driver = _driver(args(out), cluster)
    lock = shard_dir(out, 0, 2) / LOCK_NAME
    deadline = time.monotonic() + 180
    while len(_task_lines(shard_dir(out, 0, 2))) < 2:
        assert driver.poll() is None and time.monotonic() < deadline, "shard 0 never journalled two tasks"
        time.sleep(0.01)
    worker = json.loads(lock.read_text())["pid"]  # the shard's writer: the Ray worker running it
    assert worker != driver.pid
    os.kill(worker, signal.SIGKILL)
    assert len(_task_lines(shard_dir(out, 0, 2))) < in_shard0, "shard 0 finished before it was killed"

    _finish(driver)
    # the killed writer left its lock file; a new worker took the lock, finished the shard and removed the file
    assert not lock.exists()
    assert sorted(_task_lines(shard_dir(out, 0, 2))) == sorted(set(_task_lines(shard_dir(out, 0, 2))))
    assert len(_task_lines(shard_dir(out, 0, 2))) == in_shard0
    _check_merged_like_single(out, single, count)


def test_shards_reserve_their_gpus(cluster, tmp_path):
    """With one GPU in the cluster and --ray-gpus-per-shard 1, the two shards run one after the other (with CPUs
    alone, both at once)."""
    sources = mimic_sources(tmp_path / "sources", "MIMIC_ray", disease="Pleural_Effusion", per_class=1)
    args = _args(sources, tmp_path / "run", "simulator", "--limit", "6", "--ray-gpus-per-shard", "1")
    _finish(_driver(args, cluster))
    spans = []
    for i in range(2):
        stats = json.loads((shard_dir(tmp_path / "run", i, 2) / layout.STATS).read_text())
        assert stats["tasks"] > 0
        spans.append((stats["finished_at"] - stats["seconds"], stats["finished_at"]))
    first, second = sorted(spans)
    assert first[1] <= second[0], f"the shards ran at the same time: {spans}"


def test_a_driver_killed_while_merging_is_resumed(tmp_path, capsys):
    """No cluster is joined when every shard has finished. Shards merged whole before the driver died are not
    merged again; a shard merged in part is merged on from where the driver stopped."""
    from medbanana.generation.backends.simulator.phantoms import write_demo_sources

    sources = tmp_path / "sources"
    write_demo_sources(sources, n_normal=1, n_diseased=1, size=128)

    def args(out: Path) -> list[str]:
        return _args(sources, out, "simulator", "--limit", "4", "--concurrency", "2")

    whole, part, single = tmp_path / "whole", tmp_path / "part", tmp_path / "single"
    assert main(args(single)) == 0
    for i in range(2):
        assert main(args(shard_dir(whole, i, 2)) + ["--shard", f"{i}/2"]) == 0
    shutil.copytree(whole / SHARDS, part / SHARDS)
    unreachable = ["--executor", "ray", "--ray-address", "127.0.0.1:9", "--shards", "2"]

    assert main(["merge", str(shard_dir(whole, 0, 2)), "--out", str(whole), "--partial"]) == 0  # as the driver does
    assert main(args(whole) + unreachable) == 0
    _check_merged_like_single(whole, single, 4)

    assert main(["merge", str(shard_dir(part, 0, 2)), "--out", str(part), "--partial"]) == 0
    journal = part / layout.JOURNAL
    lines = journal.read_bytes().splitlines(keepends=True)
    assert len(lines) >= 2
    journal.write_bytes(b"".join(lines[:-1]))  # the merge was killed before its last task line
    assert main(args(part) + unreachable) == 0
    _check_merged_like_single(part, single, 4)  # every task once, no image left aside


def test_a_second_driver_on_the_same_out_is_refused_at_once(tiny_sources, tmp_path, capsys):
    from medbanana.generation.failures import EXIT_LOCKED
    from medbanana.generation.rundir.lock import hold_lock

    with hold_lock(tmp_path / "run" / SHARDS, "sharded run (its Ray driver)"):  # the first driver, still running
        code = main(["generate", "--sources", str(tiny_sources), "--out", str(tmp_path / "run"), "--backend",
                     "simulator", "-q", "--executor", "ray", "--shards", "2", "--ray-address", "127.0.0.1:9"])
    assert code == EXIT_LOCKED and "is being used by pid" in capsys.readouterr().err
    assert not (tmp_path / "run" / SHARDS / "0-of-2").exists()


def test_every_path_a_shard_job_names_is_made_absolute_and_a_hub_id_is_kept(tmp_path, monkeypatch):
    from medbanana.generation.runners.generate import BackendSpec
    from medbanana.generation.runners.ray_executor import ShardJob, absolute_paths
    from medbanana.generation.runners.session import RunOptions

    monkeypatch.chdir(tmp_path)
    Path("tiny-editor").mkdir()
    local = BackendSpec("simulator", {"editor": "diffusers"},
                        diffusers={"model": "tiny-editor", "attention_dir": "maps"})
    job = absolute_paths(ShardJob(Path("sources"), local, RunOptions()))
    assert job.sources == tmp_path / "sources"
    assert job.spec.diffusers.model == str(tmp_path / "tiny-editor")
    assert job.spec.diffusers.attention_dir == tmp_path / "maps"
    hub = BackendSpec("simulator", {"editor": "diffusers"}, diffusers={"model": "timbrooks/instruct-pix2pix"})
    assert absolute_paths(ShardJob(Path("s"), hub, RunOptions())).spec.diffusers.model == "timbrooks/instruct-pix2pix"


def test_a_driver_without_an_address_starts_its_own_cluster_holds_out_and_its_shards_end_with_it(
        cluster, fake_gemini, tmp_path):
    """`ray start` left a cluster on this machine (its address in Ray's address file, as `ray start` writes it):
    without --ray-address the driver still starts a local cluster of its own, whose workers inherit the driver's
    key and endpoint (a second fake server: nothing may reach the other cluster's). While the driver runs, a plain
    `generate` into OUT is refused. A shard whose worker keeps dying ends the command with exit code 4; a
    driver killed with SIGKILL leaves no shard calling the API; the same command then finishes the job."""
    sources = mimic_sources(tmp_path / "sources", "MIMIC_ray", disease="Pleural_Effusion", per_class=2)  # 16 tasks
    out = tmp_path / "run"
    ray_tmp = Path(tempfile.mkdtemp(prefix="rt", dir="/tmp"))  # short: Ray's socket paths must fit
    (ray_tmp / "ray").mkdir()
    (ray_tmp / "ray" / "ray_current_cluster").write_text(cluster.address)
    command = [sys.executable, "-m", "medbanana", *_args(sources, out, "gemini", "--concurrency", "1"),
               "--executor", "ray", "--shards", "2"]
    other_calls = fake_gemini.count()
    try:
        with FakeGemini(engine="echo", latency=0.1) as mine:
            env = {**os.environ, **cluster.env, "RAY_TMPDIR": str(ray_tmp), "GEMINI_API_KEY": "driver-key-5d1a",
                   "GOOGLE_GEMINI_BASE_URL": mine.base_url, "RAY_memory_monitor_refresh_ms": "0"}
            env.pop("RAY_ADDRESS", None)

            def start() -> subprocess.Popen:
                return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

            def shard_worker(after: int | None = None) -> int | None:
                """The pid holding shard 0's lock once it is another than `after`; None if the driver ended."""
                lock, deadline = shard_dir(out, 0, 2) / LOCK_NAME, time.monotonic() + 180
                while driver.poll() is None:
                    assert time.monotonic() < deadline, "no worker took shard 0"
                    try:
                        pid = json.loads(lock.read_text())["pid"]
                    except (OSError, ValueError):
                        pid = None
                    if pid not in (None, after):
                        return pid
                    time.sleep(0.02)
                return None

            driver = start()
            worker = shard_worker()
            assert worker is not None, driver.communicate()
            plain = subprocess.run(command[:-4], env=env, capture_output=True, text=True, timeout=120)
            assert plain.returncode == 75 and f"is being used by pid {driver.pid}" in plain.stderr, plain.stderr
            kills = 0
            while worker is not None:  # the first attempt, then each of Ray's retries
                os.kill(worker, signal.SIGKILL)
                kills += 1
                worker = shard_worker(after=worker)
            assert kills == MAX_RETRIES + 1
            _, err = driver.communicate(timeout=180)
            assert driver.returncode == 4, err
            assert "Ray: started a local cluster" in err and "shard 0/2 failed" in err, err

            before = mine.count()
            driver = start()
            while mine.count() < before + 6:  # the shards are calling the API
                assert driver.poll() is None, driver.communicate()
                time.sleep(0.02)
            driver.kill()
            driver.wait()
            time.sleep(3)  # each shard checks every 0.5 s that its driver lives
            calls = mine.count()
            time.sleep(2)
            assert mine.count() == calls, "a shard kept calling the API after its driver was killed"

            driver = start()
            _, err = driver.communicate(timeout=300)
            assert driver.returncode == 0, err
        assert fake_gemini.count() == other_calls  # nothing ran on the cluster `ray start` left
        assert len(set(_task_lines(out))) == len(scan_sources(sources))
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
