"""`medbanana review export`: majority labels (ties empty, a `qualified` tie left out), one rater's own answers,
clear refusals, and the file feeding the real `medbanana judge-agreement --human` on the run it was sampled from."""

import csv
import json
from collections import Counter

import pytest
from medbanana.builder.synthetic_run import make_synthetic_run
from medbanana.cli import main
from medbanana.evaluation.agreement import read_human_labels
from medbanana.generation.records import VERDICT_BOOLEANS
from medbanana.review.export import export_labels
from medbanana.review.items import create_review
from medbanana.generation.dataset.review_folder import Answer

# per rater, per item (6 items), the labels of the five dimensions in VERDICT_BOOLEANS order; "-" = no answer.
# Item 4: Ann and Ben only, split on qualified (left out) and on looks_realistic (empty); item 5: unanswered.
VOTES = {
    "Ann": ["TTTTT", "TFTTF", "FTTTT", "TTFTT", "TTTTT", "-"],
    "Ben": ["TTTTT", "TTTTF", "FTFTF", "TTFTF", "TTFTF", "-"],
    "Cy": ["FTTTT", "TFTFT", "TTFTF", "TTTTT", "-", "-"],
}


@pytest.fixture(scope="module")
def review(tmp_path_factory):
    root = tmp_path_factory.mktemp("export")
    make_synthetic_run(root / "run", flavor="ours", tasks_per_folder=3, datasets=("mimic_ours_cxr",
                       "brain_ours_mri"), sources_dir=root / "sources", seed=6)
    store = create_review(root / "run", root / "review", mode="rubric", items=6, raters_per_item=3, seed=0,
                          source_images=root / "sources")
    # the unanswered item: three raters take the first item and never answer it (their claims fill it); the store
    # hands the others in order, and VOTES index them in that order
    for idle in ("Dee", "Eve", "Fay"):
        store.next_item(idle)
    items = store.items()[1:] + store.items()[:1]
    for rater, answers in VOTES.items():
        while (item := store.next_item(rater)) is not None and (labels := answers[items.index(item)]) != "-":
            assert store.submit(rater, item.item_id, Answer(**{d: c == "T" for d, c in zip(VERDICT_BOOLEANS, labels)},
                                                            reason=f"{rater} on {item.item_id}"))
    assert len(store.answers()) == sum(len(a) - a.count("-") for a in VOTES.values())
    return root, store, items


def read_rows(path):
    with open(path, newline="", encoding="utf-8") as fh:
        return list(csv.DictReader(fh))


def expected_majority(n: int) -> dict | None:
    votes = [answers[n] for answers in VOTES.values() if answers[n] != "-"]
    if not votes:
        return None
    out = {"raters": str(len(votes))}
    for k, dim in enumerate(VERDICT_BOOLEANS):
        yes = sum(v[k] == "T" for v in votes)
        out[dim] = "true" if 2 * yes > len(votes) else "false" if 2 * yes < len(votes) else ""
        out[f"{dim}_yes"] = str(yes)
    return out


def test_majority_export(review, tmp_path):
    root, _store, items = review
    summary = export_labels(root / "review", tmp_path / "labels.csv")
    rows = {r["id"]: r for r in read_rows(tmp_path / "labels.csv")}
    kept = [n for n in range(6) if (e := expected_majority(n)) is not None and e["qualified"]]
    assert [r["item"] for r in rows.values()] == [items[n].item_id for n in kept]  # the review's order
    for n in kept:
        row = rows[items[n].sample_id]
        assert {k: row[k] for k in expected_majority(n)} == expected_majority(n)
        assert (row["modality"], row["disease"], row["direction"]) == (items[n].modality, items[n].disease,
                                                                     items[n].direction)
    assert summary["rows"] == len(kept) == 4 and summary["left_out_qualified_tie"] == 1
    assert (summary["answers"], summary["raters"], summary["items_answered"], summary["items"]) == (14, 3, 5, 6)
    assert summary["ties"]["looks_realistic"] == 1
    labels = read_human_labels(tmp_path / "labels.csv")  # what judge-agreement reads
    assert set(labels) == {items[n].sample_id for n in kept}
    assert all(v["qualified"] is not None for v in labels.values())
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # atomic: no temporary file left


def test_one_raters_export(review, tmp_path):
    root, _store, items = review
    summary = export_labels(root / "review", tmp_path / "sub" / "ben.csv", rater=" Ben ")
    rows = read_rows(tmp_path / "sub" / "ben.csv")
    assert summary["rater"] == "Ben" and summary["rows"] == 5 and summary["left_out_qualified_tie"] == 0
    for row, item, labels in zip(rows, items, VOTES["Ben"]):
        assert row["id"] == item.sample_id and row["raters"] == "1"
        assert [row[d] for d in VERDICT_BOOLEANS] == ["true" if c == "T" else "false" for c in labels]
        assert row["reason"] == f"Ben on {item.item_id}"


def test_refusals_are_clear(review, tmp_path):
    root, _store, _items = review
    with pytest.raises(ValueError, match="rater 'Dee' answered nothing here; raters: Ann, Ben, Cy"):
        export_labels(root / "review", tmp_path / "x.csv", rater="Dee")
    with pytest.raises(ValueError, match="a rater name may hold"):
        export_labels(root / "review", tmp_path / "x.csv", rater="<b>")
    create_review(root / "run", tmp_path / "empty", mode="rubric", items=2, raters_per_item=1, seed=0,
                  source_images=root / "sources")
    with pytest.raises(ValueError, match="no answers yet, nothing to export"):
        export_labels(tmp_path / "empty", tmp_path / "x.csv")
    realism = create_review(root / "run", tmp_path / "realism", mode="realism", items=2, raters_per_item=1, seed=0,
                            source_images=root / "sources")
    realism.submit("Ann", realism.next_item("Ann").item_id, Answer(guess="real", confidence=3))
    with pytest.raises(ValueError, match="realism review: its answers .* are not judge labels"):
        export_labels(tmp_path / "realism", tmp_path / "x.csv")
    with pytest.raises(FileNotFoundError, match="not a review folder"):
        export_labels(tmp_path / "nowhere", tmp_path / "x.csv")
    assert not (tmp_path / "x.csv").exists()


def test_the_export_feeds_judge_agreement(review, tmp_path, capsys):
    """The user's path: `medbanana review export`, then `medbanana judge-agreement RUN --human labels.csv`."""
    root, _store, items = review
    assert main(["review", "export", str(root / "review"), "--out", str(tmp_path / "labels.csv")]) == 0
    assert "left out 1 edit(s) whose raters tie on qualified" in capsys.readouterr().out
    assert main(["judge-agreement", str(root / "run"), "--out", str(tmp_path / "agreement"),
                 "--human", str(tmp_path / "labels.csv")]) == 0
    report = json.loads((tmp_path / "agreement" / "agreement.json").read_text())
    agreement = report["human_agreement"]
    rows = read_rows(tmp_path / "labels.csv")
    assert agreement["edits"] == len(rows) == 4 and agreement["unmatched_human_ids"] == []
    assert report["judge_labels"] == {"recorded": 4, "judged_now": 0}  # the run's recorded verdicts, no new calls
    judge = {i.sample_id: i.judge for i in items}
    for dim in ("qualified", "has_disease"):
        pairs = [(bool(judge[r["id"]][dim]), r[dim] == "true") for r in rows if r[dim]]
        assert agreement["dimensions"][dim]["edits"] == len(pairs)
        assert agreement["dimensions"][dim]["agreement"] == pytest.approx(sum(a == b for a, b in pairs) / len(pairs))
        expected = dict.fromkeys(("judge_yes_human_yes", "judge_yes_human_no", "judge_no_human_yes",
                                  "judge_no_human_no"), 0)
        expected.update(Counter(f"judge_{'yes' if j else 'no'}_human_{'yes' if h else 'no'}" for j, h in pairs))
        assert agreement["dimensions"][dim]["confusion"] == expected
