"""`medbanana stats`: Table 1 and Table 2 on a hand-made run match counts made by hand; the same numbers from
the built dataset; Figure 3 is a PNG with its four panels; a missing matplotlib is a clear error."""

import argparse
import json
import os
import sys

import pytest
from PIL import Image

from medbanana.builder.build import build
from medbanana.builder import commands, paper, summary
from medbanana.builder.reasons import reason_phrases
from medbanana.generation.rundir import layout

CXR, FUNDUS = "MIMIC_hand_cxr", "ODIR_hand_fundus"
SUBTLE = "Change too subtle in the lung apex (contrast-to-noise 1.2); hard edges at the lesion border."
SPILL = "Change spills outside the costophrenic angle; global intensity shift (+3.2 grey levels)."


def verdict(qualified, has, structure=True, realistic=True, fidelity=True, reason=""):
    return {"qualified": qualified, "has_disease": has, "structure_reasonable": structure,
            "looks_realistic": realistic, "fidelity_preserved": fidelity, "reason": reason}


def rounds(*verdicts):
    return [{"round": i, "generate_prompt": {"thinking_summary": "", "prompt": f"instruction {i}"},
             "edit_result": {"success": v is not None}, "verification": v} for i, v in enumerate(verdicts, 1)]


def write_folder(run, dataset, direction, tasks, progress_only=()):
    folder = layout.output_dir(run, dataset, direction)
    folder.mkdir(parents=True)
    conversations = {key: {"image": key.split("-")[0] + ".jpeg", "disease": disease, "status": status,
                           "rounds": rs, "final_prompt": "p"} for key, disease, status, rs in tasks}
    progress = {key: status for key, _d, status, _r in tasks} | {key: "api_failed" for key, _d in progress_only}
    failures = [{"task": key, "step": "edit_image", "round": 1, "error": "503", "disease": d, "image": "x.jpeg"}
                for key, d in progress_only]
    for name, value in ((layout.ALL_CONVERSATIONS, conversations), (layout.PROGRESS, progress),
                        (layout.API_FAILURES, failures)):
        (folder / name).write_text(json.dumps(value))


@pytest.fixture(scope="module")
def hand_run(tmp_path_factory):
    """CXR add: success r1, success r3, failed after 2; CXR remove: success r2, one API failure; fundus add: a
    failed task with an editor refusal in round 1 (no verdict)."""
    run = tmp_path_factory.mktemp("hand") / "run"
    write_folder(run, CXR, "add", [
        ("a1-Pleural_Effusion", "Pleural_Effusion", "success", rounds(verdict(True, True))),
        ("a2-Pneumothorax", "Pneumothorax", "success",
         rounds(verdict(False, False, reason=SUBTLE), verdict(False, False, realistic=False, reason=SUBTLE),
                verdict(True, True))),
        ("a3-Pleural_Effusion", "Pleural_Effusion", "failed",
         rounds(verdict(False, True, fidelity=False, reason=SPILL), verdict(False, False, reason=SUBTLE))),
    ])
    write_folder(run, CXR, "remove", [
        ("r1-Edema", "Edema", "success",
         rounds(verdict(False, True, structure=False, reason="Edema still visible (evidence 3.1 of 5.0)."),
                verdict(True, False))),
    ], progress_only=[("r2-Fracture", "Fracture")])
    write_folder(run, FUNDUS, "add", [("f1-Glaucoma", "Glaucoma", "failed", rounds(None, verdict(False, False)))])
    return run


def test_table1_counts_match_the_hand_made_run(hand_run):
    table = paper.table1(summary.summarise([hand_run]).stats)
    rows = {(r[0], r[1]): r[2:] for r in table.rows}
    # diseases, success, failed, api_failed, success rate, avg rounds over successes
    assert rows[("chest_xray", "add")] == [2, 2, 1, 0, pytest.approx(2 / 3), pytest.approx(2.0)]
    assert rows[("chest_xray", "remove")] == [2, 1, 0, 1, 1.0, 2.0]
    assert rows[("fundus", "add")] == [1, 0, 1, 0, 0.0, None]
    assert rows[("total", "")] == [5, 3, 2, 1, pytest.approx(3 / 5), pytest.approx(2.0)]
    assert list(rows) == [("chest_xray", "add"), ("chest_xray", "remove"), ("fundus", "add"), ("total", "")]


def test_table2_pass_rates_and_failure_reasons_match_the_hand_made_run(hand_run):
    counts = summary.summarise([hand_run])
    rows = {r[0]: r[1:] for r in paper.table2(counts.stats).rows}
    # 9 judged attempts (the refusal has no verdict). Compliance: add needs has_disease, remove its absence:
    # add verdicts has = T, F, F, T, T, F, F(fundus) -> 3 of 7; remove has = T, F -> 1 of 2: 4 of 9.
    assert rows["instruction compliance"] == [0.40, pytest.approx(4 / 9), 4, 9]
    assert rows["structural plausibility"] == [0.25, pytest.approx(8 / 9), 8, 9]
    assert rows["realism"] == [0.20, pytest.approx(8 / 9), 8, 9]
    assert rows["fidelity preservation"] == [0.15, pytest.approx(8 / 9), 8, 9]
    assert rows["qualified (all pass)"] == [None, pytest.approx(3 / 9), 3, 9]
    reasons = {r[1]: (r[2], r[3]) for r in summary.reasons_table(counts).rows}
    # 6 rejected attempts; SUBTLE in 3 of them, SPILL in 1, the Edema text in 1, one without a reason
    assert reasons["change too subtle in the lung apex"] == (3, pytest.approx(3 / 6))
    assert reasons["hard edges at the lesion border"] == (3, pytest.approx(3 / 6))
    assert reasons["change spills outside the costophrenic angle"] == (1, pytest.approx(1 / 6))
    assert reasons["global intensity shift"] == (1, pytest.approx(1 / 6))
    assert reasons["edema still visible"] == (1, pytest.approx(1 / 6))
    assert len(reasons) == 5


def test_reason_phrases_normalise_clauses():
    assert reason_phrases("Structures outside the macula changed (SSIM 0.91). Hard edges.") == [
        "structures outside the macula changed", "hard edges"]
    assert reason_phrases("Covers 12% of the lung; covers 40% of the lung") == ["covers N of the lung"]
    assert reason_phrases("") == []


@pytest.mark.slow
def test_a_built_dataset_gives_the_same_tables_as_its_run(hand_run, tmp_path):
    build([hand_run], tmp_path / "ds", configs=["conversations"], quiet=True)
    from_run, from_dataset = summary.summarise([hand_run]), summary.summarise([tmp_path / "ds"])
    for make in (paper.table1, paper.table2):
        assert make(from_dataset.stats).rows == make(from_run.stats).rows
    assert summary.reasons_table(from_dataset).rows == summary.reasons_table(from_run).rows


def test_figure3_is_a_png_with_the_four_panels(hand_run, tmp_path):
    pytest.importorskip("matplotlib")
    counts = summary.summarise([hand_run])
    figure = paper.figure3(counts.stats)
    assert [ax.get_title(loc="left") for ax in figure.axes] == list(paper.PANEL_TITLES)
    path = paper.save_figure3(counts.stats, tmp_path / "f.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with Image.open(path) as im:
        im.verify()
        assert im.format == "PNG" and im.size[0] > 1000 and im.size[1] > 800


def stats_parser():
    parser = argparse.ArgumentParser(prog="medbanana")
    commands.register(parser.add_subparsers(dest="command"))
    return parser


def test_stats_command_writes_tables_figure_and_report(hand_run, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    args = stats_parser().parse_args(["stats", str(hand_run), "--out", str(tmp_path / "out")])
    assert args.func(args) == 0
    assert "6 tasks (3 success, 2 failed, 1 api_failed), 10 attempts" in capsys.readouterr().out
    out = tmp_path / "out"
    for name in ("table1.md", "table1.csv", "table2.md", "table2.csv", "failure_reasons.csv", "figure3.png",
                 "stats.json", "report.md"):
        assert (out / name).is_file(), name
    assert "| total |  | 5 | 3 | 2 | 1 | 60.0% | 2.00 |" in (out / "table1.md").read_text()
    assert "![Figure 3" in (out / "report.md").read_text()
    assert json.loads((out / "stats.json").read_text())["table1"][-1]["success"] == 3


def test_stats_writes_no_file_through_a_link(hand_run, tmp_path):
    """stats.json, report.md and figure3.png replace what a link left in the output folder points at, by a rename."""
    pytest.importorskip("matplotlib")
    out, outside = tmp_path / "out", tmp_path / "outside"
    out.mkdir()
    outside.mkdir()
    for i, name in enumerate(("stats.json", "report.md", "figure3.png")):
        (outside / name).write_text("precious")
        (os.link if i % 2 == 0 else os.symlink)(outside / name, out / name)
    args = stats_parser().parse_args(["stats", str(hand_run), "--out", str(out)])
    assert args.func(args) == 0
    assert [(outside / name).read_text() for name in ("stats.json", "report.md", "figure3.png")] == ["precious"] * 3
    assert json.loads((out / "stats.json").read_text())["table1"][-1]["success"] == 3


def test_stats_without_matplotlib_writes_the_tables_and_says_what_to_install(hand_run, tmp_path, monkeypatch,
                                                                            capsys):
    """Only Figure 3 needs matplotlib: the tables, stats.json and report.md are written, the figure is named as left
    out with the extra to install, and the report links no missing file."""
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    args = stats_parser().parse_args(["stats", str(hand_run), "--out", str(tmp_path / "out")])
    assert args.func(args) == 0
    printed = capsys.readouterr().out
    assert "figure3.png not drawn" in printed and "pip install 'medbanana[eval]'" in printed
    out = tmp_path / "out"
    assert "| total |  | 5 | 3 | 2 | 1 | 60.0% | 2.00 |" in (out / "table1.md").read_text()
    assert not (out / "figure3.png").exists()
    assert "![Figure 3" not in (out / "report.md").read_text()
    assert "not drawn" in json.loads((out / "stats.json").read_text())["figure3"]
