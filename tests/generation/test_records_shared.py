"""One declaration of what a verdict, a task id, a yes/no and an output folder are (generation/records.py,
rundir/layout.py), used by the generator, the journal, the builder and evaluation alike; and builder/ never
imports evaluation/."""

import ast
import dataclasses
import json
from pathlib import Path

import msgspec
import pytest

from scripted import ScriptedEditor, ScriptedJudge, ScriptedWriter
from medbanana.generation.dataset import features
from medbanana.generation.rundir import schema as run_schema
from medbanana.generation.rundir.schema import attempt_from_round
from medbanana.generation.rundir.runs import discover_units, read_tasks
from medbanana.evaluation.agreement import read_human_labels
from medbanana.generation import records
from medbanana.generation.records import (FALSE_WORDS, TRUE_WORDS, VERDICT_COLUMNS, VERDICT_FIELDS, Attempt, Instruction,
                                          Usage, Verdict, as_bool, json_bool, strict_bool, task_uid,
                                          verdict_values)
from medbanana.generation.rundir import layout
from medbanana.generation.rundir.store import read_journal
from medbanana.generation.runners.local import run
from medbanana.generation.runners.session import RunOptions
from medbanana.generation.sources.scan import scan_sources
from paths import ROOT



def test_the_verdict_columns_are_records_declaration():
    assert tuple(features.VERDICT) == VERDICT_FIELDS == tuple(VERDICT_COLUMNS)
    dtypes = {bool: "bool", float: "float32", str: "string"}
    assert {name: f.dtype for name, f in features.VERDICT.items()} == {n: dtypes[k] for n, k in VERDICT_COLUMNS.items()}
    for config in ("sft", "failed", "judge"):  # flat verdict columns, in the declared order
        columns = [c for c in features.CONFIG_FEATURES[config] if c in VERDICT_COLUMNS]
        assert tuple(columns) == VERDICT_FIELDS, config
    assert run_schema.Verification.__struct_fields__[:len(VERDICT_FIELDS)] == VERDICT_FIELDS
    assert set(records.VERDICT_BOOLEANS) == {n for n, kind in VERDICT_COLUMNS.items() if kind is bool}


def test_verdict_dataclass_has_the_declared_fields_and_types():
    declared = {f.name: f.type for f in dataclasses.fields(Verdict)}
    assert {name: declared.get(name) for name in VERDICT_COLUMNS} == {n: k.__name__ for n, k in VERDICT_COLUMNS.items()}


def test_one_word_set_for_yes_and_no():
    assert TRUE_WORDS.isdisjoint(FALSE_WORDS)
    for word in TRUE_WORDS:
        assert as_bool(f" {word.upper()} ") is True and strict_bool(word) is True
    for word in FALSE_WORDS:
        assert as_bool(word) is False and strict_bool(word) is False
    assert as_bool("maybe") is False and as_bool(None) is None and as_bool(0) is False and as_bool(2) is True
    with pytest.raises(ValueError, match="'maybe' is not true/false"):
        strict_bool("maybe")
    # the builder's verdicts and the human labels read the same words
    raw = msgspec.json.decode(b'{"qualified": "Y", "has_disease": "passed", "looks_realistic": "f", "score": 1}',
                              type=run_schema.Verification)
    values = verdict_values(raw)
    assert values["qualified"] is True and values["has_disease"] is True and values["looks_realistic"] is False
    assert values["score"] == 1.0 and values["score"].__class__ is float
    from_json = verdict_values(records.JsonFields({"qualified": "Y", "score": "high"}))
    assert from_json == {**dict.fromkeys(VERDICT_FIELDS), "qualified": True}
    assert tuple(from_json) == tuple(values) == VERDICT_FIELDS  # the written-out reader keeps the declared order
    assert verdict_values(None) == dict.fromkeys(VERDICT_FIELDS)


def test_human_labels_use_the_shared_words(tmp_path):
    csv = tmp_path / "h.csv"
    csv.write_text("id,qualified,has_disease\na#1,Y,t\nb#1,failed,\n")
    assert read_human_labels(csv)["a#1"]["has_disease"] is True
    assert read_human_labels(csv)["b#1"] == {**dict.fromkeys(records.VERDICT_BOOLEANS), "qualified": False}
    csv.write_text("id,qualified\na#1,sure\n")
    with pytest.raises(ValueError, match=r"h.csv:2 qualified: 'sure' is not true/false"):
        read_human_labels(csv)


def test_strict_json_booleans_refuse_other_words():
    assert json_bool(True) is True and json_bool(" False ") is False
    assert json_bool("no") is None and json_bool(1) is None and json_bool(None) is None


def test_output_folder_names_are_parsed_in_one_place():
    assert layout.parse_output_dir("MIMIC-x-edit") == ("MIMIC-x", "add")
    assert layout.parse_output_dir("ODIR-remove") == ("ODIR", "remove")
    assert layout.parse_output_dir("ODIR-remove-failed") is None and layout.parse_output_dir("ODIR") is None
    assert all(layout.is_layout_dir(n) for n in ("A-edit", "A-remove", "A-edit-failed", "A-remove-failed"))
    assert not layout.is_layout_dir("A-failed") and not layout.is_layout_dir("medbanana-orphans")


@pytest.mark.slow
def test_what_the_generator_writes_the_journal_and_the_builder_read_alike(tiny_sources, tmp_path):
    tasks = [t for t in scan_sources(tiny_sources) if t.dataset == "MIMIC_tiny"]
    run(tasks, tmp_path / "run", ScriptedWriter(), ScriptedEditor(), ScriptedJudge(lambda t: 2),
        RunOptions(quiet=True))
    journal = {}
    for entry in read_journal(tmp_path / "run" / layout.JOURNAL):
        if entry["type"] == "round":
            journal.setdefault(entry["uid"], []).append(attempt_from_round(entry["round"]))
    built = {t.uid: t for unit in discover_units(tmp_path / "run") for t in read_tasks(unit)}
    assert set(built) == set(journal) == {t.uid for t in tasks}
    for task in tasks:
        assert task.uid == task_uid(task.dataset, task.direction, task.source_id, task.disease)
        record, attempts = built[task.uid], journal[task.uid]
        assert (record.dataset, record.direction, record.source_id, record.disease) == \
            (task.dataset, task.direction, task.source_id, task.disease)
        assert len(record.attempts) == len(attempts) == 2
        for read, written in zip(record.attempts, attempts):
            assert (read.round, read.instruction, read.accepted, read.image) == \
                (written.round, written.instruction.text, written.accepted, written.image_relpath)
            assert read.writer_thinking == written.instruction.thinking_summary
            assert read.seconds == pytest.approx(written.seconds) and (read.edit_error is None) == (not written.edit_error)
            expected = {name: getattr(written.verdict, name) for name in VERDICT_FIELDS}
            expected["score"] = round(expected["score"], 4)
            assert verdict_values(read.verdict) == expected
            assert Verdict.from_json(written.verdict.to_json()) == written.verdict


def test_the_builder_reads_a_uid_it_was_not_given_as_the_generator_makes_it(tmp_path):
    from medbanana.builder.synthetic_run import make_synthetic_run

    make_synthetic_run(tmp_path / "run", flavor="original", tasks_per_folder=2, datasets=("ODIR_synthetic",))
    progress = json.loads((tmp_path / "run" / "ODIR_synthetic-edit" / layout.PROGRESS).read_text())
    read = {t.uid: t for unit in discover_units(tmp_path / "run") for t in read_tasks(unit) if t.direction == "add"}
    assert set(read) == {f"ODIR_synthetic/add/{key}" for key in progress}  # api_failed ones too
    assert all(uid == task_uid(t.dataset, t.direction, t.source_id, t.disease) for uid, t in read.items())


def _imports(path: Path) -> set[str]:
    """Absolute names of the package modules a module imports (relative imports resolved)."""
    package = ["medbanana", *path.relative_to(ROOT).with_suffix("").parts[:-1]]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            module = ".".join([*base, *(node.module.split(".") if node.module else [])])
            found.add(module)
            found.update(f"{module}.{alias.name}" for alias in node.names)
    return found


def test_builder_never_imports_evaluation():
    offenders = {path.name: sorted(n for n in _imports(path) if n.startswith("medbanana.evaluation"))
                 for path in sorted((ROOT / "builder").glob("*.py"))}
    assert {name: found for name, found in offenders.items() if found} == {}


def test_the_import_check_sees_relative_imports():
    found = _imports(ROOT / "builder" / "build.py")
    assert "medbanana.builder.paper" in found and "medbanana.generation.rundir.lock" in _imports(
        ROOT / "generation" / "dataset" / "output.py")


def test_a_journalled_round_reads_back_as_the_attempt_that_wrote_it():
    """The journal's rounds go through the builder's schema on resume: every field a round JSON holds survives."""
    verdict = Verdict(True, False, True, True, False, "edge too sharp", score=0.6, thinking_summary="looked at it",
                      model="judge-1", details={"iou": 0.4})
    for attempt in (Attempt(2, Instruction("Add a nodule.", "why", usage=Usage(3, 4, 5)), verdict, accepted=False,
                            image_relpath="D-edit-failed/x.jpeg", seconds=1.25, edit_details={"seed": 7}),
                    Attempt(3, Instruction("Add it again."), edit_error="safety: blocked")):
        assert attempt_from_round(attempt.to_round_json()) == attempt
        assert attempt_from_round(json.dumps(attempt.to_round_json()).encode()) == attempt
    original = {"round": 1, "generate_prompt": {"thinking_summary": "t", "prompt": "p"},  # the original scripts'
                "edit_result": {"success": True}, "verification": {"qualified": "yes", "has_disease": True,
                                                                   "structure_reasonable": True,
                                                                   "looks_realistic": True, "reason": "ok"}}
    read = attempt_from_round(original)
    assert read.instruction.text == "p" and read.verdict.qualified is True and read.verdict.fidelity_preserved is False


def test_16_bit_grey_images_are_scaled_whatever_their_byte_order():
    """A 16-bit image, little- or big-endian (TIFF keeps either), keeps its contrast: min-max scaled to 0-255 as the
    generator and the masks read it, where PIL's own RGB conversion clips every value above 255 to white."""
    import io

    import numpy as np
    from PIL import Image

    from medbanana.generation.records import decode_rgb

    values = (np.arange(64 * 64).reshape(64, 64) * 12 + 1000).astype(np.uint16)
    for mode, dtype in (("I;16", "<u2"), ("I;16B", ">u2")):
        buffer = io.BytesIO()
        Image.frombytes(mode, (64, 64), values.astype(dtype).tobytes()).save(buffer, "TIFF")
        assert Image.open(io.BytesIO(buffer.getvalue())).mode == mode
        rgb = decode_rgb(buffer.getvalue())
        assert rgb.shape == (64, 64, 3) and rgb.min() == 0 and rgb.max() == 255
        assert len(np.unique(rgb[..., 0])) > 200  # a ramp, not a clipped white
