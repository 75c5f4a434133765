"""The review folder: a seeded, stratified, blind sample, and a store that gives each item to K raters and never
loses or duplicates an answer, across threads, processes and a killed process."""

from __future__ import annotations

import multiprocessing
import os
import signal
import sqlite3
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from PIL import Image

from medbanana.review.items import create_review, read_edits
from medbanana.generation.dataset.review_folder import DB_NAME, IMAGES, Answer
from medbanana.review.store import ReviewStore

YES = Answer(True, True, True, True, True, "fine")


@pytest.fixture(scope="module")
def run(demo_run_root) -> Path:
    return demo_run_root / "demo-run" / "run"


def test_the_sample_is_seeded_stratified_and_blind(run, tmp_path):
    first = create_review(run, tmp_path / "a", mode="rubric", items=6, raters_per_item=2, seed=5,
                          source_images=run.parent / "sources").items()
    again = create_review(run, tmp_path / "b", mode="rubric", items=6, raters_per_item=2, seed=5,
                          source_images=run.parent / "sources").items()
    other = create_review(run, tmp_path / "c", mode="rubric", items=6, raters_per_item=2, seed=6,
                          source_images=run.parent / "sources").items()
    assert [i.sample_id for i in first] == [i.sample_id for i in again]
    assert [i.sample_id for i in first] != [i.sample_id for i in other]
    # three modalities, two directions, both outcomes in the pool: six items cover them evenly
    assert Counter(i.modality for i in first) == {"chest_xray": 2, "brain_mri": 2, "fundus": 2}
    assert Counter(i.direction for i in first) == {"add": 3, "remove": 3}
    assert {i.stratum.rsplit("/", 1)[1] for i in first} == {"accepted", "rejected"}
    for item in first:
        assert item.item_id.startswith("item-") and item.shown == "pair" and len(item.images) == 2
        for name in item.images:  # what a browser can see of a file: its name, format and metadata
            assert name.startswith(f"{IMAGES}/") and all(part not in name for part in item.sample_id.split("/"))
            with Image.open(tmp_path / "a" / name) as image:
                assert image.format == "PNG" and not image.info.get("XML:com.adobe.xmp") and not image.text


def test_realism_items_never_show_one_rater_a_source_both_ways(run, tmp_path):
    store = create_review(run, tmp_path / "r", mode="realism", items=8, raters_per_item=3, seed=0,
                          source_images=run.parent / "sources")
    items = store.items()
    assert Counter(i.shown for i in items)["edited"] == 8 and {i.shown for i in items} == {"real", "edited"}
    assert all(i.judge is None for i in items if i.shown == "real")
    for rater in ("Ana", "Bo", "Cy", "Di"):
        seen = []
        while (item := store.next_item(rater)) is not None:
            assert store.submit(rater, item.item_id, Answer(guess="real", confidence=3))
            seen.append(item)
        assert len({i.pair_id for i in seen}) == len(seen)  # one form per source
    assert max(Counter(a.item_id for a in store.answers()).values()) <= 3


def test_each_item_reaches_k_raters_claims_hold_and_a_reload_resumes(run, tmp_path):
    store = create_review(run, tmp_path / "k", mode="rubric", items=3, raters_per_item=2, seed=1,
                          source_images=run.parent / "sources")
    shown = store.next_item("Ana")
    assert store.next_item("Ana").item_id == shown.item_id  # a reload shows the same item
    assert store.next_item("Bo").item_id == shown.item_id  # K = 2: a second rater may take it
    third = store.next_item("Cy")
    assert third.item_id != shown.item_id  # two claims fill the item
    for rater in ("Ana", "Bo", "Cy", "Di"):
        while (item := store.next_item(rater)) is not None:
            store.submit(rater, item.item_id, YES)
    counts = Counter(a.item_id for a in store.answers())
    assert counts == {item.item_id: 2 for item in store.items()}
    assert store.progress("Ana") == (3, 3)


def test_answers_are_append_only_and_checked(run, tmp_path):
    store = create_review(run, tmp_path / "c", mode="rubric", items=2, raters_per_item=1, seed=1,
                          source_images=run.parent / "sources")
    item = store.next_item("Ana")
    assert store.submit("Ana", item.item_id, YES) is True
    assert store.submit("Ana", item.item_id, Answer(False, False, False, False, False)) is False  # double submit
    assert [a.answer.qualified for a in store.answers()] == [True]  # the first answer is kept
    with pytest.raises(ValueError, match="every question"):
        store.submit("Bo", item.item_id, Answer(True, None, True, True, True))
    with pytest.raises(ValueError, match="only"):
        store.submit("Bo<script>", item.item_id, YES)
    with pytest.raises(KeyError):
        store.submit("Bo", "item-9999", YES)
    db = sqlite3.connect(tmp_path / "c" / DB_NAME)
    assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    for statement in ("UPDATE answers SET qualified = 0", "DELETE FROM answers"):
        with pytest.raises(sqlite3.DatabaseError, match="append-only"):
            db.execute(statement)
    with pytest.raises(ValueError, match="already holds a review"):
        create_review(run, tmp_path / "c", mode="rubric", items=2, raters_per_item=1, seed=1,
                      source_images=run.parent / "sources")


def test_bad_inputs_say_what_is_wrong(run, tmp_path, builder_original_run):
    with pytest.raises(FileNotFoundError, match="no such dataset or run"):
        read_edits(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="is this a Med-Banana run directory"):
        read_edits(tmp_path / "empty")
    with pytest.raises(ValueError, match="--source-images"):  # released data: sources are not in the run
        read_edits(builder_original_run)
    with pytest.raises(ValueError, match="--mode"):
        create_review(run, tmp_path / "m", mode="vibes", items=2, raters_per_item=1, seed=0,
                      source_images=run.parent / "sources")
    with pytest.raises(FileNotFoundError, match="not a review folder"):
        ReviewStore.open(tmp_path / "empty")


def _rate_until_done(folder: str, rater: str) -> int:
    store, answered = ReviewStore.open(Path(folder)), 0
    while (item := store.next_item(rater)) is not None:
        answered += store.submit(rater, item.item_id, YES)
    return answered


@pytest.mark.slow
def test_raters_in_parallel_processes_never_overfill_an_item(run, tmp_path):
    store = create_review(run, tmp_path / "p", mode="rubric", items=10, raters_per_item=1, seed=2,
                          source_images=run.parent / "sources")
    with multiprocessing.get_context("spawn").Pool(4) as pool:
        answered = pool.starmap(_rate_until_done, [(str(store.folder), f"rater {n}") for n in range(4)])
    assert sum(answered) == 10
    assert Counter(a.item_id for a in store.answers()) == {item.item_id: 1 for item in store.items()}


KILLED_RATER = """
import sys
from pathlib import Path
from medbanana.generation.dataset.review_folder import Answer
from medbanana.review.store import ReviewStore
store = ReviewStore.open(Path(sys.argv[1]))
while (item := store.next_item("Ana")) is not None:
    store.submit("Ana", item.item_id, Answer(True, True, True, True, True))
    print(item.item_id, flush=True)  # acknowledged: the answer is committed
    sys.stdin.readline()  # wait to be told to go on, or killed
"""


def test_an_answer_acknowledged_survives_a_killed_process(run, tmp_path):
    store = create_review(run, tmp_path / "x", mode="rubric", items=4, raters_per_item=1, seed=3,
                          source_images=run.parent / "sources")
    proc = subprocess.Popen([sys.executable, "-c", KILLED_RATER, str(store.folder)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    acknowledged = [proc.stdout.readline().strip()]
    proc.stdin.write("\n")
    proc.stdin.flush()
    acknowledged.append(proc.stdout.readline().strip())
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert [a.item_id for a in ReviewStore.open(store.folder).answers()] == acknowledged
    # the killed rater's claim on a third item is theirs when they come back; nothing else is lost
    assert _rate_until_done(str(store.folder), "Ana") == 2


@pytest.mark.slow
def test_refined_instructions_do_not_tell_the_round(run, tmp_path):
    items = create_review(run, tmp_path / "i", mode="rubric", items=24, raters_per_item=1, seed=0,
                          source_images=run.parent / "sources").items()
    later = [i for i in items if not i.sample_id.endswith("#1")]
    assert later, "the sample holds no refined (round 2+) instruction to check"
    assert all(i.instruction.startswith(("Add", "Take", "Remove")) for i in items)
    assert not any("previous attempt" in i.instruction.lower() for i in items)


def test_the_store_decides_what_is_stored_whatever_a_client_sends(run, tmp_path, monkeypatch):
    from medbanana.review import store as store_module
    from medbanana.review.store import NotGiven

    store = create_review(run, tmp_path / "s", mode="rubric", items=2, raters_per_item=1, seed=1,
                          source_images=run.parent / "sources")
    shown = store.next_item("Ana")
    other = next(i for i in store.items() if i.item_id != shown.item_id)
    with pytest.raises(NotGiven, match="not given to Ana"):  # an item never handed to her
        store.submit("Ana", other.item_id, YES)
    with pytest.raises(NotGiven, match="not given to Bo"):  # Ana's item, answered under another name
        store.submit("Bo", shown.item_id, YES)
    assert store.answers() == []
    # a claim that expired: the item is handed again, and the second answer is refused at K = 1
    monkeypatch.setattr(store_module, "CLAIM_SECONDS", -1)
    assert store.next_item("Bo").item_id == shown.item_id
    assert store.submit("Bo", shown.item_id, YES)
    with pytest.raises(NotGiven, match="has its 1 answers"):
        store.submit("Ana", shown.item_id, YES)
    assert Counter(a.item_id for a in store.answers()) == {shown.item_id: 1}

    realism = create_review(run, tmp_path / "r", mode="realism", items=2, raters_per_item=2, seed=0,
                            source_images=run.parent / "sources")
    first = realism.next_item("Cy")
    twin = next(i for i in realism.items() if i.pair_id == first.pair_id and i.item_id != first.item_id)
    assert realism.submit("Cy", first.item_id, Answer(guess="real", confidence=2))
    with pytest.raises(NotGiven):  # the other form of the source Cy answered
        realism.submit("Cy", twin.item_id, Answer(guess="edited", confidence=2))
    assert [(a.rater, a.item_id) for a in realism.answers()] == [("Cy", first.item_id)]


def test_a_review_folder_is_never_written_through_a_symlink(run, tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    for name in (DB_NAME, IMAGES):
        folder = tmp_path / f"linked-{name}"
        folder.mkdir()
        (folder / name).symlink_to(outside / name)
        with pytest.raises(ValueError, match="symlink"):
            create_review(run, folder, mode="rubric", items=2, raters_per_item=1, seed=0,
                          source_images=run.parent / "sources")
    assert list(outside.iterdir()) == []


def test_review_reads_only_inside_the_run_it_is_given(tmp_path, capsys):
    from medbanana.builder.synthetic_run import make_synthetic_run
    from medbanana.cli import main

    run = tmp_path / "run"
    make_synthetic_run(run, flavor="ours", tasks_per_folder=3, datasets=("mimic_ours_cxr",),
                       sources_dir=tmp_path / "sources", image_size=64, seed=2)
    # the run's medbanana-run.json names the sources beside it: a hint, confirmed with --source-images
    assert main(["review", str(run), "--out", str(tmp_path / "r0"), "--no-serve"]) != 0
    err = capsys.readouterr().err
    assert f"--source-images {tmp_path / 'sources'}" in err and len(err.strip().splitlines()) == 1
    # an accepted image replaced by a link to a file outside the run: left out, said in one line
    secret = tmp_path / "secret.jpeg"
    image = next(p for p in sorted(run.rglob("*.jpeg")) if "failed" not in str(p))
    secret.write_bytes(image.read_bytes())
    image.unlink()
    image.symlink_to(secret)
    assert main(["review", str(run), "--out", str(tmp_path / "r1"), "--no-serve", "--items", "50",
                 "--source-images", str(tmp_path / "sources")]) == 0
    err = capsys.readouterr().err
    assert "skipped 1 edit(s) whose image leads outside" in err
    shown = {i.images[1] for i in ReviewStore.open(tmp_path / "r1").items()}
    from medbanana.review.items import _write_png  # the name the secret would have in the review
    (tmp_path / "probe" / IMAGES).mkdir(parents=True)
    assert _write_png(tmp_path / "probe", secret.read_bytes()) not in shown
