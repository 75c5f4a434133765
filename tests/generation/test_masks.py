"""Per-edit masks: `edit_mask` finds what an edit changed (against known changes and the simulator's own record of
what it drew, on the demo's real build path) and `region_mask` is the task's region; both are columns of the
built dataset, null without sources, and the card says they are computed."""

import io
import json
from pathlib import Path

import numpy as np
import pytest
from datasets import load_dataset
from PIL import Image

from medbanana.generation import masks
from medbanana.cli import main
from medbanana.generation.backends.simulator.lesions import SPECS
from medbanana.generation.backends.simulator.truth import read_drawn_mask
from medbanana.generation.rundir import layout


def iou(a: np.ndarray, b: np.ndarray) -> float:
    union = (a | b).sum()
    return 1.0 if union == 0 else float((a & b).sum() / union)


def jpeg_roundtrip(rgb: np.ndarray, quality: int = 95) -> np.ndarray:
    buffer = io.BytesIO()
    Image.fromarray(rgb).save(buffer, format="JPEG", quality=quality)
    return np.asarray(Image.open(buffer).convert("RGB"))


def radiograph(size: int = 320, seed: int = 0) -> np.ndarray:
    """Smooth anatomy-like shading, ribs (sharp edges) and grain."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:size, 0:size] / size
    grey = 120 + 60 * np.cos(3 * x) * np.sin(2 * y) + 40 * (np.sin(40 * y) > 0.6) + rng.normal(0, 4, (size, size))
    return np.repeat(np.clip(grey, 0, 255)[..., None], 3, axis=2).astype(np.uint8)


def test_edit_mask_finds_a_soft_blob_through_jpeg_noise_and_a_global_drift():
    source = radiograph()
    y, x = np.mgrid[0:320, 0:320]
    r = np.hypot(x - 200, y - 120)
    blob = 35 * np.clip((30 - r) / 6 + 0.5, 0, 1)  # a 30 px finding with a soft margin
    edited = np.clip(source + blob[..., None] - 3, 0, 255).astype(np.uint8)  # and 3 grey levels darker overall
    found = masks.edit_mask(Image.fromarray(jpeg_roundtrip(source)), Image.fromarray(jpeg_roundtrip(edited)))
    assert found.mode == "L" and found.size == (320, 320) and set(np.unique(np.asarray(found))) <= {0, 255}
    assert iou(np.asarray(found) > 127, blob > 35 / 2) > 0.8
    # the same pair re-encoded: nothing changed beyond noise, so no mask
    same = masks.edit_mask(Image.fromarray(source), Image.fromarray(jpeg_roundtrip(source, 90)))
    assert not np.asarray(same).any()


def test_edit_mask_is_at_the_edits_size_and_reads_16_bit_sources():
    source = (radiograph(256).astype(np.uint16)[..., 0] * 200)
    edited = np.repeat((source / 200).astype(np.uint8)[..., None], 3, axis=2)
    edited[100:160, 60:120] = np.clip(edited[100:160, 60:120].astype(int) + 60, 0, 255)
    big = Image.fromarray(edited).resize((512, 512), Image.BICUBIC)
    found = np.asarray(masks.edit_mask(Image.fromarray(source), big)) > 127
    truth = np.zeros((512, 512), bool)
    truth[200:320, 120:240] = True
    assert found.shape == (512, 512) and iou(found, truth) > 0.7


def test_region_mask_is_the_taxonomy_region_located_on_the_source_or_typical():
    source = radiograph(96, seed=7)
    region, name = masks.region_array("chest_xray", "Pleural Effusion", (96, 96), source)
    assert name == "costophrenic_angle" and region.dtype == bool and 0 < region.mean() < 1
    wide, _ = masks.region_array(None, "Pleural_Effusion", (192, 96), np.concatenate([source, source], axis=1))
    assert wide.shape == (96, 192)
    with pytest.raises(ValueError, match="not a known disease"):
        masks.region_array("chest_xray", "Broken_Heart", (96, 96), source)
    typical = masks.region_mask("fundus", "Glaucoma", (300, 200))  # no image: where the disc usually is
    values = np.asarray(typical)
    assert typical.mode == "L" and typical.size == (300, 200) and set(np.unique(values)) == {0, 255}
    ys, xs = np.nonzero(values)
    assert 0 < values.mean() / 255 < 0.1 and xs.mean() > 150  # a small region right of centre (a right eye)


def test_findings_in_one_region_of_a_source_share_its_region_mask(monkeypatch):
    buffer = io.BytesIO()
    Image.fromarray(radiograph(256, seed=3)).save(buffer, format="JPEG")
    source = {"bytes": buffer.getvalue(), "path": None}
    computed = []
    region_grid = masks._region_grid
    monkeypatch.setattr(masks, "_region_grid", lambda *args: computed.append(args[:2]) or region_grid(*args))
    found = {disease: masks.task_masks({}, source, "chest_xray", disease).region["bytes"]
             for disease in ("Atelectasis", "Pneumonia", "Consolidation", "Pleural_Effusion")}
    assert found["Atelectasis"] == found["Pneumonia"] == found["Consolidation"] != found["Pleural_Effusion"]
    assert computed == [("chest_xray", "Atelectasis"), ("chest_xray", "Pleural_Effusion")]  # once a region
    assert masks.task_masks({}, source, "chest_xray", "No_Finding").region is None  # not an edit target


def _drawn(run_dir: Path) -> dict[tuple[str, int], dict]:
    """(uid, round) -> the simulator's recorded edit details."""
    out = {}
    for _, _, folder in layout.find_output_dirs(run_dir):
        for record in json.loads((folder / layout.ALL_CONVERSATIONS).read_text()).values():
            for round_ in record["rounds"]:
                out[(record["uid"], round_["round"])] = (round_.get("edit_result") or {}).get("details")
    return out


def focal(disease: str) -> bool:
    """A finding with a body in a bounded region (not dots, lines, a haze over the whole image or diffuse
    oedema): the ones a difference mask should outline."""
    spec = SPECS[disease]
    return spec.body and spec.max_share <= 0.9


@pytest.mark.slow
def test_the_demo_dataset_carries_masks_that_sit_on_the_simulators_lesions(tmp_path, capsys):
    """The demo as a user runs it: its sft rows' edit masks overlap what the simulator recorded drawing, and every
    mask column is filled (sources attached); the card says the masks are computed."""
    out = tmp_path / "demo"
    assert main(["demo", "--out", str(out), "--normal", "1", "--diseased", "1", "--size", "256", "-q"]) == 0
    drawn = _drawn(out / "run")
    sft = load_dataset(str(out / "dataset"), "sft", split="train")
    scores = []
    for row in sft:
        assert row["edit_mask"].size == row["edited_image"].size and row["region_mask"].size == (256, 256)
        truth = read_drawn_mask(drawn[(row["uid"], row["success_round"])], row["edited_image"].size)
        assert truth is not None  # the simulator records what it drew
        if focal(row["disease"]):
            scores.append(iou(np.asarray(row["edit_mask"]) > 127, truth))
    assert len(scores) >= 10 and np.median(scores) >= 0.6, scores
    judge = load_dataset(str(out / "dataset"), "judge", split="train")
    assert all(r["edit_mask"] is not None and r["region_mask"] is not None for r in judge)
    card = (out / "dataset" / "README.md").read_text()
    assert "computed, not annotated" in card and "medbanana.generation.masks.edit_mask" in card
    assert json.loads((out / "dataset" / "medbanana-build.json").read_text())["mask_method"] == masks.MASK_METHOD


@pytest.mark.slow
def test_a_runs_stored_masks_need_no_sources_and_a_run_without_them_gets_null_masks(tmp_path):
    """The demo's run stores each attempt image's masks when it writes it: a build without sources carries them.
    The same run with its masks folder gone (as a released run comes) built without sources: null, and said."""
    import shutil

    from medbanana.demo import run_demo

    run_demo(tmp_path / "demo", n_normal=1, n_diseased=0, size=128, quiet=True, max_rounds=2)
    run = tmp_path / "demo" / "run"
    assert main(["build", str(run), "--out", str(tmp_path / "stored"), "-q"]) == 0
    failed = list(load_dataset(str(tmp_path / "stored"), "failed", split="train"))
    assert failed and all(r["edit_mask"] is not None and r["region_mask"] is not None for r in failed)
    assert all(r["edit_mask"].size == r["edited_image"].size for r in failed)
    info = json.loads((tmp_path / "stored" / "medbanana-build.json").read_text())
    assert set(info["stats"]["edit_masks"]) == {"stored"} and info["mask_method"] == masks.MASK_METHOD

    shutil.rmtree(run / layout.MASKS)
    assert main(["build", str(run), "--out", str(tmp_path / "plain"), "-q"]) == 0
    row = next(iter(load_dataset(str(tmp_path / "plain"), "failed", split="train", streaming=True)))
    assert row["edit_mask"] is None and row["region_mask"] is None
    card = (tmp_path / "plain" / "README.md").read_text()
    assert "In this build they are null" in card and "--source-images" in card
