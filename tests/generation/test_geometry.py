"""The geometry estimate (generation/geometry.py) on the demo's sources with simulated edits (a lesion each) whose
frame was moved by a known amount (simulator/drift.py): what it finds, how the guard decides, and registration."""

from __future__ import annotations

import asyncio
import math

import numpy as np
import pytest

from medbanana.generation import geometry
from medbanana.generation.backends.simulator.drift import Drift, drifted, random_drift
from medbanana.generation.backends.simulator.editor import SimulatedEditor
from medbanana.generation.backends.simulator.phantoms import write_demo_sources
from medbanana.generation.backends.simulator.writer import compose, opening_params
from medbanana.generation.geometry import Geometry, check_edit, estimate_geometry, frame_verdict, registered
from medbanana.generation.records import EditedImage, SourceImage, Verdict, decode_rgb, encode_jpeg
from medbanana.generation.sources.scan import Selection, scan_sources

SIZE = 512


@pytest.fixture(scope="module")
def edits(tmp_path_factory):
    """(modality, source, simulated edit) for one add task of each modality, at SIZE px."""
    root = tmp_path_factory.mktemp("sources")
    write_demo_sources(root, n_normal=1, n_diseased=0, size=SIZE, seed=5)
    picked = {}
    for task in scan_sources(root, Selection()):
        if task.modality not in picked:
            source = SourceImage(task.source_path)
            edited = asyncio.run(SimulatedEditor().edit(task, source, compose(task, opening_params(task)), seed=3))
            picked[task.modality] = (task, source, edited)
    assert sorted(picked) == ["brain_mri", "chest_xray", "fundus"]
    return picked


def _moved(edited: EditedImage, change: Drift) -> bytes:
    return encode_jpeg(drifted(decode_rgb(edited.data), change))


def test_an_aligned_edit_with_its_lesion_is_aligned(edits):
    for modality, (_, source, edited) in edits.items():
        found = estimate_geometry(source.data, edited.data)
        assert found is not None and found.aligned, (modality, found)
        assert found.shift_px < 0.3 and abs(found.scale - 1) < 0.002 and found.problems() == []


@pytest.mark.parametrize("change", [
    Drift("shift", dx=1.0, dy=0.0),  # 2 px at 1024
    Drift("shift", dx=-3.5, dy=2.5),
    Drift("zoom", scale_x=1.02, scale_y=1.02),
    Drift("zoom", scale_x=0.97, scale_y=0.97),
    Drift("aspect", scale_x=1.0, scale_y=1.06, canvas=(SIZE, round(SIZE * 1.06))),
    Drift("turn", rotation_deg=2.0),
    Drift("turn", rotation_deg=-12.0),  # past what the blocks measure alone: the Fourier-Mellin start
    Drift("zoom", scale_x=1.25, scale_y=1.25),  # likewise
    Drift("shift", dx=60.0, dy=-10.0),  # past a quarter block
], ids=lambda c: f"{c.kind}-{c.dx:g}-{c.scale_y:g}-{c.rotation_deg:g}")
def test_a_moved_frame_is_measured(edits, change):
    for modality, (_, source, edited) in edits.items():
        found = estimate_geometry(source.data, _moved(edited, change))
        assert found is not None and not found.aligned, (modality, found)
        assert math.hypot(found.dx - change.dx, found.dy - change.dy) < 0.35, (modality, found)
        assert abs(found.scale_x - change.scale_x) < 0.004 and abs(found.scale_y - change.scale_y) < 0.004, found
        assert abs(found.rotation_deg - change.rotation_deg) < 0.2 and found.flip == "", (modality, found)
        assert found.edit_size == (change.canvas or (SIZE, SIZE))


def test_a_mirrored_edit_is_found_flipped(edits):
    _, source, edited = edits["chest_xray"]
    found = estimate_geometry(source.data, _moved(edited, Drift("flip", flip="horizontal")))
    assert found is not None and found.flip == "horizontal" and not found.aligned
    assert "flipped horizontally" in found.describe()
    assert found.shift_px < 0.5 and abs(found.scale - 1) < 0.003


def test_tolerances_are_stated_at_1024_px_and_scale_with_the_image():
    at = {"scale_x": 1.0, "scale_y": 1.0, "rotation_deg": 0.0, "flip": "", "match": 1.0, "stage": "blocks"}
    small = Geometry(dx=0.6, dy=0.0, source_size=(512, 512), edit_size=(512, 512), **at)
    large = Geometry(dx=0.6, dy=0.0, source_size=(2048, 2048), edit_size=(2048, 2048), **at)
    assert not small.aligned and small.problems() == ["shifted 0.6 px (dx +0.6, dy +0.0)"]  # 1.2 px at 1024
    assert large.aligned  # 0.3 px at 1024
    zoomed = Geometry(dx=0, dy=0, source_size=(1024, 1024), edit_size=(1024, 1024),
                      **{**at, "scale_x": 1.011, "scale_y": 1.011})
    assert zoomed.problems() == ["zoomed in 1.1%"]
    assert Geometry.from_json(zoomed.to_json()) == zoomed
    assert zoomed.to_json()["aligned"] is False and zoomed.to_json()["scale"] == 1.011


def test_registration_puts_the_edit_back_on_the_source_grid(edits):
    _, source, edited = edits["fundus"]
    change = Drift("mixed", dx=4.0, dy=-3.0, scale_x=1.04, scale_y=1.01,
                   canvas=(SIZE + 40, SIZE))  # a shift, a zoom and another canvas at once
    moved = _moved(edited, change)
    found = estimate_geometry(source.data, moved)
    assert found is not None and found.registrable and not found.aligned
    back = registered(moved, found)
    assert back.shape == (SIZE, SIZE, 3)
    again = estimate_geometry(source.data, encode_jpeg(back))
    assert again is not None and again.aligned, again
    # the registered edit matches the edit before the drift inside the frame (not at the borders it lost)
    inner = (slice(40, -40), slice(40, -40))
    before = decode_rgb(edited.data).astype(float)[inner]
    assert np.abs(back.astype(float)[inner] - before).mean() < 4.0
    assert np.abs(decode_rgb(moved)[:, :SIZE].astype(float)[inner] - before).mean() > 8.0


def test_the_guard_keeps_registers_rejects_or_records_by_mode(edits):
    _, source, edited = edits["chest_xray"]
    moved = EditedImage(data=_moved(edited, Drift("shift", dx=5.0, dy=0.0)), details={"x": 1})
    assert check_edit("register", source, edited).action == "kept"
    registered_check = check_edit("register", source, moved)
    assert registered_check.action == "registered" and registered_check.edited.original == moved.data
    assert registered_check.edited.details == {"x": 1} and registered_check.edited.data != moved.data
    assert registered_check.record()["action"] == "registered" and registered_check.record()["aligned"] is False
    rejected = check_edit("reject", source, moved)
    assert rejected.action == "rejected" and rejected.edited is moved
    assert check_edit("record", source, moved).action == "recorded"
    far = EditedImage(data=_moved(edited, Drift("zoom", scale_x=1.3, scale_y=1.3)))
    assert check_edit("register", source, far).action == "rejected"  # too far to be warped back
    verdict = frame_verdict(rejected)
    assert not verdict.qualified and verdict.model == geometry.GUARD_MODEL and "shifted 5.0 px" in verdict.reason
    written = verdict.to_json()
    assert written["has_disease"] is None and written["fidelity_preserved"] is False
    assert Verdict.from_json(written).to_json() == written  # the unjudged booleans stay null on a resume
    with pytest.raises(ValueError, match="unknown geometry mode"):
        check_edit("warp", source, moved)


def test_what_cannot_be_measured_is_none(edits):
    _, source, _ = edits["brain_mri"]
    blank = encode_jpeg(np.full((SIZE, SIZE, 3), 90, np.uint8))
    assert estimate_geometry(source.data, blank) is None
    assert estimate_geometry(source.data, encode_jpeg(np.full((20, 20, 3), 90, np.uint8))) is None
    noise = np.random.default_rng(0).integers(0, 255, (SIZE, SIZE, 3), dtype=np.uint8)
    assert estimate_geometry(source.data, encode_jpeg(noise)) is None  # unrelated content: nothing matches
    unmeasured = check_edit("reject", source, EditedImage(data=blank))
    assert unmeasured.action == "unmeasured" and unmeasured.geometry is None
    assert check_edit("reject", source, EditedImage(data=b"not an image")).action == "unmeasured"


def test_the_simulator_drifts_a_share_of_its_edits_on_a_stream_of_its_own(edits):
    task, source, _ = edits["chest_xray"]
    instruction = compose(task, opening_params(task))
    plain, drifting = SimulatedEditor(), SimulatedEditor(drift=1.0)
    moved = [drifting.edit_sync(task, source, instruction, seed) for seed in range(6)]
    assert all("frame_drift" in e.details for e in moved)
    assert {e.details["frame_drift"]["kind"] for e in moved} <= {"shift", "zoom", "aspect"}
    same = plain.edit_sync(task, source, instruction, 0)
    assert "frame_drift" not in same.details and same.data == SimulatedEditor(drift=0.0).edit_sync(
        task, source, instruction, 0).data
    # the edit itself does not change with the drift: only its frame
    truth = moved[0].details["frame_drift"]
    change = Drift(**{**truth, "canvas": tuple(truth["canvas"]) if truth["canvas"] else None})
    redone = decode_rgb(encode_jpeg(drifted(decode_rgb(same.data), change)))
    assert np.abs(redone.astype(float) - decode_rgb(moved[0].data).astype(float)).mean() < 1.5
    share = np.mean([random_drift(np.random.default_rng(k), (1024, 1024)).kind == "shift" for k in range(300)])
    assert 0.2 < share < 0.47
    with pytest.raises(ValueError, match="between 0 and 1"):
        SimulatedEditor(drift=1.5)
