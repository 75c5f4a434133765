"""`medbanana export medebench`: the demo's built dataset in MedEBench's layout, read back the way MedEBench's own
evaluation scripts read it (github.com/mliuby/MedEBench, src/eval_metrics/): their metadata access, their file
paths, and their masked-SSIM / PSNR code path (PIL resizes, torchvision ToTensor / ToPILImage, scikit-image).

Their code is not installable here (no package; CLIP, MedCLIP and LPIPS weights need downloads), so
`medebench_traditional_metrics` below re-traces `compute_metrics` of traditional_metrics_eval.py step by step for
the metrics that need no weights (masked_ssim, psnr); CLIP, MedCLIP, LPIPS and the GPT-4o judge are not run.
"""

import io
import json
import os
import shutil
import sys

import datasets
import numpy as np
import pytest
from PIL import Image

from medbanana.cli import main
from medbanana.evaluation.metrics import cp_medebench
from medbanana.loaders import load_medbanana
from medbanana.loaders.medebench import NO_MASK, NO_SOURCE

THEIR_FIELDS = ["id", "Organ", "Task", "prompt", "rephrased_prompt", "detailed_prompt", "previous_image",
                "changed_image", "previous_mask", "url"]  # editing/editing_metadata.json, every sample
UNUSABLE = "unusable edit_mask: truncated or corrupt"  # the reason of row 5's (generation/mask_check.py)
HOSTILE = '../../../etc/passwd "quoted"\n<script>alert(1)</script> \u00e9\u4e2d'


def corrupt_rows(folder, edit_rows: set, region_rows: set, no_source: set, broken_mask: int, hostile: int):
    """Rewrite FOLDER's sft shard through the public datasets API, keeping the masks `medbanana build` computed
    where the plan says and breaking the rest, as a hand-edited or damaged dataset would be: row i keeps its
    edit_mask when i in `edit_rows`, its region_mask when i in `region_rows`; rows in `no_source` lose their
    source image; row `broken_mask` gets an edit_mask that is no image; row `hostile` a hostile uid and
    instruction."""
    (shard,) = (folder / "sft").glob("*.parquet")
    ds = datasets.Dataset.from_parquet(str(shard))
    for column in ("source_image", "edited_image", "edit_mask", "region_mask"):
        ds = ds.cast_column(column, datasets.Image(decode=False))
    assert all(row["edit_mask"] and row["region_mask"] for row in ds)  # the build computed both for every row

    def corrupted(row, i):
        update = {"edit_mask": row["edit_mask"] if i in edit_rows else None,
                  "region_mask": row["region_mask"] if i in region_rows else None}
        if i in no_source:
            update["source_image"] = None
        if i == broken_mask:
            update["edit_mask"] = {"bytes": b"\x89PNG\r\n\x1a\n truncated", "path": None}
        if i == hostile:
            update.update(uid=f"../{HOSTILE}", instruction=HOSTILE)
        return update

    ds.map(corrupted, with_indices=True, features=ds.features).cast_column(
        "edit_mask", datasets.Image()).cast_column("region_mask", datasets.Image()).to_parquet(str(shard))


@pytest.fixture
def corrupted_dataset(demo_dataset, tmp_path):
    folder = tmp_path / "dataset"
    shutil.copytree(demo_dataset, folder)
    rows = load_medbanana(demo_dataset, "sft").num_rows
    assert rows >= 6
    plan = {"edit_rows": set(range(rows)) - {1, 2, 3}, "region_rows": {1, 2, 4}, "no_source": {4}, "broken_mask": 5,
            "hostile": 0}
    corrupt_rows(folder, **plan)
    return folder, rows, plan


def medebench_traditional_metrics(image_dir: str, metadata_path: str) -> dict:
    """MedEBench's `compute_metrics` (src/eval_metrics/traditional_metrics_eval.py), step by step, for masked_ssim
    and psnr: its metadata access, its paths, its resizes and its torchvision / scikit-image calls."""
    torch = pytest.importorskip("torch")
    transforms = pytest.importorskip("torchvision.transforms")
    from skimage.metrics import peak_signal_noise_ratio as psnr
    from skimage.metrics import structural_similarity as ssim

    def image_to_numpy(img_tensor):
        return np.clip(np.array(transforms.ToPILImage()(img_tensor.cpu())), 0, 255).astype(np.uint8)

    with open(metadata_path, "r") as f:  # as theirs: no encoding named
        metadata = json.load(f)
    results, missing = {}, []
    for sample in metadata["samples"]:
        sample_id = sample["id"]
        filename = f"{sample_id}_0.png"
        ref_dir = os.path.dirname(metadata_path)
        edited_path = os.path.join(image_dir, filename)
        prev_path = os.path.join(ref_dir, "previous", f"{sample_id}.png")
        ref_path = os.path.join(ref_dir, "changed", f"{sample_id}.png")
        mask_path = os.path.join(ref_dir, "previous_mask", f"{sample_id}.png")
        if not all(os.path.exists(p) for p in [edited_path, ref_path, prev_path, mask_path]):
            missing.append(sample_id)
            continue
        prev_img_pil = Image.open(prev_path).convert("RGB")
        target_size = prev_img_pil.size
        edited_img_pil = Image.open(edited_path).convert("RGB").resize(target_size, Image.BICUBIC)
        ref_img_pil = Image.open(ref_path).convert("RGB").resize(target_size, Image.BICUBIC)
        mask_pil = Image.open(mask_path).convert("L").resize(target_size, Image.NEAREST)
        mask_tensor = transforms.ToTensor()(mask_pil).unsqueeze(0)
        inv_mask = 1.0 - mask_tensor
        to_tensor = transforms.ToTensor()
        edited_img, ref_img, prev_img = (to_tensor(im).unsqueeze(0) for im in (edited_img_pil, ref_img_pil,
                                                                              prev_img_pil))
        with torch.no_grad():
            edited_masked_np = image_to_numpy((edited_img * inv_mask).squeeze(0))
            prev_masked_np = image_to_numpy((prev_img * inv_mask).squeeze(0))
            ref_np, edited_np = image_to_numpy(ref_img.squeeze(0)), image_to_numpy(edited_img.squeeze(0))
        with np.errstate(divide="ignore"):  # identical images: psnr is inf, as in theirs
            results[sample_id] = {"masked_ssim": ssim(prev_masked_np, edited_masked_np, channel_axis=-1),
                                  "psnr": psnr(ref_np, edited_np)}
    return {"results": results, "missing": missing}


def rgb(path) -> np.ndarray:
    return np.asarray(Image.open(path).convert("RGB"))


@pytest.mark.slow
def test_medebench_scripts_read_the_export_and_score_it(demo_dataset, tmp_path, capsys):
    """The demo's dataset as `medbanana demo` builds it (sources attached, so every row has its computed masks)."""
    rows = load_medbanana(demo_dataset, "sft").num_rows
    base_dir = tmp_path / "MedEBench"  # --out plays their repository root
    assert main(["export", "medebench", str(demo_dataset), "--split", "train", "--out", str(base_dir), "-q"]) == 0
    out, err = capsys.readouterr()
    assert f"exported {rows} of {rows} sft rows" in out and f"edit_mask {rows})" in out and "skipped" not in err
    by_uid = {row["uid"]: row for row in load_medbanana(demo_dataset, "sft", decode_images=False)}

    metadata_path = str(base_dir / "editing" / "editing_metadata.json")
    samples = json.load(open(metadata_path))["samples"]
    assert [s["id"] for s in samples] == list(range(1, rows + 1))
    for sample in samples:
        assert THEIR_FIELDS == list(sample)[:len(THEIR_FIELDS)]
        row = by_uid[sample["uid"]]
        assert sample["prompt"] == sample["detailed_prompt"] == row["instruction"] and sample["roi"] == "edit_mask"
        # evaluate_gpt4o.py: os.path.join(base_dir, sample["previous_image"]); traditional: the id's file names
        for key, folder_name in (("previous_image", "previous"), ("changed_image", "changed"),
                                 ("previous_mask", "previous_mask")):
            assert os.path.join(base_dir, sample[key]) == os.path.join(os.path.dirname(metadata_path), folder_name,
                                                                      f"{sample['id']}.png")
        # lossless, and each file holds its own row's image; the mask is the row's edit_mask, as the build made it
        prev = rgb(base_dir / sample["previous_image"])
        assert np.array_equal(prev, rgb(io.BytesIO(row["source_image"]["bytes"])))
        assert np.array_equal(rgb(base_dir / sample["changed_image"]), rgb(io.BytesIO(row["edited_image"]["bytes"])))
        mask = np.asarray(Image.open(base_dir / sample["previous_mask"]))
        assert mask.shape == prev.shape[:2] and set(np.unique(mask)) <= {0, 255}
        built = Image.open(io.BytesIO(row["edit_mask"]["bytes"])).resize(prev.shape[1::-1], Image.NEAREST)
        assert np.array_equal(mask, np.asarray(built))
    written = sorted(str(p.relative_to(base_dir)) for p in base_dir.rglob("*") if p.is_file())
    assert written == sorted(["editing/editing_metadata.json", "editing/medbanana-export.json"]
                             + [f"editing/{d}/{s['id']}.png" for s in samples for d in
                                ("previous", "changed", "previous_mask")])

    # two "models" in their generated_images/<model>/<id>_0.png layout: one answers with the ground truth edit,
    # one returns its input unchanged
    for model, key in (("ground-truth", "changed_image"), ("no-op", "previous_image")):
        (base_dir / "generated_images" / model).mkdir(parents=True)
        for sample in samples:
            shutil.copy(base_dir / sample[key], base_dir / "generated_images" / model / f"{sample['id']}_0.png")
    truth = medebench_traditional_metrics(str(base_dir / "generated_images" / "ground-truth"), metadata_path)
    noop = medebench_traditional_metrics(str(base_dir / "generated_images" / "no-op"), metadata_path)
    assert truth["missing"] == noop["missing"] == [] and len(truth["results"]) == rows
    lower = 0
    for sample in samples:
        sid, prev = sample["id"], rgb(base_dir / sample["previous_image"])
        changed, mask = rgb(base_dir / sample["changed_image"]), np.asarray(Image.open(base_dir / sample["previous_mask"]))
        assert noop["results"][sid]["masked_ssim"] == pytest.approx(1.0)
        assert truth["results"][sid]["psnr"] == float("inf")
        # their masked SSIM is ours (`eval --cp-mode medebench`) on the same files
        assert truth["results"][sid]["masked_ssim"] == pytest.approx(cp_medebench(prev, changed, mask), abs=1e-6)
        # the mask sits on the edit: the same mask moved elsewhere leaves part of the edit outside it
        moved = np.roll(mask, (mask.shape[0] // 2, mask.shape[1] // 2), axis=(0, 1))
        lower += truth["results"][sid]["masked_ssim"] > cp_medebench(prev, changed, moved)
    assert lower >= 0.9 * rows, (lower, rows)


def test_rows_without_a_usable_mask_or_source_are_skipped_with_the_reason(corrupted_dataset, tmp_path, capsys):
    folder, rows, _ = corrupted_dataset
    base_dir = tmp_path / "MedEBench"
    assert main(["export", "medebench", str(folder), "--split", "train", "--out", str(base_dir), "-q"]) == 0
    out, err = capsys.readouterr()
    exported = rows - 3  # row 3: neither mask; row 4: masks but no source; row 5: an edit_mask that is no image
    assert f"exported {exported} of {rows} sft rows" in out and f"edit_mask {rows - 5}, region_mask 2" in out
    for reason in (NO_MASK, NO_SOURCE, UNUSABLE):
        assert f"skipped 1 row(s): {reason}" in err
    report = json.loads((base_dir / "editing" / "medbanana-export.json").read_text())
    import pyarrow.parquet as pq  # the rewritten shard itself, as written

    (shard,) = (folder / "sft").glob("*.parquet")
    by_uid = {row["uid"]: row for row in pq.read_table(shard).to_pylist()}
    uids = list(by_uid)
    assert report["skipped"] == {NO_MASK: [uids[3]], NO_SOURCE: [uids[4]], UNUSABLE: [uids[5]]}
    metadata_path = base_dir / "editing" / "editing_metadata.json"
    samples = json.loads(metadata_path.read_text())["samples"]
    for sample in samples:  # a row without its edit_mask falls back to its region_mask
        assert sample["roi"] == ("edit_mask" if by_uid[sample["uid"]]["edit_mask"] else "region_mask")
    hostile = next(s for s in samples if s["uid"] == f"../{HOSTILE}")
    assert hostile["prompt"] == HOSTILE and hostile["id"] == 1  # text stays text, in the JSON only
    assert json.loads(open(metadata_path, encoding="ascii").read())["samples"][0]["prompt"] == HOSTILE
    assert sorted(p.name for p in (base_dir / "editing" / "previous_mask").iterdir()) == [
        f"{s['id']}.png" for s in sorted(samples, key=lambda s: str(s["id"]))]


def test_a_dataset_without_masks_is_refused_with_the_reason(demo_run_root, tmp_path, capsys):
    import shutil

    from medbanana.generation.rundir import layout

    # a run that stored no masks (a released one), built without --source-images: the masks are null
    run = shutil.copytree(demo_run_root / "demo-run" / "run", tmp_path / "run", symlinks=True)
    shutil.rmtree(run / layout.MASKS)
    plain = tmp_path / "plain"
    assert main(["build", str(run), "--out", str(plain), "-q"]) == 0
    rows = load_medbanana(plain, "sft").num_rows
    capsys.readouterr()
    code = main(["export", "medebench", str(plain), "--split", "train", "--out", str(tmp_path / "out"), "-q",
                 "--source-images", str(demo_run_root / "demo-run" / "sources")])  # sources, yet no masks
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert f"nothing to export: all {rows} sft rows" in err and f"{rows} {NO_MASK}" in err
    assert not (tmp_path / "out").exists()


def test_source_images_fill_a_dataset_built_without_them(corrupted_dataset, demo_run_root, tmp_path, capsys):
    folder, rows, _ = corrupted_dataset
    sources = demo_run_root / "demo-run" / "sources"
    assert main(["export", "medebench", str(folder), "--split", "train", "--out", str(tmp_path / "out"), "-q",
                 "--source-images", str(sources)]) == 0
    assert f"exported {rows - 2} of {rows} sft rows" in capsys.readouterr().out  # row 4 is back; rows 3 and 5 not


def test_out_is_new_or_empty_unless_forced_and_force_replaces_only_editing(corrupted_dataset, tmp_path, capsys):
    folder, _, _ = corrupted_dataset
    checkout = tmp_path / "MedEBench"
    (checkout / "src" / "eval_metrics").mkdir(parents=True)
    (checkout / "src" / "eval_metrics" / "keep.py").write_text("kept")
    (checkout / "editing" / "previous").mkdir(parents=True)
    (checkout / "editing" / "previous" / "9999.png").write_bytes(b"stale")
    argv = ["export", "medebench", str(folder), "--split", "train", "--out", str(checkout), "-q"]
    assert main(argv) == 2
    assert "is not empty" in capsys.readouterr().err and (checkout / "editing" / "previous" / "9999.png").exists()
    assert main(argv + ["--force"]) == 0
    assert (checkout / "src" / "eval_metrics" / "keep.py").read_text() == "kept"
    assert not (checkout / "editing" / "previous" / "9999.png").exists()
    assert (checkout / "editing" / "editing_metadata.json").is_file()
    assert sorted(p.name for p in checkout.iterdir()) == ["editing", "src"]  # no staging or lock file left


@pytest.mark.parametrize("where,message", [
    (lambda folder, tmp: folder / "export", "is inside the input"),
    (lambda folder, tmp: tmp / "file.txt", "is not a folder"),
])
def test_refused_outs_write_nothing(corrupted_dataset, tmp_path, capsys, where, message):
    folder, _, _ = corrupted_dataset
    (tmp_path / "file.txt").write_text("x")
    out = where(folder, tmp_path)
    before = sorted(str(p) for p in folder.rglob("*"))
    assert main(["export", "medebench", str(folder), "--split", "train", "--out", str(out), "-q"]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1
    assert sorted(str(p) for p in folder.rglob("*")) == before


def test_an_editing_link_in_out_is_refused(corrupted_dataset, tmp_path, capsys):
    folder, _, _ = corrupted_dataset
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "editing").symlink_to(elsewhere)
    assert main(["export", "medebench", str(folder), "--split", "train", "--out", str(tmp_path / "out"), "--force",
                 "-q"]) == 2
    assert "is not a folder" in capsys.readouterr().err and not any(elsewhere.iterdir())


def test_export_help_explains_the_layout(capsys):
    with pytest.raises(SystemExit):
        main(["export", "medebench", "--help"])
    out = capsys.readouterr().out
    assert "editing_metadata.json" in out and "previous_mask" in out and "--force" in out


def test_the_command_line_does_not_import_datasets():
    import subprocess

    code = "import sys; from medbanana.cli import build_parser; build_parser(); print('datasets' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True).stdout.strip() == "False"


@pytest.mark.slow
def test_more_threads_write_the_same_export(demo_dataset, tmp_path):
    """PNGs encoded on several threads land under the ids the rows were given, in order, byte for byte."""
    exports = {}
    for threads in (1, 3):
        out = tmp_path / f"threads-{threads}"
        assert main(["export", "medebench", str(demo_dataset), "--split", "train", "--out", str(out), "-q",
                     "--threads", str(threads)]) == 0
        folder = out / "editing"
        exports[threads] = {p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*") if p.is_file()}
    assert len(exports[1]) == 3 * len(json.loads(exports[1]["editing_metadata.json"])["samples"]) + 2
    assert exports[3] == exports[1]


def test_the_test_split_is_exported_by_default_and_a_dataset_without_one_is_refused_with_the_fix(
        demo_run_root, demo_dataset, tmp_path, capsys):
    """A benchmark scores held-out rows: `export medebench` takes the `test` split unless told otherwise; the demo's
    dataset (train only) is refused naming both ways on, and one built with --test-fraction exports its test rows."""
    assert main(["export", "medebench", str(demo_dataset), "--out", str(tmp_path / "refused"), "-q"]) == 2
    err = capsys.readouterr().err
    assert "has no test split (its sft rows are all in train)" in err and "--test-fraction 0.1" in err
    assert "--split train" in err and err.count("\n") == 1 and not (tmp_path / "refused").exists()
    demo = demo_run_root / "demo-run"
    split = tmp_path / "split"
    assert main(["build", str(demo / "run"), "--out", str(split), "--test-fraction", "0.5", "--source-images",
                 str(demo / "sources"), "--configs", "sft", "-q"]) == 0
    rows = load_medbanana(split, "sft", split=None, decode_images=False)
    test_uids = set(rows["test"]["uid"])
    assert test_uids and rows["train"].num_rows  # both splits hold rows
    capsys.readouterr()
    assert main(["export", "medebench", str(split), "--out", str(tmp_path / "bench"), "-q"]) == 0
    samples = json.loads((tmp_path / "bench" / "editing" / "editing_metadata.json").read_text())["samples"]
    assert {s["uid"] for s in samples} <= test_uids and {s["split"] for s in samples} == {"test"}
    assert main(["export", "medebench", str(split), "--split", "validation", "--out", str(tmp_path / "v"),
                 "-q"]) == 2
    assert "has no validation split; its sft splits: test, train" in capsys.readouterr().err
