"""A run made elsewhere, reopened: every journal line and the run's configuration are parsed and checked before
anything is written (issue 37).

Each test copies one finished run (a task accepted or failed, one api_failed: its source is over --max-pixels) made
by the real CLI, spoils its journal or its medbanana-run.json as another machine could have written it, and runs
the real CLI three ways: a plain resume, `--retry-failed`, and `--retry-failed --drop-missing-sources`. Each is
refused with one line naming the file, the line and the field (exit code 2), and nothing anywhere is written: not
the run, not a sibling run whose `progress.json` a `../` dataset would reach, not an absolute path's folder.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from conftest import write_jpeg
from trees import snapshot
from medbanana.cli import main
from medbanana.generation.rundir import layout

FAILED_UID = "MIMIC_far/add/large-Pneumothorax"  # api_failed: its source is over --max-pixels
OPTIONS = ["--backend", "simulator", "--diseases", "Pneumothorax", "--directions", "add", "--max-rounds", "1", "-q",
           "--max-pixels", "2000"]


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> Path:
    """A finished run with an api_failed task, and its sources, made once by the real CLI."""
    root = tmp_path_factory.mktemp("made")
    normal = root / "sources" / "MIMIC_far" / "normal"
    write_jpeg(normal / "small.jpeg", 1, size=32)
    write_jpeg(normal / "large.jpeg", 2, size=48)  # 2,304 pixels: over --max-pixels
    assert main(["generate", "--sources", str(root / "sources"), "--out", str(root / "run"), *OPTIONS]) == 3
    return root


@pytest.fixture
def machine(tmp_path, made) -> Path:
    """A copy of the run at tmp_path/a/b/run (so that `../../x` stays under tmp_path), its sources beside it, and
    another run's folder `victim-edit/` beside the run, which a record naming the dataset `../victim` would reach."""
    shutil.copytree(made / "sources", tmp_path / "sources", symlinks=True)
    run = tmp_path / "a" / "b" / "run"
    shutil.copytree(made / "run", run, symlinks=True)
    config = json.loads((run / layout.RUN_CONFIG).read_text())
    config["sources_root"] = str(tmp_path / "sources")
    (run / layout.RUN_CONFIG).write_text(json.dumps(config))
    victim = tmp_path / "a" / "b" / "victim-edit"
    victim.mkdir()
    (victim / layout.PROGRESS).write_text('{"another run": "success"}')
    return run


def CONFIRMED(run: Path) -> list[str]:
    return ["--sources", str(run.parents[2] / "sources"), "--backend", "simulator"]


MODES = {
    "resume": lambda run: ["generate", "--sources", str(run.parents[2] / "sources"), "--out", str(run), *OPTIONS],
    # a retry names the run's destinations itself (docs/data-destinations.md): the sources and the backend
    "retry": lambda run: ["generate", "--retry-failed", str(run), *CONFIRMED(run), "-q"],
    "retry and drop": lambda run: ["generate", "--retry-failed", str(run), *CONFIRMED(run), "--drop-missing-sources",
                                   "-q"],
}


def refused(run: Path, mode: str, capsys) -> str:
    """Run the CLI in `mode` on `run`: exit code 2, one line on stderr (returned), nothing under tmp_path changed."""
    tmp = run.parents[2]
    before = snapshot(tmp)
    capsys.readouterr()
    code = main(MODES[mode](run))
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.count("\n") == 1 and err.startswith("medbanana generate: ") and "Traceback" not in err, err
    assert snapshot(tmp) == before  # nothing written: not the run, not beside it, not outside
    return err


# ---------------------------------------------------------------- the journal

def _lines(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / layout.JOURNAL).read_text().splitlines()]


def _spoil(run: Path, pick, change) -> int:
    """Change the first journal line `pick` accepts in place; its line number."""
    lines = _lines(run)
    index = next(i for i, entry in enumerate(lines) if pick(entry))
    change(lines[index])
    (run / layout.JOURNAL).write_text("".join(json.dumps(entry) + "\n" for entry in lines))
    return index + 1


def _task(uid: str | None = None):
    return lambda entry: entry["type"] == "task" and (uid is None or entry["uid"] == uid)


def _round(entry: dict) -> bool:
    return entry["type"] == "round" and bool(entry["round"]["image"])


def _record(field: str, value):
    def change(entry):
        entry["record"][field] = value.format(abs=entry["_abs"]) if isinstance(value, str) else value
    return change


HOSTILE_LINES = {  # case -> (which line, how it is spoilt, the field the refusal names, text it must show)
    "dataset ../../x": (_task(FAILED_UID), _record("dataset", "../../x"), "record.dataset", "'../../x'"),
    "dataset ../victim": (_task(), _record("dataset", "../victim"), "record.dataset", "'../victim'"),
    "absolute dataset": (_task(), _record("dataset", "{abs}"), "record.dataset", "not a plain file name"),
    "disease Ed/../../x": (_task(FAILED_UID), _record("disease", "Ed/../../x"), "record.disease", "'Ed/../../x'"),
    "source_id ..": (_task(), _record("source_id", ".."), "record.source_id", "not a plain file name"),
    "disease 5": (_task(), _record("disease", 5), "record.disease", "is 5"),
    "rounds a string": (_task(), _record("rounds", "none"), "record.rounds", "'none'"),
    "round image ../../x.jpeg": (_round, lambda e: e["round"].update(image="../../x.jpeg"), "round.image",
                                 "'../../x.jpeg'"),
    "round image absolute": (_round, lambda e: e["round"].update(image=e["_abs"] + "/x.jpeg"), "round.image",
                             "not the layout's path"),
    "round uid ../../x": (_round, lambda e: e.update(uid="../../x/add/small-Pneumothorax"), "uid", "'../../x"),
    "round number 0": (_round, lambda e: e["round"].update(round=0), "round.round", "is 0"),
    "round number '1'": (_round, lambda e: e["round"].update(round="1"), "round.round", "'1'"),
}


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("case", list(HOSTILE_LINES))
def test_a_hostile_journal_line_is_refused_naming_file_line_and_field_before_anything_is_written(
        machine, capsys, case, mode):
    pick, change, field, shows = HOSTILE_LINES[case]

    def spoil(entry):
        entry["_abs"] = str(machine.parents[2] / "abs")
        change(entry)
        del entry["_abs"]

    line = _spoil(machine, pick, spoil)
    err = refused(machine, mode, capsys)
    assert f"{layout.JOURNAL} line {line}: field '{field}'" in err and shows in err, err
    assert str(machine) in err


@pytest.mark.slow
def test_an_honest_copy_resumes_and_retries(machine, capsys):
    """The copies the tests spoil are good runs: unspoilt, each way of reopening one works."""
    for mode in MODES:
        assert main(MODES[mode](machine)) in (0, 3), capsys.readouterr().err
    assert not (machine.parents[2] / "x-edit").exists()


# ---------------------------------------------------------------- the run's configuration

def _config(run: Path, change) -> None:
    config = json.loads((run / layout.RUN_CONFIG).read_text())
    change(config)
    (run / layout.RUN_CONFIG).write_text(json.dumps(config))


def _set(field: str, value):
    return lambda config: config.update({field: value})


def _selection(field: str, value):
    return lambda config: config["selection"].update({field: value})


HOSTILE_CONFIGS = {  # case -> (how medbanana-run.json is spoilt, the field the refusal names, text it must show)
    "sources_root 5": (_set("sources_root", 5), "sources_root", "is 5"),
    "sources_root relative": (_set("sources_root", "../../x"), "sources_root", "not an absolute path"),
    "max_rounds 0": (_set("max_rounds", 0), "max_rounds", "is 0"),
    "max_rounds -3": (_set("max_rounds", -3), "max_rounds", "is -3"),
    "max_rounds '5'": (_set("max_rounds", "5"), "max_rounds", "is '5'"),
    "max_rounds true": (_set("max_rounds", True), "max_rounds", "is True"),
    "seed 'x'": (_set("seed", "x"), "seed", "is 'x'"),
    "run_id 5": (_set("run_id", 5), "run_id", "is 5"),
    "c2pa a string": (_set("c2pa", "signed"), "c2pa", "'signed'"),
    "diseases a string": (_selection("diseases", "Pneumothorax"), "selection.diseases", "'Pneumothorax'"),
    "disease Ed/../../x": (_selection("diseases", ["Ed/../../x"]), "selection.diseases[0]", "'Ed/../../x'"),
    "direction sideways": (_selection("directions", ["sideways"]), "selection.directions[0]", "'sideways'"),
    "shard 2 of 2": (_selection("shard", [2, 2]), "selection.shard", "[2, 2]"),
    "limit 0": (_selection("limit", 0), "selection.limit", "is 0"),
}


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("case", list(HOSTILE_CONFIGS))
def test_a_run_config_field_of_the_wrong_type_is_refused_naming_file_and_field(machine, capsys, case, mode):
    change, field, shows = HOSTILE_CONFIGS[case]
    _config(machine, change)
    err = refused(machine, mode, capsys)
    assert f"{machine / layout.RUN_CONFIG}: field '{field}'" in err and shows in err, err


@pytest.mark.slow
def test_a_retry_of_a_run_that_records_no_sources_folder_asks_for_one(machine, capsys):
    _config(machine, _set("sources_root", None))
    before = snapshot(machine.parents[2])
    capsys.readouterr()
    assert main(["generate", "--retry-failed", str(machine), "--backend", "simulator", "-q"]) == 2
    err = capsys.readouterr().err
    assert snapshot(machine.parents[2]) == before
    assert f"{machine / layout.RUN_CONFIG} records no sources folder (sources_root); give --sources" in err
    capsys.readouterr()
    assert main(["generate", "--retry-failed", str(machine), "--sources", str(machine.parents[2] / "sources"),
                 "-q"]) == 0  # given, the retry runs (without --max-pixels 2000 the large source is read)
    last = [entry for entry in _lines(machine) if entry["type"] == "task" and entry["uid"] == FAILED_UID][-1]
    assert last["record"]["status"] in ("success", "failed")
