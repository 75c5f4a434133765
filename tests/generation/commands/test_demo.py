"""The offline demo end to end, and the pipeline on the real released sample images."""

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from datasets import load_dataset

from conftest import SHARED_SAMPLES
from medbanana.generation.rundir import layout
from medbanana.generation.runners.session import RunOptions
from medbanana.generation.runners.generate import generate


def _records(run_dir: Path) -> list[dict]:
    out = []
    for _, _, path in layout.find_output_dirs(run_dir):
        out += json.loads((path / layout.ALL_CONVERSATIONS).read_text()).values()
    return out


@pytest.mark.slow
def test_demo_command_end_to_end(tmp_path):
    """The README's set-up command minus the install: all modalities and directions, first-round and refined successes,
    failed tasks with every attempt kept, a printed summary, and a dataset that loads."""
    out = tmp_path / "demo-run"
    proc = subprocess.run([sys.executable, "-m", "medbanana", "demo", "--out", str(out), "-q"], capture_output=True,
                          text=True, cwd=tmp_path, env={**os.environ, "GEMINI_API_KEY": "", "GOOGLE_API_KEY": ""})
    assert proc.returncode == 0, proc.stderr
    assert "accepted edits" in proc.stdout and "success by round" in proc.stdout and "dataset:" in proc.stdout
    records = _records(out / "run")
    assert {(r["modality"], r["task"]) for r in records} == {
        (m, d) for m in ("chest_xray", "brain_mri", "fundus") for d in ("add", "remove")}
    statuses = Counter(r["status"] for r in records)
    rounds = Counter(r["success_round"] for r in records if r["status"] == "success")
    assert statuses["api_failed"] == 0
    assert rounds[1] > 0 and sum(v for k, v in rounds.items() if k > 1) > 0 and statuses["failed"] > 0
    for r in records:  # every attempt's image is on disk; failed tasks keep all their rounds
        assert all((out / "run" / rnd["image"]).exists() for rnd in r["rounds"])
        if r["status"] == "failed":
            assert len(r["rounds"]) == 5
    stats = json.loads((out / "run" / layout.STATS).read_text())
    assert stats["success"] == statuses["success"] and stats["failed"] == statuses["failed"]
    from medbanana.generation.rundir.provenance import read_mark

    edit = out / "run" / records[0]["rounds"][0]["image"]
    assert read_mark(edit.read_bytes()).digital_source_type == "compositeSynthetic"  # procedural, not a model
    pairs = load_dataset(str(out / "dataset"), "dpo_pairs", split="train")
    assert len(pairs) == sum(k - 1 for k in (r["success_round"] for r in records if r["status"] == "success"))
    assert pairs[0]["source_image"] is not None and pairs[0]["chosen_image"].size == (1024, 1024)


def _sample_sources(root: Path) -> Path:
    """The released sample edits as generator sources: remove-direction outputs (normal scans) as add sources and
    add-direction outputs (diseased scans) as remove sources. Symlinks: nothing is copied."""
    sources = root / "sources"
    pick = {"MIMIC_samples": ("Chest-XRay", ["Pneumothorax", "Pleural_Effusion"]),
            "ODIR_samples": ("Fundus", ["Glaucoma", "Diabetes"]), "BrainTumor_samples": ("Brain-MRI", ["glioma"])}
    for dataset, (prefix, diseases) in pick.items():
        normal = SHARED_SAMPLES / f"{prefix}-remove" / "normal"
        if normal.is_dir():
            (sources / dataset / "normal").mkdir(parents=True)
            for f in sorted(normal.glob("*.jpeg"))[:1]:
                (sources / dataset / "normal" / f.name).symlink_to(f)
        for disease in diseases:
            (sources / dataset / disease).mkdir(parents=True)
            for f in sorted((SHARED_SAMPLES / f"{prefix}-edit" / disease).glob("*.jpeg"))[:1]:
                (sources / dataset / disease / f.name).symlink_to(f)
    return sources


@pytest.mark.slow
@pytest.mark.skipif(not SHARED_SAMPLES.is_dir(), reason=f"real sample images not found at {SHARED_SAMPLES}")
def test_pipeline_on_real_sample_images(tmp_path):
    sources = _sample_sources(tmp_path)
    summary = generate(sources, tmp_path / "run", backend="simulator", options=RunOptions(quiet=True, concurrency=2),
                       selection=None)
    records = _records(tmp_path / "run")
    assert len(records) == summary.tasks > 0 and summary.statuses["api_failed"] == 0
    assert {r["modality"] for r in records} == {"chest_xray", "fundus", "brain_mri"}
    assert summary.statuses["success"] > 0
    for r in records:
        for rnd in r["rounds"]:
            assert rnd["verification"]["reason"] and 0.0 <= rnd["verification"]["score"] <= 1.0
            assert (tmp_path / "run" / rnd["image"]).stat().st_size > 10_000  # a real 1024² JPEG, not a stub


@pytest.mark.slow
def test_demo_honours_max_rounds_and_refuses_other_source_options_over_a_demo(tmp_path):
    """--max-rounds reaches the loop (it used to be parsed and ignored), and rerunning over a demo with another
    --size is refused with one line instead of returning the old results under the new options."""
    from medbanana.cli import main

    out = tmp_path / "d"
    assert main(["demo", "--out", str(out), "--normal", "1", "--diseased", "0", "--size", "128", "--max-rounds", "1",
                 "--no-build", "-q"]) == 0
    config = json.loads((out / "run" / layout.RUN_CONFIG).read_text())
    assert config["max_rounds"] == 1
    records = [json.loads(line) for line in (out / "run" / layout.JOURNAL).read_text().splitlines()]
    rounds = [r["record"]["rounds"] for r in records if r["type"] == "task"]
    assert rounds and max(len(r) for r in rounds) == 1
    before = (out / "run" / layout.RUN_CONFIG).read_bytes()
    proc = subprocess.run([sys.executable, "-m", "medbanana", "demo", "--out", str(out), "--normal", "1",
                           "--diseased", "0", "--size", "256", "--max-rounds", "1", "--no-build", "-q"],
                          capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "--size (was 128, now 256)" in proc.stderr
    assert (out / "run" / layout.RUN_CONFIG).read_bytes() == before


@pytest.mark.slow
def test_demo_refuses_a_non_empty_folder_it_did_not_make_and_resumes_its_own(tmp_path, capsys):
    from medbanana.cli import main
    from medbanana.demo import MARK

    small = ["--normal", "1", "--diseased", "0", "--size", "64", "--max-rounds", "1", "--no-build", "-q"]
    mine = tmp_path / "mine"
    (mine / "notes").mkdir(parents=True)
    (mine / "notes" / "thesis.txt").write_text("a user's file")
    assert main(["demo", "--out", str(mine), *small]) == 2
    err = capsys.readouterr().err
    assert f"--out {mine} is not empty (1 entry, e.g. notes) and was not made by `medbanana demo`" in err
    assert err.count("\n") == 1 and sorted(p.name for p in mine.rglob("*")) == ["notes", "thesis.txt"]

    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["demo", "--out", str(empty), *small]) == 0
    assert json.loads((empty / MARK).read_text())["made_by"] == "medbanana demo"
    journal = (empty / "run" / layout.JOURNAL).read_bytes()
    assert main(["demo", "--out", str(empty), *small]) == 0  # its own folder: resumed, nothing left to run
    assert (empty / "run" / layout.JOURNAL).read_bytes() == journal
