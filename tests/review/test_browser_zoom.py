"""The side-by-side images' synced zoom in a real browser: `medbanana review` serves a rubric review and headless
Chromium turns the mouse wheel, drags, double-clicks and presses keys over the images as a rater would; every
check reads where the browser draws the two images against their frames."""

import pytest
from review_browser import (WINDOW, ReviewPage, ReviewServer, assert_offline, browser_missing, close_browser,
                            free_port, make_run, new_browser)

from medbanana.generation.records import VERDICT_BOOLEANS
from medbanana.review.app import MAX_ZOOM

pytestmark = [pytest.mark.slow, pytest.mark.skipif(browser_missing() is not None, reason=str(browser_missing()))]
IMAGES = ("image-source", "image-edit")
PIXEL = 1.0  # layout rounding: a drawn edge may sit a pixel off its exact place


def view_of(box: dict) -> tuple[float, float, float, float]:
    """(scale x, scale y, offset x, offset y) of an image in its frame; offsets as fractions of the frame."""
    (fx, fy, fw, fh), (ix, iy, iw, ih) = box["frame"], box["image"]
    return iw / fw, ih / fh, (ix - fx) / fw, (iy - fy) / fh


def assert_same_view(boxes: dict) -> tuple[float, float, float, float]:
    """Both images zoomed by the same factor (the same in x and y) onto the same spot; that view."""
    source, edit = (view_of(boxes[elem_id]) for elem_id in IMAGES)
    assert source == pytest.approx(edit, abs=1e-3), (source, edit)
    assert source[0] == pytest.approx(source[1], abs=1e-3)
    return source


def assert_unzoomed(boxes: dict) -> None:
    for elem_id in IMAGES:
        assert boxes[elem_id]["image"] == pytest.approx(boxes[elem_id]["frame"], abs=PIXEL), elem_id


def assert_covers_frame(box: dict) -> None:
    """A zoomed image leaves no empty band in its frame."""
    (fx, fy, fw, fh), (ix, iy, iw, ih) = box["frame"], box["image"]
    assert ix <= fx + PIXEL and iy <= fy + PIXEL and ix + iw >= fx + fw - PIXEL and iy + ih >= fy + fh - PIXEL


def test_a_rater_zooms_both_images_onto_the_same_spot_pans_resets_and_the_next_item_starts_unzoomed(tmp_path):
    run, sources = make_run(tmp_path)
    server = ReviewServer([run, "--out", tmp_path / "review", "--items", "2", "--raters-per-item", "1",
                           "--source-images", sources], free_port(),
                          tmp_path / "server.log").start()
    driver = None
    try:
        driver = new_browser()
        page = ReviewPage(driver, server.url).open()
        page.sign_in("Dee")
        page.wait(page.item, "Dee's first item")
        boxes = page.image_boxes()
        assert_unzoomed(boxes)
        assert all(boxes[elem_id]["overflow"] == "hidden" for elem_id in IMAGES)
        # the hint is there, and it and Submit still fit a 1280x800 window
        assert "zoom both" in page.text("zoom-hint") and "double-click to reset" in page.text("zoom-hint")
        bottoms = driver.execute_script("return ['zoom-hint', 'submit'].map(id => "
                                        "document.getElementById(id).getBoundingClientRect().bottom)")
        assert max(bottoms) <= WINDOW[1], bottoms

        # the wheel over the source, left of and above its centre, zooms both around that point
        at = (-60, -40)
        page.wheel("image-source", -300, at=at)
        boxes = page.image_boxes()
        scale, _, offset_x, offset_y = assert_same_view(boxes)
        assert 1.2 < scale <= MAX_ZOOM
        (fx, fy, fw, fh), (ix, iy, _, _) = boxes["image-source"]["frame"], boxes["image-source"]["image"]
        pointer = (fx + fw / 2 + at[0], fy + fh / 2 + at[1])
        # the image point that was under the pointer (unzoomed: the same frame point) is still under it
        assert ix + scale * (pointer[0] - fx) == pytest.approx(pointer[0], abs=2 * PIXEL)
        assert iy + scale * (pointer[1] - fy) == pytest.approx(pointer[1], abs=2 * PIXEL)
        for elem_id in IMAGES:
            assert_covers_frame(boxes[elem_id])

        # clipped: beyond a frame the rater sees the page (the questions, the hint), never the zoomed image
        edit_frame, edit_image = boxes["image-edit"]["frame"], boxes["image-edit"]["image"]
        on_questions = (edit_frame[0] + edit_frame[2] + 40, edit_frame[1] + 20)
        below_source = (fx + fw / 2, fy + fh + 12)
        assert edit_image[0] + edit_image[2] > on_questions[0]  # where the zoomed edit would reach, unclipped
        assert boxes["image-source"]["image"][1] + boxes["image-source"]["image"][3] > below_source[1]
        assert page.shows_at(*on_questions, "#questions")
        between = (fx + fw + (edit_frame[0] - fx - fw) / 2, fy + fh / 2)  # the gap between the two frames
        for point in (below_source, between):
            assert not page.shows_at(*point, ".image-frame"), point
        assert page.shows_at(fx + fw / 2, fy + fh / 2, "#image-source .image-frame")
        # the label stays on top of the zoomed image (made hit-testable: gradio lets clicks pass through it)
        driver.execute_script("document.querySelector('#image-source label').style.pointerEvents = 'auto'")
        assert page.shows_at(fx + 20, fy + 12, "#image-source label")

        # dragging the edit pans both by the same distance
        before = {elem_id: boxes[elem_id]["image"] for elem_id in IMAGES}
        assert offset_x + 40 / fw <= 0 and offset_y + 25 / fh <= 0  # room to pan that far right and down
        page.drag_image("image-edit", 40, 25)
        boxes = page.image_boxes()
        assert assert_same_view(boxes)[0] == pytest.approx(scale)
        for elem_id in IMAGES:
            moved = [after - was for after, was in zip(boxes[elem_id]["image"], before[elem_id])]
            assert moved == pytest.approx([40, 25, 0, 0], abs=PIXEL), (elem_id, moved)

        # a double click on either resets both
        page.double_click_image("image-edit")
        assert_unzoomed(page.image_boxes())

        # the zoom stops at MAX_ZOOM and at 1x, the image still covering its frame
        page.wheel("image-edit", -500, at=(100, 120), times=8)
        boxes = page.image_boxes()
        assert assert_same_view(boxes)[0] == pytest.approx(MAX_ZOOM)
        for elem_id in IMAGES:
            assert_covers_frame(boxes[elem_id])
        page.wheel("image-edit", 500, times=8)
        assert_unzoomed(page.image_boxes())

        # keys over an image: + zooms both, - zooms out, 0 resets
        page.key_over_image("image-source", "+")
        zoomed = assert_same_view(page.image_boxes())[0]
        assert zoomed == pytest.approx(1.25)
        page.key_over_image("image-source", "+")
        page.key_over_image("image-source", "-")
        assert assert_same_view(page.image_boxes())[0] == pytest.approx(zoomed)
        page.key_over_image("image-edit", "0")
        assert_unzoomed(page.image_boxes())
        # typing the reason with the pointer resting on an image types, and zooms nothing
        from selenium.webdriver.common.action_chains import ActionChains

        reason = page.find("#reason textarea, #reason input")
        ActionChains(driver).click(reason).move_to_element(page.find("#image-source img")).send_keys("+2 -0").perform()
        assert reason.get_attribute("value") == "+2 -0"
        assert_unzoomed(page.image_boxes())

        # zoomed in when the answer is submitted: the next item starts unzoomed
        page.wheel("image-source", -400)
        boxes = page.image_boxes()
        assert assert_same_view(boxes)[0] > 1.2
        shown = {elem_id: boxes[elem_id]["src"] for elem_id in IMAGES}
        page.answer_rubric({name: True for name in VERDICT_BOOLEANS})
        page.submit_and_wait()
        assert page.progress() == (2, 2)
        page.wait(lambda: {e: b["src"] for e, b in page.image_boxes().items()} != shown, "the next item's images")
        assert_unzoomed(page.image_boxes())
        page.wheel("image-edit", -300)  # and it zooms as the first did
        assert assert_same_view(page.image_boxes())[0] > 1.2
        assert_offline(page)
    finally:
        if driver is not None:
            close_browser(driver)
        server.stop()
