"""The geometry guard through the real CLI: `medbanana generate` in its own process, the simulator's editor drifting
its frame (`--simulator-drift`), the judge the fake OpenAI-compatible server on 127.0.0.1 (which keeps every pair it
was asked to judge), then `medbanana build` and `medbanana eval` on what the run wrote."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from paths import SHARED_SAMPLES

pytest.importorskip("openai", reason="the fake judge is spoken to by the openai client: pip install 'medbanana[openai]'")

from medbanana.generation.backends.simulator.editor import SimulatedEditor  # noqa: E402
from medbanana.generation.backends.simulator.phantoms import write_demo_sources  # noqa: E402
from medbanana.generation.geometry import GUARD_MODEL, estimate_geometry  # noqa: E402
from medbanana.generation.records import SourceImage, Task, decode_rgb  # noqa: E402
from medbanana.generation.rundir import layout  # noqa: E402
from medbanana.generation.testing.fake_openai import FakeOpenAI  # noqa: E402

DISEASES = ("Pleural_Effusion", "Pneumothorax")
SIZE = 256


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("sources")
    write_demo_sources(root, n_normal=2, n_diseased=0, size=SIZE, seed=11)
    return root


@pytest.fixture(scope="module")
def fake():
    with FakeOpenAI() as server:
        yield server


def generate(sources: Path, out: Path, fake: FakeOpenAI, *extra: str) -> subprocess.CompletedProcess:
    fake.reset()
    command = [sys.executable, "-m", "medbanana", "generate", "--sources", str(sources), "--out", str(out),
               "--modalities", "chest_xray", "--diseases", *DISEASES, "--backend", "simulator", "--judge", "openai",
               "--openai-base-url", fake.base_url, "--openai-model", "fake-judge", "--max-rounds", "2", "-q", *extra]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OPENAI_API_KEY": "sk-test", "GEMINI_API_KEY": "", "GOOGLE_API_KEY": ""})
    assert done.returncode == 0, done.stdout + done.stderr
    return done


def rounds(run: Path) -> list[tuple[dict, dict]]:
    """(task record, round) of every round of the run, from its all_conversations.json files."""
    found = []
    for _, _, folder in layout.find_output_dirs(run):
        for record in json.loads((folder / layout.ALL_CONVERSATIONS).read_text()).values():
            found += [(record, r) for r in record["rounds"]]
    return found


def source_of(sources: Path, record: dict) -> bytes:
    return (sources / record["source_path"]).read_bytes()


@pytest.mark.slow
def test_under_the_default_no_drifted_edit_reaches_the_judge_as_it_came(sources, fake, tmp_path):
    out = tmp_path / "run"
    done = generate(sources, out, fake, "--simulator-drift", "1")
    config = json.loads((out / layout.RUN_CONFIG).read_text())
    assert config["geometry"] == "register" and config["backends"]["editor"]["drift"] == 1
    seen = rounds(out)
    assert seen and all("frame_drift" in r["edit_result"]["details"] for _, r in seen)  # every edit drifted
    actions = [r["geometry"]["action"] for _, r in seen]
    assert set(actions) <= {"registered", "rejected"} and "registered" in actions
    judged = [r for _, r in seen if r["verification"]["model"] != GUARD_MODEL]
    assert len(fake.judged) == len(judged) == actions.count("registered")  # one judge call per registered edit
    for pair in fake.judged:  # what the judge got: the edit on the source's grid
        assert estimate_geometry(*pair).aligned
    for record, r in seen:
        stored = (out / r["image"]).read_bytes()
        if r["geometry"]["action"] == "rejected":  # too far to warp back: rejected before the judge, as it came
            assert not (out / layout.original_relpath(r["image"])).exists()
            assert not estimate_geometry(source_of(sources, record), stored).aligned
            continue
        assert estimate_geometry(source_of(sources, record), stored).aligned
        # the editor's own image is kept: its encoded data byte for byte (the run's mark added before it)
        original = (out / layout.original_relpath(r["image"])).read_bytes()
        task = Task(record["dataset"], record["modality"], record["disease"], record["task"],
                    sources / record["source_path"])
        editor_bytes = SimulatedEditor(drift=1.0).edit_sync(task, SourceImage(task.source_path), r["instruction"],
                                                             r["edit_result"]["details"]["seed"]).data
        assert original[original.index(b"\xff\xda"):] == editor_bytes[editor_bytes.index(b"\xff\xda"):]
        assert (decode_rgb(original) == decode_rgb(editor_bytes)).all()
        moved = estimate_geometry(source_of(sources, record), original)
        assert not moved.aligned and abs(moved.shift_px - r["geometry"]["shift_px"]) < 0.01
    assert "warped back onto the source's grid" in done.stdout


@pytest.mark.slow
def test_reject_fails_the_attempt_before_the_judge_and_the_writer_is_told(sources, fake, tmp_path):
    out = tmp_path / "run"
    done = generate(sources, out, fake, "--simulator-drift", "1", "--geometry", "reject")
    assert fake.count("judge") == 0 and fake.judged == []
    seen = rounds(out)
    assert seen and all(r["geometry"]["action"] == "rejected" for _, r in seen)
    for record, r in seen:
        verdict = r["verification"]
        assert verdict["model"] == GUARD_MODEL and verdict["qualified"] is False and not r["accepted"]
        assert verdict["has_disease"] is None and verdict["fidelity_preserved"] is False  # not judged: null
        assert "the frame moved" in verdict["reason"]
        edit_mask, region_mask = (out / relpath for relpath in layout.mask_relpaths(r["image"]))
        assert not edit_mask.exists() and region_mask.is_file()  # no mask outlines the moved anatomy
        if r["round"] == 2:  # refined like any failure, from the reason
            assert "Rejected before judging: the frame moved" in r["generate_prompt"]["thinking_summary"]
    stats = json.loads((out / layout.STATS).read_text())
    assert stats["geometry"] == {"rejected": len(seen)} and stats["failed"] == len({rec["uid"] for rec, _ in seen})
    assert f"{len(seen)} rejected before the judge" in done.stdout


@pytest.mark.slow
def test_record_judges_every_edit_as_it_came(sources, fake, tmp_path):
    out = tmp_path / "run"
    generate(sources, out, fake, "--simulator-drift", "0.5", "--geometry", "record", "--seed", "3")
    seen = rounds(out)
    assert len(fake.judged) == len(seen)
    recorded = [(rec, r) for rec, r in seen if r["geometry"]["action"] == "recorded"]
    assert recorded and all("frame_drift" in r["edit_result"]["details"] for _, r in recorded)
    assert not (out / layout.ORIGINALS).exists()
    for record, r in recorded:
        assert not estimate_geometry(source_of(sources, record), (out / r["image"]).read_bytes()).aligned


def _build(run: Path, out: Path, *extra: str) -> Path:
    done = subprocess.run([sys.executable, "-m", "medbanana", "build", str(run), "--out", str(out), "-q", *extra],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    return out


def _rows(dataset: Path, config: str) -> list[dict]:
    from datasets import load_dataset

    columns = ["uid", "round", "aligned", "shift_px", "scale", "rotation_deg", "success_round"]
    ds = load_dataset(str(dataset), config, split="train")
    return ds.select_columns([c for c in columns if c in ds.column_names]).to_list()


@pytest.mark.slow
def test_rows_carry_the_alignment_and_a_build_measures_runs_without_it(sources, fake, tmp_path):
    run = tmp_path / "run"
    generate(sources, run, fake, "--simulator-drift", "0.5", "--geometry", "record", "--seed", "5")
    recorded = {(rec["uid"], r["round"]): r["geometry"] for rec, r in rounds(run)}
    built = _build(run, tmp_path / "built")
    for config in ("sft", "failed", "judge"):
        for row in _rows(built, config):
            geometry = recorded[(row["uid"], row.get("round") or row.get("success_round"))]
            assert row["aligned"] is geometry["aligned"]
            assert row["shift_px"] == pytest.approx(geometry["shift_px"], abs=1e-3)
            assert row["scale"] == pytest.approx(geometry["scale"], abs=1e-4)
    card = (built / "README.md").read_text()
    misaligned = sum(not g["aligned"] for g in recorded.values())
    assert misaligned and (f"**Misaligned attempts** (the frame moved beyond the tolerances): {misaligned}, all "
                           f"kept as they came") in card
    # the same run as one made before the guard: no geometry in its records
    for _, _, folder in layout.find_output_dirs(run):
        path = folder / layout.ALL_CONVERSATIONS
        records = json.loads(path.read_text())
        for record in records.values():
            for r in record["rounds"]:
                r.pop("geometry")
        path.write_text(json.dumps(records))
    measured = _build(run, tmp_path / "measured", "--source-images", str(sources))
    for config in ("failed", "judge"):
        rows = _rows(measured, config)
        assert rows and all(row["aligned"] is recorded[(row["uid"], row["round"])]["aligned"] for row in rows)
    assert "were measured at build time from source and edit" in (measured / "README.md").read_text()
    blind = _build(run, tmp_path / "blind")  # and without its sources: null, and the card says why
    assert all(row["aligned"] is None and row["shift_px"] is None for row in _rows(blind, "judge"))
    assert "needs the source image" in (blind / "README.md").read_text()


@pytest.mark.slow
def test_eval_scores_registered_pairs_and_says_so(sources, fake, tmp_path):
    run = tmp_path / "run"
    generate(sources, run, fake, "--simulator-drift", "0.6", "--geometry", "record", "--seed", "8")
    out = tmp_path / "eval"
    done = subprocess.run([sys.executable, "-m", "medbanana", "eval", str(run), "--all-attempts", "--source-images",
                           str(sources), "--out", str(out), "--no-lpips", "--judge", "none", "-q"],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    records = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    moved = [r for r in records if r.get("aligned") is False]
    assert moved and all(r.get("registered") for r in moved)
    assert all(not r.get("registered") for r in records if r.get("aligned"))
    report = (out / "report.md").read_text()
    assert f"CP, SSIM and PSNR on registered pairs: {len(moved)} of {len(records)} edits" in report


@pytest.mark.slow
@pytest.mark.skipif(not SHARED_SAMPLES.is_dir(), reason=f"released sample images not found at {SHARED_SAMPLES}")
def test_released_samples_without_sources_get_null_alignment_said_so(tmp_path):
    built = _build(SHARED_SAMPLES, tmp_path / "released")  # image-only folders: accepted edits, no sources
    rows = _rows(built, "sft")
    assert rows and all(row["aligned"] is None for row in rows)
    assert "they are null: the runs recorded no measurement, and one needs the source image" in (
        built / "README.md").read_text()


@pytest.mark.slow
def test_merge_carries_the_originals_and_opening_drops_those_no_round_names(sources, fake, tmp_path):
    shards = [tmp_path / f"shard{i}" for i in range(2)]
    for i, shard in enumerate(shards):
        generate(sources, shard, fake, "--simulator-drift", "1", "--shard", f"{i}/2")
    merged = tmp_path / "merged"
    done = subprocess.run([sys.executable, "-m", "medbanana", "merge", *map(str, shards), "--out", str(merged)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    registered = [r["image"] for _, r in rounds(merged) if r["geometry"]["action"] == "registered"]
    assert registered
    for image in registered:
        shard = next(s for s in shards if (s / image).exists())
        assert (merged / layout.original_relpath(image)).read_bytes() == (
            shard / layout.original_relpath(image)).read_bytes()
    stray = merged / layout.ORIGINALS / "X-edit-failed" / "Pneumothorax" / "x-Pneumothorax-edit-failed-1.jpeg"
    stray.parent.mkdir(parents=True)
    stray.write_bytes(b"left by a killed write")
    generate(sources, merged, fake, "--simulator-drift", "1")  # nothing left to run: it opens and closes the run
    assert not stray.exists()
    assert all((merged / layout.original_relpath(image)).is_file() for image in registered)


@pytest.mark.slow
def test_the_drift_is_the_simulators_and_a_retry_takes_the_recorded_guard(sources, tmp_path):
    import argparse

    from medbanana.generation.commands.run_options import RUN_DEFAULTS, take_recorded_options

    refused = subprocess.run([sys.executable, "-m", "medbanana", "generate", "--sources", str(sources), "--out",
                              str(tmp_path / "run"), "--editor", "diffusers", "--editor-model", str(tmp_path),
                              "--simulator-drift", "0.2"], capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and "--simulator-drift is the offline simulator's editor option" in refused.stderr
    assert not (tmp_path / "run").exists()
    recorded = {"geometry": "reject", "backends": {role: {"backend": "simulator", "model": "m"}
                                                   for role in ("writer", "editor", "judge")}}
    recorded["backends"]["editor"]["drift"] = 0.4
    # a retry names its backends itself (docs/data-destinations.md); the drift comes with the simulator's editor
    args = argparse.Namespace(**dict.fromkeys(RUN_DEFAULTS), backend="simulator", writer=None, editor=None, judge=None,
                              simulator_drift=None, writer_model=None, editor_model=None, judge_model=None,
                              openai_model=None, vertex=False, vertex_project=None, vertex_location=None)
    take_recorded_options(args, recorded)
    assert args.geometry == "reject" and args.simulator_drift == 0.4
