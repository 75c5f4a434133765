"""Dataset adapters on tiny trees in each dataset's own layout: MIMIC-CXR-JPG, Brain Tumor MRI, ODIR-5K, DICOM."""

import importlib.util
import io

import numpy as np
import pytest
from PIL import Image

from medbanana.generation.sources.adapters import AdapterOptions, PrepareError, load_dataset_sources
from medbanana.generation.sources.prepare import PrepareOptions, prepare, read_prepare_manifest
from medbanana.generation.sources.preprocess import ImageOptions, prepare_image
from medbanana.generation.sources.scan import scan_sources
from prepare_fixtures import brain_tree, dicom_bytes, mimic_tree, odir_tree, snapshot

SMALL = PrepareOptions(image=ImageOptions(size=64), quiet=True)


def by_id(sources) -> dict:
    (src,) = sources
    return {c.source_id: c for c in src.candidates}


# --- MIMIC-CXR-JPG ---------------------------------------------------------------------------------------------
def test_mimic_frontal_single_disease_one_image_per_study(tmp_path):
    root = mimic_tree(tmp_path / "mimic-cxr-jpg")
    (src,) = load_dataset_sources("mimic-cxr", root)
    cands = {c.source_id: c for c in src.candidates}
    # normal (Support Devices ignored), Pneumothorax, Lung Lesion; the rest are excluded by the documented policy
    assert {k: c.label for k, c in cands.items()} == {"s50000001": "normal", "s50000002": "Pneumothorax",
                                                      "s50000009": "Lung_Lesion"}
    assert cands["s50000002"].view == "PA" and cands["s50000002"].path.name == "d2pa.jpg"  # PA preferred over AP
    assert cands["s50000001"].relpath == "files/p10/p10000001/s50000001/d1pa.jpg"  # the lateral is never used
    assert cands["s50000009"].group == "p11000009" and cands["s50000009"].extra["dicom_id"] == "d9"
    assert src.counts["excluded_uncertain"] == 2 and src.counts["excluded_no_frontal_view"] == 1
    assert src.counts["excluded_multiple_or_other"] == 2  # effusion + edema; Pleural Other alone (not a target)
    assert [p.path for p in src.problems] == ["files/p10/p10000007/s50000007"]  # selected, but not on disk
    assert src.name == "MIMIC_CXR_single_disease"


@pytest.mark.parametrize("policy,expected", [
    ("exclude", {}),
    ("negative", {"s50000005": "Edema"}),  # -1 Atelectasis read as 0; Cardiomegaly -1 alone has no label left
    ("positive", {"s50000004": "Cardiomegaly"}),  # -1 read as 1; Edema + Atelectasis become two diseases
])
def test_mimic_uncertain_label_policy(tmp_path, policy, expected):
    root = mimic_tree(tmp_path / "mimic")
    cands = by_id(load_dataset_sources("mimic-cxr", root, AdapterOptions(uncertain=policy)))
    uncertain = {k: c.label for k, c in cands.items() if k in ("s50000004", "s50000005")}
    assert uncertain == expected


def test_mimic_prepares_into_a_folder_the_generator_reads(tmp_path):
    root, out = mimic_tree(tmp_path / "mimic"), tmp_path / "out"
    before = snapshot(tmp_path, skip=out)
    sections = prepare("mimic-cxr", root, out, opts=SMALL)
    assert snapshot(tmp_path, skip=out) == before
    assert sections["MIMIC_CXR_single_disease"]["per_class"] == {"Lung_Lesion": 1, "Pneumothorax": 1, "normal": 1}
    rows = {r["source_id"]: r for r in read_prepare_manifest(out)}
    assert rows["s50000002"]["labels"] == ["Pneumothorax"] and rows["s50000002"]["view"] == "PA"
    assert rows["s50000001"]["path"] == "MIMIC_CXR_single_disease/normal/s50000001.jpeg"
    tasks = scan_sources(out)
    assert {t.modality for t in tasks} == {"chest_xray"} and len(tasks) == 11 + 2


def test_mimic_missing_label_file_and_unusable_tables_are_fatal(tmp_path):
    root = mimic_tree(tmp_path / "mimic")
    (root / "mimic-cxr-2.0.0-chexpert.csv.gz").unlink()
    with pytest.raises(PrepareError, match="missing label file.*mimic-cxr-2.0.0-chexpert"):
        prepare("mimic-cxr", root, tmp_path / "out", opts=SMALL)
    assert not (tmp_path / "out").exists()
    root = mimic_tree(tmp_path / "mimic2", drop_metadata_column="ViewPosition")
    with pytest.raises(PrepareError, match="missing column.*ViewPosition"):
        load_dataset_sources("mimic-cxr", root)
    root = mimic_tree(tmp_path / "mimic3", extra_columns={"Reader comment": "x"})
    (src,) = load_dataset_sources("mimic-cxr", root)
    assert any(p.action == "warning" and "Reader comment" in p.reason for p in src.problems)
    assert len(src.candidates) == 3


# --- Brain Tumor MRI (Kaggle) ----------------------------------------------------------------------------------
def test_brain_tumor_kaggle_layout(tmp_path):
    root = brain_tree(tmp_path / "brain-tumor-mri-dataset")
    cands = by_id(load_dataset_sources("brain-tumor-mri", root))
    assert {k: c.label for k, c in cands.items()} == {
        "Tr-gl_0001": "glioma", "Tr-gl_0002": "glioma", "Tr-no_0001": "normal", "Te-me_0001": "meningioma",
        "Te-pi_0001": "pituitary", "Te-noTr_0001": "normal"}
    assert cands["Te-me_0001"].extra == {"split": "Testing"}
    (src,) = load_dataset_sources("brain-tumor-mri", root)
    assert [(p.path, p.action) for p in src.problems] == [("Testing/mystery", "skipped")]
    only_test = by_id(load_dataset_sources("brain-tumor-mri", root, AdapterOptions(splits=("Testing",))))
    assert sorted(only_test) == ["Te-me_0001", "Te-noTr_0001", "Te-pi_0001"]
    out = tmp_path / "out"
    prepare("brain-tumor-mri", root, out, AdapterOptions(name="Brain_Tumor_MRI_test"), SMALL)
    assert {t.modality for t in scan_sources(out)} == {"brain_mri"}
    with pytest.raises(PrepareError, match="does not tell the generator"):
        load_dataset_sources("brain-tumor-mri", root, AdapterOptions(name="scans_2024_chest"))
    with pytest.raises(PrepareError, match="not the Kaggle Brain Tumor MRI layout"):
        load_dataset_sources("brain-tumor-mri", tmp_path / "out")


# --- ODIR-5K ---------------------------------------------------------------------------------------------------
ODIR_EXPECTED = {"0_left": "Cataract", "0_right": "normal", "1_left": "Diabetes", "1_right": "normal",
                 "5_left": "Hypertension"}


def check_odir(sources):
    (src,) = sources
    cands = {c.source_id: c for c in src.candidates}
    assert {k: c.label for k, c in cands.items()} == ODIR_EXPECTED
    assert cands["1_left"].view == "left" and cands["1_left"].group == "1"
    assert cands["0_left"].relpath == "ODIR-5K/Training Images/0_left.jpg"  # not the preprocessed copy
    reasons = {p.path: p.reason for p in src.problems}
    assert "unsafe" in reasons["../4_left.jpg"]  # a path in the sheet never reaches outside the image folder
    assert "not found" in reasons["4_right.jpg"]
    assert "not a fundus photograph" in reasons["3_right.jpg"]
    assert "flag is 0" in reasons["3_left.jpg"]  # AMD keyword, A flag 0
    assert src.counts["excluded_multiple_other_or_uncertain"] == 3  # glaucoma+cataract, suspected, drusen
    return src


def test_odir_csv_one_source_per_eye_labelled_by_its_keywords(tmp_path):
    root = odir_tree(tmp_path / "odir", extra_column=True)
    src = check_odir(load_dataset_sources("odir", root))
    assert any(p.action == "warning" and "Reader notes" in p.reason for p in src.problems)
    out = tmp_path / "out"
    sections = prepare("odir", root, out, opts=SMALL)
    assert sum(sections["ODIR_fundus_single_disease"]["per_class"].values()) == 5
    assert {t.modality for t in scan_sources(out)} == {"fundus"}
    assert not any(r["source_id"] == "4_left" for r in read_prepare_manifest(out))


def test_odir_xlsx(tmp_path):
    if importlib.util.find_spec("openpyxl") is None:
        pytest.skip("openpyxl (the optional xlsx reader) is not installed")
    check_odir(load_dataset_sources("odir", odir_tree(tmp_path / "odir", sheet="xlsx")))


def test_odir_missing_sheet_or_columns_is_fatal(tmp_path, monkeypatch):
    root = odir_tree(tmp_path / "odir", drop="Right-Diagnostic Keywords")
    with pytest.raises(PrepareError, match="missing column.*Right-Diagnostic Keywords; found ID"):
        load_dataset_sources("odir", root)
    (root / "full_df.csv").unlink()
    with pytest.raises(PrepareError, match="missing label file.*--labels"):
        prepare("odir", root, tmp_path / "out", opts=SMALL)
    assert not (tmp_path / "out").exists()
    (root / "ODIR-5K_Training_Annotations.xlsx").write_bytes(b"PK")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "openpyxl" else real(name, *a))
    with pytest.raises(PrepareError, match=r"needs openpyxl: pip install 'medbanana\[xlsx\]'"):
        load_dataset_sources("odir", root)


# --- DICOM -----------------------------------------------------------------------------------------------------
def test_dicom_window_monochrome1_and_no_header(tmp_path):
    pytest.importorskip("pydicom", reason="pydicom is the optional 'dicom' extra")
    pixels = np.full((80, 100), 1500, np.uint16)
    pixels[:, 50:] = 2500
    pixels[:, 45:55] = 2000  # the window centre
    data = dicom_bytes(pixels, "MONOCHROME1", WindowCenter=2000, WindowWidth=1000)
    result = prepare_image(data, ImageOptions(size=100, aspect="stretch"), "x.dcm")
    arr = np.asarray(Image.open(io.BytesIO(result.data)).convert("L"), np.float64)
    # 1500 is below the window (0), 2500 above it (255); MONOCHROME1 inverts: left bright, right dark
    assert arr[:, :40].mean() > 245 and arr[:, 60:].mean() < 10 and 100 < arr[:, 48:52].mean() < 155
    assert "MONOCHROME1 inverted" in result.notes and any("window" in n for n in result.notes)
    assert b"Doe^Jane" not in result.data and b"MRN99887766" not in result.data
    plain = prepare_image(dicom_bytes(pixels, "MONOCHROME2"), ImageOptions(size=100, aspect="stretch"), "y.dcm")
    flat = np.asarray(Image.open(io.BytesIO(plain.data)).convert("L"), np.float64)
    assert flat[:, :40].mean() < 10 and flat[:, 60:].mean() > 245  # no window: the full 12-bit range
    with pytest.raises(ValueError, match="multi-frame DICOM"):
        prepare_image(dicom_bytes(np.stack([pixels] * 2), "MONOCHROME2", frames=2), ImageOptions(), "z.dcm")
    mimic = mimic_tree(tmp_path / "mimic")  # MIMIC-CXR in DICOM: <dicom_id>.dcm where the .jpg would be
    study = mimic / "files" / "p10" / "p10000002" / "s50000002"
    (study / "d2pa.jpg").unlink()
    (study / "d2pa.dcm").write_bytes(data)
    assert by_id(load_dataset_sources("mimic-cxr", mimic))["s50000002"].path == study / "d2pa.dcm"
    root = tmp_path / "MIMIC_dicom"
    (root / "normal").mkdir(parents=True)
    (root / "normal" / "scan1.dcm").write_bytes(data)
    (root / "normal" / "broken.dcm").write_bytes(data[:400])
    sections = prepare("folders", root, tmp_path / "out", opts=SMALL)
    assert sections["MIMIC_dicom"]["per_class"] == {"normal": 1}
    assert "unreadable DICOM" in sections["MIMIC_dicom"]["entries"][0]["reason"]
