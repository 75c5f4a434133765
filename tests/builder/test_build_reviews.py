"""`medbanana build --reviews`: a review folder's answers as the `human_review` config, loaded with datasets."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from medbanana.builder.upload import built_by_medbanana
from medbanana.cli import main
from medbanana.loaders import load_medbanana
from medbanana.review.items import create_review
from medbanana.generation.dataset.review_folder import Answer
from medbanana.review.store import ReviewStore


def answer_everything(store: ReviewStore, rater: str, qualified) -> list[tuple[str, Answer]]:
    given = []
    while (item := store.next_item(rater)) is not None:
        answer = (Answer(has_disease=True, structure_reasonable=item.item_id.endswith(("1", "3")),
                         looks_realistic=True, fidelity_preserved=False, qualified=qualified(item),
                         reason=f"rater {len(rater)} on {item.item_id}", seconds=3.5)
                  if store.settings.mode == "rubric" else Answer(guess="edited", confidence=2))
        assert store.submit(rater, item.item_id, answer)
        given.append((item.item_id, answer))
    return given


# every test builds from the module's review run (about 20 s to make)
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def reviewed(demo_run_root, tmp_path_factory):
    root = tmp_path_factory.mktemp("reviews")
    run = demo_run_root / "demo-run" / "run"
    rubric = create_review(run, root / "panel-a", mode="rubric", items=5, raters_per_item=2, seed=1,
                           source_images=run.parent / "sources")
    realism = create_review(run, root / "panel-b", mode="realism", items=3, raters_per_item=1, seed=1,
                            source_images=run.parent / "sources")
    given = {"Dr. Ana": answer_everything(rubric, "Dr. Ana", lambda item: True),
             "Bo": answer_everything(rubric, "Bo", lambda item: item.item_id.endswith("2"))}
    given["dr. ana (realism)"] = answer_everything(realism, "DR. ANA", None)
    out = root / "dataset"
    assert main(["build", str(run), "--out", str(out), "--reviews", str(rubric.folder), "--reviews",
                 str(realism.folder), "-q"]) == 0
    return out, rubric, realism, given


def test_every_answer_is_one_row_tied_to_its_judged_attempt(reviewed):
    out, rubric, realism, given = reviewed
    rows = load_medbanana(out, "human_review", split="train").to_list()
    assert len(rows) == sum(len(v) for v in given.values()) == len(rubric.answers()) + len(realism.answers())
    items = {item.item_id: item for item in rubric.items()}
    judge = {(r["uid"], r["round"]): r for r in load_medbanana(out, "judge", split="train", decode_images=False)}
    rubric_rows = [r for r in rows if r["review"] == "panel-a"]
    for stored in rubric.answers():
        row = next(r for r in rubric_rows if r["item_id"] == stored.item_id and r["reason"] == stored.answer.reason)
        item = items[stored.item_id]
        assert f"{row['uid']}#{row['round']}" == item.sample_id
        assert (row["uid"], row["round"]) in judge  # joins with the judge config
        assert judge[(row["uid"], row["round"])]["disease"] == row["disease"] == item.disease
        assert row["qualified"] == stored.answer.qualified and row["fidelity_preserved"] is False
        assert row["structure_reasonable"] == stored.answer.structure_reasonable
        assert row["seconds"] == pytest.approx(3.5) and row["mode"] == "rubric" and row["shown"] == "pair"
    realism_rows = [r for r in rows if r["review"] == "panel-b"]
    assert {r["shown"] for r in realism_rows} <= {"real", "edited"}
    assert all(r["guess"] == "edited" and r["confidence"] == 2 and r["qualified"] is None for r in realism_rows)
    assert all(r["round"] is None for r in realism_rows if r["shown"] == "real")


def test_raters_are_pseudonymised_one_pseudonym_per_person(reviewed):
    out, *_ = reviewed
    rows = load_medbanana(out, "human_review", split="train").to_list()
    names = {r["rater"] for r in rows}
    assert names == {"rater-1", "rater-2"}  # "Dr. Ana" and "DR. ANA" are one person; Bo the other
    assert {r["rater"] for r in rows if r["review"] == "panel-b"} == {"rater-1"}
    text = (out / "human_review").glob("*.parquet")
    assert not any(b"Ana" in p.read_bytes() or b"Bo\x00" in p.read_bytes() for p in text)


def test_the_card_manifest_and_upload_know_the_config(reviewed):
    out, *_ = reviewed
    info = json.loads((out / "medbanana-build.json").read_text())
    assert info["reviews"]["panel-a"] == {"mode": "rubric", "answers": 10, "rows": 10, "left_out": 0}
    assert info["configs"]["human_review"]["train"]["rows"] == 10 + info["reviews"]["panel-b"]["rows"]
    card = (out / "README.md").read_text()
    assert "config_name: human_review" in card and "human_review/train-*.parquet" in card
    sums = (out / "SHA256SUMS").read_text()
    shard = info["configs"]["human_review"]["train"]["files"][0]
    assert shard in sums and built_by_medbanana(shard)
    assert main(["verify", str(out)]) == 0


def test_a_review_of_other_runs_is_refused_and_answers_outside_the_build_are_counted(reviewed, tmp_path,
                                                                                       builder_ours_run, capsys):
    out, rubric, *_ = reviewed
    assert main(["build", str(builder_ours_run), "--out", str(tmp_path / "other"), "--reviews",
                 str(rubric.folder), "-q"]) == 2
    err = capsys.readouterr().err
    assert "none of its items is a task of the runs built" in err and not (tmp_path / "other").exists()
    assert main(["build", str(builder_ours_run), "--out", str(tmp_path / "x"), "--reviews",
                 str(tmp_path / "nowhere"), "-q"]) == 2
    assert "not a review folder" in capsys.readouterr().err


def test_review_reasons_drop_leaves_the_free_text_out(reviewed, demo_run_root, tmp_path):
    _out, rubric, _realism, given = reviewed
    run = demo_run_root / "demo-run" / "run"
    out = tmp_path / "dataset"
    assert main(["build", str(run), "--out", str(out), "--reviews", str(rubric.folder), "--review-reasons", "drop",
                 "-q"]) == 0
    rows = load_medbanana(out, "human_review", split="train").to_list()
    assert len(rows) == len(rubric.answers()) and all(r["reason"] is None for r in rows)
    assert any(answer.reason for answers in given.values() for _, answer in answers)  # there were reasons to drop


def test_build_reads_a_review_folder_without_the_review_stage(reviewed, demo_run_root, tmp_path):
    """The builder reads a review through its own read contract (generation/dataset/review_folder.py): with the review stage's
    store absent from the process (`sys.modules[name] = None`), `medbanana build --reviews` gives the same rows."""
    out, rubric, realism, _given = reviewed
    run = demo_run_root / "demo-run" / "run"
    again = tmp_path / "dataset"
    hide = Path(__file__).resolve().parents[1] / "hide_modules.py"
    result = subprocess.run([sys.executable, str(hide), "medbanana.review.store,medbanana.review.items",
                             "build", str(run), "--out", str(again), "--reviews", str(rubric.folder), "--reviews",
                             str(realism.folder), "-q"], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    rows = load_medbanana(again, "human_review", split="train").to_list()
    assert rows == load_medbanana(out, "human_review", split="train").to_list()
    assert len(rows) == len(rubric.answers()) + len(realism.answers())
