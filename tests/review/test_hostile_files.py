"""The review server against a hostile review folder, driven over HTTP as a real process on 127.0.0.1: it serves only
regular files of its own images/ folder under the names the store gives them (content-derived, checked on open),
never a link (to a file outside, or to ../review.sqlite, which holds every answer and the judge's verdicts); a
review.sqlite altered to name `../../x/secret.png` or an absolute path is refused in one line before anything is
served; a rater's reason has a length limit. No secret byte reaches an HTTP response or gradio's cache."""

import json
import sqlite3
import subprocess
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from review_browser import ReviewServer, free_port, make_run, medbanana_command
from review_http import GradioSession, value_of

from medbanana.generation.dataset.review_folder import DB_NAME, MAX_REASON
from medbanana.review.store import ReviewStore

SECRET = b"TOP-SECRET-PATIENT-LIST-3b9d"
RUBRIC = dict.fromkeys(("q-has_disease", "q-structure_reasonable", "q-looks_realistic", "q-fidelity_preserved",
                        "q-qualified"), "Yes")


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> Path:
    """A rubric review of two items, created and not served; and a secret beside it."""
    root = tmp_path_factory.mktemp("review-files")
    run, sources = make_run(root / "data")
    review = root / "review"
    result = subprocess.run([*medbanana_command(), "review", str(run), "--out", str(review), "--items", "2",
                             "--raters-per-item", "1", "--source-images", str(sources), "--no-serve"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    (root / "x").mkdir()
    (root / "x" / "secret.png").write_bytes(SECRET)
    return root


def copy_review(made: Path, tmp_path: Path) -> Path:
    import shutil

    shutil.copytree(made / "review", tmp_path / "review", symlinks=True)
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "secret.png").write_bytes(SECRET)
    return tmp_path / "review"


def rename_images(review: Path, rename) -> None:
    """Rewrite every item's image names in review.sqlite, as a crafted folder would."""
    db = sqlite3.connect(review / DB_NAME)
    for item_id, record in db.execute("SELECT item_id, record FROM items").fetchall():
        record = json.loads(record)
        record["images"] = [rename(name) for name in record["images"]]
        db.execute("UPDATE items SET record = ? WHERE item_id = ?", (json.dumps(record), item_id))
    db.commit()
    db.close()


def assert_nothing_leaked(server: ReviewServer, review: Path, responses: list[bytes]) -> None:
    for body in responses:
        assert SECRET not in body and b"SQLite format 3" not in body
    for cached in review.glob(".gradio-cache-*/**/*"):
        if cached.is_file():
            data = cached.read_bytes()
            assert SECRET not in data and not data.startswith(b"SQLite format 3"), cached


def fetch(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


@pytest.mark.parametrize("named", ["../../x/secret.png", "absolute"])
def test_a_review_naming_files_outside_its_images_is_refused_in_one_line(made, tmp_path, named):
    review = copy_review(made, tmp_path)
    target = str(tmp_path / "x" / "secret.png") if named == "absolute" else named
    rename_images(review, lambda name: target)
    result = subprocess.run([*medbanana_command(), "review", str(review), "--port", str(free_port())],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "this review folder was altered" in lines[0] and "Traceback" not in result.stderr
    assert "served at" not in result.stdout


@pytest.mark.slow
@pytest.mark.parametrize("swap", ["link outside", "link to review.sqlite", "other content", "folder"])
def test_an_image_that_is_not_the_reviews_own_file_is_never_served(made, tmp_path, swap):
    review = copy_review(made, tmp_path)
    store = ReviewStore.open(review)
    for item in store.items():
        for name in item.images:
            path = review / name
            path.unlink(missing_ok=True)
            if swap == "link outside":
                path.symlink_to(tmp_path / "x" / "secret.png")
            elif swap == "link to review.sqlite":
                path.symlink_to(Path("..") / DB_NAME)
            elif swap == "other content":
                path.write_bytes(SECRET)
            else:
                path.mkdir()
    server = ReviewServer([review], free_port(), tmp_path / "server.log").start()
    responses = []
    try:
        out = GradioSession(server.url).call("start", {"rater-name": "Ana"})
        message = value_of(out["review-message"])
        assert "cannot be shown" in message and not value_of(out["item-id"]), out
        responses.append(json.dumps(out).encode())
        for item in store.items():  # asked for directly, the files are refused too
            for name in item.images:
                status, body = fetch(f"{server.url}gradio_api/file={review / name}")
                assert status != 200
                responses.append(body)
        status, body = fetch(f"{server.url}gradio_api/file={review / DB_NAME}")
        assert status != 200
        responses.append(body)
    finally:
        assert server.stop() == 0
    assert "Traceback" not in server.output()
    assert store.answers() == []
    assert_nothing_leaked(server, review, responses)


@pytest.mark.slow
def test_the_reviews_own_images_are_served_and_reasons_are_limited(made, tmp_path):
    review = copy_review(made, tmp_path)
    store = ReviewStore.open(review)
    server = ReviewServer([review], free_port(), tmp_path / "server.log").start()
    try:
        ana = GradioSession(server.url)
        out = ana.call("start", {"rater-name": "Ana"})
        shown = value_of(out["item-id"])
        item = store.item(shown)
        served = out["image-source"].get("value") or out["image-source"]  # gradio's FileData of the copy it serves
        status, body = fetch(f"{server.url}gradio_api/file={served['path']}")
        assert status == 200 and body == (review / item.images[0]).read_bytes()  # the review's own bytes
        out = ana.call("submit", {"browserstate": "Ana", "item-id": shown, **RUBRIC,
                                  "reason": "x" * (MAX_REASON + 1)})
        assert f"at most {MAX_REASON:,} characters" in value_of(out["review-message"]).replace("\\", "")
        assert store.answers() == []
        out = ana.call("submit", {"browserstate": "Ana", "item-id": shown, **RUBRIC, "reason": "y" * MAX_REASON})
        assert "Saved" in value_of(out["review-message"])
        assert [a.answer.reason for a in store.answers()] == ["y" * MAX_REASON]
    finally:
        assert server.stop() == 0
