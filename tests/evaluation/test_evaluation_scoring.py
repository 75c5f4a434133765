"""EA / VQ as MedEBench's 0-10 judge scores: the pixel judge's scores, the gemini scorer through the fake server
with the real client, and `medbanana eval` end to end (scorer, prompt recorded, fallback for backends that cannot
score)."""

import asyncio
import json
import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from test_evaluation_eval import KEY, chest_like, eval_parser, write_manifest

from medbanana.evaluation.evaluate import read_records
from medbanana.evaluation.judging import can_score, judge_description, make_judge
from medbanana.generation.backends import Judge
from medbanana.generation.testing.fake_gemini import FakeGemini
from medbanana.generation.prompts import load_prompt, score_prompt
from medbanana.generation.records import EditedImage, SourceImage, Task, encode_jpeg
from medbanana.generation.backends.simulator.editor import SimulatedEditor
from medbanana.generation.backends.simulator.judge import PixelJudge
from medbanana.generation.backends.simulator.phantoms import normal_source
from medbanana.generation.backends.simulator.scores import ramp
from medbanana.generation.backends.simulator.writer import compose, first_params


@pytest.fixture(scope="module")
def chest(tmp_path_factory) -> SourceImage:
    path = tmp_path_factory.mktemp("scoring") / "chest.jpeg"
    path.write_bytes(encode_jpeg(normal_source("chest_xray", 0, size=512)[0]))
    return SourceImage(path)


def simulated_edit(task: Task, source: SourceImage, **levels) -> EditedImage:
    text = compose(task, replace(first_params(task), **levels))
    return SimulatedEditor(jitter=0).edit_sync(task, source, text, seed=5)


def test_ramp_is_monotone_and_six_at_the_threshold():
    margins = [0.0, 0.3, 0.99, 1.0, 1.4, 1.99, 2.0, 5.0, math.inf]
    values = [ramp(m) for m in margins]
    assert values == sorted(values) and values[0] == 0.0 and values[-1] == 10.0
    assert ramp(1.0) == 6.0 and ramp(0.5) == 3.0 and ramp(1.5) == 8.0


def test_simulator_scores_unchanged_low_a_good_edit_high_and_a_hard_paste_lower_on_vq(chest):
    judge = PixelJudge()
    task = Task("test", "chest_xray", "Consolidation", "add", chest.path)
    unchanged = judge.score_sync(task, chest, EditedImage(encode_jpeg(chest.array)))
    good_edit = simulated_edit(task, chest, intensity=3, softness=2, grain=2)
    good = judge.score_sync(task, chest, good_edit)
    hard = judge.score_sync(task, chest, simulated_edit(task, chest, intensity=3, softness=0, grain=0))
    faint = judge.score_sync(task, chest, simulated_edit(task, chest, intensity=0, softness=2, grain=2))
    for scores in (unchanged, good, hard, faint):
        assert 0.0 <= scores.editing_accuracy <= 10.0 and 0.0 <= scores.visual_quality <= 10.0
    assert unchanged.editing_accuracy < 1.0 < good.editing_accuracy
    assert judge.judge_sync(task, chest, good_edit).qualified and good.editing_accuracy >= 6.0  # a pass: >= 6
    assert faint.editing_accuracy < good.editing_accuracy  # a weaker finding, a lower EA
    assert hard.visual_quality < good.visual_quality and hard.details["realism"] < good.details["realism"]
    assert good.details["cnr"] == judge.judge_sync(task, chest, good_edit).details["cnr"]  # the verdict's measures


def test_simulator_scores_a_removal(chest):
    judge = PixelJudge()
    task = Task("test", "chest_xray", "Consolidation", "add", chest.path)
    diseased = SourceImage(chest.path, data=simulated_edit(task, chest, intensity=3, softness=2, grain=2).data)
    removal = replace(task, direction="remove")
    kept = judge.score_sync(removal, diseased, EditedImage(diseased.data))
    cleared = judge.score_sync(removal, diseased, EditedImage(encode_jpeg(chest.array)))
    assert 0.0 <= kept.editing_accuracy < cleared.editing_accuracy <= 10.0
    assert "still visible" in kept.reason


def scored_folder(tmp_path):
    source = chest_like()
    mask = np.zeros((64, 64), np.uint8)
    mask[30:50, 10:30] = 255
    brighter = source.astype(np.int16)
    brighter[mask > 0] += 60
    brighter = np.clip(brighter, 0, 255).astype(np.uint8)
    return write_manifest(tmp_path / "eval", [
        {"id": "same", "source": source, "edited": source, "mask": mask},
        {"id": "brighter", "source": source, "edited": brighter, "mask": mask, "ground_truth": brighter},
    ])


def expected_scores(folder, sample_id, scorer=None):
    scorer = scorer or PixelJudge()
    row = next(json.loads(line) for line in (folder / "samples.jsonl").read_text().splitlines()
               if json.loads(line)["id"] == sample_id)
    task = Task("eval", "chest_xray", row["disease"], row["direction"], Path(sample_id))
    return scorer.score_sync(task, SourceImage(folder / row["source"]),
                             EditedImage((folder / row["edited"]).read_bytes()))


def run_cli(folder, out, *judge_args):
    args = eval_parser().parse_args(["eval", str(folder), "--out", str(out), "--no-lpips", "-q", *judge_args])
    assert args.func(args) == 0
    return json.loads((out / "summary.json").read_text()), read_records(out / "samples.jsonl")


def test_gemini_scorer_through_the_fake_server_returns_the_fakes_scores(chest):
    task = Task("test", "chest_xray", "Consolidation", "add", chest.path)
    edited = simulated_edit(task, chest, intensity=3, softness=2, grain=2)
    expected = PixelJudge().score_sync(task, chest, edited)
    with FakeGemini(faults=["malformed_json:first=1"]) as fake:
        judge = make_judge("gemini", api_key=KEY, base_url=fake.base_url, max_attempts=1, timeout=20.0)
        assert can_score(judge)
        scores = asyncio.run(judge.score(task, chest, edited, "Add a consolidation."))
        with_truth = asyncio.run(judge.score(task, chest, edited, "Add a consolidation.", ground_truth=chest))
        calls = list(fake.calls)
    assert (scores.editing_accuracy, scores.visual_quality) == (round(expected.editing_accuracy),
                                                                round(expected.visual_quality))
    assert scores.details["prompt"] == "eval_score/1" and scores.details["tries"] == 2  # re-asked once
    assert scores.model == "gemini-2.5-pro" and scores.reason == expected.reason
    assert [(c.role, c.images, c.fault) for c in calls] == [("scorer", 2, "malformed_json"), ("scorer", 2, ""),
                                                            ("scorer", 3, "")]
    assert with_truth.details["ground_truth"] and 0 <= with_truth.editing_accuracy <= 10


def test_score_prompt_names_the_images_sent():
    task = Task("test", "chest_xray", "Consolidation", "add", Path("x"))
    plain, truth = (score_prompt(task, " Add a consolidation. ", gt) for gt in (False, True))
    assert load_prompt("eval_score").version == "1"
    assert "GROUND-TRUTH edit made by experts" in truth and "GROUND-TRUTH edit made by experts" not in plain
    assert "<instruction>\nAdd a consolidation.\n</instruction>" in plain and "- Finding: Consolidation" in plain
    assert "$" not in plain


def test_eval_with_the_simulator_reports_its_scores_over_ten(tmp_path):
    folder = scored_folder(tmp_path)
    summary, records = run_cli(folder, tmp_path / "out", "--judge", "simulator")
    for sample_id in ("same", "brighter"):
        expected = expected_scores(folder, sample_id)
        assert records[sample_id]["ea"] == expected.editing_accuracy
        assert records[sample_id]["vq"] == expected.visual_quality
        assert records[sample_id]["scores"]["reason"] == expected.reason
    assert records["same"]["ea"] < records["brighter"]["ea"]
    assert summary["overall"]["EA"] == pytest.approx((records["same"]["ea"] + records["brighter"]["ea"]) / 20)
    settings = json.loads((tmp_path / "out" / "eval-settings.json").read_text())
    assert settings["judge"]["scores"]["method"] == "scorer"
    assert any("scored 0-10 by the simulator judge" in note for note in summary["notes"])


def test_eval_with_gemini_records_the_scoring_prompt_and_the_fakes_scores(tmp_path, monkeypatch):
    monkeypatch.setenv("GEMINI_API_KEY", KEY)
    folder = scored_folder(tmp_path)
    with FakeGemini() as fake:
        summary, records = run_cli(folder, tmp_path / "out", "--judge", "gemini", "--base-url", fake.base_url)
        assert fake.count("scorer") == 2 and fake.count("judge") == 2
    scoring = json.loads((tmp_path / "out" / "eval-settings.json").read_text())["judge"]["scores"]
    assert scoring["method"] == "scorer" and scoring["prompt"] == "eval_score/1"
    assert scoring["prompt_template"] == load_prompt("eval_score").template.template
    for sample_id in ("same", "brighter"):
        record = records[sample_id]
        assert record["ea"] == round(expected_scores(folder, sample_id).editing_accuracy)
        assert record["scores"]["prompt_version"] == "eval_score/1" and "cp_judge" in record
    assert "GROUND-TRUTH edit made by experts" in records["brighter"]["score_prompt"]
    assert "GROUND-TRUTH edit made by experts" not in records["same"]["score_prompt"]
    assert any("(prompt eval_score/1)" in note for note in summary["notes"])


class VerdictOnlyJudge(Judge):
    """A backend without `score`: EA / VQ must come from its verdict's passes."""

    name = "verdict-only"

    async def judge(self, task, source, edited, instruction):
        return PixelJudge().judge_sync(task, source, edited, instruction)


def test_a_backend_that_cannot_score_falls_back_to_its_verdict_and_says_so(tmp_path):
    from medbanana.evaluation.evaluate import EvalOptions, evaluate
    from medbanana.evaluation.inputs import open_samples

    judge = VerdictOnlyJudge()
    description = judge_description(judge)
    assert description["scores"]["method"] == "verdict_passes"
    folder = scored_folder(tmp_path)
    summary = evaluate(open_samples(folder), tmp_path / "out", settings={"judge": description},
                       options=EvalOptions(quiet=True, lpips=False), judge=judge)
    records = read_records(tmp_path / "out" / "samples.jsonl")
    for record in records.values():
        assert record["ea"] == 10.0 * record["verdict"]["has_disease"] and "scores" not in record
    assert any("cannot score" in note for note in summary["notes"])
