"""`medbanana judge-agreement`: Cohen's kappa on a textbook table, repeat consistency with a judge that flips
on known calls, human labels against a run's recorded verdicts, and the command."""

import argparse
import csv
import json
from collections import Counter

import numpy as np
import pytest
from test_evaluation_eval import chest_like, write_manifest

from medbanana.evaluation import commands
from medbanana.evaluation.agreement import (cohen_kappa, human_agreement, read_human_labels, repeat_consistency,
                                            run_agreement)
from medbanana.evaluation.inputs import open_samples
from medbanana.evaluation.judging import make_judge
from medbanana.generation.backends import Judge
from medbanana.generation.records import Verdict


def test_cohen_kappa_on_the_textbook_table():
    # 50 items: both yes 20, A yes / B no 5, A no / B yes 10, both no 15: po = 0.7, pe = 0.5*0.6 + 0.5*0.4 = 0.5
    pairs = [(True, True)] * 20 + [(True, False)] * 5 + [(False, True)] * 10 + [(False, False)] * 15
    assert cohen_kappa(pairs) == pytest.approx(0.4)
    assert cohen_kappa([(True, True), (False, False)]) == 1.0
    assert cohen_kappa([(True, False), (False, True)]) == pytest.approx(-1.0)
    assert cohen_kappa([(True, True)] * 3) is None  # chance agreement is total
    # three categories by hand: po = 6/10, marginals a .4/.5, b .3/.3, c .3/.2: pe = .2 + .09 + .06 = 0.35
    three = [("a", "a")] * 3 + [("b", "b")] * 2 + [("c", "c")] + [("a", "b")] + [("b", "c")] + [("c", "a")] * 2
    assert cohen_kappa(three) == pytest.approx((0.6 - 0.35) / 0.65)


def test_human_agreement_confusion_and_strict_lenient_rates():
    table = [(True, True)] * 20 + [(True, False)] * 5 + [(False, True)] * 10 + [(False, False)] * 15
    judge = {f"e{i}": {"qualified": j, "has_disease": True} for i, (j, _h) in enumerate(table)}
    human = {f"e{i}": {"qualified": h, "has_disease": True} for i, (_j, h) in enumerate(table)}
    human["unknown"] = {"qualified": True}
    result = human_agreement(judge, human)
    q = result["dimensions"]["qualified"]
    assert (q["edits"], q["agreement"], q["kappa"]) == (50, pytest.approx(0.7), pytest.approx(0.4))
    assert q["confusion"] == {"judge_yes_human_yes": 20, "judge_yes_human_no": 5, "judge_no_human_yes": 10,
                              "judge_no_human_no": 15}
    assert (q["too_strict"], q["too_lenient"]) == (pytest.approx(0.2), pytest.approx(0.1))
    assert result["dimensions"]["has_disease"]["agreement"] == 1.0
    assert result["unmatched_human_ids"] == ["unknown"] and result["edits"] == 50


def test_repeat_consistency_counts():
    same = {d: True for d in ("has_disease", "structure_reasonable", "looks_realistic", "fidelity_preserved",
                              "qualified")}
    flipped = {**same, "looks_realistic": False, "qualified": False}
    result = repeat_consistency({"a": [same, same], "b": [same, flipped, same], "c": [flipped, flipped],
                                 "single": [same]})
    assert (result["edits"], result["identical"], result["identical_rate"]) == (3, 2, pytest.approx(2 / 3))
    assert result["flips"] == {"has_disease": 0, "structure_reasonable": 0, "looks_realistic": 1,
                               "fidelity_preserved": 0, "qualified": 1}


class FlakyJudge(Judge):
    """Realism (and so qualified) fails on the second call for edits whose id ends in 1 or 3."""

    name = "flaky"

    def __init__(self):
        self.calls = Counter()

    async def judge(self, task, source, edited, instruction):
        key = str(task.source_path)
        realistic = not (key.endswith(("1", "3")) and self.calls[key] == 1)
        self.calls[key] += 1
        return Verdict(has_disease=True, structure_reasonable=True, looks_realistic=realistic,
                       fidelity_preserved=True, qualified=realistic, reason="")


@pytest.fixture
def four_edits(tmp_path):
    return write_manifest(tmp_path / "edits", [{"id": f"e{i}", "source": chest_like(32, i), "edited":
                                                chest_like(32, i + 10)} for i in range(4)])


def test_repeat_consistency_with_a_judge_that_flips(four_edits, tmp_path):
    judge = FlakyJudge()
    report = run_agreement(lambda: open_samples(four_edits), tmp_path / "out", judge=judge, repeats=3, limit=500)
    consistency = report["repeat_consistency"]
    assert (consistency["edits"], consistency["repeats"], consistency["identical_rate"]) == (4, 3, 0.5)
    assert consistency["flip_rate"]["looks_realistic"] == 0.5 and consistency["flip_rate"]["has_disease"] == 0.0
    assert sum(judge.calls.values()) == 12
    lines = [json.loads(line) for line in (tmp_path / "out" / "verdicts.jsonl").read_text().splitlines()]
    assert {line["id"]: len(line["repeats"]) for line in lines} == {f"e{i}": 3 for i in range(4)}
    with open(tmp_path / "out" / "repeat_consistency.csv") as fh:
        rows = {r["dimension"]: r for r in csv.DictReader(fh)}
    assert rows["qualified"]["edits that flipped"] == "2"


def test_limit_draws_a_seeded_sample_and_the_simulator_is_consistent(four_edits, tmp_path):
    runs = [run_agreement(lambda: open_samples(four_edits), tmp_path / f"out{i}", judge=make_judge("simulator"),
                          repeats=2, limit=2, seed=7) for i in range(2)]
    assert runs[0]["repeat_consistency"]["edits"] == 2 and runs[0]["repeat_consistency"]["identical_rate"] == 1.0
    chosen = [sorted(json.loads(line)["id"] for line in (tmp_path / f"out{i}" / "verdicts.jsonl").open())
              for i in range(2)]
    assert chosen[0] == chosen[1]


def test_human_labels_against_the_recorded_verdicts_of_a_run(builder_ours_run, tmp_path):
    samples = [s for s in open_samples(builder_ours_run, attempts="all") if s.recorded_verdict][:4]
    rows = [{"id": s.id, "qualified": str(s.recorded_verdict["qualified"] if i else not s.recorded_verdict[
        "qualified"]).lower(), "looks_realistic": "yes" if s.recorded_verdict["looks_realistic"] else "no"}
            for i, s in enumerate(samples)]
    rows.append({"id": "nowhere/add/x-AMD#1", "qualified": "true", "looks_realistic": ""})
    with open(tmp_path / "human.csv", "w", newline="") as fh:
        writer = csv.DictWriter(fh, ["id", "qualified", "looks_realistic"])
        writer.writeheader()
        writer.writerows(rows)
    report = run_agreement(lambda: open_samples(builder_ours_run, attempts="all"), tmp_path / "out",
                           human_csv=tmp_path / "human.csv")
    agreement = report["human_agreement"]
    assert agreement["dimensions"]["qualified"]["agreement"] == 0.75  # the first label was flipped
    assert agreement["dimensions"]["looks_realistic"]["agreement"] == 1.0
    assert agreement["unmatched_human_ids"] == ["nowhere/add/x-AMD#1"]
    assert report["judge_labels"] == {"recorded": 4, "judged_now": 0}
    flipped_judge_said = samples[0].recorded_verdict["qualified"]
    assert agreement["dimensions"]["qualified"]["too_lenient" if flipped_judge_said else "too_strict"] == 0.25
    assert "Confusion matrix" in (tmp_path / "out" / "report.md").read_text()


def test_human_csv_errors_are_clear(tmp_path):
    path = tmp_path / "h.csv"
    path.write_text("id,has_disease\ne1,true\n")
    with pytest.raises(ValueError, match="needs a qualified column"):
        read_human_labels(path)
    path.write_text("uid,round,qualified\nD/add/k-AMD,2,maybe\n")
    with pytest.raises(ValueError, match="'maybe' is not true/false"):
        read_human_labels(path)
    path.write_text("uid,round,qualified\nD/add/k-AMD,2,PASS\n")
    assert read_human_labels(path)["D/add/k-AMD#2"]["qualified"] is True
    with pytest.raises(ValueError, match="nothing to measure"):
        run_agreement(lambda: iter(()), tmp_path / "out")


def test_judge_agreement_command(four_edits, tmp_path, capsys):
    parser = argparse.ArgumentParser(prog="medbanana")
    commands.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["judge-agreement", str(four_edits), "--out", str(tmp_path / "out"), "--repeats", "2",
                              "--judge", "simulator"])
    assert args.func(args) == 0
    assert "repeat consistency: 100.0% identical over 4 edits x 2" in capsys.readouterr().out
    report = json.loads((tmp_path / "out" / "agreement.json").read_text())
    assert report["settings"]["judge"]["backend"] == "simulator" and report["settings"]["repeats"] == 2
    assert np.isclose(report["repeat_consistency"]["identical_rate"], 1.0)


def test_human_labels_against_a_built_judge_config_need_no_images(builder_ours_run, tmp_path):
    from medbanana.builder.build import build

    build([builder_ours_run], tmp_path / "ds", configs=["judge"], quiet=True)  # no source images in it
    samples = list(open_samples(tmp_path / "ds", config="judge"))[:3]
    assert all(s.problem and "source image" in s.problem for s in samples)
    (tmp_path / "h.csv").write_text("id,qualified\n" + "".join(
        f"{s.id},{str(bool(s.recorded_verdict['qualified'])).lower()}\n" for s in samples))
    report = run_agreement(lambda: open_samples(tmp_path / "ds", config="judge"), tmp_path / "out",
                           judge=make_judge("simulator"), human_csv=tmp_path / "h.csv")
    assert report["human_agreement"]["dimensions"]["qualified"]["agreement"] == 1.0
    assert report["human_agreement"]["edits"] == 3 and report["judge_errors"] == 0
