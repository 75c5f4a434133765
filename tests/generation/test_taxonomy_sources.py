import pytest

from conftest import write_jpeg
from medbanana.generation.sources.scan import Selection, SourceLayoutError, scan_sources
from medbanana.generation.taxonomy import load_taxonomy


def test_taxonomy_counts_and_folders():
    tax = load_taxonomy()
    assert len(tax.labels) == 23
    assert len(tax.targets) == 20
    assert {m: len(tax.modality(m).targets) for m in tax.modalities} == {"chest_xray": 11, "brain_mri": 3, "fundus": 6}
    assert tax.target("pleural effusion").folder == "Pleural_Effusion"
    assert tax.target("diabetic retinopathy").folder == "Diabetes"
    assert tax.target("Enlarged Cardiomediastinum").folder == "Enlarged_Cardiomediastinum"
    for label in tax.targets:
        assert label.region and label.region_text and label.signs, label.name


def test_taxonomy_rejects_unknown_and_non_targets():
    tax = load_taxonomy()
    with pytest.raises(ValueError, match="not a known disease.*Pneumothorax"):
        tax.target("pneumothorox")
    with pytest.raises(ValueError, match="not an edit target"):
        tax.target("Pleural Other")
    with pytest.raises(ValueError, match="not an edit target"):
        tax.target("no tumor")


@pytest.mark.parametrize("name,modality", [("MIMIC_single_disease_selection_dim1024_1k_per_class", "chest_xray"),
                                           ("Brain_Tumor_MRI", "brain_mri"), ("ODIR-5K", "fundus"),
                                           ("somewhere", None)])
def test_infer_modality(name, modality):
    assert load_taxonomy().infer_modality(name) == modality


def test_scan_crosses_normal_sources_with_every_target(tiny_sources):
    tasks = scan_sources(tiny_sources)
    add = [t for t in tasks if t.direction == "add"]
    remove = [t for t in tasks if t.direction == "remove"]
    assert len(add) == 2 * 11 + 1 * 6
    assert sorted(t.key for t in remove) == ["1_right-Glaucoma", "e0-Pleural_Effusion", "p0-Pneumothorax"]
    assert {t.modality for t in tasks if t.dataset == "ODIR_tiny"} == {"fundus"}
    assert len({t.uid for t in tasks}) == len(tasks)


def test_scan_selection_and_single_dataset_folder(tiny_sources):
    sel = Selection.parse(diseases=["pneumothorax"], directions=["remove"])
    assert [t.key for t in scan_sources(tiny_sources, sel)] == ["p0-Pneumothorax"]
    one = scan_sources(tiny_sources / "ODIR_tiny")
    assert {t.dataset for t in one} == {"ODIR_tiny"} and len(one) == 7


def test_scan_errors_are_clear(tmp_path, tiny_sources):
    with pytest.raises(ValueError, match="not a known disease"):
        Selection.parse(diseases=["Pneumonitis"])
    with pytest.raises(SourceLayoutError, match="no dataset folders"):
        (tmp_path / "empty").mkdir()
        scan_sources(tmp_path / "empty")
    write_jpeg(tiny_sources / "MIMIC_tiny" / "Pneumonitis" / "x.jpeg")
    with pytest.raises(SourceLayoutError, match="'Pneumonitis' is not a chest_xray disease folder"):
        scan_sources(tiny_sources)


def test_scan_modality_from_disease_folders(tmp_path):
    write_jpeg(tmp_path / "src" / "mystery" / "glioma" / "a.jpeg")
    write_jpeg(tmp_path / "src" / "mystery" / "normal" / "b.jpeg")
    tasks = scan_sources(tmp_path / "src")
    assert {t.modality for t in tasks} == {"brain_mri"} and len(tasks) == 3 + 1
