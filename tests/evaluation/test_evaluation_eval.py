"""`medbanana eval`: the documented input folder, built datasets and runs in; per-sample JSONL and tables out;
ROI policy, resume, the simulator and gemini (fake server) judges, failures kept as records."""

import argparse
import csv
import io
import json

import numpy as np
import pytest
from PIL import Image
from skimage.metrics import structural_similarity

from medbanana.builder.build import build
from medbanana.evaluation import commands
from medbanana.evaluation.evaluate import EvalOptions, evaluate, read_records
from medbanana.evaluation.inputs import open_samples
from medbanana.evaluation.judging import judge_description, make_judge
from medbanana.generation.testing.fake_gemini import FakeGemini

KEY = "test-key-eval-51c0"


def png(path, array):
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.asarray(array, np.uint8)).save(path)
    return path.name


def chest_like(size=64, seed=0):
    """Bright mediastinum, dark lungs, noise: enough structure for the anatomy estimate and the judge."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:size, 0:size]
    lungs = (np.abs(x - size / 2) > size * 0.1) & (np.abs(x - size / 2) < size * 0.4) & (y > size * 0.15) & (
        y < size * 0.85)
    grey = 190 - 110 * lungs + rng.normal(0, 5, (size, size))
    return np.repeat(np.clip(grey, 0, 255)[..., None], 3, axis=2).astype(np.uint8)


def write_manifest(folder, specs, fmt="jsonl"):
    """specs: dicts of sample fields, with arrays for source / edited / mask / ground_truth (written as PNG)."""
    rows = []
    for spec in specs:
        row = {"instruction": "Add a small pleural effusion.", "disease": "Pleural_Effusion", "direction": "add",
               **{k: v for k, v in spec.items() if not isinstance(v, np.ndarray)}}
        for key, value in spec.items():
            if isinstance(value, np.ndarray):
                row[key] = f"{key}/{spec['id']}.png"
                png(folder / row[key], value)
        rows.append(row)
    folder.mkdir(parents=True, exist_ok=True)
    if fmt == "csv":
        columns = sorted({k for r in rows for k in r})
        with open(folder / "samples.csv", "w", newline="") as fh:
            writer = csv.DictWriter(fh, columns)
            writer.writeheader()
            writer.writerows(rows)
    else:
        (folder / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


@pytest.fixture
def pixel_folder(tmp_path):
    source = chest_like()
    mask = np.zeros((64, 64), np.uint8)
    mask[30:50, 10:30] = 255
    confined = source.copy()
    confined[mask > 0] = 255 - confined[mask > 0]
    return write_manifest(tmp_path / "eval", [
        {"id": "same", "source": source, "edited": source, "mask": mask},
        {"id": "confined", "source": source, "edited": confined, "mask": mask, "ground_truth": confined},
        {"id": "derived", "source": source, "edited": confined, "modality": "chest_xray"},
        {"id": "lost", "source": source, "edited": "nowhere/lost.png"},
    ])


def run_eval(folder, out, judge=None, **options):
    settings = {"input": str(folder), "cp_mode": options.get("cp_mode", "correct"),
                "judge": judge_description(judge) if judge else None}
    options = EvalOptions(quiet=True, lpips=False, **options)
    return evaluate(open_samples(folder), out, settings=settings, options=options, judge=judge)


def test_pixel_metrics_per_sample_and_errors_kept_as_records(pixel_folder, tmp_path):
    summary = run_eval(pixel_folder, tmp_path / "out")
    records = read_records(tmp_path / "out" / "samples.jsonl")
    assert set(records) == {"same", "confined", "derived", "lost"}
    same, confined = records["same"], records["confined"]
    assert same["cp"] == pytest.approx(1.0, abs=1e-12) and same["psnr"] == 100.0 and same["roi"] == "given"
    assert confined["cp"] == pytest.approx(1.0, abs=1e-9) and confined["psnr"] < 30
    assert confined["psnr_gt"] == 100.0 and confined["ssim_gt"] == pytest.approx(1.0)
    assert confined["roi_fraction"] == pytest.approx(400 / 4096, abs=1e-5)
    assert records["derived"]["roi"] == "derived:costophrenic_angle"
    assert records["lost"]["status"] == "error" and "nowhere/lost.png" in records["lost"]["error"]
    assert (summary["samples"], summary["ok"], summary["errors"]) == (4, 3, 1)
    with open(tmp_path / "out" / "by_modality.csv") as fh:
        rows = {r["modality"]: r for r in csv.DictReader(fh)}
    assert set(rows) == {"chest_xray", "all"} and rows["all"]["samples"] == "3" and rows["all"]["errors"] == "1"
    assert "SSIM vs GT" in rows["all"] and "EA" not in rows["all"]  # no judge: no judge columns
    report = (tmp_path / "out" / "report.md").read_text()
    assert "## By disease" in report and "mode `correct`" in report


def test_roi_policy_full_image_without_derivation_and_for_unknown_targets(tmp_path):
    source, edited = chest_like(seed=1), chest_like(seed=2)
    folder = write_manifest(tmp_path / "eval", [
        {"id": "a", "source": source, "edited": edited},
        {"id": "b", "source": source, "edited": edited, "disease": "Pleural_Other"},  # a label, not a target
    ], fmt="csv")
    run_eval(folder, tmp_path / "plain", roi="none")
    records = read_records(tmp_path / "plain" / "samples.jsonl")
    full = structural_similarity(source, edited, channel_axis=-1)
    assert records["a"]["roi"] == "full_image" and records["a"]["cp"] == pytest.approx(full, abs=1e-12)
    run_eval(folder, tmp_path / "derived")
    records = read_records(tmp_path / "derived" / "samples.jsonl")
    assert records["a"]["roi"] == "derived:costophrenic_angle" and records["a"]["cp"] != pytest.approx(full)
    assert records["b"]["roi"].startswith("full_image (no region:") and "not an edit target" in records["b"]["roi"]


def test_resume_scores_only_what_is_missing_and_refuses_other_settings(pixel_folder, tmp_path):
    out = tmp_path / "out"
    run_eval(pixel_folder, out)
    with open(out / "samples.jsonl", "a") as fh:
        fh.write('{"id": "same", "sta')  # a write cut short by a crash
    lines = (out / "samples.jsonl").read_text().splitlines()
    png(pixel_folder / "nowhere" / "lost.png", chest_like())  # the missing edit appears
    summary = run_eval(pixel_folder, out)
    again = (out / "samples.jsonl").read_text().splitlines()
    assert again[: len(lines)] == lines and len(again) == len(lines) + 1  # only the failed sample, retried
    assert json.loads(again[-1])["id"] == "lost"
    assert summary["errors"] == 0 and read_records(out / "samples.jsonl")["lost"]["status"] == "ok"
    with pytest.raises(ValueError, match="other settings"):
        run_eval(pixel_folder, out, cp_mode="medebench")


def test_simulator_judge_scores_ea_vq_and_gives_cp_judge_from_its_verdict(pixel_folder, tmp_path):
    summary = run_eval(pixel_folder, tmp_path / "out", judge=make_judge("simulator"))
    records = read_records(tmp_path / "out" / "samples.jsonl")
    for record in (records["same"], records["confined"]):
        v = record["verdict"]
        assert 0.0 <= record["ea"] <= 10.0 and 0.0 <= record["vq"] <= 10.0  # the scorer's (test_evaluation_scoring)
        assert record["scores"]["model"] == "medbanana-pixel-judge-1"
        assert record["cp_judge"] == 10.0 * v["fidelity_preserved"]
        assert record["judge_prompt"] is None and v["model"] == "medbanana-pixel-judge-1"
    assert records["same"]["ea"] == 0.0  # nothing was added
    assert summary["settings"]["judge"]["backend"] == "simulator"
    overall = summary["overall"]
    assert overall["EA"] == pytest.approx(np.mean([records[i]["ea"] for i in ("same", "confined", "derived")]) / 10)


def test_gemini_judge_through_the_fake_server_records_the_prompt_and_failures(pixel_folder, tmp_path):
    with FakeGemini() as fake:
        judge = make_judge("gemini", api_key=KEY, base_url=fake.base_url, max_attempts=1, timeout=10.0)
        summary = run_eval(pixel_folder, tmp_path / "ok", judge=judge)
        record = read_records(tmp_path / "ok" / "samples.jsonl")["confined"]
        assert record["judge_prompt_version"] == "judge/1"
        assert "- Finding: Pleural Effusion" in record["judge_prompt"]
        assert "<instruction>\nAdd a small pleural effusion.\n</instruction>" in record["judge_prompt"]
        assert record["verdict"]["model"] == "gemini-2.5-pro" and 0.0 <= record["ea"] <= 10.0
        assert summary["settings"]["judge"]["prompt"] == "judge/1"
        assert "$instruction" in summary["settings"]["judge"]["prompt_template"]
        assert fake.count("judge") == 3
        fake.reset(faults=["500:first=100"])
        summary = run_eval(pixel_folder, tmp_path / "failing", judge=judge)
    record = read_records(tmp_path / "failing" / "samples.jsonl")["confined"]
    assert record["status"] == "ok" and record["cp"] == pytest.approx(1.0) and "ea" not in record
    assert "APIError" in record["judge_error"]
    assert summary["judge_errors"] == 3 and summary["ok"] == 3


@pytest.fixture(scope="module")
def built_sft(builder_ours_run, tmp_path_factory):
    out = tmp_path_factory.mktemp("eval_ds") / "ds"
    build([builder_ours_run], out, configs=["sft"], source_images=builder_ours_run.parent / "sources", quiet=True)
    return out


def test_a_built_dataset_and_a_models_edits_with_ground_truth(built_sft, tmp_path):
    samples = list(open_samples(built_sft))
    assert samples and all(s.source is not None and s.problem is None for s in samples)
    assert all(s.id.rsplit("#", 1)[1].isdigit() for s in samples)
    first = samples[0]
    uid = first.id.rsplit("#", 1)[0]
    model_output = np.asarray(Image.open(io.BytesIO(first.edited)).convert("RGB"))
    png(tmp_path / "edits" / f"{uid}.png", model_output)
    summary = evaluate(open_samples(built_sft, edits=tmp_path / "edits"), tmp_path / "out",
                       settings={"cp_mode": "correct"}, options=EvalOptions(quiet=True, lpips=False))
    records = read_records(tmp_path / "out" / "samples.jsonl")
    assert len(records) == len(samples) and summary["ok"] == 1
    scored = records[first.id]
    assert scored["psnr_gt"] > 40 and scored["ssim_gt"] > 0.95  # the output is the dataset's edit, re-encoded
    assert all("no model output" in r["error"] for i, r in records.items() if i != first.id)
    assert scored["roi"] == "edit_mask"  # the model is scored outside the dataset's own edit mask
    assert "ROI policy `auto`" in (tmp_path / "out" / "report.md").read_text()


def test_the_roi_policy_uses_the_rows_edit_mask_computes_it_for_runs_or_takes_the_region(built_sft,
                                                                                        builder_ours_run, tmp_path):
    from medbanana.generation.masks import edit_mask_array
    from medbanana.evaluation.inputs import read_image

    rows = list(open_samples(built_sft))
    assert all(s.edit_mask is not None for s in rows)  # built with sources: every sft row has its mask
    for roi, expected in (("auto", "edit_mask"), ("region", "derived:"), ("none", "full_image")):
        evaluate(iter(rows), tmp_path / roi, settings={"cp_mode": "correct", "roi": roi},
                 options=EvalOptions(quiet=True, lpips=False, roi=roi))
        records = read_records(tmp_path / roi / "samples.jsonl")
        assert all(r["roi"].startswith(expected) for r in records.values()), (roi, records)
    runs = list(open_samples(builder_ours_run, source_images=builder_ours_run.parent / "sources"))
    evaluate(iter(runs), tmp_path / "run", settings={"cp_mode": "correct"}, options=EvalOptions(quiet=True, lpips=False))
    records = read_records(tmp_path / "run" / "samples.jsonl")
    first = runs[0]
    computed = edit_mask_array(read_image(first.source), read_image(first.edited))
    assert records[first.id]["roi"] == "edit_mask:computed"
    assert records[first.id]["roi_fraction"] == pytest.approx(computed.mean(), abs=1e-4)


def test_manifest_errors_name_the_line(tmp_path):
    folder = tmp_path / "bad"
    folder.mkdir()
    (folder / "samples.jsonl").write_text(json.dumps({"id": "x", "source": "s.png", "edited": "e.png",
                                                      "instruction": "i", "disease": "AMD", "direction": "add"})
                                          + "\n" + json.dumps({"id": "y", "source": "s.png"}) + "\n")
    with pytest.raises(ValueError, match=r"samples.jsonl:2: missing edited, instruction, disease, direction"):
        open_samples(folder)
    (folder / "samples.jsonl").write_text(json.dumps({"id": "x", "source": "s.png", "edited": "e.png",
                                                      "instruction": "i", "disease": "AMD", "direction": "edit"}))
    with pytest.raises(ValueError, match="direction must be add or remove"):
        open_samples(folder)


def eval_parser():
    parser = argparse.ArgumentParser(prog="medbanana")
    commands.register(parser.add_subparsers(dest="command"))
    return parser


def test_eval_command_help_and_run(pixel_folder, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # where hints shown once are recorded
    with pytest.raises(SystemExit) as exited:
        eval_parser().parse_args(["eval", "--help"])
    assert exited.value.code == 0
    assert "--cp-mode {correct,medebench}" in capsys.readouterr().out
    args = eval_parser().parse_args(["eval", str(pixel_folder), "--out", str(tmp_path / "out"), "--judge", "none",
                                     "--cp-mode", "medebench", "-q"])
    assert args.func(args) == 0
    captured = capsys.readouterr()
    assert "3 samples scored, 1 errors" in captured.out and "LPIPS not computed" in captured.err
    assert "--no-lpips" in captured.err and "alexnet-owt-7be5be79.pth" in captured.err  # what it needs, exactly
    settings = json.loads((tmp_path / "out" / "eval-settings.json").read_text())
    assert settings["cp_mode"] == "medebench" and settings["judge"] is None
    # the next eval on this machine does not repeat the hint on stderr; its report still says LPIPS is missing
    args = eval_parser().parse_args(["eval", str(pixel_folder), "--out", str(tmp_path / "again"), "--judge", "none",
                                     "-q"])
    assert args.func(args) == 0
    assert "LPIPS" not in capsys.readouterr().err
    assert "LPIPS not computed" in (tmp_path / "again" / "report.md").read_text()
