"""No file medbanana creates or replaces in a folder is written through a symbolic link planted there.

Each test plants links (dangling, and to an existing file) outside the folder the user named, runs the real CLI
(`keys init`, `generate`, `build`) and checks that nothing outside was created or changed: keys refuse a link at
their names (or, with --force, replace the link), a lock file that is a link is refused with one line, the run's
JSON files (temp file + rename) replace a link, the journal and prepare's manifest (appended to) refuse
one, and a cache log is never opened through a link. A run whose folders are links out of it is not opened.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
from pathlib import Path

import pytest

from conftest import write_jpeg
from medbanana.cli import main
from medbanana.generation.backends.response_cache import ResponseCache
from medbanana.generation.files import atomic_write_bytes, create_new, read_jsonl
from medbanana.generation.rundir import layout
from medbanana.generation.rundir.lock import LOCK_NAME

pytest.importorskip("cryptography")
OUTSIDE = b"the user's own file, outside the folder\n"


@pytest.fixture
def outside(tmp_path) -> Path:
    """A folder outside every folder a command is given: an existing file, and the name of a missing one."""
    folder = tmp_path / "outside"
    folder.mkdir()
    (folder / "existing.txt").write_bytes(OUTSIDE)
    return folder


def _assert_untouched(outside: Path) -> None:
    assert sorted(p.name for p in outside.iterdir()) == ["existing.txt"]  # nothing created there
    assert (outside / "existing.txt").read_bytes() == OUTSIDE


def _one_line(capsys) -> str:
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    return err


# ---------------------------------------------------------------- keys init

@pytest.mark.parametrize("name", ["ca.pem", "signer-chain.pem", "signer.key"])
@pytest.mark.parametrize("target", ["missing.pem", "existing.txt"])
def test_keys_init_refuses_a_link_at_a_key_name_and_force_replaces_it(tmp_path, outside, capsys, name, target):
    keys = tmp_path / "keys"
    keys.mkdir()
    (keys / name).symlink_to(outside / target)  # dangling for missing.pem
    assert main(["keys", "init", str(keys)]) == 2
    err = _one_line(capsys)
    assert f"{name} (a symbolic link)" in err and "--force" in err
    assert sorted(p.name for p in keys.iterdir()) == [name]  # nothing else written either
    _assert_untouched(outside)

    assert main(["keys", "init", str(keys), "--force"]) == 0
    _assert_untouched(outside)
    for written in ("ca.pem", "signer-chain.pem", "signer.key"):
        path = keys / written
        assert not path.is_symlink() and path.is_file() and path.read_bytes().startswith(b"-----BEGIN")
    assert stat.S_IMODE((keys / "signer.key").stat().st_mode) == 0o600


def test_keys_init_into_a_folder_of_links_writes_only_inside(tmp_path, outside, capsys):
    keys = tmp_path / "keys"
    keys.mkdir()
    for name in ("ca.pem", "signer-chain.pem"):
        (keys / name).symlink_to(outside / "existing.txt")
    (keys / "signer.key").symlink_to(outside / "stolen.key")
    assert main(["keys", "init", str(keys), "--force"]) == 0
    _assert_untouched(outside)
    assert not any(p.is_symlink() for p in keys.iterdir()) and len(list(keys.iterdir())) == 3


# ---------------------------------------------------------------- locks

@pytest.fixture
def sources(tmp_path) -> Path:
    write_jpeg(tmp_path / "sources" / "MIMIC_links" / "normal" / "n0.jpeg", 1, size=64)
    return tmp_path / "sources"


def _generate(sources: Path, out: Path) -> int:
    return main(["generate", "--sources", str(sources), "--out", str(out), "--backend", "simulator",
                 "--diseases", "Pneumothorax", "--directions", "add", "--max-rounds", "2", "-q"])


@pytest.mark.parametrize("target", ["missing.lock", "existing.txt"])
def test_a_lock_file_that_is_a_link_is_refused_in_one_line(tmp_path, outside, sources, capsys, target):
    run = tmp_path / "run"
    run.mkdir()
    (run / LOCK_NAME).symlink_to(outside / target)
    assert _generate(sources, run) == 2
    err = _one_line(capsys)
    assert "is a symbolic link" in err and LOCK_NAME in err
    _assert_untouched(outside)
    assert (run / LOCK_NAME).is_symlink()  # left as it was: the user decides


@pytest.mark.slow
def test_build_refuses_a_link_at_the_lock_beside_its_output(tmp_path, outside, sources, capsys):
    run = tmp_path / "run"
    assert _generate(sources, run) == 0
    dataset = tmp_path / "dataset"
    (tmp_path / f".dataset.{LOCK_NAME}").symlink_to(outside / "existing.txt")
    assert main(["build", str(run), "--out", str(dataset), "-q"]) == 2
    assert "is a symbolic link" in _one_line(capsys)
    _assert_untouched(outside)
    assert not dataset.exists()


@pytest.mark.slow
@pytest.mark.parametrize("target", ["missing.txt", "existing.txt"])
def test_a_journal_that_is_a_link_is_refused_in_one_line_and_not_appended_to(tmp_path, outside, sources, capsys,
                                                                              target):
    """The journal is appended to, not replaced: a link at its name is refused, whatever it points to."""
    run = tmp_path / "run"
    assert _generate(sources, run) == 0
    (run / layout.JOURNAL).unlink()
    (run / layout.JOURNAL).symlink_to(outside / target)
    assert _generate(sources, run) == 2
    assert "is a symbolic link" in _one_line(capsys)
    _assert_untouched(outside)


def test_prepare_refuses_a_link_at_its_manifest(tmp_path, outside, capsys):
    root = tmp_path / "in"
    write_jpeg(root / "MIMIC_x" / "normal" / "a.jpeg", 1, size=64)
    out = tmp_path / "sources"
    out.mkdir()
    (out / "prepare_manifest.jsonl").symlink_to(outside / "existing.txt")
    assert main(["prepare", "folders", str(root), "--out", str(out)]) == 2
    assert "is a symbolic link" in capsys.readouterr().err
    _assert_untouched(outside)


# ---------------------------------------------------------------- the run's files and the caches

@pytest.mark.slow
def test_a_resumed_run_replaces_links_at_its_json_files_instead_of_writing_through_them(tmp_path, outside, sources):
    run = tmp_path / "run"
    assert _generate(sources, run) == 0
    folder = next(folder for _, _, folder in layout.find_output_dirs(run))
    planted = [run / layout.STATS, folder / layout.PROGRESS, folder / layout.ALL_CONVERSATIONS]
    saved = {path: path.read_bytes() for path in planted[1:]}
    for path in planted:
        path.unlink()
        path.symlink_to(outside / "existing.txt")
    (run / "medbanana-journal.jsonl").unlink()  # a fresh start: every task is run and every file written again
    assert _generate(sources, run) == 0
    _assert_untouched(outside)
    for path in planted:
        assert not path.is_symlink() and json.loads(path.read_text())
    assert json.loads((folder / layout.PROGRESS).read_text()) == json.loads(saved[folder / layout.PROGRESS])


def test_temp_files_and_cache_logs_are_never_opened_through_a_planted_link(tmp_path, outside, monkeypatch):
    """A temp file's name (pid, serial) and a cache log's (clock, pid) are predictable: a link planted there is
    refused (FileExistsError), never followed, whether it dangles or not."""
    for name, target in (("dangling", "gone.txt"), ("existing", "existing.txt")):
        (tmp_path / name).symlink_to(outside / target)
        with pytest.raises(FileExistsError):
            create_new(tmp_path / name)
    _assert_untouched(outside)

    cache_dir = tmp_path / "cache"
    cache_dir.mkdir()
    monkeypatch.setattr("time.time_ns", lambda: 1234)  # the log's name is answers-TIME_NS-PID.log
    (cache_dir / f"answers-1234-{os.getpid()}.log").symlink_to(outside / "existing.txt")
    with pytest.raises(FileExistsError), pytest.warns(UserWarning, match="left out, never opened: .* symbolic link"):
        ResponseCache(cache_dir).put_json("k" * 64, '{"answer": 1}')  # not read as a log either
    _assert_untouched(outside)
    atomic_write_bytes(tmp_path / "existing", b"new")  # a link at the target itself is replaced by the file
    assert not (tmp_path / "existing").is_symlink() and (tmp_path / "existing").read_bytes() == b"new"
    _assert_untouched(outside)


# ---------------------------------------------------------------- folders of the run that lead out of it

def _files(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _linked_out_folder(run: Path, where: str) -> str:
    """The run-relative folder that `where` names in a finished run."""
    image = next(e["round"]["image"] for e in read_jsonl(run / layout.JOURNAL) if e["type"] == "round")
    mask_folder = Path(layout.mask_relpaths(image)[0]).parent
    return {"output folder": image.split("/")[0], "class folder": str(Path(image).parent),
            "masks folder": layout.MASKS, "masks mirror": str(mask_folder.parent), "masks class": str(mask_folder),
            "orphans folder": layout.ORPHANS}[where]


@pytest.mark.slow
@pytest.mark.parametrize("where", ["output folder", "class folder", "masks folder", "masks mirror", "masks class",
                                   "orphans folder"])
def test_a_run_with_a_folder_linked_out_of_it_is_refused_before_anything_is_written(tmp_path, sources, capsys, where):
    """A run from elsewhere whose folders are links out of it: resuming it would write its images, masks and JSON
    files wherever the links point."""
    run = tmp_path / "run"
    assert _generate(sources, run) == 0
    rel = _linked_out_folder(run, where)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    if (run / rel).exists():
        shutil.move(run / rel, elsewhere / "moved")
    else:
        (elsewhere / "moved").mkdir()
    (run / rel).symlink_to(elsewhere / "moved", target_is_directory=True)
    (run / layout.JOURNAL).unlink()  # a fresh start: every image and file would be written again
    before, config = _files(elsewhere), (run / layout.RUN_CONFIG).read_bytes()
    assert _generate(sources, run) == 2
    err = _one_line(capsys)
    assert f"{run / rel} is a link leading outside the run directory" in err
    assert _files(elsewhere) == before and (run / layout.RUN_CONFIG).read_bytes() == config
    assert not (run / layout.JOURNAL).exists()


@pytest.mark.slow
def test_a_folder_linked_inside_the_run_is_written_through(tmp_path, sources):
    run = tmp_path / "run"
    assert _generate(sources, run) == 0
    rel = _linked_out_folder(run, "output folder")  # the first journalled image's
    shutil.move(run / rel, run / "kept-here")
    (run / rel).symlink_to("kept-here", target_is_directory=True)  # relative: stays inside wherever the run goes
    written = sorted(_files(run / "kept-here"))
    shutil.rmtree(run / "kept-here")
    (run / "kept-here").mkdir()
    (run / layout.JOURNAL).unlink()  # a fresh start: the same images and files are written again, through the link
    assert layout.folders_leading_out(run) == []
    assert _generate(sources, run) == 0
    assert (run / rel).is_symlink() and sorted(_files(run / "kept-here")) == written and written


def test_a_folder_linked_out_after_opening_is_not_written_through(tmp_path, outside):
    """Opening refuses the links it finds; a link made while the run is open is refused at each write."""
    from medbanana.generation.records import Attempt, EditedImage, Instruction, Task
    from medbanana.generation.rundir.store import RunStore

    source = write_jpeg(tmp_path / "sources" / "MIMIC_s" / "normal" / "n0.jpeg", 1, size=64)
    store = RunStore(tmp_path / "run", {"backends": {}, "max_rounds": 2, "run_id": "r1"}).open()
    task = Task("MIMIC_s", "chest_xray", "Pneumothorax", "add", source, source.parent.parent.parent)
    attempt = Attempt(round=1, instruction=Instruction("add a pneumothorax"))
    (store.run_dir / "MIMIC_s-edit-failed").symlink_to(outside, target_is_directory=True)
    try:
        with pytest.raises(layout.UnsafePath, match="leads outside"):
            store.write_attempt(task, attempt, EditedImage(source.read_bytes()))
    finally:
        store.close()
    _assert_untouched(outside)
    assert not (store.run_dir / layout.MASKS).exists()
