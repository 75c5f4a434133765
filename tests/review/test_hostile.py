"""The review page against a hostile data source and a hostile client: instructions holding markup are shown as
text and fetch nothing; answers crafted over gradio's HTTP API for items the store did not hand that rater are never
stored; gradio's upload route is off and its file cache never leaves the review folder."""

import stat
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from review_browser import (ReviewPage, ReviewServer, assert_offline, browser_missing, close_browser, free_port,
                            make_run, new_browser)
from review_http import GradioSession, Tracker, hostile_instructions, value_of, write_samples

from medbanana.review.store import ReviewStore

GUESS = {"q-guess": "real", "q-confidence": 3}


def gradio_caches(review: Path) -> list[Path]:
    return sorted(review.glob(".gradio-cache-*"))


@pytest.mark.slow
def test_crafted_answers_over_http_are_refused_and_nothing_leaves_the_review_folder(tmp_path):
    run, sources = make_run(tmp_path / "data")
    review, system_tmp = tmp_path / "review", tmp_path / "system-tmp"
    system_tmp.mkdir()
    server = ReviewServer([run, "--out", review, "--mode", "realism", "--items", "4", "--raters-per-item", "1",
                           "--source-images", sources], free_port(), tmp_path / "server.log",
                          env={"TMPDIR": str(system_tmp)}).start()
    try:
        store = ReviewStore.open(review)
        upload = urllib.request.Request(f"{server.url}gradio_api/upload", method="POST", data=(
            b'--x\r\nContent-Disposition: form-data; name="files"; filename="a.png"\r\n\r\nPNG\r\n--x--\r\n'),
            headers={"Content-Type": "multipart/form-data; boundary=x"})
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(upload, timeout=10)
        assert refused.value.code == 401

        eve = GradioSession(server.url)
        shown = value_of(eve.call("start", {"rater-name": "Eve"})["item-id"])
        item = store.item(shown)
        twin = next(i for i in store.items() if i.pair_id == item.pair_id and i.item_id != shown)
        # an item this session was never shown (the other form of Eve's source): refused, nothing stored
        out = eve.call("submit", {"browserstate": "Eve", "item-id": twin.item_id, **GUESS})
        assert "not the one this page was showing you" in value_of(out["review-message"])
        # the item shown, answered under a name the store never handed it to: refused
        out = eve.call("submit", {"browserstate": "Mallory", "item-id": shown, **GUESS})
        assert "not given to Mallory" in value_of(out["review-message"]).replace("\\", "")
        assert store.answers() == []
        eve = GradioSession(server.url)  # Eve comes back: the store shows her the item it holds for her
        assert value_of(eve.call("start", {"rater-name": "Eve"})["item-id"]) == shown
        out = eve.call("submit", {"browserstate": "Eve", "item-id": shown, **GUESS})
        assert "Saved" in value_of(out["review-message"])
        # a new session of Eve's is handed another source; the twin, sent anyway, is refused again
        again = GradioSession(server.url)
        handed = value_of(again.call("start", {"rater-name": "Eve"})["item-id"])
        assert store.item(handed).pair_id != item.pair_id
        again.call("submit", {"browserstate": "Eve", "item-id": twin.item_id, **GUESS})
        assert [(a.rater, a.item_id) for a in store.answers()] == [("Eve", shown)]

        # what gradio served is cached in the review's own 0700 folder, not in the system temp folder
        (cache,) = gradio_caches(review)
        assert stat.S_IMODE(cache.stat().st_mode) == 0o700 and any(cache.rglob("*.png"))
    finally:
        assert server.stop() == 0
    assert gradio_caches(review) == [] and list(system_tmp.rglob("*")) == []


pytestmark_browser = pytest.mark.skipif(browser_missing() is not None, reason=str(browser_missing()))


@pytest.mark.slow
@pytestmark_browser
def test_instructions_holding_markup_show_as_text_and_fetch_nothing(tmp_path):
    tracker = Tracker()
    texts = hostile_instructions(tracker.url)
    samples = write_samples(tmp_path / "eval", texts)
    review = tmp_path / "review"
    server = ReviewServer([samples, "--out", review, "--items", "2", "--raters-per-item", "1"], free_port(),
                          tmp_path / "server.log").start()
    driver = None
    try:
        store = ReviewStore.open(review)
        assert sorted(i.instruction for i in store.items()) == sorted(texts)  # nothing in them speaks of rounds
        driver = new_browser()
        page = ReviewPage(driver, server.url).open()
        page.sign_in("Ana")
        seen = []
        while page.wait(lambda: page.item() or page.text("finished"), "an item or the end") and page.item():
            assert page.instruction() == store.item(page.item()).instruction  # the text, literally
            seen.append(page.instruction())
            html = page.find("#item-view").get_attribute("innerHTML")
            assert not any(f'{attr}="{tracker.url}' in html for attr in ("src", "href", "action"))
            assert_offline(page)
            page.answer_rubric(dict.fromkeys(("has_disease", "structure_reasonable", "looks_realistic",
                                              "fidelity_preserved", "qualified"), True))
            page.submit_and_wait()
        assert sorted(seen) == sorted(texts)
    finally:
        if driver is not None:
            close_browser(driver)
        server.stop()
        tracker.close()
    assert tracker.requests == [], f"the page made requests to another host: {tracker.requests}"
