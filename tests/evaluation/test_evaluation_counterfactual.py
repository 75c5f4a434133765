"""Counterfactual validity: the per-edit and per-group arithmetic against hand computations on planted images (a
classifier whose output is a known function of the pixels), torchxrayvision built with weights=None (labels mapped
to the taxonomy, the same numbers as the package's own preprocessing), and a tiny ViT checkpoint folder through
the real CLI."""

import csv
import json

import numpy as np
import pytest
from medbanana.cli import main
from medbanana.evaluation.classifiers import XRV_TO_TAXONOMY, Classifier, load_classifier, xrv_classifier
from medbanana.evaluation.counterfactual import run_counterfactual, target_effect
from medbanana.generation.failures import UsageError
from medbanana.evaluation.inputs import Sample
from medbanana.generation.taxonomy import load_taxonomy
from PIL import Image


def flat(value: int, size: int = 32) -> np.ndarray:
    return np.full((size, size, 3), value, np.uint8)


def save(path, array):
    Image.fromarray(array).save(path)
    return path


def brightness_classifier() -> Classifier:
    """p(Pleural_Effusion) = mean/255, p(Cardiomegaly) = 1 - mean/255, p(Edema) = 0.3 always."""
    def predict(images):
        m = np.array([im.mean() / 255 for im in images])
        return np.stack([m, 1 - m, np.full_like(m, 0.3)], axis=1)
    return Classifier("planted", ["Pleural_Effusion", "Cardiomegaly", "Edema"], "chest_xray", predict)


def test_target_effect_by_hand():
    add = target_effect(np.array([0.2, 0.6, 0.1]), np.array([0.7, 0.5, 0.4]), 0, "add", 0.5)
    assert add["delta"] == pytest.approx(0.5) and add["crossed"] and add["right_direction"]
    assert add["other_change"] == pytest.approx((0.1 + 0.3) / 2)
    remove = target_effect(np.array([0.6, 0.2]), np.array([0.55, 0.2]), 0, "remove", 0.5)
    assert remove["delta"] == pytest.approx(-0.05) and remove["right_direction"] and not remove["crossed"]
    assert remove["other_change"] == 0


def test_planted_images_give_the_hand_computed_table(tmp_path):
    # add effusion: source mean 51 -> edit 153 (p 0.2 -> 0.6: +0.4, crosses 0.5; cardiomegaly 0.8 -> 0.4)
    # add effusion: source mean 51 -> edit 102 (p 0.2 -> 0.4: +0.2, no crossing; cardiomegaly 0.8 -> 0.6)
    # remove effusion: source mean 204 -> edit 76.5 rounded to 76 (p 0.8 -> 76/255, crosses)
    # Lung_Lesion: no classifier output -> not covered
    src_low, src_high = save(tmp_path / "low.png", flat(51)), save(tmp_path / "high.png", flat(204))
    specs = [("a1", src_low, 153, "add", "Pleural_Effusion"), ("a2", src_low, 102, "add", "Pleural_Effusion"),
             ("r1", src_high, 76, "remove", "Pleural_Effusion"), ("x", src_low, 90, "add", "Lung_Lesion")]
    samples = [Sample(id=i, dataset="d", modality="chest_xray", disease=disease, direction=direction,
                      instruction="", source=src, edited=save(tmp_path / f"{i}.png", flat(value)))
               for i, src, value, direction, disease in specs]
    result = run_counterfactual(samples, brightness_classifier(), threshold=0.5)
    by_id = {r["id"]: r for r in result["samples"]}
    assert by_id["a1"]["delta"] == pytest.approx(0.4) and by_id["a1"]["crossed"]
    assert by_id["a2"]["delta"] == pytest.approx(0.2) and not by_id["a2"]["crossed"]
    # others: cardiomegaly moves by |delta|, edema by 0 -> mean |delta| / 2
    assert by_id["a1"]["other_change"] == pytest.approx(0.2)
    assert by_id["r1"]["delta"] == pytest.approx(76 / 255 - 0.8) and by_id["r1"]["crossed"]
    assert result["not_covered"] == {"Lung_Lesion": 1}
    rows = {(r["disease"], r["direction"]): r for r in result["rows"]}
    add = rows[("Pleural_Effusion", "add")]
    assert add["edits"] == 2 and add["mean_delta"] == pytest.approx(0.3)
    assert add["crossed"] == pytest.approx(0.5) and add["right_direction"] == 1.0
    assert add["other_change"] == pytest.approx((0.2 + 0.1) / 2)
    assert rows[("all", "remove")]["edits"] == 1


def test_torchxrayvision_untrained_model_maps_labels_and_matches_its_own_preprocessing():
    xrv = pytest.importorskip("torchxrayvision")
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    model = xrv.models.DenseNet(weights=None)
    with torch.no_grad():  # an untrained head saturates the sigmoid; scaled down, a wrong input would show
        model.classifier.weight.mul_(1e-3)
        model.classifier.bias.zero_()
    classifier = xrv_classifier(model)
    taxonomy = load_taxonomy()
    assert len(classifier.labels) == len(XRV_TO_TAXONOMY) == 12
    assert all(taxonomy.find(label, "chest_xray").folder == label for label in classifier.labels)
    assert classifier.index("Pleural_Effusion") is not None and classifier.index("Hernia") is None
    y, x = np.mgrid[0:300, 0:260]
    image = np.clip(128 + 80 * np.sin(x / 23.0) * np.cos(y / 31.0) + y / 6, 0, 255).astype(np.uint8)
    ours = classifier.predict([np.repeat(image[..., None], 3, axis=2)])[0]
    # the package's own way: normalise, centre-crop, resize to 224
    ref = xrv.datasets.normalize(image.astype(np.float32), 255)[None]
    ref = xrv.datasets.XRayCenterCrop()(ref)
    ref = xrv.datasets.XRayResizer(224)(ref)
    assert np.ptp(ours) > 0.05  # the outputs differ by label: a label mix-up would show
    with torch.no_grad():
        expected = torch.sigmoid(model(torch.from_numpy(ref[None].astype(np.float32)))).numpy()[0]
    names = list(xrv.datasets.default_pathologies)
    for label, value in zip(classifier.labels, ours):
        xrv_name = next(k for k, v in XRV_TO_TAXONOMY.items() if v == label)
        assert value == pytest.approx(expected[names.index(xrv_name)], abs=2e-3)


@pytest.fixture
def tiny_vit(tmp_path):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("torch").manual_seed(0)
    config = transformers.ViTConfig(image_size=32, patch_size=8, hidden_size=16, num_hidden_layers=1,
                                    num_attention_heads=2, intermediate_size=32, num_labels=3,
                                    id2label={0: "Pleural Effusion", 1: "Cardiomegaly", 2: "normal"},
                                    label2id={"Pleural Effusion": 0, "Cardiomegaly": 1, "normal": 2})
    folder = tmp_path / "tiny-vit"
    transformers.ViTForImageClassification(config).save_pretrained(folder)
    transformers.ViTImageProcessor(size={"height": 32, "width": 32}).save_pretrained(folder)
    return folder


@pytest.mark.slow
def test_checkpoint_folder_through_the_cli_matches_the_model_called_directly(tmp_path, tiny_vit):
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    classifier = load_classifier(str(tiny_vit))
    assert classifier.labels == ["Pleural_Effusion", "Cardiomegaly", "normal"]
    folder = tmp_path / "in"
    folder.mkdir()
    rng = np.random.default_rng(1)
    rows, arrays = [], {}
    for i in range(4):
        arrays[f"s{i}"] = rng.integers(0, 256, (48, 48, 3), dtype=np.uint8)
        arrays[f"e{i}"] = np.clip(arrays[f"s{i}"].astype(int) + 60, 0, 255).astype(np.uint8)
        save(folder / f"s{i}.png", arrays[f"s{i}"])
        save(folder / f"e{i}.png", arrays[f"e{i}"])
        rows.append({"id": f"c{i}", "source": f"s{i}.png", "edited": f"e{i}.png", "instruction": "Add an effusion.",
                     "disease": "Pleural_Effusion", "direction": "add"})
    (folder / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out"
    assert main(["eval", str(folder), "--out", str(out), "--judge", "none", "--no-lpips", "-q",
                 "--classifier", str(tiny_vit)]) == 0
    model = transformers.AutoModelForImageClassification.from_pretrained(tiny_vit).eval()
    processor = transformers.AutoImageProcessor.from_pretrained(tiny_vit)

    def probs(array):
        with torch.no_grad():
            pixels = processor(images=[Image.fromarray(array)], return_tensors="pt")["pixel_values"]
            return torch.softmax(model(pixel_values=pixels).logits, -1).numpy()[0]

    expected = [probs(arrays[f"e{i}"]) - probs(arrays[f"s{i}"]) for i in range(4)]
    with open(out / "probe_samples.csv", newline="") as fh:
        per_sample = {r["id"]: r for r in csv.DictReader(fh)}
    for i in range(4):
        assert float(per_sample[f"c{i}"]["delta"]) == pytest.approx(expected[i][0], abs=1e-5)
        assert float(per_sample[f"c{i}"]["other_change"]) == pytest.approx(np.abs(expected[i][1:]).mean(), abs=1e-5)
    summary = json.loads((out / "counterfactual.json").read_text())
    row = next(r for r in summary["rows"] if r["disease"] == "Pleural_Effusion")
    assert row["mean_delta"] == pytest.approx(np.mean([e[0] for e in expected]), abs=1e-5)
    assert "## Counterfactual validity" in (out / "report.md").read_text()
    assert (out / "counterfactual.png").stat().st_size > 1000


def test_bad_classifier_spec_is_one_line_error(tmp_path, capsys):
    (tmp_path / "in").mkdir()
    empty = tmp_path / "not-a-model"
    empty.mkdir()
    Image.fromarray(flat(10)).save(tmp_path / "in" / "a.png")
    (tmp_path / "in" / "samples.jsonl").write_text(json.dumps(
        {"id": "a", "source": "a.png", "edited": "a.png", "instruction": "x", "disease": "Edema",
         "direction": "add"}) + "\n")
    code = main(["eval", str(tmp_path / "in"), "--out", str(tmp_path / "out"), "--judge", "none",
                 "--classifier", str(empty)])
    assert code != 0
    assert "no config.json" in capsys.readouterr().err
    assert not (tmp_path / "out" / "samples.jsonl").exists()  # refused before anything was scored


def _one_sample(folder):
    folder.mkdir()
    Image.fromarray(flat(10, 64)).save(folder / "a.png")
    Image.fromarray(flat(40, 64)).save(folder / "b.png")
    (folder / "samples.jsonl").write_text(json.dumps(
        {"id": "a", "source": "a.png", "edited": "b.png", "instruction": "x", "disease": "Pleural_Effusion",
         "direction": "add"}) + "\n")
    return folder


def _xrv_weights_file(path, seed: int):
    """A DenseNet saved the way torchxrayvision's release files are (the whole model pickled), random weights."""
    xrv = pytest.importorskip("torchxrayvision")
    torch = pytest.importorskip("torch")
    torch.manual_seed(seed)
    model = xrv.models.DenseNet(weights=None)
    with torch.no_grad():  # an untrained head saturates the sigmoid
        model.classifier.weight.mul_(1e-3)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(model, path)
    return path


def test_torchxrayvision_without_its_weights_offline_fails_in_one_line_naming_the_file(tmp_path, monkeypatch,
                                                                                       capsys):
    pytest.importorskip("torchxrayvision")
    from medbanana.evaluation.classifiers import xrv_weights_path

    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # an empty torchxrayvision cache
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    expected, url = xrv_weights_path("densenet121-res224-all")
    assert expected.parent == tmp_path / "home" / ".torchxrayvision" / "models_data"
    code = main(["eval", str(_one_sample(tmp_path / "in")), "--out", str(tmp_path / "out"), "--judge", "none",
                 "--classifier", "torchxrayvision:densenet121-res224-all"])
    captured = capsys.readouterr()
    assert code == 2 and captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and str(expected) in lines[0] and url in lines[0] and "--classifier-weights" in lines[0]
    assert not expected.exists() and not (tmp_path / "out" / "samples.jsonl").exists()


@pytest.mark.slow
def test_torchxrayvision_weights_placed_in_its_cache_or_given_as_a_file(tmp_path, monkeypatch):
    pytest.importorskip("torchxrayvision")
    from medbanana.evaluation.classifiers import xrv_weights_path

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # nothing may be downloaded: the files below are all there is
    expected, _ = xrv_weights_path("densenet121-res224-all")
    _xrv_weights_file(expected, seed=0)
    elsewhere = _xrv_weights_file(tmp_path / "my weights" / "chest.pt", seed=0)
    other = _xrv_weights_file(tmp_path / "other.pt", seed=1)
    image = np.repeat(np.clip(np.arange(64 * 64).reshape(64, 64) % 251, 0, 255).astype(np.uint8)[..., None], 3, 2)
    cached = load_classifier("torchxrayvision:densenet121-res224-all").predict([image])
    given = load_classifier("torchxrayvision:densenet121-res224-all", elsewhere).predict([image])
    different = load_classifier("torchxrayvision:densenet121-res224-all", other).predict([image])
    assert np.allclose(cached, given) and not np.allclose(cached, different, atol=1e-4)
    out = tmp_path / "out"  # the same through the CLI, the file given as an option
    assert main(["eval", str(_one_sample(tmp_path / "in")), "--out", str(out), "--judge", "none", "--no-lpips",
                 "-q", "--classifier", "torchxrayvision:densenet121-res224-all",
                 "--classifier-weights", str(other)]) == 0
    with open(out / "probe_samples.csv", newline="") as fh:
        assert float(next(csv.DictReader(fh))["p_source"]) >= 0


def test_a_hub_id_under_hf_hub_offline_is_looked_up_in_the_cache_only(tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))  # an empty cache
    with pytest.raises(UsageError) as caught:
        load_classifier("no-such-org/no-such-classifier")
    message = str(caught.value)
    assert "\n" not in message and "no-such-org/no-such-classifier" in message and "HF_HUB_OFFLINE" in message


def test_classifier_weights_without_a_torchxrayvision_classifier_is_refused(tmp_path, capsys, tiny_vit):
    folder = _one_sample(tmp_path / "in")
    for extra in ([], ["--classifier", str(tiny_vit)]):
        code = main(["eval", str(folder), "--out", str(tmp_path / "out"), "--judge", "none",
                     "--classifier-weights", str(tmp_path / "w.pt"), *extra])
        assert code == 2 and "--classifier-weights applies to --classifier torchxrayvision" in capsys.readouterr().err
