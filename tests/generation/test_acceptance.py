"""Acceptance rules (generation/acceptance.py): the text a run records parses back to itself, each rule decides as
it says, a POLICY.json is read only when the user names one, and `generate --accept POLICY.json` runs by its rule
(per modality here: one modality accepts from a score, the other nothing)."""

from __future__ import annotations

import json

import pytest
from medbanana.cli import main
from medbanana.generation.acceptance import (POLICY_FORMAT, POLICY_VERSION, AcceptanceRule, read_policy,
                                             rule_option)
from medbanana.generation.backends.simulator.phantoms import write_demo_sources
from medbanana.generation.loop import acceptance_policy
from medbanana.generation.records import Verdict
from medbanana.generation.rundir import layout
from medbanana.generation.rundir.store import read_journal

PASS_ALL = {"qualified": True, "has_disease": True, "structure_reasonable": True, "looks_realistic": True,
            "fidelity_preserved": True, "score": 1.0}


@pytest.mark.parametrize("text", ["qualified", "none", "score>=0.85", "all()", "all(structure_reasonable)",
                                  "all(structure_reasonable,looks_realistic,fidelity_preserved)",
                                  "brain_mri:all(looks_realistic);chest_xray:score>=0.6;fundus:none"])
def test_a_rule_text_parses_back_to_itself(text):
    assert AcceptanceRule.parse(text).text == text
    assert AcceptanceRule.parse(AcceptanceRule.parse(text).text) == AcceptanceRule.parse(text)


@pytest.mark.parametrize("text,match", [
    ("vibes", "unknown acceptance policy"), ("score>=1.5", "between 0 and 1"),
    ("all(has_disease)", "compliance is always required"), ("chest_xray:qualified;score>=0.7", "for every part"),
    ("fundus:qualified;fundus:none", "named twice"), ("Fundus:qualified", "for every part")])
def test_a_wrong_rule_is_refused_saying_why(text, match):
    with pytest.raises(ValueError, match=match):
        AcceptanceRule.parse(text)


def test_each_rule_decides_as_it_says():
    weak = {**PASS_ALL, "qualified": False, "looks_realistic": False, "score": 0.8}
    removed = {**PASS_ALL, "has_disease": False}  # a remove edit done: the finding is gone
    cases = {"qualified": (True, False), "score>=0.8": (True, True), "score>=0.81": (True, False),
             "all(structure_reasonable)": (True, True), "all(looks_realistic)": (True, False), "none": (False, False)}
    for text, (strong_passes, weak_passes) in cases.items():
        rule = AcceptanceRule.parse(text)
        assert rule.accepts(PASS_ALL, "add", "fundus") is strong_passes, text
        assert rule.accepts(weak, "add", "fundus") is weak_passes, text
        assert rule.accepts(PASS_ALL, "remove", "fundus") is False, text  # the finding is still there: not compliant
        assert rule.accepts(removed, "remove", "fundus") is (text != "none"), text
    assert AcceptanceRule.parse("all()").accepts({"has_disease": None}, "add", None) is False  # not judged
    per = AcceptanceRule.parse("chest_xray:score>=0.8")
    assert per.accepts(weak, "add", "chest_xray") and not per.accepts(PASS_ALL, "add", "fundus")
    verdict = Verdict(True, True, False, True, False, "grain", score=0.8)  # the loop's view of the same rules
    task = type("T", (), {"direction": "add", "modality": "chest_xray"})()
    assert acceptance_policy("chest_xray:score>=0.8")(verdict, task) is True
    assert acceptance_policy("fundus:score>=0.8")(verdict, task) is False


def write_policy(path, rule: str, **extra) -> None:
    path.write_text(json.dumps({"format": POLICY_FORMAT, "version": POLICY_VERSION, "rule": rule, **extra}))


def test_a_policy_file_is_read_only_when_named_and_checked(tmp_path):
    policy = tmp_path / "policy.json"
    write_policy(policy, "score>=0.75")
    assert rule_option(str(policy))[0] == "score>=0.75"
    assert rule_option("score >= 0.9") == ("score >= 0.9", None)  # a rule is kept as written
    (tmp_path / "other.json").write_text(json.dumps({"rule": "qualified"}))
    with pytest.raises(ValueError, match="not an acceptance policy"):
        read_policy(tmp_path / "other.json")
    write_policy(tmp_path / "future.json", "qualified", version=99)
    with pytest.raises(ValueError, match="policy version 99"):
        read_policy(tmp_path / "future.json")
    write_policy(tmp_path / "bad.json", "score>=2")
    with pytest.raises(ValueError, match="between 0 and 1"):
        read_policy(tmp_path / "bad.json")
    with pytest.raises(FileNotFoundError):
        rule_option(str(tmp_path / "missing.json"))
    with pytest.raises(ValueError, match="unknown acceptance policy"):  # a run's recorded rule is never a path
        acceptance_policy(str(policy))


@pytest.mark.slow
def test_generate_runs_by_a_policy_files_rule(tmp_path, capsys):
    write_demo_sources(tmp_path / "sources", n_normal=2, n_diseased=0, size=64)
    rule = "chest_xray:score>=0.6;fundus:none"
    write_policy(tmp_path / "policy.json", rule)
    run = tmp_path / "run"
    code = main(["generate", "--sources", str(tmp_path / "sources"), "--out", str(run), "--backend", "simulator",
                 "--diseases", "Pneumothorax", "Glaucoma", "--directions", "add", "--max-rounds", "2", "-q",
                 "--accept", str(tmp_path / "policy.json")])
    assert code in (0, 3), capsys.readouterr().err
    assert json.loads((run / layout.RUN_CONFIG).read_text())["accept"] == rule  # the rule, not the file
    records = [e["record"] for e in read_journal(run / layout.JOURNAL) if e["type"] == "task"]
    by_modality = {m: [r for r in records if r["modality"] == m] for m in ("chest_xray", "fundus")}
    assert all(by_modality.values())
    decide = AcceptanceRule.parse(rule)
    for modality, tasks in by_modality.items():
        for record in tasks:
            rounds = [r for r in record["rounds"] if r.get("verification")]
            decisions = [decide.accepts(r["verification"], "add", modality) for r in rounds]
            assert [r["accepted"] for r in rounds] == [d and not any(decisions[:i]) for i, d in enumerate(decisions)]
            assert (record["status"] == "success") is any(decisions)
    assert not any(r["status"] == "success" for r in by_modality["fundus"])
    assert len(rounds_of(by_modality["fundus"])) == 2 * len(by_modality["fundus"])  # refined to the limit

    capsys.readouterr()
    (tmp_path / "broken.json").write_text("{")
    with pytest.raises(SystemExit) as exit_:  # refused as the options are read, before anything runs
        main(["generate", "--sources", str(tmp_path / "sources"), "--out", str(tmp_path / "run2"),
              "--backend", "simulator", "--accept", str(tmp_path / "broken.json")])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "not a readable policy file" in err and "Traceback" not in err and not (tmp_path / "run2").exists()


def rounds_of(records: list[dict]) -> list[dict]:
    return [r for record in records for r in record["rounds"]]
