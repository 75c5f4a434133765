"""`build` takes the masks a run stored beside each attempt image (medbanana-masks/{image}.edit.png / .region.png):
copied as they are, without sources; an unusable one is computed from the source (or null without it); the masks
folder and each mask are read like images, never from outside the run or the named folder.

The runs are written the way another machine writes them: a synthetic run of ours, its masks planted as files
(a rectangle no computation would give, so a copied mask is told from a computed one).
"""

import io
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from datasets import load_dataset
from medbanana.builder.synthetic_run import make_synthetic_run
from medbanana.cli import main
from medbanana.generation.masks import task_masks
from medbanana.generation.rundir import layout
from PIL import Image, PngImagePlugin

DATASET = "mimic_ours_cxr"
MARKER = "MEDBANANA-PLANTED-MASK-5d1e"


def png(mask: np.ndarray, mode: str = "L", text: str = "") -> bytes:
    info = PngImagePlugin.PngInfo()
    if text:
        info.add_text("planted", text)
    buffer = io.BytesIO()
    Image.fromarray(mask.astype(np.uint8) * 255).convert(mode).save(buffer, "PNG", pnginfo=info)
    return buffer.getvalue()


def rectangle(size: tuple[int, int], seed: int) -> np.ndarray:
    """A rectangle placed by `seed`: what no edit mask computed from these images would be."""
    mask = np.zeros(size[::-1], bool)
    mask[seed % 5: seed % 5 + 7, 3: 3 + 1 + seed % 9] = True
    return mask


def attempt_images(run: Path) -> list[str]:
    found = []
    for _, _, folder in layout.find_output_dirs(run):
        for record in json.loads((folder / layout.ALL_CONVERSATIONS).read_text()).values():
            found += [r["image"] for r in record["rounds"] if r.get("image") and (run / r["image"]).is_file()]
    return found


def plant_masks(run: Path) -> dict[str, tuple[bytes, bytes]]:
    """Each attempt image's stored masks, as the run writes them; {image: (edit PNG, region PNG)}."""
    planted = {}
    for n, image in enumerate(attempt_images(run)):
        with Image.open(run / image) as im:
            size = im.size
        edit_rel, region_rel = layout.mask_relpaths(image)
        planted[image] = (png(rectangle(size, n)), png(rectangle(size, n + 1)))
        for rel, data in zip((edit_rel, region_rel), planted[image]):
            (run / rel).parent.mkdir(parents=True, exist_ok=True)
            (run / rel).write_bytes(data)
    return planted


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("run-masks")
    make_synthetic_run(root / "run", flavor="ours", tasks_per_folder=4, datasets=(DATASET,), image_size=48,
                       sources_dir=root / "sources", seed=3)
    return root


@pytest.fixture
def run(base, tmp_path) -> Path:
    shutil.copytree(base / "run", tmp_path / "run", symlinks=True)
    return tmp_path / "run"


def build(tmp_path, capsys, *args, out="out") -> tuple[int, str, Path]:
    target = tmp_path / out
    code = main(["build", *map(str, args), "--out", str(target), "-q"])
    return code, capsys.readouterr().err, target


def rows(out: Path, config: str = "failed") -> list[dict]:
    return list(load_dataset(str(out), config, split="train"))


def mask_bytes(value) -> bytes:
    buffer = io.BytesIO()
    value.save(buffer, "PNG")
    return buffer.getvalue()


def test_stored_masks_are_copied_as_they_are_without_sources(run, tmp_path, capsys):
    planted = plant_masks(run)
    code, err, out = build(tmp_path, capsys, run, "--configs", "failed,sft")
    assert code == 0, err
    table = rows(out)
    assert table and all(r["edit_mask"] is not None and r["region_mask"] is not None for r in table if r["edited_image"] is not None)
    import pyarrow.parquet as pq

    stored = pq.read_table(next((out / "failed").glob("*.parquet"))).to_pylist()
    for row in stored:
        edit, region = planted[row["edited_image"]["path"]]
        assert row["edit_mask"]["bytes"] == edit  # the run's own bytes, not a computed mask
        assert row["region_mask"]["bytes"] in {r for _, r in planted.values()}
    info = json.loads((out / "medbanana-build.json").read_text())
    assert info["stats"]["edit_masks"] == {"stored": len(planted)}
    assert info["mask_method"] is not None
    assert f"{len(planted):,} were stored by the run" in (out / "README.md").read_text()


def test_unusable_stored_masks_are_computed_from_sources_or_null_without(run, base, tmp_path, capsys):
    planted = plant_masks(run)
    images = sorted(planted)
    wrong_size, rgb, not_png = images[:3]
    (run / layout.mask_relpaths(wrong_size)[0]).write_bytes(png(np.ones((5, 5), bool)))
    (run / layout.mask_relpaths(rgb)[0]).write_bytes(png(rectangle((48, 48), 0), mode="RGB"))
    (run / layout.mask_relpaths(not_png)[0]).write_bytes((run / not_png).read_bytes())  # the edit itself, a JPEG
    code, err, out = build(tmp_path, capsys, run, "--configs", "failed", "--source-images", base / "sources")
    assert code == 0, err
    info = json.loads((out / "medbanana-build.json").read_text())
    assert info["stats"]["edit_masks"] == {"stored": len(planted) - 3, "computed": 3, "rejected": 3}

    import pyarrow.parquet as pq

    by_image = {r["edited_image"]["path"]: r for r in
                pq.read_table(next((out / "failed").glob("*.parquet"))).to_pylist()}
    for image in (wrong_size, rgb, not_png):
        row = by_image[image]
        computed = task_masks({image: row["edited_image"]}, row["source_image"], None, row["disease"])
        assert row["edit_mask"]["bytes"] == computed.edits[image]["bytes"]
    code, err, plain = build(tmp_path, capsys, run, "--configs", "failed", out="plain")
    assert code == 0, err
    info = json.loads((plain / "medbanana-build.json").read_text())
    assert info["stats"]["edit_masks"] == {"stored": len(planted) - 3, "missing": 3, "rejected": 3}
    nulls = {r["edited_image"]["path"] for r in pq.read_table(next((plain / "failed").glob("*.parquet"))).to_pylist()
             if r["edit_mask"] is None}
    assert nulls == {wrong_size, rgb, not_png}


def test_a_run_without_masks_built_without_sources_has_null_masks_and_says_so(run, tmp_path, capsys):
    code, err, out = build(tmp_path, capsys, run, "--configs", "failed")
    assert code == 0, err
    assert all(r["edit_mask"] is None and r["region_mask"] is None for r in rows(out))
    assert "In this build they are null" in (out / "README.md").read_text()


def planted_outside(tmp_path: Path, run: Path) -> Path:
    """A copy of the run's masks tree outside the run, each mask carrying MARKER."""
    outside = tmp_path / "outside-masks"
    for image in attempt_images(run):
        with Image.open(run / image) as im:
            size = im.size
        for rel in layout.mask_relpaths(image):
            target = outside / rel.removeprefix(layout.MASKS + "/")
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(png(rectangle(size, 1), text=MARKER))
    return outside


def no_marker(out: Path) -> None:
    import pyarrow.parquet as pq

    for path in out.rglob("*.parquet"):
        for row in pq.read_table(path).to_pylist():
            for value in (row.get("edit_mask"), row.get("region_mask")):
                assert value is None or MARKER.encode() not in value["bytes"]


def test_a_masks_folder_linking_out_of_the_run_is_refused(run, tmp_path, capsys):
    (run / layout.MASKS).symlink_to(planted_outside(tmp_path, run), target_is_directory=True)
    code, err, out = build(tmp_path, capsys, run, "--configs", "failed")
    assert code != 0 and len(err.strip().splitlines()) == 1 and "outside" in err and layout.MASKS in err, err
    assert not out.exists()
    # --unsafe skip leaves the masks folder out (listed), not the tasks: they are built with null masks
    code, err, out = build(tmp_path, capsys, run, "--configs", "failed", "--unsafe", "skip", out="skipped")
    assert code == 0, err
    no_marker(out)
    refused = json.loads((out / "medbanana-build.json").read_text())["stats"]["refused"]
    assert refused["tasks_left_out"] == 0 and any(layout.MASKS in item for item in refused["items"])
    table = rows(out)
    assert table and all(r["edit_mask"] is None for r in table)


def test_a_stored_mask_linking_outside_is_refused_and_never_read(run, tmp_path, capsys):
    plant_masks(run)
    outside = planted_outside(tmp_path, run)
    image = sorted(attempt_images(run))[0]
    link = run / layout.mask_relpaths(image)[0]
    link.unlink()
    link.symlink_to(outside / layout.mask_relpaths(image)[0].removeprefix(layout.MASKS + "/"))
    code, err, out = build(tmp_path, capsys, run, "--configs", "failed")
    assert code != 0 and "outside" in err and Path(image).name in err, err
    code, err, out = build(tmp_path, capsys, run, "--configs", "failed,sft", "--unsafe", "skip", out="skipped")
    assert code == 0, err
    no_marker(out)
    refused = json.loads((out / "medbanana-build.json").read_text())["stats"]["refused"]
    assert refused["tasks_left_out"] == 1


def test_a_build_of_one_named_folder_reads_its_masks_mirror_only(run, tmp_path, capsys):
    planted = plant_masks(run)
    folder = f"{DATASET}-edit"
    code, err, out = build(tmp_path, capsys, run / folder, "--configs", "failed")
    assert code == 0, err
    info = json.loads((out / "medbanana-build.json").read_text())
    mine = [image for image in planted if image.startswith(folder + "/") or image.startswith(folder + "-failed/")]
    assert info["stats"]["edit_masks"] == {"stored": len(mine)}
    # a mask in the mirror that links to another folder's mask leads outside the named folder: refused
    other = next(image for image in planted if image.startswith(f"{DATASET}-remove"))
    link = run / layout.mask_relpaths(mine[0])[0]
    link.unlink()
    link.symlink_to(run / layout.mask_relpaths(other)[0])
    code, err, _ = build(tmp_path, capsys, run / folder, "--configs", "failed", out="again")
    assert code != 0 and "outside" in err, err
