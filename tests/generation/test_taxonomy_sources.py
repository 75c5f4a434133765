from pathlib import Path

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


ADJECTIVE_ENDINGS = ("ary", "al", "ic", "ous", "ive")  # "pituitary", "diabetic": a finding named by an adjective
TARGETS = [(label, direction) for label in load_taxonomy().targets for direction in ("add", "remove")]


@pytest.mark.parametrize("label,direction", TARGETS, ids=[f"{t.folder}-{d}" for t, d in TARGETS])
def test_every_task_sentence_names_its_finding_as_a_noun_phrase(label, direction):
    """The dataset's task sentence ("Add a pituitary tumor to this brain MRI.", never "Add pituitary ...") and the
    simulator's first instruction sentence, for all 20 targets in both directions."""
    from medbanana.generation.backends.simulator.params import EditParams
    from medbanana.generation.backends.simulator.writer import compose
    from medbanana.generation.records import Task

    tax = load_taxonomy()
    display, view = tax.modality(label.modality).display, tax.modality(label.modality).view
    sentence = tax.task_sentence(label.folder, label.modality, direction)
    noun = sentence.removeprefix("Add ").removeprefix("Remove ").rsplit(" to this " if direction == "add" else
                                                                          " from this ", 1)[0]
    assert sentence == (f"Add {noun} to this {display}." if direction == "add" else
                        f"Remove {noun} from this {display}.")
    words = noun.split()
    head = [w for w in words if not w.startswith("(")][-1]  # "(AMD)" qualifies, it is not the head
    assert not head.endswith(ADJECTIVE_ENDINGS), sentence
    assert all(w.islower() or w.strip("()").isupper() for w in words), sentence  # no "Pleural Effusion"
    if direction == "add" and words[0] in ("a", "an"):
        assert (words[0] == "an") == (words[1][0] in "aeiou"), sentence
    if direction == "remove":
        assert words[0] == "the" and words[1] not in ("a", "an"), sentence
        added = tax.task_sentence(label.folder, label.modality, "add").removeprefix("Add ").split(" to this ")[0]
        article, _, rest = added.partition(" ")
        assert noun == f"the {rest if article in ('a', 'an') else added}"  # the same finding, definite
    task = Task("D", label.modality, label.folder, direction, Path("s.jpeg"))
    first = compose(task, EditParams()).split(". ")[0] + "."
    assert first == (tax.task_sentence(label.folder, label.modality, "add", where=view) if direction == "add"
                     else f"Take {label.noun('remove')} out of this {view}.")


def test_a_built_dataset_carries_the_task_sentences(builder_ours_run, tmp_path):
    """`medbanana build`: dpo_pairs' `prompt` is the task sentence of its row's finding and direction."""
    import pyarrow.parquet as pq

    from medbanana.cli import main

    assert main(["build", str(builder_ours_run), "--out", str(tmp_path / "ds"), "--configs", "dpo_pairs", "-q"]) == 0
    rows = pq.read_table(tmp_path / "ds" / "dpo_pairs", columns=["prompt", "disease", "modality", "task"]).to_pylist()
    tax = load_taxonomy()
    assert rows and all(r["prompt"] == tax.task_sentence(r["disease"], r["modality"], r["task"]) for r in rows)
    assert not any(r["prompt"].startswith(("Add pituitary ", "Add Pleural")) for r in rows)
