"""The masks a run stores beside each attempt image (medbanana-masks/{image}.edit.png and .region.png): written by
`medbanana demo` / `medbanana generate` (in the worker process with --workers), equal to what the build would
compute (`masks.task_masks`), removed on opening when no journal line names their image, removed at write time when
they cannot be made, and carried by `medbanana merge` only from regular files inside the shard."""

from __future__ import annotations

import io
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from medbanana.cli import main
from medbanana.generation import masks
from medbanana.generation.records import Attempt, EditedImage, Instruction, Task
from medbanana.generation.rundir import layout, mask_files
from medbanana.generation.rundir.store import RunStore, read_journal
from medbanana.generation.runners import processes

DEMO = ["--normal", "1", "--diseased", "1", "--size", "128", "--max-rounds", "2", "--no-build", "-q"]


def _rounds(run: Path) -> list[tuple[dict, dict]]:
    """(task record, round) of every round with an image, from the run's finished tasks."""
    found = []
    for entry in read_journal(run / layout.JOURNAL):
        if entry["type"] == "task":
            found += [(entry["record"], r) for r in entry["record"]["rounds"] if r.get("image")]
    return found


def _companions(run: Path) -> set[str]:
    root = run / layout.MASKS
    return {p.relative_to(run).as_posix() for p in root.rglob("*") if p.is_file() or p.is_symlink()}


def _assert_masks_as_the_build_computes(run: Path, sources: Path) -> int:
    """Every attempt image has both companions, byte-equal to `task_masks` on its source and the image as written,
    and no other companion is there; returns how many edit masks mark some pixels."""
    rounds = _rounds(run)
    assert rounds
    marked = 0
    for record, rnd in rounds:
        source = (sources / record["source_path"]).read_bytes()
        image = (run / rnd["image"]).read_bytes()
        expected = masks.task_masks({rnd["image"]: {"bytes": image, "path": None}}, {"bytes": source, "path": None},
                                    record["modality"], record["disease"])
        edit_rel, region_rel = layout.mask_relpaths(rnd["image"])
        edit, region = (run / edit_rel).read_bytes(), (run / region_rel).read_bytes()
        assert edit == expected.edits[rnd["image"]]["bytes"]
        assert region == expected.region["bytes"]
        with Image.open(io.BytesIO(edit)) as mask, Image.open(io.BytesIO(image)) as edited:
            assert mask.mode == "L" and mask.size == edited.size
            marked += bool(np.asarray(mask).any())
        with Image.open(io.BytesIO(region)) as mask, Image.open(io.BytesIO(source)) as original:
            assert mask.size == original.size and set(np.unique(np.asarray(mask))) <= {0, 255}
    assert _companions(run) == {rel for _, rnd in rounds for rel in layout.mask_relpaths(rnd["image"])}
    return marked


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> Path:
    """A folder as `medbanana demo --out` leaves it (sources/ and run/); tests that change it work on a copy."""
    out = tmp_path_factory.mktemp("masks") / "d"
    assert main(["demo", "--out", str(out), *DEMO]) == 0
    return out


@pytest.mark.slow
def test_demo_run_stores_both_masks_of_every_attempt_image(demo):
    marked = _assert_masks_as_the_build_computes(demo / "run", demo / "sources")
    assert marked > 0  # the simulator's drawn findings are found, not an all-empty mask everywhere


@pytest.mark.slow
def test_worker_processes_compute_the_masks_and_the_parent_only_writes_them(demo, tmp_path, monkeypatch):
    sources = demo / "sources"
    computed_here, received = [], []
    compute = mask_files.compute
    monkeypatch.setattr(mask_files, "compute", lambda *a: computed_here.append(a) or compute(*a))  # the parent's
    handle = processes._Pool.handle

    def recording(pool, worker, message):
        if isinstance(message, processes.AttemptDone):
            received.append(message)
        return handle(pool, worker, message)

    monkeypatch.setattr(processes._Pool, "handle", recording)
    run = tmp_path / "workers"
    assert main(["generate", "--sources", str(sources), "--out", str(run), "--backend", "simulator", "--limit", "4",
                 "--workers", "2", "--concurrency", "2", "--max-rounds", "2", "-q"]) in (0, 3)
    assert not computed_here  # not one mask made in the parent
    with_image = [m for m in received if m.image is not None]
    assert with_image and all(isinstance(m.masks, tuple) and len(m.masks) == 2 for m in with_image)
    for message in with_image:  # the parent's store named the image (`write_image` sets it) and wrote these bytes
        for relpath, data in zip(layout.mask_relpaths(message.attempt.image_relpath), message.masks):
            assert isinstance(data, bytes) and (run / relpath).read_bytes() == data
    _assert_masks_as_the_build_computes(run, sources)


@pytest.mark.slow
def test_opening_a_run_removes_masks_no_journal_line_names_and_nothing_else(demo, tmp_path, capsys):
    shutil.copytree(demo, tmp_path / "d", symlinks=True)
    run = tmp_path / "d" / "run"
    kept = {rel: (run / rel).read_bytes() for rel in _companions(run)}
    image = next(iter(_rounds(run)))[1]["image"]
    folder = (run / layout.mask_relpaths(image)[0]).parent
    orphan = folder / "ghost-Pneumothorax-edit-failed-9.jpeg.edit.png"  # a killed write's, image never journalled
    orphan.write_bytes(b"stale")
    temp = folder / ".ghost.jpeg.region.png.tmp123.4"
    temp.write_bytes(b"torn")
    notes = run / layout.MASKS / "notes.txt"  # not named like a mask: not ours to remove
    notes.write_text("keep")
    outside = tmp_path / "outside"
    (outside / "inner").mkdir(parents=True)
    secret = outside / "inner" / "x.jpeg.edit.png"
    secret.write_bytes(b"secret")
    (run / layout.MASKS / "linked").symlink_to(outside / "inner", target_is_directory=True)  # never walked
    linked_mask = folder / "linked-Pneumothorax-edit-failed-7.jpeg.region.png"
    linked_mask.symlink_to(secret)  # an orphan that is a link: the link goes, its target stays

    assert main(["demo", "--out", str(tmp_path / "d"), *DEMO]) == 0  # a resume: opening reconciles
    printed = capsys.readouterr()
    assert f"2 masks of no journalled image removed from {layout.MASKS}/" in printed.out + printed.err
    assert not orphan.exists() and not temp.exists() and not os.path.lexists(linked_mask)
    assert notes.read_text() == "keep" and secret.read_bytes() == b"secret"
    assert (run / layout.MASKS / "linked").is_symlink()
    assert {rel: (run / rel).read_bytes() for rel in kept} == kept


def _store_and_task(tmp_path: Path, source: Path) -> tuple[RunStore, Task, Attempt]:
    store = RunStore(tmp_path / "run", {"backends": {}, "max_rounds": 2, "run_id": "r1"}).open()
    task = Task("MIMIC_s", "chest_xray", "Pneumothorax", "add", source, source.parent.parent.parent)
    attempt = Attempt(round=1, instruction=Instruction("add a pneumothorax"))
    return store, task, attempt


def _jpeg(value: int) -> bytes:
    buffer = io.BytesIO()
    rgb = np.full((64, 64, 3), value, np.uint8)
    rgb[20:40, 20:40] = 255 - value
    Image.fromarray(rgb).save(buffer, format="JPEG", quality=95)
    return buffer.getvalue()


@pytest.mark.parametrize("cause", ["source deleted", "mask function fails"])
def test_a_stale_mask_is_removed_when_the_round_cannot_make_one(tmp_path, monkeypatch, cause):
    source = tmp_path / "sources" / "MIMIC_s" / "normal" / "n0.jpeg"
    source.parent.mkdir(parents=True)
    source.write_bytes(_jpeg(60))
    store, task, attempt = _store_and_task(tmp_path, source)
    image_rel = layout.attempt_image_relpath("MIMIC_s", "add", "n0", "Pneumothorax", 1, False)
    stale = [store.run_dir / rel for rel in layout.mask_relpaths(image_rel)]
    for path in stale:  # left by an earlier write of this round (after opening, so reconcile did not see them)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"stale")
    if cause == "source deleted":
        source.unlink()
    else:
        def broken(*args):
            raise RuntimeError("a bug in the mask code")

        monkeypatch.setattr(mask_files, "attempt_mask_files", broken)
    try:
        store.write_attempt(task, attempt, EditedImage(_jpeg(70)))
    finally:
        store.close()
    assert attempt.image_relpath == image_rel and (store.run_dir / image_rel).is_file()  # the round is written
    assert not any(path.exists() for path in stale)
    assert [e["round"]["image"] for e in read_journal(store.run_dir / layout.JOURNAL)] == [image_rel]


def test_given_masks_are_written_as_given_and_a_missing_one_removes_its_file(tmp_path):
    source = tmp_path / "sources" / "MIMIC_s" / "normal" / "n0.jpeg"
    source.parent.mkdir(parents=True)
    source.write_bytes(_jpeg(60))
    store, task, attempt = _store_and_task(tmp_path, source)
    edit_rel, region_rel = layout.mask_relpaths(layout.attempt_image_relpath("MIMIC_s", "add", "n0", "Pneumothorax",
                                                                             1, False))
    (store.run_dir / region_rel).parent.mkdir(parents=True)
    (store.run_dir / region_rel).write_bytes(b"stale")
    try:
        store.write_attempt(task, attempt, EditedImage(_jpeg(70)), masks=(b"edit-png", None))
    finally:
        store.close()
    assert (store.run_dir / edit_rel).read_bytes() == b"edit-png" and not (store.run_dir / region_rel).exists()


@pytest.mark.slow
def test_merge_carries_masks_from_regular_files_inside_the_shard_only(demo, tmp_path):
    for i in range(2):
        assert main(["generate", "--sources", str(demo / "sources"), "--out", str(tmp_path / f"shard{i}"),
                     "--backend", "simulator", "--shard", f"{i}/2", "--limit", "6", "--max-rounds", "1",
                     "-q"]) in (0, 3)
    shard = tmp_path / "shard0"
    images = [rnd["image"] for _, rnd in _rounds(shard)]
    assert len(images) >= 3
    outside = tmp_path / "outside.png"
    outside.write_bytes(b"not the shard's")
    linked = shard / layout.mask_relpaths(images[0])[0]
    linked.unlink()
    linked.symlink_to(outside)  # a link leading out of the shard: not followed, not carried
    missing = shard / layout.mask_relpaths(images[1])[1]
    missing.unlink()
    fifo = shard / layout.mask_relpaths(images[2])[0]
    fifo.unlink()
    os.mkfifo(fifo)  # irregular: never opened (opening a FIFO would block the merge)

    out = tmp_path / "merged"
    assert main(["merge", str(shard), str(tmp_path / "shard1"), "--out", str(out)]) == 0
    skipped = {linked, missing, fifo}
    expected = {(root / rel, out / rel) for root in (shard, tmp_path / "shard1") for _, rnd in _rounds(root)
                for rel in layout.mask_relpaths(rnd["image"]) if root / rel not in skipped}
    for src, dst in expected:
        assert dst.is_file() and not dst.is_symlink() and dst.read_bytes() == src.read_bytes()
    assert _companions(out) == {dst.relative_to(out).as_posix() for _, dst in expected}
    assert outside.read_bytes() == b"not the shard's"
