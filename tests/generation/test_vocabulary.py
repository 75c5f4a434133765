"""One vocabulary across the commands (generation/vocabulary.py, docs/concepts.md#glossary): every command's --help is
read as a user reads it, and an option name never means processes in one command and threads in another; the old
spellings still work, say what to write instead, and do not clutter --help."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from conftest import write_jpeg

from medbanana.cli import build_parser, command_paths, main
from medbanana.generation.vocabulary import PARALLELISM

ENTRY = re.compile(r"^  (-\S.*?)(?:\s{2,}(.*))?$")  # "  --workers N   processes ..." (help on the same line or below)
OPTION = re.compile(r"(?<![\w-])--[a-z0-9][\w-]*")
# what an option counts is the help's first words: "processes making the calls", "feature worker processes",
# "threads encoding the PNGs", "tasks in flight at once"
KINDS = {"processes": re.compile(r"^(\S+ ){0,2}process(es)?\b"), "threads": re.compile(r"^(\S+ ){0,2}threads?\b"),
         "in flight": re.compile(r"^(\S+ )?in flight\b")}
# (command, old spelling, new spelling, a value, the value parsed, the destination the command reads)
OLD_SPELLINGS = [
    (("build", "RUN", "--out", "DS"), "--num-proc", "--workers", "3", 3, "workers"),
    (("build", "RUN", "--out", "DS"), "--max-shard-size", "--max-file-size", "1MB", "1MB", "max_file_size"),
    (("prepare", "folders", "ROOT", "--out", "OUT"), "--workers", "--threads", "2", 2, "threads"),
    (("export", "medebench", "DS", "--out", "OUT"), "--workers", "--threads", "2", 2, "threads"),
    # judge-agreement's --repeats is a count; calibrate's file of repeated verdicts has its own name
    (("calibrate", "LABELS.csv", "--run", "R", "--target-precision", "0.9", "--out", "P.json"), "--repeats",
     "--repeated-verdicts", "v.jsonl", Path("v.jsonl"), "repeated_verdicts"),
]


def subparser(words: tuple[str, ...]):
    parser = build_parser()
    for word in words:
        parser = parser.subcommands.choices[word]
    return parser


def help_entries(words: tuple[str, ...], monkeypatch) -> dict[str, str]:
    """option -> its help text, as `medbanana WORDS --help` prints it (wrapped lines joined)."""
    monkeypatch.setenv("COLUMNS", "100")
    entries: dict[str, str] = {}
    current: list[str] = []
    for line in subparser(words).format_help().splitlines():
        match = ENTRY.match(line)
        if match:
            current = OPTION.findall(match[1])
            for option in current:
                entries[option] = match[2] or ""
        elif line.startswith("   ") and current:  # a continuation of the entry above
            for option in current:
                entries[option] = f"{entries[option]} {line.strip()}".strip()
        else:
            current = []
    return entries


def all_entries(monkeypatch) -> dict[tuple[str, ...], dict[str, str]]:
    return {words: help_entries(words, monkeypatch) for words in command_paths(build_parser()) if words}


def test_every_commands_help_is_read(monkeypatch):
    entries = all_entries(monkeypatch)
    assert len(entries) > 15 and all(entries.values()), [words for words, found in entries.items() if not found]
    assert "processes" in entries[("generate",)]["--workers"] and "threads" in entries[("prepare",)]["--threads"]
    assert "in flight" in entries[("generate",)]["--concurrency"] and entries[("build",)]["--workers"]


def test_no_option_name_means_two_kinds_of_parallelism(monkeypatch):
    kinds: dict[str, set[str]] = {}
    where: dict[str, list[str]] = {}
    for words, entries in all_entries(monkeypatch).items():
        for option, text in entries.items():
            found = {kind for kind, pattern in KINDS.items() if pattern.search(text)}
            if found:
                kinds.setdefault(option, set()).update(found)
                where.setdefault(option, []).append(" ".join(words))
    assert {"--workers", "--threads", "--concurrency"} <= set(kinds), kinds
    mixed = {option: (sorted(k), where[option]) for option, k in kinds.items() if len(k) > 1}
    assert not mixed, f"options naming more than one kind of parallelism: {mixed}"
    for option, found in kinds.items():  # each kind has its one name (a prefix such as --probe-workers allowed)
        (kind,) = found
        name = next(n for n, k in PARALLELISM.items() if k == kind)
        assert option == name or option.endswith(name[1:]), f"{option} counts {kind}: call it {name}"


@pytest.mark.parametrize("command,old,new,value,parsed,dest", OLD_SPELLINGS, ids=lambda v: str(v))
def test_an_old_spelling_still_works_and_says_the_new_one(command, old, new, value, parsed, dest, capsys,
                                                          monkeypatch):
    new_args = build_parser().parse_args([*command, new, value])
    assert capsys.readouterr().err == ""
    old_args = build_parser().parse_args([*command, old, value])
    err = capsys.readouterr().err
    assert getattr(old_args, dest) == getattr(new_args, dest) == parsed
    assert vars(old_args) == vars(new_args)
    assert err.count("\n") == 1 and f"{old} is the old spelling of {new}" in err and err.startswith("medbanana ")
    words = max((w for w in command_paths(build_parser()) if command[:len(w)] == w), key=len)
    entries = help_entries(words, monkeypatch)
    assert old not in entries and f"{old} is its old spelling" in entries[new]  # hidden, named by the new one


def test_prepare_runs_with_its_old_spelling(tmp_path, capsys):
    """The path a script written for the old spelling takes: the whole command, which prepares its images."""
    for i in range(2):
        write_jpeg(tmp_path / "in" / "normal" / f"n{i}.jpg", i, size=80)
    argv = ["prepare", "folders", str(tmp_path / "in"), "--out", str(tmp_path / "out"), "--modality", "fundus",
            "--size", "64", "-q"]
    assert main([*argv, "--workers", "2"]) == 0
    err = capsys.readouterr().err
    assert "--workers is the old spelling of --threads" in err
    manifest = [json.loads(line) for line in (tmp_path / "out" / "prepare_manifest.jsonl").read_text().splitlines()]
    assert len(manifest) == 2
