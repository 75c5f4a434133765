"""A dataset folder made hostile after its build: `load_medbanana` and `medbanana export medebench` read only the
regular shard files in the folder the user named, whatever its card says; a card or a shard footer they cannot read
is one line (exit 2 from the command line), never a traceback.

Each case is a real copy of a built folder changed as an attacker would; an `outside` folder beside it holds a
valid shard whose instructions carry a marker, which must never reach a loaded row or an export."""

import io
import json
import shutil
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image, PngImagePlugin

from medbanana.loaders import load_medbanana

MARKER = "OUTSIDE-SECRET-7f3a"
SHARD = "train-00000-of-00001.parquet"


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """A small build (sources embedded, so it exports), and an `outside` copy of its sft shard, marked."""
    from medbanana.builder.build import build
    from medbanana.builder.synthetic_run import make_synthetic_run

    root = tmp_path_factory.mktemp("hostile-folders")
    make_synthetic_run(root / "run", flavor="ours", tasks_per_folder=3, image_size=40,
                       sources_dir=root / "sources", seed=5)
    build([root / "run"], root / "dataset", source_images=root / "sources", quiet=True)
    table = pq.read_table(root / "dataset" / "sft" / SHARD)
    marked = table.set_column(table.column_names.index("instruction"), "instruction",
                              pa.array([MARKER] * table.num_rows, pa.string()))
    (root / "outside" / "sft").mkdir(parents=True)
    pq.write_table(marked, root / "outside" / "sft" / SHARD)
    return root


def copy(built: Path, tmp_path: Path) -> Path:
    folder = tmp_path / "dataset"
    shutil.copytree(built / "dataset", folder)
    return folder


def edit_card(folder: Path, old: str, new: str) -> None:
    card = folder / "README.md"
    text = card.read_text()
    assert old in text
    card.write_text(text.replace(old, new, 1))


def retarget_yaml(built, folder, relative):  # the card's data_files point out of the folder
    if relative:  # a marked shard beside the folder
        shutil.copytree(built / "outside", folder.parent / "outside")
    target = "../outside/sft/*.parquet" if relative else built / "outside" / "sft" / "*.parquet"
    edit_card(folder, "path: sft/train-*", f"path: {target}")


def set_metadata(shard: Path, value: bytes) -> None:
    table = pq.read_table(shard)
    pq.write_table(table.replace_schema_metadata({**table.schema.metadata, b"huggingface": value}), shard)


HOSTILE = {  # case -> (how the folder is changed, what the one line says)
    "yaml data_files absolute, own shards gone": (
        lambda b, f: (retarget_yaml(b, f, False), shutil.rmtree(f / "sft")), "has no sft parquet files"),
    "yaml data_files ../, own shards gone": (
        lambda b, f: (retarget_yaml(b, f, True), shutil.rmtree(f / "sft")), "has no sft parquet files"),
    "symlinked shard": (
        lambda b, f: ((f / "sft" / SHARD).unlink(), (f / "sft" / SHARD).symlink_to(b / "outside" / "sft" / SHARD)),
        "is a symbolic link"),
    "symlinked config folder": (
        lambda b, f: (shutil.rmtree(f / "sft"), (f / "sft").symlink_to(b / "outside" / "sft")),
        "sft is a symbolic link"),
    "extra symlinked test shard": (
        lambda b, f: (f / "sft" / "test-00000-of-00001.parquet").symlink_to(b / "outside" / "sft" / SHARD),
        "test-00000-of-00001.parquet is a symbolic link"),
    "a !!python tag": (
        lambda b, f: edit_card(f, "pretty_name:", "x: !!python/object/apply:os.system ['echo pwned']\npretty_name:"),
        "could not determine a constructor"),
    "malformed yaml": (lambda b, f: edit_card(f, "pretty_name:", "x: [unclosed\npretty_name:"), "YAML header"),
    "deeply nested yaml": (
        lambda b, f: edit_card(f, "pretty_name:", f"x: {'[' * 50000}{']' * 50000}\npretty_name:"), "RecursionError"),
    "deeply nested parquet metadata": (
        lambda b, f: set_metadata(f / "sft" / SHARD, b'{"info": {"features": ' + b"[" * 200000 + b"]" * 200000
                                  + b"}}"), "parquet metadata cannot be read"),
    "not parquet": (lambda b, f: (f / "sft" / SHARD).write_bytes(b"PAR1" + b"\0" * 64), "not a parquet file"),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", HOSTILE)
def test_export_refuses_a_hostile_folder_in_one_line(built, tmp_path, case):
    change, message = HOSTILE[case]
    folder = copy(built, tmp_path)
    change(built, folder)
    out = tmp_path / "export"
    result = subprocess.run([sys.executable, "-m", "medbanana", "export", "medebench", str(folder), "--out", str(out),
                             "--split", "train", "-q"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("medbanana export: error: ") and message in lines[0], lines
    assert "Traceback" not in result.stderr and "pwned" not in result.stdout
    assert not out.exists()  # nothing written
    with pytest.raises(ValueError, match=message.split(" (")[0]):
        load_medbanana(folder, "sft", split=None)


@pytest.mark.slow
def test_the_cards_own_files_and_side_files_are_never_followed(built, tmp_path):
    """The card's data_files point out of the folder and a `.huggingface.yaml` and `dataset_infos.json` say more:
    the folder's own shards load, and nothing of the outside one (loaded rows, exported metadata)."""
    folder = copy(built, tmp_path)
    retarget_yaml(built, folder, False)
    (folder / ".huggingface.yaml").write_text(f"configs:\n- config_name: sft\n  data_files: "
                                              f"{built / 'outside' / 'sft' / '*.parquet'}\n")
    (folder / "dataset_infos.json").write_text("[1,")  # would be a traceback if datasets read it
    (folder / "sft" / "notashard.parquet").symlink_to(built / "outside" / "sft" / SHARD)  # not a shard's name
    rows = load_medbanana(folder, "sft", split=None)
    assert list(rows) == ["train"] and MARKER not in rows["train"]["instruction"]
    assert rows["train"]["uid"] == load_medbanana(built / "dataset", "sft")["uid"]
    out = tmp_path / "export"
    result = subprocess.run([sys.executable, "-m", "medbanana", "export", "medebench", str(folder), "--out", str(out),
                             "--split", "train", "-q"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    metadata = (out / "editing" / "editing_metadata.json").read_text()
    assert MARKER not in metadata and len(json.loads(metadata)["samples"]) == rows["train"].num_rows


def test_a_data_files_argument_for_a_folder_is_refused(built):
    with pytest.raises(ValueError, match="split="):
        load_medbanana(built / "dataset", "sft", data_files=str(built / "outside" / "sft" / SHARD))


def png(levels: np.ndarray, text: bytes = b"") -> bytes:
    info = PngImagePlugin.PngInfo()
    if text:
        info.add_text("planted", text)
    buffer = io.BytesIO()
    Image.fromarray(levels.astype(np.uint8), mode="L").save(buffer, "PNG", pnginfo=info)
    return buffer.getvalue()


def bomb_png(side: int) -> bytes:
    """A PNG header claiming side x side grey pixels, no real data: refused before anything is decoded."""
    def chunk(kind, body):
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", side, side, 8, 0, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(b"\0" * (side + 1))) + chunk(b"IEND", b""))


@pytest.mark.slow
def test_export_skips_rows_whose_masks_are_not_masks_of_their_image(built, tmp_path):
    """A dataset whose sft masks were replaced: a 1x1 edit_mask is never stretched into a MedEBench mask, and grey
    levels, a text chunk, a bomb or a region_mask of another size skip their rows, counted by reason."""
    folder = copy(built, tmp_path)
    shard = folder / "sft" / SHARD
    table = pq.read_table(shard)
    rows = table.to_pylist()
    assert len(rows) >= 6 and all(r["edit_mask"] and r["region_mask"] for r in rows)
    size = Image.open(io.BytesIO(rows[0]["edited_image"]["bytes"])).size
    white = np.full(size[::-1], 255)
    planted = {0: ("edit_mask", png(np.full((1, 1), 255)), "unusable edit_mask: not the expected size"),
               1: ("edit_mask", png(np.arange(white.size).reshape(white.shape) % 256),
                   "unusable edit_mask: not binary"),
               2: ("edit_mask", png(white, MARKER.encode()), "unusable edit_mask: a chunk other than"),
               3: ("edit_mask", bomb_png(50000), "unusable edit_mask: too large"),
               4: ("region_mask", png(np.full((900, 17), 255)), "unusable region_mask: not the expected size")}
    for i, (column, data, _) in planted.items():
        if column == "region_mask":
            rows[i]["edit_mask"] = None
        rows[i][column] = {"bytes": data, "path": None}
    pq.write_table(pa.Table.from_pylist(rows, schema=table.schema), shard)
    out = tmp_path / "export"
    result = subprocess.run([sys.executable, "-m", "medbanana", "export", "medebench", str(folder), "--out", str(out),
                             "--split", "train", "-q"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    report = json.loads((out / "editing" / "medbanana-export.json").read_text())
    assert report["exported"] == len(rows) - len(planted)
    for i, (_, _, reason) in planted.items():
        (found,) = [r for r, uids in report["skipped"].items() if rows[i]["uid"] in uids]
        assert found.startswith(reason) and found in result.stderr
    for mask in (out / "editing" / "previous_mask").iterdir():  # what was exported is binary, the source's size
        levels = np.asarray(Image.open(mask))
        assert set(np.unique(levels)) <= {0, 255}
    for path in out.rglob("*"):
        assert not path.is_file() or MARKER.encode() not in path.read_bytes()
