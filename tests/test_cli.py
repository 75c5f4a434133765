import json

import pytest

from medbanana.cli import main
from medbanana.generation import backends
from medbanana.generation.failures import NotFound, UsageError
from medbanana.generation.rundir import layout


@pytest.fixture
def scripted_backend():
    for role, cls in (("writer", "ScriptedWriter"), ("editor", "ScriptedEditor"), ("judge", "ScriptedJudge")):
        backends.register("scripted", role, f"scripted:{cls}")
    yield "scripted"
    backends.unregister("scripted")


def test_help_explains_every_command(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    for command in ("demo", "generate", "merge", "taxonomy"):
        assert command in out
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    out = capsys.readouterr().out
    assert "--sources" in out and "--max-rounds" in out and "resume" in out.lower()


@pytest.mark.slow
def test_generate_prints_a_summary_and_resumes(tiny_sources, tmp_path, scripted_backend, capsys):
    argv = ["generate", "--sources", str(tiny_sources), "--out", str(tmp_path / "run"), "--backend", "scripted",
            "--diseases", "Pneumothorax", "Glaucoma", "-q"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "tasks 5 (ran 5, already done 0)" in out and "failed attempts" in out
    assert main(argv) == 0
    assert "tasks 5 (ran 0, already done 5)" in capsys.readouterr().out
    progress = json.loads((tmp_path / "run" / "ODIR_tiny-remove" / layout.PROGRESS).read_text())
    assert list(progress) == ["1_right-Glaucoma"]


@pytest.mark.parametrize("extra,message", [
    (["--diseases", "Pneumonitis"], "'Pneumonitis' is not a known disease"),
    (["--directions", "remove", "--modalities", "brain_mri"], "no source images"),
])
def test_generate_user_errors_exit_non_zero_with_one_clear_line(tiny_sources, tmp_path, scripted_backend, capsys,
                                                               extra, message):
    code = main(["generate", "--sources", str(tiny_sources), "--out", str(tmp_path / "run"), "--backend",
                 "scripted", "-q", *extra])
    err = capsys.readouterr().err
    assert code == 2 and message in err and "Traceback" not in err
    assert not (tmp_path / "run").exists()


def test_generate_refuses_a_folder_of_another_configuration(tiny_sources, tmp_path, scripted_backend, capsys):
    base = ["generate", "--sources", str(tiny_sources), "--out", str(tmp_path / "run"), "--backend", "scripted",
            "--diseases", "Glaucoma", "-q"]
    assert main(base) == 0
    assert main(base + ["--seed", "7"]) == 2
    assert "seed: was 0, now 7" in capsys.readouterr().err


def test_empty_sources_folder(tmp_path, capsys):
    (tmp_path / "src" / "MIMIC" / "normal").mkdir(parents=True)
    assert main(["generate", "--sources", str(tmp_path / "src"), "--out", str(tmp_path / "run"), "-q"]) == 2
    assert "no source images" in capsys.readouterr().err


@pytest.mark.parametrize("raised, code", [(UsageError("--diseases Foo: unknown"), 2), (NotFound("no such run"), 2),
                                          (ValueError("a bug: bad state"), 1), (RuntimeError("a bug too"), 1),
                                          (FileNotFoundError("a bug naming no file"), 1)])
def test_only_a_usage_error_is_one_line_every_other_exception_keeps_its_traceback(monkeypatch, capsys, raised, code):
    """A user's mistake (UsageError) is one line and exit 2; a ValueError, RuntimeError or FileNotFoundError that is
    not one is a bug: its traceback, exit 1, so that it is not mistaken for the user's."""
    from medbanana.generation.commands import taxonomy

    def broken():
        raise raised

    monkeypatch.setattr(taxonomy, "load_taxonomy", broken)
    assert main(["taxonomy"]) == code
    err = capsys.readouterr().err
    if code == 2:
        assert err == f"medbanana taxonomy: error: {raised}\n"
    else:
        assert "Traceback" in err and err.rstrip().endswith(f"{type(raised).__name__}: {raised}")


@pytest.mark.parametrize("name, content, said", [
    ("first.jsonl", b"garbage{\n", "first.jsonl: not JSON lines"),
    ("later.jsonl", b'{"id": "a"}\n{bad\n', "later.jsonl:2: not a JSON line"),
    ("list.jsonl", b"[1, 2]\n", "list.jsonl:1: a sample is a JSON object, not list"),
    ("latin.csv", b"id,source\n\xff\xfe,x\n", "latin.csv: not UTF-8 text")])
def test_a_malformed_samples_file_is_the_users_mistake_in_one_line(tmp_path, capsys, name, content, said):
    samples = tmp_path / name
    samples.write_bytes(content)
    assert main(["eval", str(samples), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"medbanana eval: error: {samples.parent}/{said}") and err.count("\n") == 1, err
