"""The path a user takes, through the real CLI on the simulator's run: `review --calibration` draws the sample, a
rater answers it, `review export` writes the labels, `calibrate` chooses a rule with its guarantee, `build --accept`
re-decides the run by it and the card states the rule and the experts' approval; `review --only` opens exactly the
edits calibrate could not decide. The rater is simulated: an edit is qualified when its judge score is >= 0.8."""

from __future__ import annotations

import csv
import json
from collections import Counter

import pytest
from medbanana.cli import main
from medbanana.generation.acceptance import AcceptanceRule
from medbanana.review.judged import judged_tasks
from medbanana.generation.dataset.review_folder import Answer
from medbanana.review.store import ReviewStore

EXPERT_BAR = 0.8  # the simulated expert approves an edit whose judge score is at least this


def answer_all(folder, rater="Ann") -> int:
    store = ReviewStore.open(folder)
    n = 0
    while (item := store.next_item(rater)) is not None:
        qualified = (item.judge or {}).get("score", 0) >= EXPERT_BAR
        store.submit(rater, item.item_id, Answer(has_disease=True, structure_reasonable=True, looks_realistic=True,
                                                 fidelity_preserved=True, qualified=qualified))
        n += 1
    return n


def first_passing(run, rule: AcceptanceRule) -> dict[str, int]:
    """uid -> round of each task's first judged attempt the rule passes, from the run read independently."""
    found = {}
    for task in judged_tasks(run):
        for attempt in task.attempts:
            if rule.accepts(attempt.values, task.direction, task.modality):
                found[task.uid] = attempt.round
                break
    return found


@pytest.fixture(scope="module")
def calibrated(demo_run_root, tmp_path_factory):
    root = tmp_path_factory.mktemp("calibrate")
    demo = demo_run_root / "demo-run"
    run, sources = demo / "run", demo / "sources"
    assert main(["review", str(run), "--out", str(root / "review"), "--calibration", "--items", "70",
                 "--raters-per-item", "1", "--no-serve", "--source-images", str(sources)]) == 0
    answered = answer_all(root / "review")
    assert main(["review", "export", str(root / "review"), "--out", str(root / "labels.csv")]) == 0
    code = main(["calibrate", str(root / "labels.csv"), "--run", str(run), "--target-precision", "0.8", "--delta",
                 "0.2", "--out", str(root / "policy.json"), "--bootstrap", "200"])
    assert code == 0
    return root, run, sources, answered, json.loads((root / "policy.json").read_text())


@pytest.mark.slow
def test_the_calibration_sample_is_random_stratified_and_says_so(calibrated):
    root, run, _sources, answered, _policy = calibrated
    rows = list(csv.DictReader(open(root / "labels.csv", encoding="utf-8")))
    assert len(rows) == answered == 70
    assert {r["sample"] for r in rows} == {"calibration"}
    judged = Counter(t.stratum for t in judged_tasks(run) for _ in t.attempts)
    total = sum(judged.values())
    for row in rows:  # every judged attempt drawn with probability n / N; its stratum's size recorded
        assert float(row["inclusion_probability"]) == pytest.approx(70 / total)
        assert int(row["stratum_size"]) == judged[f"{row['modality']}/{row['direction']}"]
    drawn = Counter(f"{r['modality']}/{r['direction']}" for r in rows)
    for stratum, size in judged.items():  # proportional allocation, rounded systematically
        assert abs(drawn[stratum] - 70 * size / total) < 1
    assert {r["qualified"] for r in rows} == {"true", "false"}  # accepted and rejected attempts both drawn
    assert main(["review", "report", str(root / "review"), "--out", str(root / "report"), "--bootstrap", "50"]) == 0
    assert "Sample: a calibration sample" in (root / "report" / "report.md").read_text()


@pytest.mark.slow
def test_calibrate_chooses_the_most_yielding_rule_that_passes_in_sequence(calibrated):
    root, run, _sources, _answered, policy = calibrated
    rule = AcceptanceRule.parse(policy["rule"])
    assert (policy["target_precision"], policy["delta"]) == (0.8, 0.2)
    group = policy["groups"]["all modalities"]
    assert group["p_value"] <= 0.2 and policy["bound"] >= 0.8 and group["lower_bound"] == pytest.approx(policy["bound"])
    tested = policy["tested"]["all modalities"]
    thresholds = [float(t["rule"].split(">=")[1]) for t in tested]
    assert thresholds == sorted(thresholds, reverse=True)  # from the strictest
    ran = [t for t in tested if t["p_value"] is not None]
    assert all(t["rejected"] for t in ran[:-1])  # the sequence stops at the first rule not rejected
    safe = [t for t in ran if t["rejected"]]
    assert group["accepted"] == max(t["accepted"] for t in safe)
    accepted = first_passing(run, rule)
    assert policy["yield"]["accepted"] == len(accepted) == group["accepted"]
    labels = {r["id"]: r["qualified"] == "true" for r in csv.DictReader(open(root / "labels.csv", encoding="utf-8"))}
    inside = [labels[f"{uid}#{n}"] for uid, n in accepted.items() if f"{uid}#{n}" in labels]
    assert (group["labelled"], group["approved"]) == (len(inside), sum(inside))
    assert policy["labels"]["calibration_sample"] is True and policy["labels"]["matched"] == 70
    assert policy["kappa"]["n"] == 70 and policy["kappa"]["ci95"] is not None
    assert len(policy["expert_labels"]) == 70


def test_the_same_verdicts_read_from_the_built_dataset_give_the_same_policy(calibrated, demo_run_root, tmp_path):
    root, _run, _sources, _answered, policy = calibrated
    assert main(["calibrate", str(root / "labels.csv"), "--dataset", str(demo_run_root / "demo-run" / "dataset"),
                 "--target-precision", "0.8", "--delta", "0.2", "--out", str(tmp_path / "p.json"),
                 "--bootstrap", "200"]) == 0
    again = json.loads((tmp_path / "p.json").read_text())
    assert (again["rule"], again["tested"], again["yield"]) == (policy["rule"], policy["tested"], policy["yield"])


def test_build_accept_redecides_without_calls_and_the_card_states_it(calibrated, tmp_path, capsys):
    import pyarrow.parquet as pq

    root, run, _sources, _answered, policy = calibrated
    out = tmp_path / "dataset"
    assert main(["build", str(run), "--accept", str(root / "policy.json"), "--out", str(out), "-q",
                 "--configs", "sft,failed,judge,conversations"]) == 0
    rule = AcceptanceRule.parse(policy["rule"])
    accepted = first_passing(run, rule)

    def rows(config):
        return [r for f in sorted((out / config).glob("*.parquet"))
                for r in pq.read_table(f, columns=None if config == "conversations" else
                                       ["uid", "round" if config != "sft" else "success_round"]).to_pylist()]

    assert {(r["uid"], r["success_round"]) for r in rows("sft")} == set(accepted.items())
    tasks = judged_tasks(run)
    judged = {(t.uid, a.round) for t in tasks for a in t.attempts}
    assert {(r["uid"], r["round"]) for r in rows("judge")} == judged  # every judged attempt kept
    for r in rows("failed"):  # rejected attempts only: never one after the accepted edit
        assert r["uid"] not in accepted or r["round"] < accepted[r["uid"]]
    statuses = {r["uid"]: r["status"] for r in rows("conversations")}
    assert {uid for uid, s in statuses.items() if s == "success"} == set(accepted)

    card = (out / "README.md").read_text()
    assert "re-decided the runs' recorded verdicts" in card and policy["rule"].replace(">", "&gt;") in card
    assert "expert precision of the accepted edits at least 0.8 with probability at least 0.8" in card
    approval = json.loads((out / "medbanana-build.json").read_text())["acceptance"]["expert_approval"]
    estimate = approval["overall"]["estimate"]
    assert approval["labels"] == 70 and approval["calibration_sample"] is True
    truth = [a.values["score"] >= EXPERT_BAR for t in tasks for a in t.attempts if accepted.get(t.uid) == a.round]
    assert estimate["low"] <= sum(truth) / len(truth) <= estimate["high"]
    assert f"of the {len(accepted):,} accepted edits would be approved" in card


def test_build_with_reviews_states_the_experts_approval_of_the_runs_own_acceptance(calibrated, tmp_path):
    root, run, *_ = calibrated
    out = tmp_path / "dataset"
    assert main(["build", str(run), "--reviews", str(root / "review"), "--out", str(out), "-q", "--configs",
                 "sft"]) == 0
    info = json.loads((out / "medbanana-build.json").read_text())["acceptance"]
    assert info["rule"] is None and info["recorded_rules"] == ["qualified"]
    approval = info["expert_approval"]
    assert approval["labels"] == 70 and approval["calibration_sample"] is True
    accepted = [a for t in judged_tasks(run) for a in t.attempts if a.values["qualified"] and a.values["score"] == 1.0]
    estimate = approval["overall"]["estimate"]
    truth = sum(a.values["score"] >= EXPERT_BAR for a in accepted) / len(accepted)
    assert approval["overall"]["accepted"] == len(accepted) and estimate["low"] <= truth <= estimate["high"]
    card = (out / "README.md").read_text()
    assert "Edits were accepted as the runs decided, by the rule(s) qualified." in card
    assert "**Expert approval.** An estimated" in card and "a calibration sample" in card


def test_too_few_labels_is_one_line_saying_how_many_more(calibrated, tmp_path, capsys):
    root, run, *_ = calibrated
    with open(root / "labels.csv", encoding="utf-8") as fh:
        lines = fh.readlines()
    (tmp_path / "few.csv").write_text("".join(lines[:5]), encoding="utf-8")
    capsys.readouterr()
    assert main(["calibrate", str(tmp_path / "few.csv"), "--run", str(run), "--target-precision", "0.9",
                 "--out", str(tmp_path / "p.json")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "too few labels for any rule" in err[0] and " more " in err[0], err
    assert not (tmp_path / "p.json").exists()


@pytest.mark.slow
def test_labels_that_are_not_a_calibration_sample_are_said_so(calibrated, demo_run_root, tmp_path, capsys):
    _root, run, sources, *_ = calibrated
    assert main(["review", str(run), "--out", str(tmp_path / "turns"), "--items", "60", "--raters-per-item", "1",
                 "--no-serve", "--source-images", str(sources)]) == 0
    answer_all(tmp_path / "turns")
    assert main(["review", "export", str(tmp_path / "turns"), "--out", str(tmp_path / "turns.csv")]) == 0
    capsys.readouterr()
    code = main(["calibrate", str(tmp_path / "turns.csv"), "--run", str(run), "--target-precision", "0.8",
                 "--delta", "0.2", "--out", str(tmp_path / "p.json")])
    err = capsys.readouterr().err
    assert "not a calibration sample" in err
    if code == 0:
        assert json.loads((tmp_path / "p.json").read_text())["labels"]["calibration_sample"] is False


def test_review_only_opens_exactly_the_undecided_edits(calibrated, tmp_path, capsys):
    root, run, sources, _answered, policy = calibrated
    undecided = {entry["id"] for entry in policy["undecided"]}
    assert undecided, "calibrate found no edit at the rule's boundary: nothing to escalate in this run"
    labelled = {r["id"] for r in csv.DictReader(open(root / "labels.csv", encoding="utf-8"))}
    assert not undecided & labelled  # edits the experts already labelled are decided
    assert main(["review", str(run), "--out", str(tmp_path / "escalate"), "--only", str(root / "policy.json"),
                 "--no-serve", "--source-images", str(sources)]) == 0
    store = ReviewStore.open(tmp_path / "escalate")
    assert {item.sample_id for item in store.items()} == undecided
    assert store.settings.design == "escalation"
    assert answer_all(tmp_path / "escalate") == len(undecided)
    # built with both reviews, the card's estimate rests on the calibration sample alone (escalated edits are not random)
    assert main(["build", str(run), "--reviews", str(root / "review"), "--reviews", str(tmp_path / "escalate"),
                 "--out", str(tmp_path / "dataset"), "-q", "--configs", "sft"]) == 0
    approval = json.loads((tmp_path / "dataset" / "medbanana-build.json").read_text())["acceptance"]["expert_approval"]
    assert (approval["labels"], approval["left_out"], approval["calibration_sample"]) == (70, len(undecided), True)
    capsys.readouterr()
    assert main(["review", str(run), "--out", str(tmp_path / "x"), "--only", str(root / "policy.json"), "--items",
                 "3", "--no-serve"]) == 2
    assert "leave out --calibration and --items" in capsys.readouterr().err


# ---------------------------------------------------------------- the choice itself, on tasks made here

def make_tasks(spec: dict[str, list[list[float]]]) -> list:
    """modality -> each task's attempts' scores (add tasks; a score of 1.0 is qualified)."""
    from medbanana.review.judged import JudgedAttempt, JudgedTask

    tasks = []
    for modality, scores in spec.items():
        for n, attempts in enumerate(scores):
            uid = f"D/add/{modality}{n}-X"
            task = JudgedTask(uid, modality, "add")
            task.attempts = [JudgedAttempt(f"{uid}#{r}", r, {"qualified": s == 1.0, "has_disease": True,
                                                              "structure_reasonable": True, "looks_realistic": True,
                                                              "fidelity_preserved": True, "score": s})
                             for r, s in enumerate(attempts, 1)]
            tasks.append(task)
    return tasks


def test_per_modality_rules_each_at_their_share_of_delta():
    from medbanana.review.calibrate import calibrate
    from medbanana.review.judged import ExpertLabel

    tasks = make_tasks({"fundus": [[1.0]] * 40 + [[0.6, 1.0]] * 20, "brain_mri": [[1.0]] * 40})
    approved = {a.id: a.values["score"] == 1.0 if t.modality == "fundus" else t.uid.endswith(("mri0-X", "mri1-X"))
                for t in tasks for a in t.attempts}  # fundus: what scores 1.0; brain_mri: 2 of 40
    labels = [ExpertLabel(i, q, "calibration", 1.0, 1) for i, q in approved.items()]  # sizes recorded wrongly
    policy = calibrate(tasks, labels, target=0.9, delta=0.1, per_modality=True, bootstrap=0)
    assert policy["rule"] == "fundus:score>=1.0"  # 0.6 would accept 20 disapproved edits in 60
    assert [t["rejected"] for t in policy["tested"]["fundus"]] == [True, False]
    assert policy["modalities_without_rule"] == ["brain_mri"]  # nothing passes: it accepts nothing
    assert policy["groups"]["fundus"]["delta"] == pytest.approx(0.05)
    assert policy["yield"]["by_modality"]["brain_mri"]["accepted"] == 0
    assert policy["yield"]["by_modality"]["fundus"]["accepted"] == 60
    assert policy["labels"]["calibration_sample"] is False
    assert "another set of judged attempts" in policy["labels"]["sample_note"]


def test_unequal_inclusion_probabilities_use_the_stratified_bound_and_repeats_escalate():
    from medbanana.review.calibrate import calibrate
    from medbanana.review.judged import ExpertLabel

    tasks = make_tasks({"fundus": [[1.0]] * 60, "chest_xray": [[0.8], [1.0]] * 30})
    probability = {"fundus": 0.5, "chest_xray": 0.25}
    labels = [ExpertLabel(t.attempts[0].id, True, "calibration", probability[t.modality], 60)
              for t in tasks[::2]]  # every other task (in chest_xray, those of score 0.8), all approved
    repeats = {tasks[1].attempts[0].id: [{"qualified": True, "has_disease": False, "structure_reasonable": True,
                                          "looks_realistic": True, "fidelity_preserved": True}]}
    policy = calibrate(tasks, labels, target=0.8, delta=0.1, repeats=repeats, bootstrap=0)
    assert "Bonferroni" in policy["method"] and policy["labels"]["calibration_sample"] is True
    assert policy["bound"] >= 0.8
    why = {entry["id"]: entry["why"] for entry in policy["undecided"]}
    assert why.get(tasks[1].attempts[0].id) == "judge repeats disagree"  # the repeat sees no finding: rejected
