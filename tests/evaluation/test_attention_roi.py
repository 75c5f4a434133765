"""Attention IoU against the dataset's edit_mask, on the path a user takes: a tiny InstructPix2Pix pipeline saved
with save_pretrained and loaded by path, `medbanana generate --editor diffusers --diffusers-attention` (simulator
writer and judge), `medbanana build --source-images`, then `medbanana eval DATASET --attention-run RUN`."""

from __future__ import annotations

import io
import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

pytest.importorskip("diffusers", reason="the diffusers editor needs `pip install 'medbanana[train]'`")

from medbanana.cli import main  # noqa: E402
from medbanana.generation.backends.attention import MASK_KEY, iou, region_mask  # noqa: E402
from medbanana.generation.raster import decode_mask, encode_mask  # noqa: E402
from medbanana.generation.records import decode_rgb  # noqa: E402
from medbanana.generation.rundir import layout  # noqa: E402


@pytest.fixture
def chest_sources(tmp_path):
    """Smooth synthetic chest radiographs (lungs dark on a bright body, faint noise) in the input layout: the tiny
    pipeline's edits differ from them well beyond their noise, so each edit_mask is neither empty nor full."""
    from fake_runs import chest_source

    root = tmp_path / "sources"
    for folder, stem in (("normal", "n0"), ("normal", "n1"), ("Pneumothorax", "p0")):
        (root / "MIMIC_tiny" / folder).mkdir(parents=True, exist_ok=True)
        chest_source(root / "MIMIC_tiny" / folder, size=96).path.rename(root / "MIMIC_tiny" / folder / f"{stem}.jpeg")
    return root


@pytest.fixture
def attention_run(chest_sources, tmp_path, capsys):
    from medbanana.dpo.tiny import tiny_instruct_pix2pix

    words = ["add a pneumothorax to this chest x-ray", "remove the pneumothorax"]
    tiny_instruct_pix2pix(words, resolution=64).save_pretrained(tmp_path / "tiny-ip2p")
    run_dir = tmp_path / "run"
    code = main(["generate", "--sources", str(chest_sources), "--out", str(run_dir), "--diseases", "Pneumothorax",
                 "--editor", "diffusers", "--editor-model", str(tmp_path / "tiny-ip2p"), "--diffusers-steps", "2",
                 "--diffusers-resolution", "64", "--device", "cpu", "--max-rounds", "1", "--diffusers-attention",
                 "-q"])
    assert code == 0, capsys.readouterr().err
    return run_dir


def recorded_rounds(run_dir) -> dict[str, dict]:
    """uid#round -> the round's details, read straight from the run's files."""
    out = {}
    for _, _, folder in layout.find_output_dirs(run_dir):
        for conversation in json.loads((folder / layout.ALL_CONVERSATIONS).read_text()).values():
            for round_ in conversation["rounds"]:
                out[f"{conversation['uid']}#{round_['round']}"] = round_["edit_result"]["details"]
    return out


def column_mask(row: dict, column: str) -> np.ndarray:
    with Image.open(io.BytesIO(row[column]["bytes"])) as image:
        return np.asarray(image.convert("L")) > 127


def by_hand(a: np.ndarray, b: np.ndarray) -> float:
    assert a.shape == b.shape
    union = np.logical_or(a, b).sum()
    return 1.0 if union == 0 else round(float(np.logical_and(a, b).sum() / union), 4)


@pytest.mark.slow
def test_the_editor_records_its_attention_mask_at_the_source_size(attention_run, chest_sources):
    rounds = recorded_rounds(attention_run)
    assert len(rounds) == 3  # two adds, one remove; one round each
    for uid_round, details in rounds.items():
        grounding = details["attention"]
        stem = uid_round.split("/")[-1].split("-")[0]
        source = next(chest_sources.rglob(f"{stem}.jp*g"))
        height, width = decode_rgb(source.read_bytes()).shape[:2]
        mask = decode_mask(grounding[MASK_KEY])
        assert mask.shape == (height, width) and mask.dtype == bool
        # the generation-time IoU is the recorded mask's, against the task's grown region
        roi = region_mask(decode_rgb(source.read_bytes()), "chest_xray", "Pneumothorax")
        assert grounding["roi"] == "region" and grounding["iou"] == round(iou(mask, roi), 4)


def half_edit_masks(config_dir) -> None:
    """Every row's edit_mask made its left half. The tiny random pipeline changes the whole image, which the
    build's noise estimate leaves as an empty edit_mask; against an empty mask every IoU is 0 and proves nothing."""
    for path in sorted(config_dir.rglob("*.parquet")):
        table = pq.read_table(path)
        masks = []
        for row in table.to_pylist():
            height, width = column_mask(row, "edit_mask").shape
            half = np.zeros((height, width), np.uint8)
            half[:, : width // 2] = 255
            buffer = io.BytesIO()
            Image.fromarray(half).save(buffer, "PNG")
            masks.append({"bytes": buffer.getvalue(), "path": None})
        index = table.schema.get_field_index("edit_mask")
        field = table.schema.field(index)
        pq.write_table(table.set_column(index, field, pa.array(masks, type=field.type)), path)


@pytest.mark.slow
def test_eval_scores_the_recorded_mask_against_the_datasets_edit_mask(attention_run, chest_sources, tmp_path,
                                                                      capsys):
    dataset = tmp_path / "dataset"
    assert main(["build", str(attention_run), "--out", str(dataset), "--source-images", str(chest_sources),
                 "-q"]) == 0
    capsys.readouterr()
    half_edit_masks(dataset / "judge")
    out = tmp_path / "eval"
    assert main(["eval", str(dataset), "--config", "judge", "--attention-run", str(attention_run), "--out", str(out),
                 "--judge", "none", "--no-lpips", "-q"]) == 0
    printed = capsys.readouterr().out
    assert "attention Pneumothorax: n 3," in printed and "(roi: edit_mask 3)" in printed
    report = json.loads((out / "attention.json").read_text())
    assert report["by_disease"]["Pneumothorax"]["roi"] == {"edit_mask": 3}

    rows = pq.read_table(sorted((dataset / "judge").rglob("*.parquet"))).to_pylist()
    rounds = recorded_rounds(attention_run)
    by_id = {r["id"]: r for r in report["samples"]}
    assert len(by_id) == len(rows) == 3
    for row in rows:
        attention = decode_mask(rounds[f"{row['uid']}#{row['round']}"]["attention"][MASK_KEY])
        assert 0 < attention.sum() < attention.size
        record = by_id[f"{row['uid']}#{row['round']}"]
        edit = column_mask(row, "edit_mask")
        assert 0 < edit.sum() < edit.size  # a partial mask: an IoU computed against anything else would differ
        assert record["roi"] == "edit_mask" and record["iou"] == by_hand(attention, edit)

    # --roi region: the same masks against the task's region (the dataset's region_mask), said so
    out = tmp_path / "eval-region"
    assert main(["eval", str(dataset), "--config", "judge", "--attention-run", str(attention_run), "--out", str(out),
                 "--roi", "region", "--judge", "none", "--no-lpips", "-q"]) == 0
    assert "(roi: region 3)" in capsys.readouterr().out
    by_id = {r["id"]: r for r in json.loads((out / "attention.json").read_text())["samples"]}
    for row in rows:
        attention = decode_mask(rounds[f"{row['uid']}#{row['round']}"]["attention"][MASK_KEY])
        region = column_mask(row, "region_mask")
        assert 0 < region.sum() < region.size
        assert by_id[f"{row['uid']}#{row['round']}"]["iou"] == by_hand(attention, region)
    # a dataset holds no attention: without the run it came from, one clear line before anything is scored
    code = main(["eval", str(dataset), "--config", "judge", "--attention", "--out", str(tmp_path / "eval-none"),
                 "--judge", "none", "-q"])
    err = capsys.readouterr().err
    assert code == 2 and "--attention-run RUN_DIR" in err and "Traceback" not in err
    assert not (tmp_path / "eval-none" / "samples.jsonl").exists()


def test_mask_text_round_trips_and_rejects_garbage():
    mask = np.zeros((5, 7), bool)
    mask[1:3, 2:6] = True
    assert np.array_equal(decode_mask(encode_mask(mask)), mask)
    assert decode_mask(encode_mask(mask), (14, 10)).shape == (10, 14)
    with pytest.raises(ValueError, match="not a base64 mask image"):
        decode_mask("not base64 at all!")
