"""`medbanana prepare` on full-data folders: sizes, determinism, stripped metadata, bad input, resume, CLI."""

import io
import json
import os

import numpy as np
import pytest
from PIL import Image, ImageCms

from conftest import SHARED_SAMPLES
from medbanana.generation.sources.adapters import AdapterOptions, PrepareError
from medbanana.generation.destinations import MANIFEST
from medbanana.generation.sources.prepare import REPORT, PrepareOptions, prepare, read_prepare_manifest
from medbanana.generation.sources.preprocess import ImageOptions, prepare_image
from medbanana.generation.rundir.provenance import jpeg_segments
from medbanana.generation.sources.scan import scan_sources
from prepare_fixtures import png_header_only, run_cli, save, scan, snapshot

SMALL = PrepareOptions(image=ImageOptions(size=64), quiet=True)
PIXEL_SEGMENTS = {0xE0, 0xDB, 0xC0, 0xC4, 0xDA}  # JFIF header, tables, frame, scan: nothing else


def jpeg_bytes(image: Image.Image, **kw) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="JPEG", **kw)
    return buf.getvalue()


def entries_by_path(out, dataset) -> dict:
    report = json.loads((out / REPORT).read_text())
    return {e["path"]: e for e in report["datasets"][dataset]["entries"]}


@pytest.fixture
def full_data(tmp_path):
    """The original scripts' full-data/{D}/{normal,<Disease>} layout, good files only."""
    root = tmp_path / "full-data"
    for i in range(3):
        save(root / "MIMIC_tiny" / "normal" / f"n{i}.jpeg", scan(i), quality=90)
    for i in range(2):
        save(root / "MIMIC_tiny" / "Pneumothorax" / f"p{i}.jpg", scan(10 + i), quality=90)
    save(root / "MIMIC_tiny" / "Pleural_Effusion" / "e0.png", scan(20))
    save(root / "MIMIC_tiny" / "Pleural_Other" / "o0.jpg", scan(21))  # a label, not an edit target
    save(root / "MIMIC_tiny" / "Kidney_Stone" / "k0.jpg", scan(22))  # not a chest X-ray class
    save(root / "Fundus_tiny" / "normal" / "0_left.jpg", scan(30, mode="RGB"))
    save(root / "Fundus_tiny" / "AMD" / "1_right.jpg", scan(31, mode="RGB"))
    return root


def test_folders_become_generator_sources_with_a_manifest(full_data, tmp_path):
    out = tmp_path / "out"
    sections = prepare("folders", full_data, out, AdapterOptions(skip_unknown=True), SMALL)
    assert sections["MIMIC_tiny"]["per_class"] == {"Pleural_Effusion": 1, "Pneumothorax": 2, "normal": 3}
    assert sections["Fundus_tiny"]["per_class"] == {"AMD": 1, "normal": 1}
    skipped = entries_by_path(out, "MIMIC_tiny")
    assert "not an edit target" in skipped["Pleural_Other"]["reason"]
    assert "not a chest_xray class folder" in skipped["Kidney_Stone"]["reason"]  # left out: --skip-unknown
    rows = read_prepare_manifest(out)
    assert len(rows) == 8
    for row in rows:
        with Image.open(out / row["path"]) as im:
            assert (im.format, im.mode, im.size) == ("JPEG", "RGB", (64, 64))
        assert row["width"] == row["height"] == 64 and (row["source_width"], row["source_height"]) == (120, 90)
        assert row["original_path"].startswith(row["label"] + "/") and len(row["sha256"]) == 64
    effusion = next(r for r in rows if r["label"] == "Pleural_Effusion")
    assert effusion["modality"] == "chest_xray" and effusion["original_path"] == "Pleural_Effusion/e0.png"
    # the generator reads OUT as it is: 3 normals x 11 chest targets + 3 removes, 1 x 6 fundus targets + 1
    tasks = scan_sources(out)
    assert sum(t.dataset == "MIMIC_tiny" and t.direction == "add" for t in tasks) == 3 * 11
    assert sum(t.dataset == "MIMIC_tiny" and t.direction == "remove" for t in tasks) == 3
    assert sum(t.dataset == "Fundus_tiny" for t in tasks) == 6 + 1


def test_same_input_same_bytes_quality_95_and_aspect_options():
    source = jpeg_bytes(scan(5, size=(160, 80)), quality=88)
    pad = prepare_image(source, ImageOptions())
    assert prepare_image(source, ImageOptions()).data == pad.data  # deterministic
    with Image.open(io.BytesIO(pad.data)) as im:
        assert (im.size, im.mode) == ((1024, 1024), "RGB")
        reference = Image.open(io.BytesIO(jpeg_bytes(Image.new("RGB", (16, 16)), quality=95)))
        assert im.quantization == reference.quantization  # the q95 tables
        padded = np.asarray(im)
    # pad keeps the 2:1 aspect: black bands above and below, the scan in the middle
    assert padded[:240].max() < 20 and padded[-240:].max() < 20 and padded[400:600].mean() > 60
    stretched = np.asarray(Image.open(io.BytesIO(prepare_image(source, ImageOptions(aspect="stretch")).data)))
    assert stretched[:100].mean() > 40 and stretched[-100:].mean() > 40
    with pytest.raises(ValueError, match="decompression limit: 160x80 = 12800 pixels > 5000"):
        prepare_image(source, ImageOptions(max_pixels=5000))  # checked from the header, before decoding


def test_metadata_is_dropped_and_orientation_applied():
    exif = Image.Exif()
    exif[0x010F] = "ScannerMaker"  # Make
    exif[0x0112] = 6  # rotate 90 degrees clockwise when shown
    icc = ImageCms.ImageCmsProfile(ImageCms.createProfile("sRGB")).tobytes()
    wide = Image.fromarray(np.random.default_rng(0).integers(190, 230, (80, 160, 3), np.uint8))
    source = jpeg_bytes(wide, quality=90, exif=exif.tobytes(), icc_profile=icc, comment=b"PatientName Doe^Jane",
                        xmp=b"<x:xmpmeta xmlns:x='adobe:ns:meta/'>secret</x:xmpmeta>")
    with Image.open(io.BytesIO(source)) as im:
        assert {"exif", "icc_profile", "comment", "xmp"} <= set(im.info)  # the probe carries all four
    result = prepare_image(source, ImageOptions(size=64))
    assert {marker for marker, _, _ in jpeg_segments(result.data)} <= PIXEL_SEGMENTS
    assert b"Doe^Jane" not in result.data and b"ScannerMaker" not in result.data and b"secret" not in result.data
    with Image.open(io.BytesIO(result.data)) as im:
        assert not {"exif", "icc_profile", "comment", "xmp"} & set(im.info)
        arr = np.asarray(im)
    # shown upright the scan is tall (80 wide, 160 high): the padding is left and right, not above and below
    assert arr[:, :12].max() < 20 and arr[:, -12:].max() < 20 and arr[:6, 20:44].mean() > 150
    assert "EXIF orientation applied to the pixels" in result.notes


def test_bad_files_are_reported_and_the_rest_prepared(tmp_path):
    root, out, outside = tmp_path / "full-data" / "Brain_bad", tmp_path / "out", tmp_path / "elsewhere.jpg"
    normal, glioma = root / "normal", root / "glioma"
    save(normal / "good.jpg", scan(1))
    good = (normal / "good.jpg").read_bytes()
    (normal / "copy of good.jpg").write_bytes(good)  # duplicate content under another name
    (normal / "truncated.jpg").write_bytes(jpeg_bytes(scan(2))[:600])
    (normal / "notes.jpg").write_text("Patient notes, not an image\n")
    save(normal / "cmyk.jpg", scan(3, mode="CMYK"))
    save(normal / "tiny.png", Image.new("L", (1, 1), 128))
    save(normal / "blank.png", Image.new("RGB", (100, 100)))
    (normal / "huge.png").write_bytes(png_header_only(20000, 20000))
    save(glioma / "sixteen.png", Image.fromarray((np.asarray(scan(4), np.uint16) * 8 + 1000).astype(np.uint16)))
    rgba = np.dstack([np.asarray(scan(5, mode="RGB")), np.full((90, 120), 255, np.uint8)])
    rgba[:30, :, 3] = 0
    save(glioma / "alpha.png", Image.fromarray(rgba, "RGBA"))
    save(glioma / "with space.jpg", scan(6))
    save(glioma / "\u00f6dem\u00e4.jpg", scan(7))
    save(outside, scan(8))
    os.symlink(outside, glioma / "escape.jpg")
    (glioma / "readme.txt").write_text("x")
    before = snapshot(tmp_path, skip=out)

    sections = prepare("folders", root, out, opts=SMALL)
    assert snapshot(tmp_path, skip=out) == before  # nothing written outside OUT, inputs untouched
    entries = entries_by_path(out, "Brain_bad")
    expect = {"normal/truncated.jpg": ("skipped", "truncated"), "normal/notes.jpg": ("skipped", "not an image"),
              "normal/cmyk.jpg": ("skipped", "CMYK"), "normal/tiny.png": ("skipped", "too small: 1x1"),
              "normal/blank.png": ("skipped", "uniform image"),
              "normal/huge.png": ("skipped", "decompression limit"),
              "glioma/sixteen.png": ("converted", "16-bit grey scaled to 8-bit"),
              "glioma/alpha.png": ("converted", "composited onto black"),
              "glioma/with space.jpg": ("renamed", "'with_space'"),
              "glioma/\u00f6dem\u00e4.jpg": ("renamed", "'odema'"),
              "glioma/escape.jpg": ("skipped", "outside the dataset root"),
              "glioma/readme.txt": ("skipped", "unsupported file type")}
    for path, (action, words) in expect.items():
        assert entries[path]["action"] == action and words in entries[path]["reason"], (path, entries.get(path))
    names = ("normal/good.jpg", "normal/copy of good.jpg")
    assert sum("duplicate" in entries.get(p, {}).get("reason", "") for p in names) == 1  # one kept, one reported
    assert sections["Brain_bad"]["per_class"] == {"glioma": 4, "normal": 1}
    assert sorted(p.name for p in (out / "Brain_bad" / "glioma").iterdir()) == [
        "alpha.jpeg", "odema.jpeg", "sixteen.jpeg", "with_space.jpeg"]
    sixteen = np.asarray(Image.open(out / "Brain_bad" / "glioma" / "sixteen.jpeg"))
    assert sixteen[8:56].min() < 40 and sixteen[8:56].max() > 215  # the 16-bit range spread over 0..255
    alpha = np.asarray(Image.open(out / "Brain_bad" / "glioma" / "alpha.jpeg"))
    assert alpha[8:17].max() < 25 and alpha[30:50].mean() > 40  # transparent top rows are black


def test_rerun_skips_done_files_and_per_class_extends_in_seeded_order(tmp_path):
    root = tmp_path / "Fundus_many"
    for i in range(8):
        save(root / "normal" / f"{i}_left.jpg", scan(40 + i, mode="RGB"))
        save(root / "Glaucoma" / f"{i}_right.jpg", scan(60 + i, mode="RGB"))
    out = tmp_path / "out"

    def run(n, seed=0, where=out):
        return prepare("folders", root, where, opts=PrepareOptions(image=ImageOptions(size=64), per_class=n,
                                                                   seed=seed, quiet=True))["Fundus_many"]

    first = run(2)
    assert first["per_class"] == {"Glaucoma": 2, "normal": 2} and first["counts"]["prepared_now"] == 4
    chosen = {r["original_path"] for r in read_prepare_manifest(out)}
    mtimes = {p: p.stat().st_mtime_ns for p in (out / "Fundus_many").rglob("*.jpeg")}
    again = run(2)
    assert again["counts"]["prepared_now"] == 0 and len(read_prepare_manifest(out)) == 4
    assert {p: p.stat().st_mtime_ns for p in (out / "Fundus_many").rglob("*.jpeg")} == mtimes
    more = run(3)
    assert more["counts"]["prepared_now"] == 2 and chosen < {r["original_path"] for r in read_prepare_manifest(out)}
    # the same seed elsewhere picks the same three per class; the order does not depend on N
    assert run(3, where=tmp_path / "other")["per_class"] == {"Glaucoma": 3, "normal": 3}
    assert {r["original_path"] for r in read_prepare_manifest(tmp_path / "other")} == \
        {r["original_path"] for r in read_prepare_manifest(out)}
    run(3, seed=1, where=tmp_path / "seed1")
    assert {r["original_path"] for r in read_prepare_manifest(tmp_path / "seed1")} != \
        {r["original_path"] for r in read_prepare_manifest(out)}
    # a file lost after its manifest line, and a torn last manifest line, are redone on the next run
    lost = out / read_prepare_manifest(out)[0]["path"]
    lost.unlink()
    with open(out / MANIFEST, "ab") as fh:
        fh.write(b'{"dataset": "Fundus_many", "tor')
    assert run(3)["counts"]["prepared_now"] == 1 and lost.is_file()
    with pytest.raises(PrepareError, match="prepared with"):
        prepare("folders", root, out, opts=PrepareOptions(image=ImageOptions(size=128), quiet=True))


def test_cli_help_summary_and_clear_fatal_errors(full_data, tmp_path, capsys):
    with pytest.raises(SystemExit):
        run_cli(["--help"])
    text = capsys.readouterr().out
    for words in ("mimic-cxr", "brain-tumor-mri", "odir", "folders", "--per-class", "--aspect", "pad", "stretch",
                  "--uncertain", "burned-in", "Support Devices"):
        assert words in text, words
    out = tmp_path / "out"
    assert run_cli(["folders", full_data, "--out", out, "--size", 64, "--skip-unknown", "-q"]) == 0
    assert "MIMIC_tiny (chest_xray): 6 prepared now" in capsys.readouterr().out
    assert run_cli(["mimic-cxr", full_data, "--out", tmp_path / "never", "-q"]) == 2
    assert "missing label file" in capsys.readouterr().err and not (tmp_path / "never").exists()
    assert run_cli(["folders", full_data, "--out", out, "--classes", "Pleural_Efusion", "-q"]) == 2
    assert "unknown class(es) Pleural_Efusion (did you mean Pleural_Effusion?)" in capsys.readouterr().err
    assert run_cli(["folders", full_data, "--out", out, "--size", 128, "--skip-unknown", "-q"]) == 2
    assert "Use another --out" in capsys.readouterr().err


def test_dicom_without_pydicom_names_the_extra(tmp_path, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "pydicom" else real(name, *a))
    (tmp_path / "MIMIC_dcm" / "normal").mkdir(parents=True)
    (tmp_path / "MIMIC_dcm" / "normal" / "a.dcm").write_bytes(b"\0" * 128 + b"DICM")
    with pytest.raises(PrepareError, match=r"pip install 'medbanana\[dicom\]'"):
        prepare("folders", tmp_path / "MIMIC_dcm", tmp_path / "out", opts=SMALL)
    assert not (tmp_path / "out").exists()


def test_real_sample_images(tmp_path):
    folder = SHARED_SAMPLES / "Fundus-edit"
    if not folder.is_dir():
        pytest.skip(f"released sample images not found at {SHARED_SAMPLES}")
    before = snapshot(SHARED_SAMPLES, skip=tmp_path)
    out = tmp_path / "out"
    sections = prepare("folders", folder, out, AdapterOptions(name="Fundus_samples"),
                       PrepareOptions(per_class=1, classes=("AMD", "Glaucoma"), quiet=True))
    assert sections["Fundus_samples"]["per_class"] == {"AMD": 1, "Glaucoma": 1}
    assert snapshot(SHARED_SAMPLES, skip=tmp_path) == before
    for row in read_prepare_manifest(out):
        original = np.asarray(Image.open(folder / row["original_path"]).convert("RGB"), np.float64)
        prepared = np.asarray(Image.open(out / row["path"]), np.float64)
        assert prepared.shape == original.shape == (1024, 1024, 3)
        assert 10 * np.log10(255 ** 2 / np.mean((prepared - original) ** 2)) > 35  # same picture, re-encoded q95


def test_a_misspelt_disease_folder_is_named_with_the_closest_class_and_stops_prepare(full_data, tmp_path, capsys):
    """Through the `medbanana` command: a class folder no taxonomy name matches ends the run before anything is
    written (exit 2), named with the class it was probably meant to be; --skip-unknown leaves it out, reported."""
    from medbanana.cli import main

    save(full_data / "MIMIC_tiny" / "Pleural_Efusion" / "typo.jpg", scan(40))
    out = tmp_path / "out"
    assert main(["prepare", "folders", str(full_data), "--out", str(out), "--size", "64", "-q"]) == 2
    err = capsys.readouterr().err
    assert "2 folders not in the taxonomy" in err
    assert "MIMIC_tiny/Pleural_Efusion (did you mean Pleural_Effusion?)" in err and "MIMIC_tiny/Kidney_Stone" in err
    assert "--skip-unknown" in err and err.count("\n") == 1 and not out.exists()
    assert main(["prepare", "folders", str(full_data), "--out", str(out), "--size", "64", "--skip-unknown",
                 "-q"]) == 0
    capsys.readouterr()
    reasons = entries_by_path(out, "MIMIC_tiny")
    assert "(did you mean Pleural_Effusion?)" in reasons["Pleural_Efusion"]["reason"]
    assert all(row["label"] != "Pleural_Efusion" for row in read_prepare_manifest(out))
