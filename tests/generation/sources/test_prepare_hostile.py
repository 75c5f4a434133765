"""`medbanana prepare` on hostile trees (issue 26): each bad file is one report entry and the run goes on; no
FIFO is opened; no dataset folder linked out of ROOT is read; no DICOM file name reaches output names or manifest."""

import io
import json
import os
import zlib

import numpy as np
import pytest
from PIL import Image

from medbanana.generation.destinations import MANIFEST
from medbanana.generation.sources.prepare import PRIVATE, REPORT, read_prepare_manifest
from medbanana.generation.sources.scan import scan_sources
from prepare_fixtures import (brain_tree, dicom_bytes, odir_tree, png_with_chunk, run_prepare_process, save, scan)

LONG_STEM = "a" * 245  # 250 bytes with ".jpeg": a legal input name, too long once suffixed


def entries(out, dataset) -> dict[str, dict]:
    report = json.loads((out / REPORT).read_text())
    return {e["path"]: e for e in report["datasets"][dataset]["entries"]}


def webp_with_exif(image: Image.Image, exif: bytes) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="WEBP", exif=exif)
    return buf.getvalue()


def dicom_scan(offset: int) -> bytes:
    pixels = np.tile(np.linspace(200 + offset, 3000, 100, dtype=np.uint16), (80, 1))
    return dicom_bytes(pixels, "MONOCHROME2")


@pytest.fixture
def hostile_root(tmp_path):
    """ROOT/MIMIC_hostile/normal with good files and one of each bad kind; ROOT/MIMIC_escape linked out of ROOT;
    ROOT/MIMIC_linked linked to a dataset folder elsewhere inside ROOT."""
    root = tmp_path / "ROOT"
    normal = root / "MIMIC_hostile" / "normal"
    save(normal / "good1.jpeg", scan(1), quality=90)
    save(normal / "good2.png", scan(2))
    save(normal / f"{LONG_STEM}.jpeg", scan(3), quality=90)
    os.mkfifo(normal / "x.jpeg")  # opening it for reading would block until a writer comes: never
    os.symlink("x.jpeg", normal / "pipe_link.jpg")  # a link inside the dataset, to the FIFO
    (normal / "folder.jpeg").mkdir()
    (normal / "exif.png").write_bytes(png_with_chunk(scan(4), b"eXIf", b"this is no TIFF header"))
    (normal / "exif.webp").write_bytes(webp_with_exif(scan(5, mode="RGB"), b"Exif\0\0not a TIFF either"))
    bomb = zlib.compress(bytes(64 << 20), 9)  # 64 MiB of text from 64 KB, past Pillow's MAX_TEXT_CHUNK
    (normal / "ztxt.png").write_bytes(png_with_chunk(scan(6), b"zTXt", b"Comment\0\0" + bomb))
    (normal / "itxt.png").write_bytes(png_with_chunk(scan(7), b"iTXt", b"Comment\0\1\0en\0\0" + bomb))
    (normal / "DOE_JOHN.dcm").write_bytes(dicom_scan(0))
    (normal / "SMITH_ANNA.jpg").write_bytes(dicom_scan(50))  # a DICOM by its content, whatever its suffix
    save(tmp_path / "outside" / "MIMIC_escape" / "normal" / "secret.jpeg", scan(8))
    os.symlink(tmp_path / "outside" / "MIMIC_escape", root / "MIMIC_escape")
    save(root / "store" / "MIMIC_kept" / "normal" / "kept.jpeg", scan(9))
    os.symlink(os.path.join("store", "MIMIC_kept"), root / "MIMIC_linked")
    return root


def test_hostile_files_are_listed_and_the_good_ones_prepared(hostile_root, tmp_path):
    pytest.importorskip("pydicom", reason="pydicom is the optional 'dicom' extra")
    out = tmp_path / "SOURCES"
    done = run_prepare_process(["folders", hostile_root, "--out", out, "--size", 64, "-q"], timeout=300)
    assert done.returncode == 0, done.stderr  # partial success: images were prepared, the rest is in the report
    assert "Traceback" not in done.stderr
    bad = entries(out, "MIMIC_hostile")
    assert "FIFO" in bad["normal/x.jpeg"]["reason"] and "without opening" in bad["normal/x.jpeg"]["reason"]
    assert "FIFO" in bad["normal/pipe_link.jpg"]["reason"]
    assert "subfolder" in bad["normal/folder.jpeg"]["reason"]
    for name in ("exif.png", "exif.webp"):
        assert "unreadable EXIF" in bad[f"normal/{name}"]["reason"] and "TIFF" in bad[f"normal/{name}"]["reason"]
    for name in ("ztxt.png", "itxt.png"):
        assert "MAX_TEXT_CHUNK" in bad[f"normal/{name}"]["reason"]
    assert {e["action"] for p, e in bad.items() if p != f"normal/{LONG_STEM}.jpeg"} == {"skipped", "converted"}
    assert bad[f"normal/{LONG_STEM}.jpeg"]["action"] == "renamed"

    rows = {r["source_id"]: r for r in read_prepare_manifest(out) if r["dataset"] == "MIMIC_hostile"}
    long_id = next(i for i in rows if i.startswith("aaaa"))
    assert len(long_id) <= 100 and (out / rows[long_id]["path"]).is_file()
    dicom_ids = sorted(i for i in rows if i.startswith("dicom_"))
    assert len(dicom_ids) == 2 and {"good1", "good2"} <= set(rows) and len(rows) == 5
    assert all(rows[i]["original_path"] is None for i in dicom_ids)

    # no DICOM's file name in any output name, the manifest, or what the command printed
    names = [str(p.relative_to(out)) for p in out.rglob("*")]
    public = [MANIFEST, *(n for n in names if n not in (REPORT, PRIVATE))]
    for secret in ("DOE_JOHN", "SMITH_ANNA"):
        assert not any(secret in n for n in public), names
        assert secret not in (out / MANIFEST).read_text() and secret not in done.stdout + done.stderr
    private = {json.loads(line)["original_path"]: json.loads(line)["path"] for line in (out / PRIVATE).open()}
    assert set(private) == {"normal/DOE_JOHN.dcm", "normal/SMITH_ANNA.jpg"}
    assert sorted(rows[i]["path"] for i in dicom_ids) == sorted(private.values())

    # the dataset folder linked out of ROOT is listed and never read; the one linked inside ROOT is prepared
    escape = entries(out, "MIMIC_escape")["MIMIC_escape"]
    assert escape["action"] == "skipped" and "outside ROOT" in escape["reason"]
    assert "MIMIC_escape: dataset folder skipped" in done.stdout
    assert not (out / "MIMIC_escape").exists()
    assert [r["original_path"] for r in read_prepare_manifest(out) if r["dataset"] == "MIMIC_linked"] == \
        ["normal/kept.jpeg"]
    assert {t.dataset for t in scan_sources(out)} == {"MIMIC_hostile", "MIMIC_linked"}

    # a rerun finds the DICOMs done through the private file: nothing is prepared twice
    lines = (out / MANIFEST).read_text().count("\n")
    again = run_prepare_process(["folders", hostile_root, "--out", out, "--size", 64, "-q"], timeout=300)
    assert again.returncode == 0 and "MIMIC_hostile (chest_xray): 0 prepared now, 5 in total" in again.stdout
    assert (out / MANIFEST).read_text().count("\n") == lines


@pytest.mark.slow
def test_other_adapters_skip_fifos_and_folders_linked_out(tmp_path):
    # ODIR: the spreadsheet names a file that is a link to a FIFO (read only through the prepare stage's check)
    odir = odir_tree(tmp_path / "odir")
    images = odir / "ODIR-5K" / "Training Images"
    (images / "0_left.jpg").unlink()
    os.mkfifo(images / "pipe")
    os.symlink("pipe", images / "0_left.jpg")
    done = run_prepare_process(["odir", odir, "--out", tmp_path / "out_odir", "--size", 64, "-q"], timeout=300)
    assert done.returncode == 0, done.stderr
    reason = entries(tmp_path / "out_odir", "ODIR_fundus_single_disease")["ODIR-5K/Training Images/0_left.jpg"]
    assert "FIFO" in reason["reason"]
    # Brain Tumor MRI: the Testing split linked out of ROOT is listed once and not read; Training is prepared
    brain = brain_tree(tmp_path / "brain")
    (brain / "Testing").rename(tmp_path / "elsewhere")
    os.symlink(tmp_path / "elsewhere", brain / "Testing")
    done = run_prepare_process(["brain-tumor-mri", brain, "--out", tmp_path / "out_brain", "--size", 64, "-q"],
                               timeout=300)
    assert done.returncode == 0, done.stderr
    listed = entries(tmp_path / "out_brain", "Brain_Tumor_MRI")
    assert "outside" in listed["Testing"]["reason"] and not any(p.startswith("Testing/") for p in listed)
    assert {r["extra"]["split"] for r in read_prepare_manifest(tmp_path / "out_brain")} == {"Training"}
