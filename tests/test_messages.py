"""What commands print, through the `medbanana` command: every summary line names the file or option it is about,
and no Python structure (a dict's or list's repr) reaches the output."""

from __future__ import annotations

import re
import shutil

import pytest

from conftest import write_jpeg
from medbanana.cli import main

REPR = re.compile(r"\{'|\['|': ")  # a dict's or list's repr: {'source_error': 11}, ['a', 'b']


@pytest.fixture
def no_key(monkeypatch):
    for name in ("GEMINI_API_KEY", "GOOGLE_API_KEY", "GOOGLE_GENAI_USE_VERTEXAI"):
        monkeypatch.delenv(name, raising=False)


def test_generate_names_the_unreadable_source_and_counts_errors_in_words(tiny_sources, tmp_path, capfd, no_key):
    sources = tmp_path / "two"
    shutil.copytree(tiny_sources / "MIMIC_tiny" / "normal", sources / "MIMIC_tiny" / "normal")
    (sources / "MIMIC_tiny" / "normal" / "n1.jpeg").write_bytes(b"notes, not a scan")
    out = tmp_path / "run"
    assert main(["generate", "--sources", str(sources), "--out", str(out), "--diseases", "Pneumothorax",
                 "--max-rounds", "1", "-q"]) == 3
    printed = capfd.readouterr()
    assert "errors           1 (source_error 1)" in printed.out and not REPR.search(printed.out)
    reason = next(line for line in printed.err.splitlines() if "source_error at load_source" in line)
    assert "not a readable image" in reason  # the grouped reason, then the file its first task named
    assert reason.endswith(f"(e.g. {sources / 'MIMIC_tiny' / 'normal' / 'n1.jpeg'})")
    assert not REPR.search(printed.err)


def test_gemini_without_a_key_says_what_to_set(tiny_sources, tmp_path, capfd, no_key):
    assert main(["generate", "--sources", str(tiny_sources), "--out", str(tmp_path / "run"), "--backend", "gemini",
                 "-q"]) == 2
    *warnings, error = capfd.readouterr().err.splitlines()
    # the sources' data-use warning (unknown data to a cloud destination) may come first: one line, as warnings are
    assert all(line.startswith("medbanana: warning: images of unknown data use") for line in warnings), warnings
    assert "GEMINI_API_KEY or GOOGLE_API_KEY" in error and "aistudio.google.com" in error
    assert "api_key" not in error  # no option of that name exists
    assert not (tmp_path / "run").exists()  # refused on its options: nothing left behind


def test_prepare_names_the_option_that_takes_a_missing_label_file(tmp_path, capfd):
    root = tmp_path / "mimic"
    write_jpeg(root / "files" / "p10" / "p10000001" / "s50000001" / "d1.jpg")
    assert main(["prepare", "mimic-cxr", str(root), "--out", str(tmp_path / "out"), "-q"]) == 2
    err = capfd.readouterr().err
    assert "missing label file" in err and "pass its path with --labels FILE" in err
    (root / "mimic-cxr-2.0.0-chexpert.csv").write_text("subject_id,study_id\n")
    assert main(["prepare", "mimic-cxr", str(root), "--out", str(tmp_path / "out"), "-q"]) == 2
    assert "pass its path with --metadata FILE" in capfd.readouterr().err
    assert main(["prepare", "mimic-cxr", str(root), "--out", str(tmp_path / "out"), "--labels",
                 str(tmp_path / "nowhere.csv"), "-q"]) == 2
    assert "(--labels) does not exist" in capfd.readouterr().err


def test_build_names_unknown_configs_without_a_repr(tmp_path, capfd):
    (tmp_path / "run").mkdir()
    assert main(["build", str(tmp_path / "run"), "--out", str(tmp_path / "ds"), "--configs", "sft,pairs", "-q"]) == 2
    err = capfd.readouterr().err
    assert "unknown config(s) pairs; choose from" in err and "(--configs)" in err and not REPR.search(err)
