"""`medbanana review report`: Cohen's kappa equals a hand computation from answers submitted through the store,
Fleiss / alpha / judge-vs-human on the same answers, realism accuracy and AUROC on a constructed case, seeded
intervals, and statistics that cannot be computed saying so."""

import json
import math

import krippendorff
import numpy as np
import pytest
from medbanana.builder.synthetic_run import make_synthetic_run
from medbanana.cli import main
from medbanana.generation.records import VERDICT_BOOLEANS
from medbanana.review.items import create_review
from medbanana.review.report import write_report
from medbanana.generation.dataset.review_folder import Answer
from medbanana.review.store import ReviewStore
from PIL import Image

BOOT = 300  # resamples: enough for an interval, short to run

# two raters' labels per item (8 items), per dimension; the judge-vs-human and kappa checks recompute from these
ANN = {"has_disease": "TTTFFTFT", "structure_reasonable": "TTTTTTTF", "looks_realistic": "TFTFTFTF",
       "fidelity_preserved": "TTTTTTTT", "qualified": "TTTFFTFT"}
BEN = {"has_disease": "TFTFTTFF", "structure_reasonable": "TTTTTTFF", "looks_realistic": "FTFTFTFT",
       "fidelity_preserved": "TTTTTTTT", "qualified": "TFTFTTFF"}


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("review_run")
    make_synthetic_run(root / "run", flavor="ours", tasks_per_folder=3, datasets=("mimic_ours_cxr",
                       "odir_ours_fundus"), sources_dir=root / "sources", seed=4)
    return root / "run"


def rubric(labels: dict, n: int) -> Answer:
    return Answer(**{d: labels[d][n] == "T" for d in VERDICT_BOOLEANS}, reason="")


def kappa_by_hand(a: list[bool], b: list[bool]) -> float:
    """Cohen's kappa from the 2x2 table: po = (yy + nn) / n, pe = p(a yes) p(b yes) + p(a no) p(b no)."""
    n = len(a)
    yy = sum(x and y for x, y in zip(a, b))
    nn = sum(not x and not y for x, y in zip(a, b))
    po = (yy + nn) / n
    pe = (sum(a) / n) * (sum(b) / n) + (1 - sum(a) / n) * (1 - sum(b) / n)
    return (po - pe) / (1 - pe)


@pytest.fixture(scope="module")
def two_raters(run_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("rubric") / "review"
    store = create_review(run_dir, folder, mode="rubric", items=8, raters_per_item=2, seed=1,
                          source_images=run_dir.parent / "sources")
    items = store.items()
    assert len(items) == 8
    index = {item.item_id: n for n, item in enumerate(items)}
    for rater, labels in (("Ann", ANN), ("Ben", BEN)):  # each answers what the store hands them, in its order
        while (item := store.next_item(rater)) is not None:
            assert store.submit(rater, item.item_id, rubric(labels, index[item.item_id]))
    out = folder.parent / "report"
    assert main(["review", "report", str(folder), "--out", str(out), "--bootstrap", str(BOOT)]) == 0
    return folder, items, out


@pytest.mark.slow
def test_cohen_kappa_is_the_hand_computation(two_raters):
    _folder, _items, out = two_raters
    report = json.loads((out / "report.json").read_text())
    markdown = (out / "report.md").read_text()
    for dim in ("has_disease", "qualified", "structure_reasonable"):
        expected = kappa_by_hand([c == "T" for c in ANN[dim]], [c == "T" for c in BEN[dim]])
        got = report["inter_rater"]["dimensions"][dim]["cohen_kappa"]
        assert got["value"] == pytest.approx(expected) and got["n"] == 8
        assert f"{expected:.3f} (" in markdown  # shown with its interval
        assert got["low"] <= got["value"] <= got["high"]
    # agreement: share of items the two agree on; fidelity_preserved is always yes: kappa undefined, said so
    qualified = report["inter_rater"]["dimensions"]["qualified"]
    same = sum(a == b for a, b in zip(ANN["qualified"], BEN["qualified"]))
    assert qualified["percent_agreement"]["value"] == pytest.approx(same / 8)
    assert report["inter_rater"]["dimensions"]["fidelity_preserved"]["cohen_kappa"]["value"] is None
    assert "fidelity_preserved: cannot be computed: one answer value only" in markdown
    assert "nan" not in markdown.lower() and "NaN" not in (out / "report.json").read_text()


def test_fleiss_and_alpha_on_the_same_answers(two_raters):
    _folder, _items, out = two_raters
    report = json.loads((out / "report.json").read_text())
    assert report["inter_rater"]["fleiss_items"] == 8 and report["inter_rater"]["fleiss_answers_per_item"] == 2
    for dim in ("has_disease", "looks_realistic"):
        a, b = [1.0 if c == "T" else 0.0 for c in ANN[dim]], [1.0 if c == "T" else 0.0 for c in BEN[dim]]
        alpha = krippendorff.alpha(reliability_data=np.array([a, b]), level_of_measurement="nominal")
        assert report["inter_rater"]["dimensions"][dim]["krippendorff_alpha"]["value"] == pytest.approx(alpha)
        # Fleiss' kappa with two raters: pooled shares for chance agreement
        share = (sum(a) + sum(b)) / 16
        po = sum(x == y for x, y in zip(a, b)) / 8
        pe = share ** 2 + (1 - share) ** 2
        assert report["inter_rater"]["dimensions"][dim]["fleiss_kappa"]["value"] == pytest.approx((po - pe) / (1 - pe))


def test_judge_vs_human_uses_the_majority_and_the_recorded_verdicts(two_raters):
    _folder, items, out = two_raters
    report = json.loads((out / "report.json").read_text())
    qualified = report["judge_vs_human"]["dimensions"]["qualified"]
    agreeing = [n for n in range(8) if ANN["qualified"][n] == BEN["qualified"][n]]  # two raters: a tie is left out
    judge = [bool(items[n].judge["qualified"]) for n in agreeing]
    human = [ANN["qualified"][n] == "T" for n in agreeing]
    assert qualified["edits"] == len(agreeing) and qualified["ties"] == 8 - len(agreeing)
    assert qualified["agreement"]["value"] == pytest.approx(sum(j == h for j, h in zip(judge, human)) / len(judge))
    assert qualified["confusion"]["judge_yes_human_no"] == sum(j and not h for j, h in zip(judge, human))
    markdown = (out / "report.md").read_text()
    assert "qualified: judge \\ human" in markdown and "![judge vs human confusion matrices]" in markdown
    for name in ("judge_confusion.png", "agreement.png"):
        with Image.open(out / name) as image:
            assert image.format == "PNG" and image.size[0] > 300


@pytest.mark.slow
def test_intervals_are_reproducible_by_seed(two_raters, tmp_path):
    folder, _items, out = two_raters
    again = json.loads(write_report(folder, tmp_path / "same", bootstrap=BOOT, seed=0).with_name(
        "report.json").read_text())
    other = json.loads(write_report(folder, tmp_path / "other", bootstrap=BOOT, seed=9).with_name(
        "report.json").read_text())
    first = json.loads((out / "report.json").read_text())
    assert again["inter_rater"] == first["inter_rater"] and again["judge_vs_human"] == first["judge_vs_human"]
    alpha = [r["inter_rater"]["dimensions"]["has_disease"]["krippendorff_alpha"] for r in (first, other)]
    assert alpha[0]["value"] == alpha[1]["value"] and (alpha[0]["low"], alpha[0]["high"]) != (alpha[1]["low"],
                                                                                             alpha[1]["high"])


def pairwise_auroc(edited: list[float], real: list[float]) -> float:
    return sum((e > r) + 0.5 * (e == r) for e in edited for r in real) / (len(edited) * len(real))


def test_realism_accuracy_and_auroc_on_a_constructed_case(run_dir, tmp_path):
    store = create_review(run_dir, tmp_path / "realism", mode="realism", items=8, raters_per_item=1, seed=2,
                          source_images=run_dir.parent / "sources")
    items = store.items()
    # the edited images: "edited" with confidence 1..5 in turn (every third one "real", 2);
    # the real images: "real", confidence 3, except every second one "edited", 1
    expected: dict[str, dict[str, list]] = {}
    index = {item.item_id: n for n, item in enumerate(items)}
    for rater in ("Ann", "Ben", "Cy"):  # one form of each source per rater: the store hands the rest to the next
        while (item := store.next_item(rater)) is not None:
            n = index[item.item_id]
            if item.shown == "edited":
                guess, confidence = ("real", 2) if n % 3 == 0 else ("edited", 1 + n % 5)
            else:
                guess, confidence = ("edited", 1) if n % 2 else ("real", 3)
            assert store.submit(rater, item.item_id, Answer(guess=guess, confidence=confidence))
            score = 0.5 + (confidence if guess == "edited" else -confidence) / 10
            for group in ("all", item.modality):
                entry = expected.setdefault(group, {"edited": [], "real": [], "correct": []})
                entry[item.shown].append(score)
                entry["correct"].append(guess == item.shown)
    assert len(store.answers()) == len(items)  # every item answered once
    report_md = write_report(tmp_path / "realism", tmp_path / "out", bootstrap=BOOT)
    rows = {r["group"]: r for r in json.loads(report_md.with_name("report.json").read_text())["realism"]["groups"]}
    assert set(rows) == set(expected) and len(expected) == 3  # all + two modalities
    for group, e in expected.items():
        assert rows[group]["accuracy"]["value"] == pytest.approx(sum(e["correct"]) / len(e["correct"]))
        assert rows[group]["auroc"]["value"] == pytest.approx(pairwise_auroc(e["edited"], e["real"]))
        assert (rows[group]["edited"], rows[group]["real"]) == (len(e["edited"]), len(e["real"]))
    overall = rows["all"]["auroc"]
    assert overall["low"] <= overall["value"] <= overall["high"]
    text = report_md.read_text()
    assert f"{rows['all']['auroc']['value']:.3f} (" in text and "![realism detection](realism.png)" in text
    with Image.open(tmp_path / "out" / "realism.png") as image:
        assert image.format == "PNG"


def test_what_cannot_be_computed_is_said(run_dir, tmp_path):
    # one rater, three items: no agreement statistic, no interval; the judge comparison still works
    store = create_review(run_dir, tmp_path / "one", mode="rubric", items=3, raters_per_item=2, seed=0,
                          source_images=run_dir.parent / "sources")
    index = {item.item_id: n for n, item in enumerate(store.items())}
    while (item := store.next_item("Ann")) is not None:
        store.submit("Ann", item.item_id, rubric(ANN, index[item.item_id]))
    text = write_report(tmp_path / "one", tmp_path / "one-out", bootstrap=BOOT).read_text()
    assert "Cohen's kappa, has_disease, structure_reasonable, looks_realistic, fidelity_preserved, qualified: " \
           "cannot be computed: needs exactly two raters; 1 answered." in text
    assert "Krippendorff's alpha, has_disease" in text and "cannot be computed: no item has two answers" in text
    assert "no interval: 3 item(s) are too few to resample" in text
    settings = ReviewStore.open(tmp_path / "one").settings  # the blinding measure, kept from the review's creation
    assert ("Blinding: the instructions shown tell round 1 from later rounds with AUROC" in text
            if settings.round_auroc is not None else f"Blinding: {settings.round_auroc_note}." in text)
    assert not any(math.isnan(v) for v in _numbers(json.loads((tmp_path / "one-out" / "report.json").read_text())))
    assert "nan" not in text.lower()
    # realism with only edited images answered: no AUROC; a review without answers: coverage only
    store = create_review(run_dir, tmp_path / "edited-only", mode="realism", items=6, raters_per_item=1, seed=0,
                          source_images=run_dir.parent / "sources")
    raters = iter(f"rater {n}" for n in range(20))
    rater = next(raters)
    while (item := store.next_item(rater)) is not None:
        if item.shown == "edited":
            store.submit(rater, item.item_id, Answer(guess="edited", confidence=4))
        else:  # a real image is left unanswered: its rater stops there, and the next takes the rest
            rater = next(raters)
    text = write_report(tmp_path / "edited-only", tmp_path / "eo-out", bootstrap=BOOT).read_text()
    assert "AUROC, all" in text and "cannot be computed: needs answers on both real and edited images" in text
    create_review(run_dir, tmp_path / "empty", mode="rubric", items=2, raters_per_item=2, seed=0,
                  source_images=run_dir.parent / "sources")
    text = write_report(tmp_path / "empty", tmp_path / "empty-out", bootstrap=BOOT).read_text()
    assert "No answers yet" in text and "2 items, 0 rater(s), 0 answers" in text


def _numbers(value):
    if isinstance(value, float):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _numbers(v)
    elif isinstance(value, list):
        for v in value:
            yield from _numbers(v)
