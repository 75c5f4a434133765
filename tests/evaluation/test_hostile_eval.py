"""`medbanana eval` against a hostile dataset and a hostile `--attention-run`: every per-sample failure (a truncated
or bomb edit_mask, a bomb attention mask, an attention that is no object, an iou out of range) stays that sample's
error, a run file that cannot be read is left out and listed; no traceback, ever, and none after report.md is
written. What cannot be read at all (an `--attention-run` that is a file, a shard that is a symlink) is refused in
one line before anything is written.

The run is a synthetic one whose rounds are given recorded attention (as `generate --diffusers-attention` records
it) by editing its JSON, as another machine's files would come; the CLI runs as a real process."""

import base64
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

from medbanana.generation.raster import encode_mask
from medbanana.generation.rundir import layout

SIZE = 40
MARKER = "OUTSIDE-SECRET-e41b"


def chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def bomb(side: int) -> bytes:
    """A PNG claiming side x side grey pixels in a few hundred bytes."""
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", side, side, 8, 0, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(b"\0" * (side + 1) * 8)) + chunk(b"IEND", b""))


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """A run whose every round recorded attention (a full mask at the source's size, IoU 0.4), and its build."""
    from medbanana.builder.build import build
    from medbanana.builder.synthetic_run import make_synthetic_run

    root = tmp_path_factory.mktemp("hostile-eval")
    make_synthetic_run(root / "run", flavor="ours", tasks_per_folder=3, image_size=SIZE, sources_dir=root / "sources",
                       seed=8)
    for _, _, folder in layout.find_output_dirs(root / "run"):
        path = folder / layout.ALL_CONVERSATIONS
        conversations = json.loads(path.read_text())
        for conversation in conversations.values():
            for round_ in conversation["rounds"]:
                round_["edit_result"].setdefault("details", {})["attention"] = {
                    "iou": 0.4, "mask": encode_mask(np.ones((SIZE, SIZE), bool))}
        path.write_text(json.dumps(conversations))
    build([root / "run"], root / "dataset", source_images=root / "sources", quiet=True)
    return root


def evaluate(*argv, timeout=300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "medbanana", "eval", *map(str, argv), "--judge", "none", "-q"],
                          capture_output=True, text=True, timeout=timeout)


def each_round(run: Path, change) -> None:
    """`change(conversation, round)` for every round of the run's JSON, as files another machine wrote."""
    for _, _, folder in layout.find_output_dirs(run):
        path = folder / layout.ALL_CONVERSATIONS
        conversations = json.loads(path.read_text())
        for conversation in conversations.values():
            for round_ in list(conversation["rounds"]):
                change(conversation, round_)
        path.write_text(json.dumps(conversations))


def no_traceback(result: subprocess.CompletedProcess) -> None:
    assert "Traceback" not in result.stderr, result.stderr


@pytest.mark.slow
def test_bad_dataset_masks_and_attention_are_per_sample_errors(base, tmp_path):
    dataset, run = tmp_path / "dataset", tmp_path / "run"
    shutil.copytree(base / "dataset", dataset)
    shutil.copytree(base / "run", run)
    shard = next((dataset / "sft").glob("*.parquet"))
    table = pq.read_table(shard)
    rows = table.to_pylist()
    rows[0]["edit_mask"] = {"bytes": rows[0]["edit_mask"]["bytes"][:-40], "path": None}  # truncated
    rows[1]["edit_mask"] = {"bytes": bomb(60000), "path": None}
    pq.write_table(pa.Table.from_pylist(rows, schema=table.schema), shard)
    ids = {f"{r['uid']}#{r['success_round']}": r for r in rows}
    targets = iter(sorted(set(ids) - {f"{rows[0]['uid']}#{rows[0]['success_round']}",
                                      f"{rows[1]['uid']}#{rows[1]['success_round']}"}))
    planted = {next(targets): kind for kind in ("bomb", "1x1", "string", "iou 5", "iou text")}

    def plant(conversation, round_):
        kind = planted.get(f"{conversation['uid']}#{round_['round']}")
        details = round_["edit_result"]["details"]
        if kind == "bomb":
            details["attention"]["mask"] = base64.b64encode(bomb(50000)).decode()
        elif kind == "1x1":
            details["attention"]["mask"] = encode_mask(np.ones((1, 1), bool))
        elif kind == "string":
            details["attention"] = "a string"
        elif kind == "iou 5":
            details["attention"] = {"iou": 5.0}
        elif kind == "iou text":
            details["attention"] = {"iou": "high"}
    each_round(run, plant)

    out = tmp_path / "eval"
    result = evaluate(dataset, "--out", out, "--attention-run", run)
    no_traceback(result)
    assert result.returncode == 0 and (out / "report.md").is_file(), result.stderr
    records = {json.loads(line)["id"]: json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()}
    for row, problem in ((rows[0], "truncated or corrupt"), (rows[1], "too large")):
        record = records[f"{row['uid']}#{row['success_round']}"]
        assert record["status"] == "error" and "edit_mask refused" in record["error"] and problem in record["error"]
    attention = {r["id"]: r for r in json.loads((out / "attention.json").read_text())["samples"]}
    for sample, kind in planted.items():
        assert attention[sample]["iou"] is None and attention[sample]["reason"], (kind, attention[sample])
    assert "not a number in [0, 1]" in attention[next(s for s, k in planted.items() if k == "iou 5")]["reason"]
    assert "not the source's" in attention[next(s for s, k in planted.items() if k == "1x1")]["reason"]
    scored = [r for r in attention.values() if r["iou"] is not None]
    assert scored and all(0 <= r["iou"] <= 1 for r in scored)
    assert "samples not scored" in result.stderr


@pytest.mark.slow
@pytest.mark.parametrize("case", ["list", "rounds dict", "entry a string", "disease a number"])
def test_a_malformed_attention_run_is_left_out_and_listed(base, tmp_path, case):
    run = tmp_path / "run"
    shutil.copytree(base / "run", run)
    (_, _, folder), *_ = layout.find_output_dirs(run)
    path = folder / layout.ALL_CONVERSATIONS
    conversations = json.loads(path.read_text())
    key = next(iter(conversations))
    if case == "list":
        conversations = list(conversations.values())
    elif case == "rounds dict":
        conversations[key]["rounds"] = {"1": conversations[key]["rounds"][0]}
    elif case == "entry a string":
        conversations[key] = "a string"
    else:
        conversations[key]["disease"] = 5
    path.write_text(json.dumps(conversations))
    out = tmp_path / "eval"
    result = evaluate(base / "dataset", "--out", out, "--attention-run", run)
    no_traceback(result)
    assert result.returncode == 0, result.stderr
    report = json.loads((out / "attention.json").read_text())
    assert report["problems"] and all(str(path) in p for p in report["problems"])
    assert f"warning: --attention: {path}" in result.stderr
    assert report["samples"]  # the other folders' samples are scored


@pytest.mark.slow
def test_an_attention_run_that_is_a_file_is_refused_before_anything_is_written(base, tmp_path):
    not_a_run = tmp_path / "run.json"
    not_a_run.write_text("{}")
    out = tmp_path / "eval"
    result = evaluate(base / "dataset", "--out", out, "--attention-run", not_a_run)
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "--attention-run" in result.stderr and "not a folder" in result.stderr
    assert not out.exists()


def test_a_dataset_shard_linking_out_of_the_folder_is_refused(base, tmp_path):
    dataset = tmp_path / "dataset"
    shutil.copytree(base / "dataset", dataset)
    shard = next((dataset / "sft").glob("*.parquet"))
    outside = tmp_path / "outside.parquet"
    table = pq.read_table(shard)
    pq.write_table(table.set_column(table.column_names.index("instruction"), "instruction",
                                    pa.array([MARKER] * table.num_rows, pa.string())), outside)
    (dataset / "sft" / "test-00000-of-00001.parquet").symlink_to(outside)
    out = tmp_path / "eval"
    result = evaluate(dataset, "--out", out)
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "symbolic link" in result.stderr and not out.exists()
