"""Separability probe: AUROC arithmetic, grouped folds (no source in train and test), the real-vs-real sanity check
near 0.5, the raw/controlled split removing a pure format confound, and the CLI writing its report."""

import io
import json

import numpy as np
import pytest
from PIL import Image

pytest.importorskip("sklearn")

from medbanana.cli import main
from medbanana.evaluation.inputs import Sample
from medbanana.evaluation.probe_features import (
    CONTROLLED_FEATURES,
    RAW_FEATURES,
    FeatureSettings,
    image_features,
    radial_spectrum,
)
from medbanana.evaluation.separability import (
    auroc,
    grouped_bootstrap_interval,
    out_of_fold_scores,
    probe,
    run_separability,
)


def scan(seed: int, size: int = 96) -> np.ndarray:
    """A chest-like grey image: smooth anatomy whose layout varies with the seed, plus sensor noise."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:size, 0:size] / size
    field = 120 + 50 * np.sin(6 * x + rng.uniform(0, 6)) * np.cos(5 * y + rng.uniform(0, 6))
    lungs = (np.abs(x - 0.5) > 0.1) & (np.abs(x - 0.5) < 0.4) & (y > 0.15) & (y < 0.85)
    return np.clip(field - 60 * lungs + rng.normal(0, 6, (size, size)), 0, 255).astype(np.uint8)


def encode(array: np.ndarray, fmt: str = "PNG", **kw) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(array).save(buffer, fmt, **kw)
    return buffer.getvalue()


def test_auroc_matches_a_hand_count():
    # pairs (edit, real): (0.35, 0.1) win, (0.35, 0.4) loss, (0.8, 0.1) win, (0.8, 0.4) win -> 3/4
    assert auroc(np.array([0.1, 0.4, 0.35, 0.8]), np.array([0, 0, 1, 1])) == pytest.approx(0.75)
    assert auroc(np.array([0.5, 0.5]), np.array([0, 1])) == pytest.approx(0.5)  # a tie counts half
    assert auroc(np.array([0.1, 0.2]), np.array([1, 1])) is None


def test_folds_never_put_one_source_in_train_and_test():
    rng = np.random.default_rng(0)
    groups = np.repeat(np.arange(30), 3)  # a source and two edits made from it
    labels = np.tile([0, 1, 1], 30)
    scores, splits = out_of_fold_scores(rng.normal(size=(90, 5)), labels, groups)
    assert len(splits) == 5
    tested = np.concatenate([test for _, test in splits])
    assert sorted(tested) == list(range(90))  # every row scored exactly once, out of fold
    for train, test in splits:
        assert not set(groups[train]) & set(groups[test])
    assert np.isfinite(scores).all()


def test_real_vs_real_comes_out_near_one_half():
    images = [encode(scan(seed), "JPEG", quality=85) for seed in range(160)]
    raw = np.stack([image_features(data, FeatureSettings(size=64))[0] for data in images])
    labels = np.array([seed % 2 for seed in range(160)])
    result = probe(raw, labels, np.arange(160), repeats=300)
    assert abs(result.auroc - 0.5) < 0.15
    assert result.low < 0.5 < result.high


def test_interval_is_a_grouped_bootstrap_around_the_estimate():
    rng = np.random.default_rng(2)
    labels = np.tile([0, 1], 100)
    scores = rng.normal(size=200) + 0.8 * labels
    low, high = grouped_bootstrap_interval(scores, labels, np.repeat(np.arange(100), 2), repeats=400)
    assert low < auroc(scores, labels) < high
    assert 0.05 < high - low < 0.3


def test_features_have_their_declared_length_and_see_jpeg_tables():
    array = scan(3, 128)
    raw_png, controlled_png = image_features(encode(array), FeatureSettings(size=64, quality=90))
    raw_jpeg, _ = image_features(encode(array, "JPEG", quality=50), FeatureSettings(size=64, quality=90))
    assert raw_png.shape == (len(RAW_FEATURES),) and controlled_png.shape == (len(CONTROLLED_FEATURES),)
    index = RAW_FEATURES.index
    assert raw_png[index("is_jpeg")] == 0 and raw_jpeg[index("is_jpeg")] == 1
    assert raw_jpeg[index("luma_q_dc")] == 16  # the IJG quality-50 luminance table starts with 16
    assert raw_png[index("log2_width")] == 7


def test_radial_spectrum_puts_a_fine_pattern_in_the_high_bands():
    _, x = np.mgrid[0:64, 0:64]
    coarse = radial_spectrum((128 + 60 * np.sin(x / 6.0)).astype(np.float32))
    fine = radial_spectrum((128 + 60 * np.sin(x * 2.5)).astype(np.float32))
    assert np.argmax(coarse) < np.argmax(fine)


def samples_with_format_confound(folder, n=60):
    """Real sources as grey PNG; 'edits' are other real scans of the same kind stored as RGB JPEG quality 97."""
    samples = []
    for i in range(n):
        source, edit = folder / f"src-{i}.png", folder / f"edit-{i}.jpg"
        source.write_bytes(encode(scan(i)))
        edit.write_bytes(encode(np.repeat(scan(1000 + i)[..., None], 3, axis=2), "JPEG", quality=97))
        samples.append(Sample(id=f"s{i}", dataset="eval", modality="chest_xray", disease="Pleural_Effusion",
                              direction="add", instruction="add", source=source, edited=edit))
    return samples


def test_format_confound_shows_raw_and_vanishes_controlled(tmp_path):
    result = run_separability(samples_with_format_confound(tmp_path), settings=FeatureSettings(size=64, quality=90),
                              workers=1, repeats=200)
    row = next(r for r in result["rows"] if r["comparison"] == "real vs accepted")
    assert (row["real"], row["compared"], row["sources"]) == (60, 60, 60)
    assert row["auroc_raw"] > 0.95  # file format alone gives the edits away
    assert row["auroc_controlled"] < 0.75 and row["low_controlled"] < 0.5  # re-encoded alike: near chance
    sanity = next(r for r in result["rows"] if r["comparison"] == "real vs real")
    assert sanity["real"] + sanity["compared"] == 60
    assert sanity["low_raw"] < 0.5 < sanity["high_raw"] and sanity["low_controlled"] < 0.5 < sanity["high_controlled"]
    assert len(result["images"]) == 120 and all(0 <= i["p_edit_raw"] <= 1 for i in result["images"])


def test_real_vs_real_split_is_the_same_in_any_folder(tmp_path):
    """The split depends on the images' order, not on where they sit (it hashed the path, and differed by machine)."""
    rows = []
    for name in ("a", "other folder"):
        (tmp_path / name).mkdir()
        result = run_separability(samples_with_format_confound(tmp_path / name, n=30),
                                  settings=FeatureSettings(size=64, quality=90), workers=1, repeats=50)
        rows.append(next(r for r in result["rows"] if r["comparison"] == "real vs real"))
    assert rows[0] == rows[1] and (rows[0]["real"], rows[0]["compared"]) == (15, 15)


def test_eval_cli_writes_the_separability_report(tmp_path):
    folder = tmp_path / "in"
    folder.mkdir()
    rows = []
    for i, sample in enumerate(samples_with_format_confound(folder, n=24)):
        rows.append({"id": sample.id, "source": sample.source.name, "edited": sample.edited.name,
                     "instruction": "Add a pleural effusion.", "disease": "Pleural Effusion", "direction": "add",
                     "accepted": "true" if i % 3 else "false"})
    (folder / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out"
    code = main(["eval", str(folder), "--out", str(out), "--judge", "none", "--no-lpips", "-q", "--separability",
                 "--probe-size", "64", "--probe-workers", "2"])
    assert code == 0
    table = (out / "separability.csv").read_text().splitlines()
    assert table[0].startswith("features,modality,direction,comparison,real,compared,sources,AUROC raw")
    comparisons = [line.split(",")[3] for line in table[1:]]
    assert comparisons == ["real vs accepted", "real vs rejected", "real vs real"]
    accepted = json.loads((out / "separability.json").read_text())["rows"][0]
    assert (accepted["real"], accepted["compared"]) == (24, 16)
    report = (out / "report.md").read_text()
    assert "## By direction" in report and "## Separability (real vs edited)" in report
    assert (out / "separability.png").stat().st_size > 1000
    per_sample = (out / "probe_samples.csv").read_text().splitlines()
    assert per_sample[0].startswith("id,p_edit_raw,p_edit_controlled") and len(per_sample) == 25


def test_pretrained_timm_features_from_a_folder_add_their_rows(tmp_path):
    timm = pytest.importorskip("timm")
    pytest.importorskip("torch").manual_seed(0)
    from timm.models import save_for_hf

    model_dir = tmp_path / "tiny-timm"
    save_for_hf(timm.create_model("test_vit", pretrained=False), model_dir)  # no network: random weights
    _check_pretrained_rows(tmp_path, f"timm:{model_dir}")


def test_open_clip_features_from_a_checkpoint_file_add_their_rows(tmp_path):
    """`open_clip:MODEL/PRETRAINED` with PRETRAINED a checkpoint file, as open_clip's own releases are saved (a
    state dict). The architecture is a tiny one registered the way open_clip takes custom configs: weights of a
    released model are hundreds of MB and need the network."""
    open_clip = pytest.importorskip("open_clip")
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    configs = tmp_path / "configs"
    configs.mkdir()
    (configs / "medbanana-tiny-clip.json").write_text(json.dumps({
        "embed_dim": 16, "vision_cfg": {"image_size": 32, "layers": 1, "width": 32, "head_width": 16, "patch_size": 8},
        "text_cfg": {"context_length": 16, "vocab_size": 64, "width": 32, "heads": 2, "layers": 1}}))
    open_clip.add_model_config(configs)
    checkpoint = tmp_path / "open_clip_model.bin"
    torch.save(open_clip.create_model("medbanana-tiny-clip").state_dict(), checkpoint)
    spec = f"open_clip:medbanana-tiny-clip/{checkpoint}"
    _check_pretrained_rows(tmp_path, spec)

    from PIL import Image

    from medbanana.evaluation.probe_embeddings import load_embedder

    image = Image.fromarray(np.repeat(scan(3)[..., None], 3, axis=2))
    embeddings = []
    for seed in (1, 2):  # the checkpoint's weights, not a random initialisation, whatever the seed
        torch.manual_seed(seed)
        embeddings.append(load_embedder(spec).embed_batch([image]))
    assert embeddings[0].shape == (1, 16) and np.array_equal(embeddings[0], embeddings[1])


def _check_pretrained_rows(tmp_path, spec: str) -> None:
    """`eval --separability --probe-features SPEC` on 12 pairs adds SPEC's rows, raw and controlled."""
    folder = tmp_path / "in"
    folder.mkdir()
    rows = [{"id": s.id, "source": s.source.name, "edited": s.edited.name, "instruction": "Add an effusion.",
             "disease": "Pleural_Effusion", "direction": "add"} for s in samples_with_format_confound(folder, n=12)]
    (folder / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out"
    assert main(["eval", str(folder), "--out", str(out), "--judge", "none", "--no-lpips", "-q", "--separability",
                 "--probe-size", "64", "--probe-workers", "1", "--probe-features", spec]) == 0
    result = json.loads((out / "separability.json").read_text())
    assert result["settings"]["features"] == ["weight-free", spec]
    pretrained = [r for r in result["rows"] if r["features"] == spec]
    assert [r["comparison"] for r in pretrained] == ["real vs accepted", "real vs real"]
    assert pretrained[0]["real"] == pretrained[0]["compared"] == 12 and pretrained[0]["auroc_raw"] is not None
    header = (out / "probe_samples.csv").read_text().splitlines()[0]
    assert "p_edit_raw_pretrained" in header


def test_run_directory_all_attempts_gives_accepted_and_rejected_rows(builder_ours_run, tmp_path):
    from medbanana.evaluation.inputs import open_samples

    sources = builder_ours_run.parent / "sources"
    every = [s for s in open_samples(builder_ours_run, source_images=sources, attempts="all") if not s.problem]
    accepted = {s.id for s in open_samples(builder_ours_run, source_images=sources) if not s.problem}
    assert accepted and {s.id for s in every if s.accepted} == accepted  # the run's choice, not the judge's
    rejected = [s for s in every if s.accepted is False]
    assert rejected
    out = tmp_path / "out"
    assert main(["eval", str(builder_ours_run), "--source-images", str(sources), "--all-attempts", "--out", str(out),
                 "--judge", "none", "--no-lpips", "-q", "--separability", "--probe-size", "64",
                 "--probe-workers", "2"]) == 0
    rows = json.loads((out / "separability.json").read_text())["rows"]
    compared = {}
    for row in rows:
        compared[row["comparison"]] = compared.get(row["comparison"], 0) + row["compared"]
    assert compared["real vs accepted"] == len(accepted)
    assert compared["real vs rejected"] == len(rejected)
