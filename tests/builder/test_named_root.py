"""Issue #26, items 1 and 6: the root is the folder the user named, and inconsistent records are refused.

Each case builds a hostile tree on disk (a JSON `dataset` naming another folder, a `..` source id, an image or a
`-failed` folder linked outside, a recorded `sources_root` pointing elsewhere, records that disagree with each
other), runs the real CLI (`medbanana build`, `medbanana eval`) and searches what it wrote for MARKER, planted only
outside the folder named (helpers shared with test_build_containment).
"""

import json
import os
import shutil
from pathlib import Path

import pytest
from medbanana.cli import main
from test_build_containment import (DATASET, EDIT, MARKER, accepted, assert_refused, base, build,  # noqa: F401
                                    conversations, marked_jpeg, parquet_values, run, write_conversations)

FAILED = f"{EDIT}-failed"


def info_of(out: Path) -> dict:
    return json.loads((out / "medbanana-build.json").read_text())


def images_in(out: Path) -> list[bytes]:
    found = [v for v in parquet_values(out) if isinstance(v, bytes)]
    assert found, "no image bytes in the build: the MARKER search would prove nothing"
    return found


def marker_in(out: Path) -> bool:
    return any(MARKER in v for v in images_in(out))


def image_of(entry: dict, dataset: str, source_id: str) -> str:
    """The accepted image path the layout gives an add entry with this dataset and source id."""
    disease = entry["disease"]
    return f"{dataset}-edit/{disease}/{source_id}-{disease}-edit.jpeg"


# --- item 1: the folder named is the root ----------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("field", ["dataset", "source_id"])
def test_a_named_edit_folder_is_the_root_not_its_run(run, tmp_path, capsys, field):
    data = conversations(run)
    key, entry = accepted(data)
    if field == "dataset":  # another output folder of the same run
        entry["dataset"] = "Other"
        planted = run / image_of(entry, "Other", entry["source_id"])
    else:  # a folder of the run that is no output folder
        entry["source_id"] = "../../private/x"
        planted = Path(os.path.normpath(run / image_of(entry, DATASET, "../../private/x")))
        assert planted == run / "private" / f"x-{entry['disease']}-edit.jpeg"
    write_conversations(run, data)
    marked_jpeg(planted)

    code, err, out = build(tmp_path, capsys, run / EDIT)
    assert_refused(code, err, out, repr(key), "outside", str(run / EDIT))
    code, err, out = build(tmp_path, capsys, run / EDIT, "--unsafe", "skip", out="skipped")
    assert code == 0, err
    refused = info_of(out)["stats"]["refused"]
    assert refused["by_reason"] == {"outside its root": 1} and refused["tasks_left_out"] == 1
    assert not marker_in(out)
    assert not any(str(run / "private") in v or "Other-edit" in v for v in parquet_values(out) if isinstance(v, str))

    # the same tree given whole: the planted file is inside what was named, and read (the search finds it)
    code, err, out = build(tmp_path, capsys, run, out="whole")
    assert code == 0, err
    assert marker_in(out)


@pytest.mark.slow
def test_a_named_folder_reads_its_failed_sibling_but_not_one_linked_out(run, tmp_path, capsys):
    code, err, out = build(tmp_path, capsys, run / EDIT, "--configs", "failed")
    assert code == 0, err
    failed_rows = [v for v in parquet_values(out) if isinstance(v, str) and v.startswith(f"{FAILED}/")]
    assert failed_rows and images_in(out)  # rejected attempts come from {D}-edit-failed

    outside = tmp_path / "outside-failed"
    shutil.move(run / FAILED, outside)
    for image in outside.rglob("*.jpeg"):
        marked_jpeg(image)
    (run / FAILED).symlink_to(outside, target_is_directory=True)
    code, err, out = build(tmp_path, capsys, run / EDIT, "--configs", "failed", out="linked")
    assert_refused(code, err, out, FAILED, "outside", "through a symlink")
    code, err, out = build(tmp_path, capsys, run / EDIT, "--configs", "failed", "--unsafe", "skip", out="skipped")
    assert code == 0, err
    assert info_of(out)["stats"]["refused"]["count"] >= 1
    assert not any(MARKER in v for v in parquet_values(out) if isinstance(v, bytes))


def test_a_named_folder_does_not_read_its_runs_config(run, tmp_path, capsys):
    config = json.loads((run / "medbanana-run.json").read_text())
    (run / "medbanana-run.json").write_text(json.dumps({**config, "max_rounds": 77}))
    code, err, out = build(tmp_path, capsys, run / EDIT, "--configs", "sft")
    assert code == 0, err
    assert "up to 77 rounds" not in (out / "README.md").read_text()
    code, err, out = build(tmp_path, capsys, run, "--configs", "sft", out="whole")
    assert code == 0, err
    assert "up to 77 rounds" in (out / "README.md").read_text()  # the phrase the card would use


def eval_cli(capsys, *args) -> tuple[int, str]:
    code = main(["eval", *map(str, args), "--judge", "none", "--no-lpips", "-q"])
    return code, capsys.readouterr().err


def eval_records(out: Path) -> dict[str, dict]:
    return {r["id"]: r for r in map(json.loads, (out / "samples.jsonl").read_text().splitlines())}


def test_eval_does_not_score_an_image_linked_outside(run, tmp_path, capsys):
    _, entry = accepted(run)
    image = run / entry["final_image"]
    image.unlink()
    image.symlink_to(marked_jpeg(tmp_path / "outside" / "secret.jpeg"))
    out = tmp_path / "eval"
    eval_cli(capsys, run, "--source-images", tmp_path / "sources", "--out", out)
    records = eval_records(out)
    bad = records[f"{entry['uid']}#{entry['success_round']}"]
    assert bad["status"] == "error" and "outside" in bad["error"] and entry["final_image"] in bad["error"]
    assert "psnr" not in bad and any(r["status"] == "ok" for r in records.values())


def test_eval_of_a_named_folder_refuses_a_dataset_naming_another_folder(run, tmp_path, capsys):
    data = conversations(run)
    key, entry = accepted(data)
    entry["dataset"] = "Other"
    write_conversations(run, data)
    marked_jpeg(run / image_of(entry, "Other", entry["source_id"]))
    out = tmp_path / "eval"
    code, err = eval_cli(capsys, run / EDIT, "--source-images", tmp_path / "sources", "--out", out)
    assert code == 2 and "Traceback" not in err
    line = next(line for line in err.splitlines() if "error" in line)
    assert line.startswith("medbanana eval: error:") and repr(key) in line and "outside" in line


def test_eval_model_outputs_are_looked_up_inside_edits_only(run, tmp_path, capsys):
    data = conversations(run)
    _, entry = accepted(data)
    entry["uid"] = "../outside/secret"
    write_conversations(run, data)
    marked_jpeg(tmp_path / "outside" / "secret.jpeg")  # = EDITS/../outside/secret.jpeg
    (tmp_path / "edits").mkdir()
    out = tmp_path / "eval"
    eval_cli(capsys, run, "--source-images", tmp_path / "sources", "--edits", tmp_path / "edits", "--out", out)
    bad = eval_records(out)[f"../outside/secret#{entry['success_round']}"]
    assert bad["status"] == "error" and "outside" in bad["error"]


def test_a_recorded_sources_root_is_named_not_followed(run, tmp_path, capsys):
    elsewhere = tmp_path / "elsewhere-sources"
    shutil.move(tmp_path / "sources", elsewhere)
    config = json.loads((run / "medbanana-run.json").read_text())
    (run / "medbanana-run.json").write_text(json.dumps({**config, "sources_root": str(elsewhere)}))
    out = tmp_path / "eval"
    code, err = eval_cli(capsys, run, "--out", out)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert err.startswith("medbanana eval: error:") and "not followed" in err
    assert f"--source-images {elsewhere}" in err
    assert not out.exists()  # nothing scored, nothing written
    code, err = eval_cli(capsys, run, "--source-images", elsewhere, "--out", out)  # confirmed by the user
    assert code == 0, err
    assert all(r["status"] == "ok" for r in eval_records(out).values())

    from medbanana.evaluation.inputs import open_samples  # what `review` reads: it still uses it, said each time
    with pytest.warns(UserWarning, match="sources_root"):
        assert all(s.problem is None for s in open_samples(run))
    strict = list(open_samples(run, follow_recorded_sources=False))
    assert strict and all("not followed" in s.problem and s.source is None for s in strict)


def test_attach_sources_ignores_a_source_path_naming_a_file_outside(run, tmp_path, capsys):
    from datasets import load_dataset
    from medbanana.loaders import attach_sources

    data = conversations(run)
    _, entry = accepted(data)
    secret = marked_jpeg(tmp_path / "outside" / f"{entry['source_id']}.jpeg")
    entry["source_path"] = os.path.relpath(secret, tmp_path / "sources")  # ../outside/<stem>.jpeg
    write_conversations(run, data)
    for found in (tmp_path / "sources").rglob(f"{entry['source_id']}.*"):
        found.unlink()  # its own source gone: only the path outside could match
    code, err, out = build(tmp_path, capsys, run, "--configs", "sft")
    assert code == 0, err
    ds = load_dataset(str(out), "sft", split="train", cache_dir=str(tmp_path / "cache"))
    with pytest.warns(UserWarning, match="keep a null source_image"):
        filled = attach_sources(ds, tmp_path / "sources")
    row = next(r for r in filled if r["uid"] == entry["uid"])
    assert row["source_image"] is None
    assert any(r["source_image"] is not None for r in filled)


# --- item 6: inconsistent records ------------------------------------------------------------------------------

def _success_round_edit_failed(run: Path) -> str:
    data = conversations(run)
    key, entry = accepted(data)
    entry["rounds"][-1]["edit_result"] = {"success": False, "error": "refused"}
    write_conversations(run, data)
    return key


def _success_without_entry(run: Path) -> str:
    data = conversations(run)
    key, _ = accepted(data)
    del data[key]
    write_conversations(run, data)
    return key


@pytest.mark.parametrize("case,words", [
    (_success_round_edit_failed, ("'success_round'", "edit failed")),
    (_success_without_entry, ("progress.json", "status 'success'", "no entry")),
], ids=["success-round-edit-failed", "success-without-entry"])
def test_inconsistent_records_are_refused_or_left_out_and_listed(run, tmp_path, capsys, case, words):
    key = case(run)
    code, err, out = build(tmp_path, capsys, run)
    assert_refused(code, err, out, repr(key), *words)
    code, err, out = build(tmp_path, capsys, run, "--unsafe", "skip", out="skipped")
    assert code == 0, err
    refused = info_of(out)["stats"]["refused"]
    assert refused["by_reason"] == {"inconsistent entry": 1} and refused["tasks_left_out"] == 1
    assert any(repr(key) in item for item in refused["items"])
    assert "Refused inputs left out" in (out / "README.md").read_text()
    uid = f"{DATASET}/add/{key}"
    assert uid not in [v for v in parquet_values(out) if isinstance(v, str)]


@pytest.mark.slow
def test_coerced_verdict_values_are_counted_and_named_once_per_field(run, tmp_path, capsys):
    code, err, out = build(tmp_path, capsys, run, "--configs", "conversations")
    assert code == 0 and info_of(out)["stats"]["coerced"] == {} and "read as booleans" not in err

    data = conversations(run)
    judged = [r["verification"] for e in data.values() for r in e["rounds"] if r.get("verification")]
    judged[0]["qualified"], judged[1]["qualified"] = "maybe", "high"
    judged[2]["has_disease"] = 7
    judged[3]["looks_realistic"] = "yes"  # a yes/no word: read, not coerced
    write_conversations(run, data)
    code, err, out = build(tmp_path, capsys, run, "--configs", "conversations", out="coerced")
    assert code == 0, err
    coerced = info_of(out)["stats"]["coerced"]
    assert coerced == {"has_disease": {"count": 1, "examples": {"7": True}},
                       "qualified": {"count": 2, "examples": {"'high'": False, "'maybe'": False}}}
    lines = [line for line in err.splitlines() if "read as booleans" in line]
    assert len(lines) == 2
    assert "'has_disease'" in lines[0] and "7 as true" in lines[0]
    assert "'qualified'" in lines[1] and "'maybe' as false" in lines[1] and "2 judge value(s)" in lines[1]
    assert "were read as booleans: 1 `has_disease`, 2 `qualified`" in (out / "README.md").read_text()
