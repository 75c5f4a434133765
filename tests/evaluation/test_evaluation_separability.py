"""Separability probe: AUROC arithmetic, grouped folds (no source in train and test), the closed-form probe, the
permutation test and refit interval, the real-vs-real sanity check near 0.5, the raw/controlled split removing a pure
format confound, and the CLI writing its report."""

import io
import json

import numpy as np
import pytest
from PIL import Image

from medbanana.cli import main
from medbanana.evaluation.inputs import Sample
from medbanana.evaluation.probe_features import FeatureSettings, image_features, radial_spectrum
from medbanana.evaluation.probe_statistics import (
    RIDGE,
    auroc,
    group_folds,
    out_of_fold_scores,
    permuted_labels,
    probe,
)
from medbanana.evaluation.separability import run_separability


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
    groups = np.repeat(np.arange(30), 3)  # a source and two edits made from it
    fold = group_folds(groups, 5)
    assert sorted(np.bincount(fold)) == [18] * 5  # six groups a fold
    for k in range(5):
        assert not set(groups[fold == k]) & set(groups[fold != k])
    scores = out_of_fold_scores(np.random.default_rng(0).normal(size=(90, 5)), np.tile([0, 1, 1], 30), fold)
    assert scores.shape == (90,) and np.isfinite(scores).all()


def test_each_fold_is_the_ridge_discriminant_fitted_on_the_other_folds():
    """The closed form (fixed total covariance, class means per label set) equals a direct fit on the training part."""
    rng = np.random.default_rng(1)
    x, labels = rng.normal(size=(80, 6)), np.tile([0, 1], 40)
    x[labels == 1, 0] += 1.0
    fold = group_folds(np.arange(80), 4)
    scores = out_of_fold_scores(x, labels, fold)
    for k in range(4):
        train = x[fold != k]
        mean, scale = train.mean(axis=0), train.std(axis=0)
        z, y = (train - mean) / scale, labels[fold != k]
        mu1, mu0 = z[y == 1].mean(axis=0), z[y == 0].mean(axis=0)
        within = ((z[y == 1] - mu1).T @ (z[y == 1] - mu1) + (z[y == 0] - mu0).T @ (z[y == 0] - mu0)) / (len(z) - 2)
        coef = np.linalg.solve(within + RIDGE * np.eye(6), mu1 - mu0)
        expected = ((x[fold == k] - mean) / scale) @ coef - coef @ (mu0 + mu1) / 2
        assert np.allclose(scores[fold == k], expected)


def test_permutations_keep_the_design():
    """Inside a group (a source and its edits) labels are shuffled, never moved between groups of other sizes."""
    groups = np.concatenate([np.repeat(np.arange(20), 3), 100 + np.arange(10)])  # 20 triples, 10 single images
    labels = np.concatenate([np.tile([0, 1, 1], 20), [0] * 5 + [1] * 5])
    relabelled = permuted_labels(labels, groups, 50, seed=3)
    triples, singles = relabelled[:60], relabelled[60:]
    assert (triples.reshape(20, 3, 50).sum(axis=1) == 2).all() and (singles.sum(axis=0) == 5).all()
    assert (triples != labels[:60, None]).any() and (singles != labels[60:, None]).any()


def test_real_vs_real_comes_out_near_one_half():
    images = [encode(scan(seed), "JPEG", quality=85) for seed in range(160)]
    raw = np.stack([image_features(data, FeatureSettings(size=64, detail=0))[0] for data in images])
    labels = np.array([seed % 2 for seed in range(160)])
    result = probe(raw, labels, np.arange(160), bootstrap=100, permutations=99)
    assert abs(result.auroc - 0.5) < 0.15
    assert result.low < 0.5 < result.high and result.p_value > 0.05


def test_a_weak_difference_is_found_and_its_estimate_lies_in_its_interval():
    """A source and three edits per group (the duplicated groups that once pushed the interval off its estimate):
    a small shift of one feature is found (p small, interval above 0.5) and the estimate sits inside its interval."""
    rng = np.random.default_rng(4)
    groups, labels = np.repeat(np.arange(60), 4), np.tile([0, 1, 1, 1], 60)
    features = rng.normal(size=(240, 12)) + rng.normal(size=(60, 12)).repeat(4, axis=0)  # a source's edits resemble it
    features[labels == 1, 0] += 1.0
    result = probe(features, labels, groups, bootstrap=100, permutations=99)
    assert result.low <= result.auroc <= result.high
    assert result.low > 0.5 and result.p_value == pytest.approx(0.01)
    assert ((0 < result.scores) & (result.scores < 1)).all()


def test_the_interval_excludes_one_half_exactly_when_the_permutation_test_rejects():
    """From nothing to find to a clear difference: the interval lies above 0.5 when, and only when, p is in the
    permutation null's top 2.5 % (p <= 5/200 with 199 relabellings), and always holds its estimate."""
    rng = np.random.default_rng(6)
    labels, groups = np.tile([0, 1], 40), np.repeat(np.arange(40), 2)
    seen = set()
    for shift in np.repeat([0.0, 0.3, 0.5, 0.8], 8):
        features = rng.normal(size=(80, 6))
        features[labels == 1, 0] += shift
        result = probe(features, labels, groups, bootstrap=30, permutations=199, seed=int(rng.integers(1000)))
        assert result.low <= result.auroc <= result.high
        assert (result.low > 0.5) == (result.p_value <= 0.025), (shift, result)
        seen.add(result.low > 0.5)
    assert seen == {True, False}


def test_features_have_their_declared_length_and_see_jpeg_tables():
    array = scan(3, 128)
    settings = FeatureSettings(size=64, quality=90, detail=0)
    raw_png, controlled_png = image_features(encode(array), settings)
    raw_jpeg, _ = image_features(encode(array, "JPEG", quality=50), settings)
    raw_names, controlled_names = settings.names()
    assert raw_png.shape == (len(raw_names),) and controlled_png.shape == (len(controlled_names),)
    index = raw_names.index
    assert raw_png[index("is_jpeg")] == 0 and raw_jpeg[index("is_jpeg")] == 1
    assert raw_jpeg[index("luma_q_dc")] == 16  # the IJG quality-50 luminance table starts with 16
    assert raw_png[index("log2_width")] == 7


def test_the_detail_view_is_the_centre_at_the_detail_scale():
    """With `detail`, the second half of each vector measures a size² crop of the image's centre brought to detail²
    (raw as is, controlled re-encoded), after the whole view."""
    from medbanana.evaluation.probe_features import pixel_statistics, reencoded

    grey = Image.fromarray(scan(7, 300))
    settings = FeatureSettings(size=64, quality=90, detail=160)
    raw, controlled = image_features(encode(np.asarray(grey)), settings)
    crop = grey.resize((160, 160), Image.Resampling.BILINEAR).crop((48, 48, 112, 112))
    whole = grey.resize((64, 64), Image.Resampling.BILINEAR)
    n = len(pixel_statistics(np.zeros((64, 64), np.float32)))
    assert (len(raw), len(controlled)) == tuple(len(names) for names in settings.names()) and len(controlled) == 2 * n
    assert np.allclose(raw[-n:], pixel_statistics(np.asarray(crop, np.float32)), rtol=1e-5, atol=1e-5)
    assert np.allclose(controlled[:n], pixel_statistics(np.asarray(reencoded(whole, 90), np.float32)), atol=1e-5)
    assert np.allclose(controlled[n:], pixel_statistics(np.asarray(reencoded(crop, 90), np.float32)), atol=1e-5)
    with pytest.raises(ValueError, match="--probe-detail"):
        FeatureSettings(size=64, detail=32)


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
    # the whole view only: the detail view, near the stored resolution, keeps fine traces of the edits' JPEG coding
    result = run_separability(samples_with_format_confound(tmp_path),
                              settings=FeatureSettings(size=64, quality=90, detail=0), workers=1, bootstrap=100,
                              permutations=99)
    row = next(r for r in result["rows"] if r["comparison"] == "real vs accepted")
    assert (row["real"], row["compared"], row["sources"]) == (60, 60, 60)
    assert row["auroc_raw"] > 0.95 and row["p_raw"] == pytest.approx(0.01)  # file format alone gives the edits away
    assert row["low_controlled"] < 0.5 and row["p_controlled"] > 0.05  # re-encoded alike: nothing to find
    sanity = next(r for r in result["rows"] if r["comparison"] == "real vs real")
    assert sanity["real"] + sanity["compared"] == 60
    for which in ("raw", "controlled"):  # what the calibrated statistics promise when nothing separates the halves
        assert sanity[f"low_{which}"] <= sanity[f"auroc_{which}"] <= sanity[f"high_{which}"]
        assert sanity[f"low_{which}"] < 0.5 < sanity[f"high_{which}"] and sanity[f"p_{which}"] > 0.05
    assert len(result["images"]) == 120 and all(0 <= i["p_edit_raw"] <= 1 for i in result["images"])


def test_real_vs_real_split_is_the_same_in_any_folder(tmp_path):
    """The split depends on the images' order, not on where they sit (it hashed the path, and differed by machine)."""
    rows = []
    for name in ("a", "other folder"):
        (tmp_path / name).mkdir()
        result = run_separability(samples_with_format_confound(tmp_path / name, n=30),
                                  settings=FeatureSettings(size=64, quality=90, detail=128), workers=1, bootstrap=20,
                                  permutations=19)
        rows.append(next(r for r in result["rows"] if r["comparison"] == "real vs real"))
    assert rows[0] == rows[1] and (rows[0]["real"], rows[0]["compared"]) == (15, 15)


@pytest.mark.slow
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
                 "--probe-size", "64", "--probe-detail", "128", "--probe-workers", "2"])
    assert code == 0
    table = (out / "separability.csv").read_text().splitlines()
    assert table[0].startswith("features,modality,direction,comparison,real,compared,sources,AUROC raw")
    comparisons = [line.split(",")[3] for line in table[1:]]
    assert comparisons == ["real vs accepted", "real vs rejected", "real vs real"]
    accepted = json.loads((out / "separability.json").read_text())["rows"][0]
    assert (accepted["real"], accepted["compared"]) == (24, 16)
    report = (out / "report.md").read_text()
    assert "## By direction" in report and "## Separability (real vs edited)" in report
    assert table[0].endswith("AUROC raw,95% CI raw,p raw,AUROC controlled,95% CI controlled,p controlled")
    # in words: each number's meaning, what the probe cannot show, and each row read with its p and n
    assert "smallest possible p is 0.005" in report and "What it cannot show" in report
    readings = [line for line in report.splitlines() if line.startswith("- weight-free chest_xray")]
    assert len(readings) == 3 and "real vs accepted (24 sources)" in readings[0]
    assert "separable as stored, not once re-encoded alike" in readings[0] and "p = 0.005" in readings[0]
    assert (out / "separability.png").stat().st_size > 1000
    per_sample = (out / "probe_samples.csv").read_text().splitlines()
    assert per_sample[0].startswith("id,p_edit_raw,p_edit_controlled") and len(per_sample) == 25


@pytest.mark.slow
def test_pretrained_timm_features_from_a_folder_add_their_rows(tmp_path):
    timm = pytest.importorskip("timm")
    pytest.importorskip("torch").manual_seed(0)
    from timm.models import save_for_hf

    model_dir = tmp_path / "tiny-timm"
    save_for_hf(timm.create_model("test_vit", pretrained=False), model_dir)  # no network: random weights
    _check_pretrained_rows(tmp_path, f"timm:{model_dir}")


@pytest.mark.slow
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
                 "--probe-size", "64", "--probe-detail", "128", "--probe-workers", "1",
                 "--probe-features", spec]) == 0
    result = json.loads((out / "separability.json").read_text())
    assert result["settings"]["features"] == ["weight-free", spec]
    pretrained = [r for r in result["rows"] if r["features"] == spec]
    assert [r["comparison"] for r in pretrained] == ["real vs accepted", "real vs real"]
    assert pretrained[0]["real"] == pretrained[0]["compared"] == 12 and pretrained[0]["auroc_raw"] is not None
    header = (out / "probe_samples.csv").read_text().splitlines()[0]
    assert "p_edit_raw_pretrained" in header


@pytest.mark.slow
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
                 "--probe-detail", "128", "--probe-workers", "2"]) == 0
    rows = json.loads((out / "separability.json").read_text())["rows"]
    compared = {}
    for row in rows:
        compared[row["comparison"]] = compared.get(row["comparison"], 0) + row["compared"]
    assert compared["real vs accepted"] == len(accepted)
    assert compared["real vs rejected"] == len(rejected)


def test_eval_defaults_are_the_feature_defaults():
    """`--probe-size` and `--probe-detail` default to what bench_probe_power.py chose (probe_features)."""
    from medbanana.cli import build_parser
    from medbanana.evaluation.probe_features import PROBE_DETAIL, PROBE_SIZE

    args = build_parser().parse_args(["eval", "x", "--out", "y", "--separability"])
    assert (args.probe_size, args.probe_detail) == (PROBE_SIZE, PROBE_DETAIL) == (FeatureSettings().size,
                                                                                  FeatureSettings().detail)
