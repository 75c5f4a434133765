"""Hostile sources: `generate` refuses huge images from their header, `prepare` records broken symlinks (issue 13)."""

import json
import os
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
from medbanana.cli import build_parser, main
from medbanana.generation.rundir import layout
from medbanana.generation.sources.prepare import REPORT, read_prepare_manifest
from medbanana.generation.records import DEFAULT_MAX_PIXELS
from medbanana.generation.rundir.store import read_journal
from conftest import write_jpeg
from prepare_fixtures import mimic_tree, odir_tree, png_chunk, save, scan


def black_png(width: int, height: int) -> bytes:
    """A whole, valid 1-bit PNG of width x height: all-zero rows compress to a few KB, decoding takes it all."""
    row, packer = b"\0" * (1 + (width + 7) // 8), zlib.compressobj(9)
    data = b"".join(packer.compress(row) for _ in range(height)) + packer.flush()
    ihdr = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + png_chunk(b"IHDR", ihdr) + png_chunk(b"IDAT", data) + png_chunk(b"IEND", b"")


def generate_argv(sources: Path, out: Path, *extra: str) -> list[str]:
    return ["generate", "--sources", str(sources), "--out", str(out), "--backend", "simulator", "--diseases",
            "Pneumothorax", "--directions", "add", "--max-rounds", "1", "-q", *extra]


def failures(run_dir: Path, dataset: str) -> dict[str, dict]:
    path = layout.output_dir(run_dir, dataset, "add") / layout.API_FAILURES
    return {f["task"]: f for f in json.loads(path.read_text())}


# --- generate --max-pixels -------------------------------------------------------------------------------------
@pytest.mark.slow
def test_the_issue_png_is_a_source_error_from_its_header_in_little_memory(tmp_path):
    normal = tmp_path / "sources" / "MIMIC_bomb" / "normal"
    normal.mkdir(parents=True)
    (normal / "huge.png").write_bytes(black_png(13000, 13000))  # the issue's case: 169 Mpx, 10.6 GB when decoded
    # a header claiming 10 Gpx: past Pillow's own hard limit, which raises from Image.open
    (normal / "claims.png").write_bytes(black_png(100_000, 100_000)[:33] + png_chunk(b"IEND", b""))
    write_jpeg(normal / "fine.jpeg", 1)
    assert (normal / "huge.png").stat().st_size < 200_000
    run_dir = tmp_path / "run"
    # its own process, its peak RSS read as VmHWM: the high-water mark of its own address space (getrusage's
    # ru_maxrss survives exec, so it would report the forked pytest process's size, GBs late in the suite)
    code = ("import re, sys; from medbanana.cli import main; rc = main(sys.argv[1:]); "
            "status = open('/proc/self/status').read(); "
            "print('maxrss_kb', re.search(r'VmHWM:\\s+(\\d+) kB', status)[1]); sys.exit(rc)")
    done = subprocess.run([sys.executable, "-c", code, *generate_argv(tmp_path / "sources", run_dir)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 3, done.stderr  # the refused sources are api_failed tasks
    peak_kb = int(done.stdout.split("maxrss_kb")[-1])
    assert peak_kb < 1024 * 1024, f"peak RSS {peak_kb} KB: the huge source was decoded"
    assert "Traceback" not in done.stderr and "DecompressionBomb" not in done.stderr

    fails = failures(run_dir, "MIMIC_bomb")
    assert set(fails) == {"huge-Pneumothorax", "claims-Pneumothorax"}  # the fine source went on
    huge = fails["huge-Pneumothorax"]
    assert (huge["step"], huge["kind"], huge["round"]) == ("load_source", "source_error", 0)
    assert "13000x13000 = 169000000 pixels" in huge["error"] and f"> {DEFAULT_MAX_PIXELS}" in huge["error"]
    claims = fails["claims-Pneumothorax"]
    assert claims["kind"] == "source_error" and "10000000000 pixels" in claims["error"]
    assert str(DEFAULT_MAX_PIXELS) in claims["error"]
    progress = json.loads((layout.output_dir(run_dir, "MIMIC_bomb", "add") / layout.PROGRESS).read_text())
    assert progress["huge-Pneumothorax"] == "api_failed" and progress["fine-Pneumothorax"] in ("success", "failed")
    (entry,) = [e for e in read_journal(run_dir / layout.JOURNAL) if e["uid"] == "MIMIC_bomb/add/huge-Pneumothorax"]
    assert entry["record"]["status"] == "api_failed" and "169000000 pixels" in json.dumps(entry["record"])
    stats = json.loads((run_dir / layout.STATS).read_text())
    assert stats["error_kinds"] == {"source_error": 2} and stats["api_failed"] == 2


@pytest.mark.slow
def test_generate_max_pixels_is_prepares_option_and_is_honoured(tmp_path):
    parser = build_parser()
    prepare_args = parser.parse_args(["prepare", "folders", "ROOT", "--out", "OUT"])
    generate_args = parser.parse_args(["generate"])
    assert generate_args.max_pixels == prepare_args.max_pixels == DEFAULT_MAX_PIXELS

    normal = tmp_path / "sources" / "MIMIC_small" / "normal"
    write_jpeg(normal / "small.jpeg", 1, size=32)  # 1024 pixels
    write_jpeg(normal / "large.jpeg", 2, size=48)  # 2304 pixels
    assert main(generate_argv(tmp_path / "sources", tmp_path / "run", "--max-pixels", "2000")) == 3
    fails = failures(tmp_path / "run", "MIMIC_small")
    assert set(fails) == {"large-Pneumothorax"}
    assert "48x48 = 2304 pixels > 2000 (--max-pixels)" in fails["large-Pneumothorax"]["error"]
    # a larger limit on --retry-failed lets the refused source run
    assert main(["generate", "--retry-failed", str(tmp_path / "run"), "--sources", str(tmp_path / "sources"),
                 "--backend", "simulator", "--diseases",
                 "Pneumothorax", "--directions", "add", "--max-rounds", "1", "-q"]) == 0
    progress = json.loads((layout.output_dir(tmp_path / "run", "MIMIC_small", "add") / layout.PROGRESS).read_text())
    assert progress["large-Pneumothorax"] in ("success", "failed")


# --- prepare: symlinks -----------------------------------------------------------------------------------------
def report_reasons(out: Path, dataset: str) -> dict[str, str]:
    report = json.loads((out / REPORT).read_text())
    return {e["path"]: e["reason"] for e in report["datasets"][dataset]["entries"] if e["action"] == "skipped"}


def test_prepare_records_loops_and_dangling_links_and_goes_on(tmp_path, capsys):
    root, out = tmp_path / "full-data" / "Brain_links", tmp_path / "out"
    save(root / "normal" / "good.jpg", scan(1))
    save(root / "glioma" / "tumour.jpg", scan(2))
    glioma = root / "glioma"
    os.symlink("loop.jpg", glioma / "loop.jpg")  # points at itself
    os.symlink("ping.jpg", glioma / "pong.jpg")
    os.symlink("pong.jpg", glioma / "ping.jpg")  # a loop of two
    os.symlink("gone.jpg", glioma / "dangling.jpg")  # inside the root, target missing
    os.symlink(tmp_path / "nowhere" / "x.jpg", glioma / "dangling_out.jpg")  # outside, and missing too
    save(tmp_path / "private.jpg", scan(3))
    os.symlink(tmp_path / "private.jpg", glioma / "escape.jpg")  # outside, and there
    os.symlink("meningioma", root / "meningioma")  # a looping class folder
    assert main(["prepare", "folders", str(root), "--out", str(out), "--size", "64", "-q"]) == 0
    assert "sources:" in capsys.readouterr().out

    reasons = report_reasons(out, "Brain_links")
    assert reasons == {"glioma/loop.jpg": "symlink loop", "glioma/ping.jpg": "symlink loop",
                       "glioma/pong.jpg": "symlink loop", "meningioma": "symlink loop",
                       "glioma/dangling.jpg": "dangling symlink (target missing)",
                       "glioma/dangling_out.jpg": "dangling symlink (target missing)",
                       "glioma/escape.jpg": "link points outside the dataset root"}
    assert sorted(r["original_path"] for r in read_prepare_manifest(out)) == ["glioma/tumour.jpg", "normal/good.jpg"]


def test_odir_and_mimic_links_are_recorded_not_fatal(tmp_path):
    odir = odir_tree(tmp_path / "odir")
    images = odir / "ODIR-5K" / "Training Images"
    (images / "0_left.jpg").unlink()
    os.symlink("0_left.jpg", images / "0_left.jpg")
    (images / "0_right.jpg").unlink()
    os.symlink("0_right_original.jpg", images / "0_right.jpg")
    (images / "5_left.jpg").rename(tmp_path / "5_left.jpg")
    os.symlink(tmp_path / "5_left.jpg", images / "5_left.jpg")
    assert main(["prepare", "odir", str(odir), "--out", str(tmp_path / "out_odir"), "--size", "64", "-q"]) == 0
    reasons = report_reasons(tmp_path / "out_odir", "ODIR_fundus_single_disease")
    assert reasons["0_left.jpg"] == "symlink loop"
    assert reasons["0_right.jpg"] == "dangling symlink (target missing)"
    assert reasons["5_left.jpg"] == "link points outside the image folder"

    mimic = mimic_tree(tmp_path / "mimic")
    image = mimic / "files" / "p10" / "p10000001" / "s50000001" / "d1pa.jpg"
    image.unlink()
    os.symlink("d1pa.jpg", image)
    assert main(["prepare", "mimic-cxr", str(mimic), "--out", str(tmp_path / "out_mimic"), "--size", "64",
                 "-q"]) == 0
    reasons = report_reasons(tmp_path / "out_mimic", "MIMIC_CXR_single_disease")
    assert reasons["files/p10/p10000001/s50000001/d1pa.jpg"] == "symlink loop"
