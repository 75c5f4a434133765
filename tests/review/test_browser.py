"""The review page in a real browser: `medbanana review` runs as its own process on 127.0.0.1 and headless Chromium
drives it through Selenium, as raters would — two raters at once, a reload, a killed server, a double submit."""

import json
import random
import re
import urllib.error
import urllib.request
from collections import Counter
from pathlib import Path

import pytest
from review_browser import (WINDOW, ReviewPage, ReviewServer, assert_offline, browser_missing, close_browser,
                            free_port, make_run, new_browser)

from medbanana.cli import main
from medbanana.generation.records import VERDICT_BOOLEANS
from medbanana.review.store import ReviewStore

pytestmark = [pytest.mark.slow, pytest.mark.skipif(browser_missing() is not None, reason=str(browser_missing()))]


@pytest.fixture(scope="module")
def small_run(tmp_path_factory) -> tuple[Path, Path]:
    return make_run(tmp_path_factory.mktemp("review_run"))


def choices_for(rater: str, item: str) -> dict:
    """A rater's answer to an item, different per rater and item (so a swapped answer would show)."""
    rng = random.Random(f"{rater}/{item}")
    return {name: rng.random() < 0.6 for name in VERDICT_BOOLEANS}


def answer(page: ReviewPage, rater: str, expected: dict, *, double: bool = False) -> str:
    """Answer the item the page shows as `rater` would, remember it, submit; the message shown after."""
    item = page.item()
    flags, reason = choices_for(rater, item), f"{rater} looked at {item}"
    page.answer_rubric(flags, reason)
    expected[(rater, item)] = (flags, reason)
    return page.submit_and_wait(double=double)


def stored(store: ReviewStore) -> dict:
    return {(a.rater, a.item_id): a.answer for a in store.answers()}


def assert_stored_as_clicked(store: ReviewStore, expected: dict) -> None:
    answers = stored(store)
    assert set(answers) == set(expected)
    for key, (flags, reason) in expected.items():
        got = answers[key]
        assert {name: getattr(got, name) for name in VERDICT_BOOLEANS} == flags, key
        assert got.reason == reason, key
        assert got.seconds is not None and 0 < got.seconds < 600, (key, got.seconds)


def assert_blind(page: ReviewPage, store: ReviewStore) -> None:
    """The page shows the item's images (source left, edit right) and never its metadata or the judge's verdict."""
    html = page.driver.page_source
    shown = store.item(page.item())
    assert page.find("#image-source img").get_attribute("src").endswith(Path(shown.images[0]).name)
    assert page.find("#image-edit img").get_attribute("src").endswith(Path(shown.images[1]).name)
    assert page.instruction() == shown.instruction
    for item in store.items():
        hidden = [item.sample_id, item.sample_id.split("#")[0], item.stratum, item.dataset]
        if item.judge and item.judge.get("reason"):
            hidden.append(item.judge["reason"])
        leaked = [text for text in hidden if text and text in html]
        assert not leaked, f"the page shows {leaked}"
    assert not re.search(r"\b(accepted|rejected|verdict|round \d)\b", page.text("item-view"), re.IGNORECASE)


def test_two_raters_review_six_items_through_a_reload_a_killed_server_and_double_submits(small_run, tmp_path):
    run, sources = small_run
    review, port, log = tmp_path / "review", free_port(), tmp_path / "server.log"
    server = ReviewServer([run, "--out", review, "--items", "6", "--raters-per-item", "2", "--seed", "1",
                           "--source-images", sources], port, log).start()
    drivers, expected = [], {}
    try:
        store = ReviewStore.open(review)
        assert f"http://127.0.0.1:{port}/" in server.output() and "Ctrl+C" in server.output()
        for secret in (store.path, run / "medbanana-run.json"):  # gradio serves the images folder and nothing else
            with pytest.raises(urllib.error.HTTPError):
                urllib.request.urlopen(f"{server.url}gradio_api/file={secret}", timeout=10)
        drivers += [new_browser(), new_browser()]
        ana, ben = (ReviewPage(driver, server.url).open() for driver in drivers)

        # a bad name: a clear message, no item, nothing stored
        ana.sign_in("Ana <script>")
        ana.wait(lambda: "letters, digits" in ana.message(), "the bad name's message")
        assert ana.item() is None and ana.text("sign-in")
        ana.sign_in("Ana")
        ana.wait(ana.item, "Ana's first item")
        assert ana.progress() == (1, 6)
        assert_blind(ana, store)
        inner = ana.driver.execute_script("return [window.innerWidth, window.innerHeight]")
        bottom = ana.driver.execute_script("return document.getElementById('submit').getBoundingClientRect().bottom")
        assert inner[0] == WINDOW[0] and bottom <= inner[1], f"Submit is below the fold of a 1280x800 window: {bottom}"
        ana.driver.save_screenshot(str(tmp_path / "review-page.png"))
        from PIL import Image

        assert Image.open(tmp_path / "review-page.png").size[0] == WINDOW[0]
        assert_offline(ana)
        with urllib.request.urlopen(ana.find("#image-source img").get_attribute("src"), timeout=10) as image:
            assert image.status == 200  # the same route that refused the store and the run serves the images

        # an incomplete answer: a message naming what is missing, nothing stored, the same item stays
        first = ana.item()
        ana.choose("has_disease", "Yes")
        ana.choose("qualified", "No")
        ana.submit()
        ana.wait(lambda: "answer every question" in ana.message(), "the incomplete answer's message")
        assert "structure_reasonable" in ana.message() and ana.item() == first and store.answers() == []

        # two raters at once, in two browsers
        ben.sign_in("Ben")
        ben.wait(ben.item, "Ben's first item")
        assert "Saved" in answer(ana, "Ana", expected)
        answer(ben, "Ben", expected)
        answer(ana, "Ana", expected)
        assert_stored_as_clicked(store, expected)

        # a reload resumes at the item Ana was shown, her answers kept
        held = ana.item()
        ana.reload()
        ana.wait(ana.item, "Ana's item after the reload")
        assert ana.item() == held and ana.progress() == (3, 6)
        # so does entering the name again
        ben_held = ben.item()
        ben.find("#change-rater").click()
        ben.wait(lambda: ben.text("sign-in"), "the sign-in form")
        ben.sign_in("Ben")
        ben.wait(ben.item, "Ben's item after entering his name again")
        assert ben.item() == ben_held

        # a second tab of Ana's answers first; the first tab's submit is then reported and moves on
        first_tab = ana.driver.current_window_handle
        ana.driver.switch_to.new_window("tab")
        second = ReviewPage(ana.driver, server.url).open()
        second.wait(second.item, "the second tab's item")
        assert second.item() == held
        answer(second, "Ana", expected)
        ana.driver.close()
        ana.driver.switch_to.window(first_tab)
        assert ana.item() == held
        flipped = {name: not value for name, value in expected[("Ana", held)][0].items()}
        ana.answer_rubric(flipped, "a second opinion")
        message = ana.submit_and_wait()
        assert "already answered" in message and "first answer is kept" in message
        # a double click stores one answer, to the item it was clicked on
        before = len(store.answers())
        answer(ana, "Ana", expected, double=True)
        assert len(store.answers()) == before + 1
        assert_stored_as_clicked(store, expected)

        # the server is killed: nothing answered is lost, and raters continue after a reload
        ana_held, ben_held = ana.item(), ben.item()
        server.kill()
        assert_stored_as_clicked(ReviewStore.open(review), expected)
        server = ReviewServer([review], port, log).start()
        for page, held in ((ana, ana_held), (ben, ben_held)):
            page.reload()
            page.wait(page.item, "an item after the restart")
            assert page.item() == held

        for page, rater in ((ana, "Ana"), (ben, "Ben")):
            while page.item():
                answer(page, rater, expected)
            assert "You answered 6 items" in page.text("finished")
        assert ana.progress() is None
    finally:
        for driver in drivers:
            close_browser(driver)
        exit_code = server.stop()

    assert exit_code == 0 and "stopped" in server.output()
    assert Counter(item for _, item in stored(store)) == {item.item_id: 2 for item in store.items()}
    assert_stored_as_clicked(store, expected)

    # the export feeds judge-agreement, which compares the raters' majority with the judge's recorded verdicts
    labels, agreement = tmp_path / "labels.csv", tmp_path / "agreement"
    assert main(["review", "export", str(review), "--out", str(labels)]) == 0
    assert main(["judge-agreement", str(run), "--out", str(agreement), "--human", str(labels),
                 "--source-images", str(sources)]) == 0
    report = json.loads((agreement / "agreement.json").read_text())["human_agreement"]
    majority = {}
    for item in store.items():
        votes = [expected[(rater, item.item_id)][0]["qualified"] for rater in ("Ana", "Ben")]
        if votes[0] == votes[1]:  # two raters: a tie has no majority and is left out of the labels
            majority[item.sample_id] = (votes[0], item.judge["qualified"])
    assert report["unmatched_human_ids"] == [] and report["edits"] == len(majority)
    if majority:
        qualified = report["dimensions"]["qualified"]
        assert qualified["agreement"] == pytest.approx(sum(h == j for h, j in majority.values()) / len(majority))


def test_realism_review_never_shows_one_source_both_real_and_edited(small_run, tmp_path):
    run, sources = small_run
    review = tmp_path / "realism"
    server = ReviewServer([run, "--out", review, "--mode", "realism", "--items", "4", "--raters-per-item", "2",
                           "--source-images", sources],
                          free_port(), tmp_path / "server.log").start()
    driver, given = None, {}
    try:
        store = ReviewStore.open(review)
        driver = new_browser()
        page = ReviewPage(driver, server.url).open()
        page.sign_in("Cy")
        page.wait(page.item, "Cy's first item")
        first_progress = page.progress()
        while page.item():
            item = store.item(page.item())
            assert page.find("#image-single img").get_attribute("src").endswith(Path(item.images[0]).name)
            html = driver.page_source
            assert item.shown not in page.text("review-header") and item.sample_id not in html
            rng = random.Random(item.item_id)
            guess, confidence = rng.choice(["real", "edited"]), rng.randint(1, 5)
            page.choose("guess", guess)
            page.submit()  # incomplete: the confidence is missing
            page.wait(lambda: "how sure" in page.message(), "the incomplete answer's message")
            page.choose("confidence", confidence)
            page.submit_and_wait()
            given[item.item_id] = (guess, confidence)
        assert f"You answered {len(given)} items" in page.text("finished")
        assert first_progress == (1, len(given))  # "item 1 of N": one item per source, from the start
    finally:
        if driver is not None:
            close_browser(driver)
        server.stop()

    answers = {a.item_id: a.answer for a in store.answers() if a.rater == "Cy"}
    assert {k: (a.guess, a.confidence) for k, a in answers.items()} == given
    pairs = Counter(store.item(item_id).pair_id for item_id in answers)
    assert max(pairs.values()) == 1, "a source was shown to one rater both real and edited"
    assert set(pairs) == {item.pair_id for item in store.items()}, "a source was never shown"
