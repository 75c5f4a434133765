"""Issue 14, items 4 and 1 (build and eval): a build deletes only its own earlier output, refuses input runs
inside --out (or --out inside a run), fails on --source-images that match nothing and counts partial matches
alike in the summary, the card and medbanana-build.json; build and eval take their folders' locks, so a second
process is refused at once (exit code 75) naming the holder. Through the real CLI, locks with a real second
process."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from conftest import write_jpeg
from medbanana.cli import main
from medbanana.generation.rundir.lock import hold_lock
from PIL import Image

EXIT_LOCKED = 75  # documented (generation/failures.py, docs/exit-codes.md), pinned here on purpose
DATASET = "odir_ours_fundus"
KEPT = "mimic_ours_cxr"  # the one dataset whose sources are held in the partial cases


def keep_only_one_dataset(sources: Path) -> None:
    """Remove the other datasets' sources. Their stems (n00000, d00001, ...) recur in the one kept, which must
    not stand in for them."""
    for folder in sources.iterdir():
        if folder.name != KEPT:
            shutil.rmtree(folder)


def snapshot(folder: Path) -> dict[str, str]:
    """Every file under `folder` (relative path -> SHA-256), to show nothing was written or deleted."""
    return {p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def cli(capfd, *argv) -> tuple[int, str, str]:
    code = main(["build", *map(str, argv), "-q"])
    captured = capfd.readouterr()
    return code, captured.out, captured.err


def subprocess_cli(*argv) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "medbanana", *map(str, argv)], capture_output=True, text=True,
                          timeout=300, check=False)


@pytest.fixture
def run(builder_ours_run, tmp_path) -> Path:
    """A copy of a small run of ours, with its source images beside it in the input layout."""
    shutil.copytree(builder_ours_run.parent / "sources", tmp_path / "sources")
    return Path(shutil.copytree(builder_ours_run, tmp_path / "run"))


@pytest.fixture
def earlier(run, tmp_path, capfd) -> Path:
    """An earlier build, made by the CLI."""
    assert cli(capfd, run, "--out", tmp_path / "nest", "--configs", "sft")[0] == 0
    return tmp_path / "nest"


# --- item 4: nothing but a build's own output is ever deleted ------------------------------------------------

def test_the_issue_case_a_build_holding_its_input_run_and_notes_is_refused_and_kept(earlier, run, capfd):
    """`medbanana build nest/myrun --out nest` returned 0 and deleted the run and NOTES.txt."""
    shutil.copytree(run, earlier / "myrun")
    (earlier / "NOTES.txt").write_text("my notes")
    before = snapshot(earlier)
    code, _out, err = cli(capfd, earlier / "myrun", "--out", earlier)
    assert code == 2
    assert len(err.strip().splitlines()) == 1 and "holds the input" in err and str(earlier / "myrun") in err
    assert snapshot(earlier) == before  # the run, the notes and the earlier build, byte for byte
    assert sorted(p.name for p in earlier.parent.iterdir()) == ["nest", "run", "sources"]  # no lock, no staging


@pytest.mark.parametrize("planted", ["NOTES.txt", "sft/keep.txt", "analysis/", "README.md/"])
def test_files_a_build_did_not_write_make_a_rebuild_refuse(earlier, run, capfd, planted):
    target = earlier / planted.rstrip("/")
    if planted.endswith("/"):
        if target.exists():
            target.unlink()  # README.md as a folder: a name of ours, but not what a build writes
        (target / "inner.txt").parent.mkdir(parents=True)
        (target / "inner.txt").write_text("mine")
    else:
        target.write_text("mine")
    before = snapshot(earlier)
    code, _out, err = cli(capfd, run, "--out", earlier, "--configs", "conversations")
    assert code == 2
    assert f"holds what a build did not write: {planted}" in err and len(err.strip().splitlines()) == 1
    assert snapshot(earlier) == before


@pytest.mark.parametrize("given", [".", f"{DATASET}-edit"])  # a run, or one output folder of it
def test_out_inside_an_input_run_is_refused(run, capfd, given):
    before = snapshot(run)
    code, _out, err = cli(capfd, run / given, "--out", run / "dataset", "--configs", "sft")
    assert code == 2 and "is inside the input" in err and str(run) in err
    assert snapshot(run) == before and not (run / "dataset").exists()


def test_a_rebuild_leaves_a_file_added_after_its_check(tmp_path):
    """Removal goes file by file, so even what appears between the check and the rename is kept."""
    from medbanana.generation.dataset.output import remove_build

    previous = tmp_path / ".nest.previous-1"
    (previous / "sft").mkdir(parents=True)
    (previous / "sft" / "train-00000-of-00001.parquet").write_bytes(b"PAR1")
    (previous / "README.md").write_text("card")
    (previous / "sft" / "late.txt").write_text("mine")
    with pytest.warns(UserWarning, match=r"kept .*sft/late.txt"):
        remove_build(previous)
    assert snapshot(previous) == {"sft/late.txt": hashlib.sha256(b"mine").hexdigest()}


# --- item 4: --source-images claims only what it attached ----------------------------------------------------

def test_source_images_matching_nothing_is_an_error_naming_the_folder_and_what_was_looked_for(run, tmp_path, capfd):
    elsewhere = tmp_path / "elsewhere"
    write_jpeg(elsewhere / "unrelated" / "zzz.jpg")
    code, _out, err = cli(capfd, run, "--out", tmp_path / "out", "--configs", "sft", "--source-images", elsewhere)
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert f"--source-images {elsewhere}: no source image" in err and "1 image file(s)" in err
    assert "looked for e.g." in err and ".{jpeg,jpg,png}" in err
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.*"))


def test_source_images_without_a_config_that_holds_them_is_an_error(run, tmp_path, capfd):
    code, _out, err = cli(capfd, run, "--out", tmp_path / "out", "--configs", "conversations",
                          "--source-images", tmp_path / "sources")
    assert code == 2 and "has a source_image column" in err and not (tmp_path / "out").exists()


def test_partial_source_matches_are_counted_alike_in_summary_card_and_build_info(run, tmp_path, capfd):
    keep_only_one_dataset(tmp_path / "sources")
    out = tmp_path / "out"
    code, _out, err = cli(capfd, run, "--out", out, "--configs", "sft,conversations",
                          "--source-images", tmp_path / "sources")
    assert code == 0
    datasets = pq.read_table(out / "conversations").column("dataset").to_pylist()
    total, matched = len(datasets), datasets.count(KEPT)
    assert 0 < matched < total
    info = json.loads((out / "medbanana-build.json").read_text())
    assert info["sources_attached"] is False  # not claimed: not every task has its source
    assert (info["sources"]["matched"], info["sources"]["total"]) == (matched, total)
    assert not any(e.startswith(f"{KEPT}/") for e in info["sources"]["missing_examples"])
    assert f"attached to {matched:,} of {total:,} tasks" in err
    card = (out / "README.md").read_text()
    assert f"for {matched:,} of {total:,} tasks" in card and "attached from the builder's source folder." not in card
    sft = pq.read_table(out / "sft", columns=["dataset", "source_path", "source_image"]).to_pylist()
    assert all((row["source_image"] is None) == (row["dataset"] != KEPT) for row in sft)
    assert all(row["source_image"]["bytes"] == (tmp_path / "sources" / row["source_path"]).read_bytes()
               for row in sft if row["dataset"] == KEPT)
    # the lock covered the build and went with it: nothing of it in the published folder or beside it
    assert not (out / "medbanana.lock").exists() and sorted(p.name for p in tmp_path.iterdir()) == [
        "out", "run", "sources"]


def test_attach_sources_matching_no_row_is_an_error_and_a_partial_match_is_counted(run, tmp_path, capfd):
    from datasets import load_dataset
    from medbanana.loaders import attach_sources

    assert cli(capfd, run, "--out", tmp_path / "out", "--configs", "sft")[0] == 0
    ds = load_dataset(str(tmp_path / "out"), "sft", split="train", cache_dir=str(tmp_path / "cache"))
    elsewhere = tmp_path / "elsewhere"
    write_jpeg(elsewhere / "unrelated" / "zzz.jpg")
    with pytest.raises(ValueError, match=r"no source image in .*elsewhere for any of the .* rows; looked for e\.g\."):
        attach_sources(ds, elsewhere)
    keep_only_one_dataset(tmp_path / "sources")
    expected = ds["dataset"].count(KEPT)
    with pytest.warns(UserWarning, match=f"{expected:,} of {ds.num_rows:,} rows got a source image"):
        attach_sources(ds, tmp_path / "sources")


# --- item 1: one writer per folder (build and eval), a real second process -----------------------------------

@pytest.mark.slow
def test_a_build_is_refused_while_another_process_builds_the_same_out(earlier, run, tmp_path):
    from medbanana.generation.dataset.output import output_lock

    before = snapshot(earlier)
    with output_lock(earlier):  # as a build in progress holds it
        done = subprocess_cli("build", run, "--out", earlier, "-q")
    assert done.returncode == EXIT_LOCKED
    assert f"pid {os.getpid()}" in done.stderr and "--out nest" in done.stderr
    assert snapshot(earlier) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["nest", "run", "sources"]  # the lock file went too
    done = subprocess_cli("build", run, "--out", earlier, "-q", "--configs", "conversations")
    assert done.returncode == 0 and "kept" not in done.stderr  # the lock is free again; only own files replaced
    assert (earlier / "conversations").is_dir() and not (earlier / "sft").exists()


@pytest.mark.slow
@pytest.mark.parametrize("given", [".", f"{DATASET}-edit"])  # one output folder given: its run is locked
def test_a_build_is_refused_while_generate_writes_its_input_run(run, tmp_path, given):
    with hold_lock(run, "run directory"):  # as `medbanana generate` holds it while it writes
        done = subprocess_cli("build", run / given, "--out", tmp_path / "out", "-q")
    assert done.returncode == EXIT_LOCKED
    assert f"{run} (run directory) is being written by pid {os.getpid()}" in done.stderr
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.*"))


def test_eval_is_refused_while_another_process_holds_its_out(tmp_path):
    folder = tmp_path / "eval"
    folder.mkdir()
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (48, 48, 3), dtype=np.uint8)).save(folder / "a.png")
    sample = {"id": "a", "source": "a.png", "edited": "a.png", "instruction": "Add an effusion.",
              "disease": "Pleural_Effusion", "direction": "add"}
    (folder / "samples.jsonl").write_text(json.dumps(sample) + "\n")
    out = tmp_path / "out"
    with hold_lock(out, "evaluation folder"):
        done = subprocess_cli("eval", folder, "--out", out, "--judge", "none", "--no-lpips", "-q")
    assert done.returncode == EXIT_LOCKED
    assert f"{out} (evaluation folder) is being used by pid {os.getpid()}" in done.stderr
    assert list(out.iterdir()) == []  # nothing written; the lock file went when its holder released it


# --- sources a build may attach: the ones the run edited ----------------------------------------------------------

@pytest.mark.slow
def test_a_build_without_sources_says_so_in_one_line_and_how_to_attach_them(run, tmp_path, capfd):
    code, _out, err = cli(capfd, run, "--out", tmp_path / "out", "--configs", "sft,conversations")
    assert code == 0
    notes = [line for line in err.splitlines() if "source_image is null" in line]
    assert len(notes) == 1 and "--source-images DIR" in notes[0] and "attach_sources" in notes[0]
    code, _out, err = cli(capfd, run, "--out", tmp_path / "out", "--configs", "conversations")
    assert code == 0 and "source_image" not in err  # no config with the column: nothing to say


@pytest.mark.slow
def test_sources_other_than_the_runs_are_refused_naming_the_file_and_its_size(tiny_sources, tmp_path, capfd,
                                                                             monkeypatch):
    """`generate` records each source's SHA-256; a --source-images file of the same name with other content (the
    original download at another size, say) is refused, or with --unsafe skip leaves its tasks out, listed."""
    for name in ("GEMINI_API_KEY", "GOOGLE_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    run_dir = tmp_path / "run"
    assert main(["generate", "--sources", str(tiny_sources), "--out", str(run_dir), "--diseases", "Pneumothorax",
                 "--max-rounds", "1", "-q"]) in (0, 3)
    records = [json.loads(line)["record"] for line in (run_dir / "medbanana-journal.jsonl").read_text().splitlines()
               if json.loads(line)["type"] == "task"]
    assert records and all(r["source_sha256"] == hashlib.sha256((tiny_sources / r["source_path"]).read_bytes())
                           .hexdigest() for r in records)
    capfd.readouterr()
    code, _out, err = cli(capfd, run_dir, "--out", tmp_path / "same", "--source-images", tiny_sources)
    assert code == 0 and "source images attached" not in err  # the run's own sources: attached, no complaint

    originals = Path(shutil.copytree(tiny_sources, tmp_path / "originals"))
    write_jpeg(originals / "MIMIC_tiny" / "normal" / "n0.jpeg", 0, size=90)  # the same scan before `prepare`
    code, _out, err = cli(capfd, run_dir, "--out", tmp_path / "out", "--source-images", originals)
    assert code == 2 and len(err.strip().splitlines()) == 1 and not (tmp_path / "out").exists()
    assert f"{originals / 'MIMIC_tiny' / 'normal' / 'n0.jpeg'} is not the source the run edited" in err
    assert "90x90 pixels" in err and "SHA-256 differs" in err and "generate --sources" in err
    code, _out, err = cli(capfd, run_dir, "--out", tmp_path / "out", "--source-images", originals, "--unsafe", "skip")
    assert code == 0
    refused = json.loads((tmp_path / "out" / "medbanana-build.json").read_text())["stats"]["refused"]
    uses = sum(r["source_path"] == "MIMIC_tiny/normal/n0.jpeg" for r in records)
    assert refused["count"] == refused["tasks_left_out"] == uses > 0
    assert all("is not the source the run edited" in item for item in refused["items"])
