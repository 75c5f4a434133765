"""Stored masks made hostile (medbanana-masks/ of a run written elsewhere): every one that is not a binary PNG mask of
its image's size is rejected on read, counted with its path in medbanana-build.json and the card, and computed from
the source (or left null without it); never embedded. A 300 MB file is not read, a decompression bomb not decoded;
a folder or a FIFO where a mask or an image should be is a counted problem naming its path, never an abort or a
hang. The build runs as a real process, so that its peak memory can be measured."""

import io
import json
import os
import shutil
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import datasets
import numpy as np
import pyarrow.parquet as pq
import pytest
from PIL import Image
from test_run_masks import DATASET, attempt_images, plant_masks, png, rectangle

from medbanana.builder.synthetic_run import make_synthetic_run
from medbanana.generation.mask_check import mask_problem
from medbanana.generation.rundir import layout

MARKER = b"MEDBANANA-HOSTILE-MASK-91c2"
SIZE = 48  # the synthetic run's images and sources


def chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def bomb(width: int, height: int) -> bytes:
    """A small PNG claiming width x height grey pixels (its data compresses to almost nothing)."""
    raw = zlib.compressobj(9)
    data = b"".join(raw.compress(b"\0" * (width + 1)) for _ in range(min(height, 16))) + raw.flush()
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0))
            + chunk(b"IDAT", data) + chunk(b"IEND", b""))


def grey_levels(size) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray((np.arange(size[0] * size[1]) % 256).astype(np.uint8).reshape(size[::-1])).save(buffer, "PNG")
    return buffer.getvalue()


def with_text(data: bytes, text: bytes) -> bytes:
    """`data` with a tEXt chunk after IHDR."""
    return data[:33] + chunk(b"tEXt", b"planted\0" + text) + data[33:]


EDIT_CASES = {  # stored edit mask -> the kind counted
    "grey levels": (lambda: grey_levels((SIZE, SIZE)), "not binary"),
    "truncated": (lambda: png(rectangle((SIZE, SIZE), 1))[:-30], "truncated or corrupt"),
    "bad crc": (lambda: (lambda d: d[:45] + bytes([d[45] ^ 0xFF]) + d[46:])(png(rectangle((SIZE, SIZE), 1))),
                "truncated or corrupt"),
    "text chunk": (lambda: with_text(png(rectangle((SIZE, SIZE), 1)), MARKER * 100), "a chunk other than"),
    "1 MB text chunk": (lambda: with_text(png(rectangle((SIZE, SIZE), 1)), MARKER * 40000), "too large"),
    "bomb": (lambda: bomb(60000, 60000), "too large"),
    "wrong size": (lambda: png(np.ones((1, 1), bool)), "not the expected size"),
}


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("hostile-masks")
    make_synthetic_run(root / "run", flavor="ours", tasks_per_folder=3, datasets=(DATASET,), image_size=SIZE,
                       sources_dir=root / "sources", seed=4)
    return root


# runs a command and prints the peak memory of it and its own children (KB), which it waits for
PEAK = ("import resource, subprocess, sys; code = subprocess.call(sys.argv[1:]); "
        "print(f'PEAK_KB={resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss}'); sys.exit(code)")


def build(run: Path, out: Path, *extra) -> tuple[subprocess.CompletedProcess, int]:
    """`medbanana build` as a process; its result and the peak memory of it and its workers (KB)."""
    result = subprocess.run([sys.executable, "-c", PEAK, sys.executable, "-m", "medbanana", "build", str(run),
                             "--out", str(out), "-q", "--configs", "failed,sft", *map(str, extra)],
                            capture_output=True, text=True, timeout=300)
    return result, int(result.stdout.rsplit("PEAK_KB=", 1)[1])


def rows(out: Path) -> dict[str, dict]:
    """Attempt image -> its row (failed and accepted attempts)."""
    return {r["edited_image"]["path"]: r for config in ("failed", "sft") for shard in (out / config).glob("*.parquet")
            for r in pq.read_table(shard).to_pylist()}


def assert_no_marker(out: Path) -> None:
    for path in out.rglob("*"):
        if path.is_file():
            assert MARKER not in path.read_bytes(), path


@pytest.mark.slow
@pytest.mark.parametrize("with_sources", [True, False], ids=["sources", "no-sources"])
def test_bad_stored_edit_masks_are_rejected_counted_and_recomputed_or_null(base, tmp_path, with_sources):
    run = tmp_path / "run"
    shutil.copytree(base / "run", run)
    planted = plant_masks(run)
    images = sorted(planted)
    hostile = dict(zip(images, EDIT_CASES))
    for image, case in hostile.items():
        (run / layout.mask_relpaths(image)[0]).write_bytes(EDIT_CASES[case][0]())
    big = images[len(hostile)]  # 300 MB (sparse): refused on its size, never read
    with open(run / layout.mask_relpaths(big)[0], "r+b") as fh:
        fh.truncate(300 * 2**20)
    folder = images[len(hostile) + 1]  # a folder where the mask goes
    (run / layout.mask_relpaths(folder)[0]).unlink()
    (run / layout.mask_relpaths(folder)[0]).mkdir()
    fifo = images[len(hostile) + 2]
    (run / layout.mask_relpaths(fifo)[0]).unlink()
    os.mkfifo(run / layout.mask_relpaths(fifo)[0])

    out = tmp_path / "out"
    result, peak_kb = build(run, out, *(["--source-images", base / "sources"] if with_sources else []))
    assert result.returncode == 0, result.stderr
    assert peak_kb < 1_000_000, f"the build peaked at {peak_kb / 1e6:.2f} GB"
    bad = {*hostile, big, folder, fifo}
    stats = json.loads((out / "medbanana-build.json").read_text())["stats"]
    good = len(planted) - len(bad)
    assert stats["edit_masks"] == {"stored": good, "rejected": len(bad),
                                   **({"computed": len(bad)} if with_sources else {"missing": len(bad)})}
    rejected = stats["rejected_masks"]
    assert rejected["count"] == len(bad)
    for case, (_, kind) in EDIT_CASES.items():
        assert any(k.startswith(kind) for k in rejected["by_reason"]), (case, rejected)
    assert rejected["by_reason"]["a folder or special file"] == 2 and rejected["by_reason"]["too large"] == 3
    for image in bad:  # each named by its path in the run
        assert any(item.startswith(f"run/{layout.mask_relpaths(image)[0]}: ") for item in rejected["examples"])
    card = (out / "README.md").read_text()
    assert f"rejected {len(bad)} stored edit masks" in card
    table = rows(out)
    for image in bad:
        mask = table[image]["edit_mask"]
        if with_sources:  # recomputed, and it is a mask
            assert mask is not None and mask_problem(mask["bytes"], (SIZE, SIZE)) is None
        else:
            assert mask is None
    for image in set(planted) - bad:
        assert table[image]["edit_mask"]["bytes"] == planted[image][0]
    assert_no_marker(out)


@pytest.mark.slow
@pytest.mark.parametrize("region", [(12000, 12000), (17, 900)], ids=["12000x12000", "17x900"])
def test_region_masks_of_another_size_are_rejected(base, tmp_path, region):
    run = tmp_path / "run"
    shutil.copytree(base / "run", run)
    planted = plant_masks(run)
    wrong = png(np.ones(region[::-1], bool)) if region[0] * region[1] < 1e6 else bomb(*region)
    for image in planted:
        (run / layout.mask_relpaths(image)[1]).write_bytes(wrong)
    for extra, counted in (([], None), (["--source-images", base / "sources"], "computed")):
        out = tmp_path / f"out-{bool(extra)}"
        result, peak_kb = build(run, out, *extra)
        assert result.returncode == 0, result.stderr
        assert peak_kb < 1_000_000
        stats = json.loads((out / "medbanana-build.json").read_text())["stats"]
        assert stats["edit_masks"]["region_rejected"] >= 1 and stats["edit_masks"]["stored"] == len(planted)
        regions = [r["region_mask"] for r in rows(out).values()]
        if counted:  # the source's region, computed
            assert all(r is not None and Image.open(io.BytesIO(r["bytes"])).size == (SIZE, SIZE) for r in regions)
        else:
            assert all(r is None for r in regions)


@pytest.mark.slow
def test_a_folder_where_an_image_should_be_is_counted_by_its_path(base, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(base / "run", run)
    image = sorted(attempt_images(run))[0]
    (run / image).unlink()
    (run / image).mkdir()
    out = tmp_path / "out"
    result, _ = build(run, out)
    assert result.returncode == 0 and "Errno" not in result.stderr, result.stderr
    stats = json.loads((out / "medbanana-build.json").read_text())["stats"]
    assert stats["missing_images"] == 1 and stats["missing_image_examples"] == [f"run/{image}"]


def test_medbanana50k_reads_stored_masks_through_the_same_checks(base, tmp_path):
    """The loading builder (medbanana_50k.py) over a run whose stored masks are hostile: none is embedded, and a
    warning counts them (a build lists them in medbanana-build.json)."""
    from medbanana.medbanana_50k import MedBanana50k

    run = tmp_path / "run"
    shutil.copytree(base / "run", run)
    planted = plant_masks(run)
    bad = sorted(planted)[:3]
    for image, case in zip(bad, ("grey levels", "text chunk", "wrong size")):
        (run / layout.mask_relpaths(image)[0]).write_bytes(EDIT_CASES[case][0]())
    builder = MedBanana50k(config_name="failed", data_dir=str(run), cache_dir=str(tmp_path / "cache"))
    with pytest.warns(UserWarning, match=r"3 stored mask\(s\) rejected"):
        builder.download_and_prepare()
    undecoded = builder.as_dataset(split="train")
    for column in ("edit_mask", "edited_image"):
        undecoded = undecoded.cast_column(column, datasets.Image(decode=False))
    table = {r["edited_image"]["path"]: r for r in undecoded}
    for image in planted:
        if image in table:
            mask = table[image]["edit_mask"]
            assert (mask is None) if image in bad else (mask["bytes"] == planted[image][0])
    assert any(image in table for image in bad)
