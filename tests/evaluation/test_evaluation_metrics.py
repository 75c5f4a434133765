"""Known-answer tests of the pixel metrics: CP in both modes, MedGEN-Bench's SSIM / PSNR, LPIPS's gate, ROIs."""

import math

import numpy as np
import pytest
from skimage.metrics import structural_similarity

from medbanana.evaluation import metrics

C1, C2 = (0.01 * 255) ** 2, (0.03 * 255) ** 2  # scikit-image's SSIM constants for range 255
WIN = 7


def textured(size: int = 64, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8)


def square_mask(size: int, start: int, side: int) -> np.ndarray:
    mask = np.zeros((size, size), np.uint8)
    mask[start:start + side, start:start + side] = 255
    return mask


def test_identical_images_give_cp_1_psnr_100_ssim_1():
    image = textured()
    mask = square_mask(64, 20, 16)
    for mode in metrics.CP_MODES:
        assert metrics.context_preservation(image, image, mask, mode) == pytest.approx(1.0, abs=1e-12)
    assert metrics.psnr_rgb(image, image) == 100.0
    assert metrics.ssim_gray(image, image) == pytest.approx(1.0, abs=1e-12)


def test_psnr_of_a_one_level_change_is_20_log10_255():
    image = np.full((16, 16, 3), 100, np.uint8)
    assert metrics.psnr_rgb(image, image + 1) == pytest.approx(20 * math.log10(255), rel=1e-12)


@pytest.mark.parametrize("side", [6, 20, 40])
def test_edit_confined_to_the_roi_gives_cp_1_in_both_modes(side):
    source = textured(seed=1)
    mask = square_mask(64, 10, side)
    edited = source.copy()
    edited[mask > 0] = textured(seed=2)[mask > 0]  # anything at all inside the ROI
    assert metrics.context_preservation(source, edited, mask, "correct") == pytest.approx(1.0, abs=1e-9)
    # MedEBench zeroes the ROI in both images, so the two become identical too
    assert metrics.context_preservation(source, edited, mask, "medebench") == pytest.approx(1.0, abs=1e-9)
    # without the dilation by half the window, the SSIM map next to the ROI would show the edit
    _, ssim_map = structural_similarity(source, edited, channel_axis=-1, full=True)
    border = np.zeros((64, 64), bool)
    border[10 - 1, 10:10 + side] = True
    assert ssim_map.mean(axis=-1)[border].mean() < 0.99


def medebench_by_hand(a: float, b: float, size: int, start: int, side: int) -> float:
    """Source constant a, edit constant b outside a square ROI: after zeroing the ROI, a 7x7 window holding a
    fraction p of outside pixels has means a*p, b*p and (sample) covariances k*a*a, k*b*b, k*a*b with
    k = 49/48 * p(1-p); SSIM = (2ab p² + C1)(2ab k + C2) / ((a²+b²) p² + C1)((a²+b²) k + C2). Averaged over the
    window centres scikit-image keeps (all but a border of 3)."""
    half = WIN // 2
    total, count = 0.0, 0
    for r in range(half, size - half):
        rows = max(0, min(r + half, start + side - 1) - max(r - half, start) + 1)
        for c in range(half, size - half):
            cols = max(0, min(c + half, start + side - 1) - max(c - half, start) + 1)
            p = (WIN * WIN - rows * cols) / (WIN * WIN)
            k = WIN * WIN / (WIN * WIN - 1) * p * (1 - p)
            total += ((2 * a * b * p * p + C1) * (2 * a * b * k + C2)) / (((a * a + b * b) * p * p + C1)
                                                                        * ((a * a + b * b) * k + C2))
            count += 1
    return total / count


def test_medebench_cp_grows_with_roi_size_as_computed_by_hand_while_correct_cp_does_not():
    a, b, size = 200.0, 20.0, 64  # a strong global change outside the ROI
    outside_only = (2 * a * b + C1) / (a * a + b * b + C1)  # every window outside the ROI: constant a vs b
    values = []
    for side in (16, 32, 48):
        start = 8
        source = np.full((size, size, 3), a, np.uint8)
        edited = np.full((size, size, 3), b, np.uint8)
        mask = square_mask(size, start, side)
        edited[mask > 0] = textured(size, seed=side)[mask > 0]
        medebench = metrics.cp_medebench(source, edited, mask)
        assert medebench == pytest.approx(medebench_by_hand(a, b, size, start, side), abs=1e-6)
        assert metrics.context_preservation(source, edited, mask, "correct") == pytest.approx(outside_only, abs=1e-9)
        values.append(medebench)
    assert values[0] < values[1] < values[2]
    assert values[0] > outside_only  # the zeroed ROI counts as perfect similarity


def test_correct_cp_without_roi_is_skimage_full_image_ssim_and_none_when_nothing_is_outside():
    source, edited = textured(seed=3), textured(seed=4)
    empty = np.zeros((64, 64), np.uint8)
    expected = structural_similarity(source, edited, channel_axis=-1)
    assert metrics.context_preservation(source, edited, empty, "correct") == pytest.approx(expected, abs=1e-12)
    assert metrics.context_preservation(source, edited, empty, "medebench") == pytest.approx(expected, abs=1e-12)
    assert metrics.context_preservation(source, edited, np.full((64, 64), 255, np.uint8), "correct") is None
    with pytest.raises(ValueError, match="CP mode"):
        metrics.context_preservation(source, edited, empty, "other")


def test_medebench_masking_matches_torch_float32_round_trip():
    torch = pytest.importorskip("torch")
    image = textured(seed=5)
    mask = np.random.default_rng(6).integers(0, 256, (64, 64), dtype=np.uint8)  # soft weights too
    tensor = torch.from_numpy(image).permute(2, 0, 1).float().div(255)  # ToTensor
    keep = 1.0 - torch.from_numpy(mask).float().div(255)[None]
    expected = (tensor * keep).mul(255).byte().permute(1, 2, 0).numpy()  # ToPILImage
    assert np.array_equal(metrics.medebench_masked(image, mask), expected)


def test_edit_of_another_size_is_resized_to_the_source_for_every_metric():
    source = np.full((32, 32, 3), 90, np.uint8)
    edited = np.full((64, 64, 3), 90, np.uint8)
    assert metrics.psnr_rgb(source, edited) == 100.0
    assert metrics.context_preservation(source, edited, np.zeros((32, 32), np.uint8), "medebench") == 1.0


def test_lpips_is_gated_on_local_weights_with_a_clear_message(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "lpips", None)  # as when the package is not installed
    with pytest.raises(metrics.LPIPSUnavailable, match="pip install lpips"):
        metrics.LPIPSMetric()
    scaled = metrics.lpips_input(np.stack([np.zeros((10, 10)), np.full((10, 10), 255), np.full((10, 10), 51)],
                                          axis=-1).astype(np.uint8))
    assert scaled.shape == (1, 3, 256, 256) and scaled.dtype == np.float32
    assert scaled[0, 0].max() == -1.0 and scaled[0, 1].min() == 1.0
    assert scaled[0, 2, 0, 0] == pytest.approx(51 / 127.5 - 1)
