"""`generate --retry-failed` over a run whose failed task's source was deleted since: named in one line and left
api_failed (the sources may only be unmounted), or ended for good with --drop-missing-sources, records kept."""

import json
from pathlib import Path

import pytest

from medbanana.cli import main
from medbanana.generation.rundir import layout
from medbanana.generation.rundir.store import read_journal
from conftest import write_jpeg

UID = "MIMIC_small/add/large-Pneumothorax"


def retry(run: Path, *extra: str) -> int:
    return main(["generate", "--retry-failed", str(run), "--sources", str(run.parent / "sources"), "--backend",
                 "simulator", "--diseases", "Pneumothorax", "--directions", "add", "--max-rounds", "1", "-q", *extra])


def task_lines(run: Path) -> list[dict]:
    return [e["record"] for e in read_journal(run / layout.JOURNAL) if e["type"] == "task" and e["uid"] == UID]


@pytest.mark.slow
def test_a_deleted_source_is_named_then_dropped_on_request_and_not_again(tmp_path, capsys):
    normal = tmp_path / "sources" / "MIMIC_small" / "normal"
    write_jpeg(normal / "small.jpeg", 1, size=32)
    write_jpeg(normal / "large.jpeg", 2, size=48)
    run = tmp_path / "run"
    assert main(["generate", "--sources", str(tmp_path / "sources"), "--out", str(run), "--backend", "simulator",
                 "--diseases", "Pneumothorax", "--directions", "add", "--max-rounds", "1", "-q",
                 "--max-pixels", "2000"]) == 3  # the large source is refused: api_failed
    (normal / "large.jpeg").unlink()
    (before,) = task_lines(run)
    capsys.readouterr()

    assert retry(run) == 3  # without the flag nothing is ended: the sources might only be unmounted
    err = capsys.readouterr().err
    assert "1 api_failed task(s) cannot be retried: their source file is gone (first: MIMIC_small/normal/large.jpeg)" in err
    assert (f"--retry-failed {run} --sources {tmp_path / 'sources'} --backend simulator --drop-missing-sources"
            in err and "Traceback" not in err)  # the retry line names what the run records (confirm.py)
    assert task_lines(run) == [before]

    assert retry(run, "--drop-missing-sources") == 0
    err = capsys.readouterr().err
    assert "1 api_failed task(s) dropped: their source file is gone" in err and "ended api_failed" not in err
    *_, dropped = task_lines(run)
    assert dropped["status"] == "api_failed" and dropped["rounds"] == before["rounds"]
    assert (dropped["error"]["step"], dropped["error"]["kind"]) == ("load_source", "source_missing")
    failures = json.loads((layout.output_dir(run, "MIMIC_small", "add") / layout.API_FAILURES).read_text())
    assert [(f["task"], f["kind"]) for f in failures] == [("large-Pneumothorax", "source_missing")]
    stats = json.loads((run / layout.STATS).read_text())
    assert stats["api_failed"] == 1 and stats["error_kinds"] == {"source_missing": 1}

    assert retry(run) == 0  # a later retry neither runs nor drops it again
    assert "source file is gone" not in capsys.readouterr().err
    assert len(task_lines(run)) == 2


def test_drop_missing_sources_goes_with_retry_failed(tmp_path, capsys):
    assert main(["generate", "--sources", str(tmp_path), "--out", str(tmp_path / "run"), "--backend", "simulator",
                 "--drop-missing-sources"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "give --retry-failed RUN_DIR with it" in err
