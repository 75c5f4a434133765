"""`eval --separability` resumes: the real CLI, killed (SIGKILL to its process group, as a preempted node) once part
of the per-image features are in OUT/medbanana-cache/probe-features/, then rerun, reuses them and reports exactly
what an uninterrupted run reports; a torn last record is ignored; other settings or other image bytes never hit."""

import io
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

pytest.importorskip("sklearn")

from medbanana.cli import main
from medbanana.evaluation.probe_cache import CACHE_NAME, FeatureCache, feature_key

PAIRS = 60  # sources and as many edits: 120 images
REPORTED = re.compile(r"separability features: ([\d,]+) computed, ([\d,]+) reused from ")


def _scan(seed: int, size: int = 320) -> np.ndarray:
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:size, 0:size] / size
    field = 120 + 50 * np.sin(6 * x + rng.uniform(0, 6)) * np.cos(5 * y + rng.uniform(0, 6))
    return np.clip(field + rng.normal(0, 6, (size, size)), 0, 255).astype(np.uint8)


def _encoded(array: np.ndarray, fmt: str, **kw) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(array).save(buffer, fmt, **kw)
    return buffer.getvalue()


@pytest.fixture(scope="module")
def samples_folder(tmp_path_factory) -> Path:
    """An evaluation folder: grey PNG sources, RGB JPEG 'edits' (a format confound the raw probe sees)."""
    folder = tmp_path_factory.mktemp("probe_resume") / "in"
    folder.mkdir()
    rows = []
    for i in range(PAIRS):
        (folder / f"src-{i}.png").write_bytes(_encoded(_scan(i), "PNG"))
        (folder / f"edit-{i}.jpg").write_bytes(_encoded(np.repeat(_scan(1000 + i)[..., None], 3, 2), "JPEG",
                                                        quality=97))
        rows.append({"id": f"s{i}", "source": f"src-{i}.png", "edited": f"edit-{i}.jpg",
                     "instruction": "Add a pleural effusion.", "disease": "Pleural_Effusion", "direction": "add",
                     "accepted": "false" if i % 4 == 0 else "true"})
    (folder / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


def _command(folder: Path, out: Path, size: int = 192, *extra: str) -> list[str]:
    return [sys.executable, "-m", "medbanana", "eval", str(folder), "--out", str(out), "--judge", "none",
            "--no-lpips", "-q", "--separability", "--probe-size", str(size), "--probe-workers", "2", *extra]


def _eval(folder: Path, out: Path, size: int = 192, *extra: str) -> tuple[int, int]:
    """Run the CLI to the end; (features computed, features reused) as it reports them."""
    done = subprocess.run(_command(folder, out, size, *extra), check=False, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    found = REPORTED.search(done.stdout)
    assert found, done.stdout
    return int(found[1].replace(",", "")), int(found[2].replace(",", ""))


def _tables(out: Path) -> dict:
    return {name: (out / name).read_text() for name in ("separability.csv", "separability.md", "separability.json",
                                                         "probe_samples.csv")}


def _whole_records(path: Path) -> int:
    cache = FeatureCache(path)  # only once no writer is left: opening cuts a torn tail
    try:
        return len(cache)
    finally:
        cache.close()


def _logs(cache_path: Path) -> list[Path]:
    return sorted(cache_path.glob("answers-*.log"))


def _cache_bytes(cache_path: Path) -> int:
    return sum(log.stat().st_size for log in _logs(cache_path))


def _kill_partway(folder: Path, out: Path, cache_path: Path, at_least: int = 3000) -> int:
    """Start the CLI in its own process group and SIGKILL the group once the cache holds `at_least` bytes."""
    proc = subprocess.Popen(_command(folder, out), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while _cache_bytes(cache_path) < at_least:
            assert proc.poll() is None, "the run ended before it could be killed: give it more images"
            assert time.monotonic() < deadline, "the cache never grew"
            time.sleep(0.002)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    return proc.returncode


@pytest.mark.slow
def test_a_killed_probe_resumes_from_its_cache_and_reports_like_an_uninterrupted_run(samples_folder, tmp_path):
    images = 2 * PAIRS
    reference = tmp_path / "uninterrupted"
    assert _eval(samples_folder, reference) == (images, 0)

    out = tmp_path / "resumed"
    cache_path = out / "medbanana-cache" / CACHE_NAME
    assert _kill_partway(samples_folder, out, cache_path) == -signal.SIGKILL
    assert not (out / "separability.csv").exists()
    cached = _whole_records(cache_path)
    assert 0 < cached < images, "the kill came before any feature or after all of them"

    # a crash mid-write: the last record (a header and 83 float32, over 400 bytes) loses its last 100 bytes
    (log,) = _logs(cache_path)  # the killed process's
    os.truncate(log, log.stat().st_size - 100)
    assert _whole_records(cache_path) == cached - 1

    assert _eval(samples_folder, out) == (images - (cached - 1), cached - 1)
    assert _tables(out) == _tables(reference)
    assert _whole_records(cache_path) == images  # what was appended after the cut is read back

    assert _eval(samples_folder, out) == (0, images)  # nothing left to compute
    assert _tables(out) == _tables(reference)

    before = _cache_bytes(cache_path)
    assert _eval(samples_folder, out, size=128) == (images, 0)  # another --probe-size: no stale entry reused
    assert _cache_bytes(cache_path) > before
    assert _eval(samples_folder, out, size=192) == (0, images)  # the first settings' entries are still there


@pytest.mark.slow
def test_changed_image_bytes_are_computed_again(samples_folder, tmp_path):
    folder = tmp_path / "in"
    folder.mkdir()
    for path in samples_folder.iterdir():
        (folder / path.name).write_bytes(path.read_bytes())
    out = tmp_path / "out"
    assert _eval(folder, out, 192, "--limit", "8") == (16, 0)
    edited = folder / "edit-5.jpg"
    stat = edited.stat()
    edited.write_bytes(_encoded(np.repeat(_scan(5000)[..., None], 3, 2), "JPEG", quality=97))
    os.utime(edited, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # same time stamp: only the bytes tell
    assert _eval(folder, out, 192, "--limit", "8") == (1, 15)


def test_cache_keys_vectors_and_torn_tails(tmp_path):
    path = tmp_path / CACHE_NAME
    keys = [feature_key(f"{i:064x}", "weight-free", 1, 256, 90) for i in range(3)]
    assert len(set(keys)) == 3
    assert feature_key("0" * 64, "weight-free", 1, 256, 90) != feature_key("0" * 64, "weight-free", 2, 256, 90)
    assert feature_key("0" * 64, "weight-free", 1, 256, 90) != feature_key("0" * 64, "timm:x", 1, 256, 90)
    assert feature_key("0" * 64, "weight-free", 1, 256, 90) != feature_key("0" * 64, "weight-free", 1, 256, 80)
    rng = np.random.default_rng(0)
    vectors = [(rng.normal(size=5).astype(np.float32), rng.normal(size=3).astype(np.float32)) for _ in keys]
    cache = FeatureCache(path)
    for key, (raw, controlled) in zip(keys, vectors):
        cache.put(key, raw, controlled)
    cache.close()
    (log,) = _logs(path)
    log.write_bytes(log.read_bytes() + b"f" * 64 + b" 36 1\n" + b"\x00" * 7)  # a torn record after them
    cache = FeatureCache(path)
    assert len(cache) == 3 and cache.get("f" * 64) is None
    for key, (raw, controlled) in zip(keys, vectors):
        got_raw, got_controlled = cache.get(key)
        assert got_raw.tobytes() == raw.tobytes() and got_controlled.tobytes() == controlled.tobytes()
    assert cache.reused == 3
    cache.put("e" * 64, *vectors[0])  # appended to a log of this process: the torn one is never written again
    cache.close()
    cache = FeatureCache(path)
    assert len(cache) == 4 and cache.get("e" * 64)[1].tobytes() == vectors[0][1].tobytes()
    cache.close()


@pytest.mark.slow
def test_pretrained_embeddings_are_cached_beside_the_weight_free_features(samples_folder, tmp_path, capsys):
    timm = pytest.importorskip("timm")
    pytest.importorskip("torch").manual_seed(0)
    from timm.models import save_for_hf

    model_dir = tmp_path / "tiny-timm"
    save_for_hf(timm.create_model("test_vit", pretrained=False), model_dir)  # no network: random weights
    out = tmp_path / "out"
    command = ["eval", str(samples_folder), "--out", str(out), "--judge", "none", "--no-lpips", "-q", "--limit", "10",
               "--separability", "--probe-size", "64", "--probe-workers", "1", "--probe-features", f"timm:{model_dir}"]
    counts = []
    for _ in range(2):
        assert main(command) == 0
        found = REPORTED.search(capsys.readouterr().out)
        counts.append((int(found[1]), int(found[2])))
    assert counts == [(40, 0), (0, 40)]  # 20 images, each with weight-free and pretrained vectors
    rows = json.loads((out / "separability.json").read_text())["rows"]
    assert any(r["features"] == f"timm:{model_dir}" and r["auroc_raw"] is not None for r in rows)

    # the folder's weights replaced (a model trained further): its embeddings are computed again, the rest reused
    save_for_hf(timm.create_model("test_vit", pretrained=False), model_dir)
    assert main(command) == 0
    found = REPORTED.search(capsys.readouterr().out)
    assert (int(found[1]), int(found[2])) == (20, 20)
