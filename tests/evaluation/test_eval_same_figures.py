"""`eval`'s figures are the ones its straightforward computation gives: scikit-image's SSIM maps (CP: their RGB mean
outside the ROI dilated by half the window; SSIM: the "L" images' mean), PSNR in float64, and the simulator judge
measuring each image pair for its verdict and again for its scores, each from its own decoding. The computation
that replaced it (integer window sums shared by CP and SSIM, images decoded once, measured once) must give every
metric to 1e-6 on a demo dataset, and `--workers 2` the same files as one process."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from scipy import ndimage
from skimage.metrics import structural_similarity

from medbanana.cli import main
from medbanana.demo import run_demo
from medbanana.evaluation import judging, metrics
from medbanana.generation.backends.simulator.judge import PixelJudge

OUTPUTS = ("samples.jsonl", "summary.json", "report.md", "by_modality.csv", "by_disease.csv", "by_direction.csv")


def cp_by_hand(source, edited, roi, maps=None):
    """CP as scikit-image's full RGB SSIM map gives it: its channel mean over the pixels whose 7x7 window lies
    outside the ROI and inside the image."""
    _, ssim_map = structural_similarity(source, edited, channel_axis=-1, full=True)
    half = metrics.SSIM_WINDOW // 2
    window = np.ones((metrics.SSIM_WINDOW, metrics.SSIM_WINDOW), bool)
    valid = ~ndimage.binary_dilation(roi, structure=window) if roi.any() else ~roi
    valid[:half], valid[-half:], valid[:, :half], valid[:, -half:] = False, False, False, False
    return float(ssim_map.mean(axis=-1)[valid].mean()) if valid.any() else None


def ssim_by_hand(a, b, maps=None):
    grey_a = np.asarray(Image.fromarray(a).convert("L"))
    grey_b = np.asarray(Image.fromarray(metrics.to_size(b, a.shape)[0]).convert("L"))
    return float(structural_similarity(grey_a, grey_b, data_range=255))


def psnr_by_hand(a, b):
    mse = float(np.mean((a.astype(np.float64) - metrics.to_size(b, a.shape)[0].astype(np.float64)) ** 2))
    return metrics.PSNR_IDENTICAL if mse == 0 else 10 * math.log10(255.0**2 / mse)


@pytest.fixture(scope="module", params=[256, pytest.param(1024, marks=pytest.mark.slow)], ids=["256px", "1024px"])
def dataset(request, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("same-figures") / "demo"
    run_demo(out, n_normal=1, n_diseased=1, size=request.param, quiet=True)
    return out / "dataset"


def _records(out: Path) -> dict[str, dict]:
    return {r["id"]: r for r in map(json.loads, (out / "samples.jsonl").read_text().splitlines())}


def _assert_close(before, after, where: str) -> None:
    if isinstance(before, float) and isinstance(after, float):
        assert math.isclose(before, after, rel_tol=0, abs_tol=1e-6), (where, before, after)
    elif isinstance(before, dict) and isinstance(after, dict):
        assert before.keys() == after.keys(), where
        for key in before:
            _assert_close(before[key], after[key], f"{where}.{key}")
    elif isinstance(before, list) and isinstance(after, list):
        assert len(before) == len(after), where
        for i, (b, a) in enumerate(zip(before, after)):
            _assert_close(b, a, f"{where}[{i}]")
    else:
        assert before == after, (where, before, after)


@pytest.mark.slow
def test_eval_gives_the_straightforward_computations_figures_and_workers_change_nothing(dataset, tmp_path,
                                                                                        monkeypatch):
    with monkeypatch.context() as before:
        before.setattr(metrics, "cp_correct", cp_by_hand)
        before.setattr(metrics, "ssim_gray", ssim_by_hand)
        before.setattr(metrics, "psnr_rgb", psnr_by_hand)
        before.setattr(PixelJudge, "_measured", lambda judge, task, source, edited: judge.measure(task, source, edited))
        images = judging._images
        before.setattr(judging, "_images", lambda sample, source, edited, arrays=None: images(sample, source, edited))
        assert main(["eval", str(dataset), "--out", str(tmp_path / "by-hand"), "--no-lpips", "-q"]) == 0
    for name, workers in (("one", "1"), ("two", "2")):
        assert main(["eval", str(dataset), "--out", str(tmp_path / name), "--no-lpips", "--workers", workers,
                     "-q"]) == 0

    by_hand, one = _records(tmp_path / "by-hand"), _records(tmp_path / "one")
    assert len(by_hand) >= 10 and all(r["status"] == "ok" for r in by_hand.values())
    assert {r["modality"] for r in by_hand.values()} == {"chest_xray", "brain_mri", "fundus"}  # grey and colour
    assert all(isinstance(r["cp"], float) and "ea" in r and "verdict" in r for r in by_hand.values())
    _assert_close(by_hand, one, "samples")
    _assert_close(*(json.loads((tmp_path / name / "summary.json").read_text()) for name in ("by-hand", "one")),
                  "summary")
    for name in OUTPUTS:  # another process count, the same files
        assert (tmp_path / "two" / name).read_bytes() != b""
        if name == "samples.jsonl":
            assert _records(tmp_path / "two") == one
        else:
            assert (tmp_path / "two" / name).read_text().replace(str(tmp_path / "two"), "OUT") == \
                (tmp_path / "one" / name).read_text().replace(str(tmp_path / "one"), "OUT"), name


@pytest.mark.parametrize("value", ["0", "-1", "two", "1.5"])
def test_eval_workers_must_be_a_count_or_auto(value, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["eval", str(tmp_path), "--out", str(tmp_path / "out"), "--workers", value])
    assert exit_.value.code == 2 and "--workers" in capsys.readouterr().err
