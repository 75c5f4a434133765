"""`medbanana build` on hostile run trees: nothing from outside the run (or --source-images) is read, only JPEG/PNG
images are embedded, malformed JSON is a clear error; `--unsafe skip` leaves the input out and lists it.

Each case plants a file holding MARKER outside the run (a valid JPEG, so that only containment stops it) or a
broken image inside it, runs the real CLI, and searches every value of the decoded parquet for MARKER.
"""

import io
import json
import os
import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from medbanana.builder.synthetic_run import make_synthetic_run
from medbanana.cli import main
from PIL import Image

MARKER = b"MEDBANANA-PLANTED-SECRET-7f3c9e"
DATASET = "mimic_ours_cxr"
EDIT = f"{DATASET}-edit"
CONV = "all_conversations.json"


def marked_jpeg(path: Path, size: int = 16) -> Path:
    """A valid JPEG (of noise: its entropy-coded data follows the header) carrying MARKER in a comment segment."""
    buf = io.BytesIO()
    Image.effect_noise((size, size), 60).convert("RGB").save(buf, "JPEG", comment=MARKER)
    assert MARKER in buf.getvalue()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(buf.getvalue())
    return path


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("containment")
    make_synthetic_run(root / "run", flavor="ours", tasks_per_folder=5, datasets=(DATASET,),
                       sources_dir=root / "sources", seed=7)
    return root


@pytest.fixture
def run(base, tmp_path) -> Path:
    shutil.copytree(base / "run", tmp_path / "run", symlinks=True)
    shutil.copytree(base / "sources", tmp_path / "sources", symlinks=True)
    return tmp_path / "run"


@pytest.fixture
def secret(tmp_path) -> Path:
    return marked_jpeg(tmp_path / "outside" / "secret.jpeg")


def conversations(run: Path, folder: str = EDIT) -> dict:
    return json.loads((run / folder / CONV).read_text())


def write_conversations(run: Path, data: dict, folder: str = EDIT) -> None:
    (run / folder / CONV).write_text(json.dumps(data, indent=2))


def accepted(run_or_data) -> tuple[str, dict]:
    """(key, entry) of the first accepted add task, in a run or in its conversations as loaded."""
    data = run_or_data if isinstance(run_or_data, dict) else conversations(run_or_data)
    return next((k, e) for k, e in data.items() if e["status"] == "success")


def build(tmp_path, capsys, *args, out="out"):
    """Run the CLI; (exit code, stderr, out folder)."""
    target = tmp_path / out
    code = main(["build", *map(str, args), "--out", str(target), "-q"])
    return code, capsys.readouterr().err, target


def assert_refused(code: int, err: str, out: Path, *names: str) -> None:
    assert code != 0
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("medbanana build: error:"), err
    assert "Traceback" not in err
    for name in names:
        assert name in err, (name, err)
    assert not out.exists() and not list(out.parent.glob(f".{out.name}.*"))  # nothing written to --out


def parquet_values(out: Path) -> list:
    """Every bytes and str value of every parquet file, nested structs and lists included."""
    found = []

    def collect(value):
        if isinstance(value, (bytes, str)):
            found.append(value)
        elif isinstance(value, dict):
            for item in value.values():
                collect(item)
        elif isinstance(value, list):
            for item in value:
                collect(item)

    for path in sorted(out.rglob("*.parquet")):
        for column in pq.read_table(path).columns:
            collect(column.to_pylist())
    return found


def assert_skipped(code: int, out: Path, *names: str, tasks_left_out: int | None = 1) -> dict:
    """A `--unsafe skip` build that succeeded, listed each refusal, and embedded no MARKER."""
    assert code == 0
    refused = json.loads((out / "medbanana-build.json").read_text())["stats"]["refused"]
    assert refused["count"] >= 1 and len(refused["items"]) == refused["count"]
    if tasks_left_out is not None:
        assert refused["tasks_left_out"] == tasks_left_out
    for name in names:
        assert any(name in item for item in refused["items"]), (name, refused["items"])
    assert "Refused inputs left out" in (out / "README.md").read_text()
    values = parquet_values(out)
    images = [v for v in values if isinstance(v, bytes)]
    assert images, "no image bytes in the build: the MARKER search would prove nothing"
    assert not any(MARKER in v for v in images)
    assert not any(MARKER.decode() in v for v in values if isinstance(v, str))
    return refused


def test_the_marker_search_finds_a_marker_inside_the_run_and_links_inside_the_run_are_followed(
        run, tmp_path, capsys):
    _, entry = accepted(run)
    image = run / entry["final_image"]
    marked_jpeg(run / "extra" / "marked.jpeg")
    image.unlink()
    image.symlink_to(os.path.relpath(run / "extra" / "marked.jpeg", image.parent))
    code, err, out = build(tmp_path, capsys, run)
    assert code == 0, err
    assert any(MARKER in v for v in parquet_values(out) if isinstance(v, bytes))
    info = json.loads((out / "medbanana-build.json").read_text())
    assert info["unsafe"] == "error" and info["stats"]["refused"]["count"] == 0


@pytest.mark.slow
def test_an_accepted_image_linked_outside_is_refused(run, secret, tmp_path, capsys):
    key, entry = accepted(run)
    image = run / entry["final_image"]
    image.unlink()
    image.symlink_to(secret)
    code, err, out = build(tmp_path, capsys, run)
    assert_refused(code, err, out, entry["final_image"], CONV, repr(key), "outside", "--unsafe skip")
    code, err, out = build(tmp_path, capsys, run, "--unsafe", "skip", out="skipped")
    assert "refused and left out" in err
    assert_skipped(code, out, entry["final_image"], repr(key))
    uids = [v for v in parquet_values(out) if isinstance(v, str) and v == entry["uid"]]
    assert not uids  # the task gives no row in any config
    code, err, out = build(tmp_path, capsys, run, "--workers", "2", out="parallel")  # told from a worker
    assert_refused(code, err, out, entry["final_image"], repr(key), "outside")
    code, err, out = build(tmp_path, capsys, run, "--workers", "2", "--unsafe", "skip", out="parallel-skipped")
    assert_skipped(code, out, entry["final_image"], repr(key))


@pytest.mark.slow
def test_a_class_folder_or_output_folder_linked_outside_is_refused(run, tmp_path, capsys):
    key, entry = accepted(run)
    disease = entry["disease"]
    outside = tmp_path / "outside-class"
    shutil.copytree(run / EDIT / disease, outside)
    for image in outside.glob("*.jpeg"):
        marked_jpeg(image)
    shutil.rmtree(run / EDIT / disease)
    (run / EDIT / disease).symlink_to(outside, target_is_directory=True)
    code, err, out = build(tmp_path, capsys, run)
    assert_refused(code, err, out, f"{EDIT}/{disease}/", repr(key), "outside", "through a symlink")
    code, err, out = build(tmp_path, capsys, run, "--unsafe", "skip", out="skipped")
    assert_skipped(code, out, repr(key), tasks_left_out=None)

    moved = tmp_path / "outside-edit"  # now the whole {D}-edit folder, JSON included, lives outside
    (run / EDIT).rename(moved)
    (run / EDIT).symlink_to(moved, target_is_directory=True)
    code, err, out = build(tmp_path, capsys, run, out="out2")
    assert_refused(code, err, out, EDIT, "outside")
    code, err, out = build(tmp_path, capsys, run, "--unsafe", "skip", out="skipped2")
    refused = assert_skipped(code, out, EDIT, tasks_left_out=0)
    assert refused["by_reason"] == {"outside its root": 1}
    assert not any(isinstance(v, str) and v.startswith(f"{DATASET}/add/") for v in parquet_values(out))


@pytest.mark.slow
@pytest.mark.parametrize("field", ["dataset", "dataset-absolute", "source_id", "task key", "disease"])
def test_json_fields_that_steer_paths_outside_are_refused(run, tmp_path, capsys, field):
    data = conversations(run)
    key, entry = accepted(data)
    if field == "dataset":
        entry["dataset"] = "../victim"
    elif field == "dataset-absolute":
        entry["dataset"] = str(tmp_path / "victim")
    elif field == "source_id":
        entry["source_id"] = "../../../../x"
    elif field == "disease":
        entry["disease"] = "../../x"
    else:  # the original scripts' entries: the source stem comes from the key
        for name in ("source_id", "image", "uid"):
            entry.pop(name)
        del data[key]
        progress = json.loads((run / EDIT / "progress.json").read_text())
        progress[f"../../../evil-{entry['disease']}"] = progress.pop(key)  # else a success with no entry: refused
        (run / EDIT / "progress.json").write_text(json.dumps(progress))
        key = f"../../../evil-{entry['disease']}"
    data[key] = entry
    write_conversations(run, data)
    word = "edit"
    relative = (f"{entry['dataset']}-{word}/{entry['disease']}/"
                f"{entry.get('source_id', key[:-len(entry['disease']) - 1])}-{entry['disease']}-{word}.jpeg")
    target = Path(os.path.normpath(run / relative))
    assert run not in target.parents and (tmp_path in target.parents or field == "source_id")
    marked_jpeg(target)  # what a build following the JSON would embed
    code, err, out = build(tmp_path, capsys, run)
    assert_refused(code, err, out, CONV, repr(key), "outside" if "absolute" not in field else "absolute path")
    code, err, out = build(tmp_path, capsys, run, "--unsafe", "skip", out="skipped")
    assert_skipped(code, out, repr(key))


def test_an_image_only_release_with_links_outside_is_refused(tmp_path, secret, capsys):
    release = tmp_path / "release"
    for i in range(2):
        marked = release / "Fundus-edit" / "AMD" / f"{i}_left-AMD-edit.jpeg"
        marked.parent.mkdir(parents=True, exist_ok=True)
        Image.new("RGB", (8, 8), (i, 0, 0)).save(marked, "JPEG")
    (release / "Fundus-edit" / "AMD" / "evil_left-AMD-edit.jpeg").symlink_to(secret)
    code, err, out = build(tmp_path, capsys, release)
    assert_refused(code, err, out, "evil_left-AMD-edit.jpeg", "Fundus-edit", "outside")
    code, err, out = build(tmp_path, capsys, release, "--unsafe", "skip", out="skipped")
    assert_skipped(code, out, "evil_left-AMD-edit.jpeg")

    (release / "Fundus-edit" / "AMD" / "evil_left-AMD-edit.jpeg").unlink()
    shutil.copytree(secret.parent, tmp_path / "outside-class")
    (tmp_path / "outside-class" / "secret.jpeg").rename(tmp_path / "outside-class" / "s_left-Glaucoma-edit.jpeg")
    (release / "Fundus-edit" / "Glaucoma").symlink_to(tmp_path / "outside-class", target_is_directory=True)
    code, err, out = build(tmp_path, capsys, release, out="out2")
    assert_refused(code, err, out, "Fundus-edit/Glaucoma", "outside")
    code, err, out = build(tmp_path, capsys, release, "--unsafe", "skip", out="skipped2")
    assert_skipped(code, out, "Fundus-edit/Glaucoma", tasks_left_out=0)


def test_a_source_image_linked_outside_is_refused(run, secret, tmp_path, capsys):
    _, entry = accepted(run)
    source = tmp_path / "sources" / entry["source_path"]
    source.unlink()
    source.symlink_to(secret)
    args = (run, "--source-images", tmp_path / "sources", "--configs", "sft")
    code, err, out = build(tmp_path, capsys, *args)
    assert_refused(code, err, out, entry["source_path"], "source images lookup", "outside")
    code, err, out = build(tmp_path, capsys, *args, "--unsafe", "skip", out="skipped")
    refused = assert_skipped(code, out, entry["source_path"], tasks_left_out=None)
    assert refused["tasks_left_out"] >= 1  # every task of that source (add tasks share normal sources)


def test_attach_sources_refuses_a_source_linked_outside(run, secret, tmp_path, capsys):
    from datasets import load_dataset
    from medbanana.loaders import attach_sources

    code, err, out = build(tmp_path, capsys, run, "--configs", "sft")
    assert code == 0, err
    _, entry = accepted(run)
    source = tmp_path / "sources" / entry["source_path"]
    source.unlink()
    source.symlink_to(secret)
    ds = load_dataset(str(out), "sft", split="train", cache_dir=str(tmp_path / "cache"))
    with pytest.raises(ValueError, match="outside"):
        attach_sources(ds, tmp_path / "sources")


def _truncated_png() -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (32, 32), (1, 2, 3)).save(buf, "PNG")
    return buf.getvalue()[:-20]


@pytest.mark.parametrize("content,reason", [
    (b"", "empty"),
    (b"hello " + MARKER + b"\n", "JPEG or PNG signature"),
    ("truncated-jpeg", "truncated JPEG"),
    (_truncated_png(), "cannot read it as PNG"),
    (b"\xff\xd8\xff\xe0" + MARKER, "cannot read it as JPEG"),
], ids=["empty", "text", "truncated-jpeg", "truncated-png", "jpeg-magic-then-text"])
def test_files_that_are_not_images_are_refused(run, tmp_path, capsys, content, reason):
    key, entry = accepted(run)
    image = run / entry["final_image"]
    if content == "truncated-jpeg":
        whole = marked_jpeg(tmp_path / "whole.jpeg", size=64).read_bytes()
        content = whole[: len(whole) - 200]  # inside the entropy-coded data: the header still reads
    image.write_bytes(content)
    code, err, out = build(tmp_path, capsys, run)
    assert_refused(code, err, out, entry["final_image"], repr(key), "not an image", reason)
    code, err, out = build(tmp_path, capsys, run, "--unsafe", "skip", out="skipped")
    refused = assert_skipped(code, out, entry["final_image"])
    assert refused["by_reason"] == {"not an image": 1}


@pytest.mark.slow
def test_records_and_run_config_linked_outside_are_refused(run, tmp_path, capsys):
    outside = tmp_path / "outside-records.jsonl"
    outside.write_text(json.dumps({"image_id": "x.jpeg", "dataset": DATASET, "disease": "Effusion",
                                   "task": "add"}) + "\n")
    records_run = tmp_path / "records-run"
    records_run.mkdir()
    (records_run / "records.jsonl").symlink_to(outside)
    code, err, out = build(tmp_path, capsys, records_run)
    assert_refused(code, err, out, "records.jsonl", "outside")

    config = run / "medbanana-run.json"
    (tmp_path / "outside-config.json").write_text(json.dumps({"max_rounds": 77}))
    config.unlink()
    config.symlink_to(tmp_path / "outside-config.json")
    code, err, out = build(tmp_path, capsys, run, out="out2")
    assert_refused(code, err, out, "medbanana-run.json", "outside")
    code, err, out = build(tmp_path, capsys, run, "--unsafe", "skip", out="skipped")
    assert_skipped(code, out, "medbanana-run.json", tasks_left_out=0)
    assert "up to 77 rounds" not in (out / "README.md").read_text()


@pytest.mark.slow
def test_a_records_line_steering_outside_is_refused(tmp_path, capsys):
    records_run = tmp_path / "records-run"
    records_run.mkdir()
    line = {"image_id": "n1.jpeg", "dataset": "../victim", "disease": "Effusion", "task": "add", "outcome": "success",
            "success_round": 1, "rounds": [{"round": 1, "instruction": "x", "verdict": {"qualified": True}}]}
    good = {**line, "dataset": DATASET, "image_id": "n2.jpeg"}
    (records_run / "records.jsonl").write_text(json.dumps(good) + "\n" + json.dumps(line) + "\n")
    marked_jpeg(tmp_path / "victim-edit" / "Effusion" / "n1-Effusion-edit.jpeg")
    good_image = records_run / f"{DATASET}-edit" / "Effusion" / "n2-Effusion-edit.jpeg"
    good_image.parent.mkdir(parents=True)
    Image.new("RGB", (8, 8)).save(good_image, "JPEG")
    code, err, out = build(tmp_path, capsys, records_run)
    assert_refused(code, err, out, "records.jsonl, line 2", "outside")
    code, err, out = build(tmp_path, capsys, records_run, "--unsafe", "skip", out="skipped")
    assert_skipped(code, out, "line 2")


# --- malformed JSON: one clear line naming the file, the entry and the field -----------------------------------

def _set(path: list, value):
    def change(entry):
        target = entry
        for step in path[:-1]:
            target = target[step]
        target[path[-1]] = value
    return change


MALFORMED = {
    "bogus task": (_set(["task"], "bogus"), "'task'"),
    "seed past 2**63": (_set(["seed"], 2**64), "$.seed"),
    "round past int32": (_set(["rounds", 0, "round"], 2**63), "$.rounds[0].round"),
    "models object": (_set(["models", "writer"], {"a": 1}), "$.models.writer"),
    "string success": (_set(["rounds", -1, "edit_result", "success"], "nope"), "'edit_result.success'"),
    "success_round not a round": (_set(["success_round"], 9), "'success_round'"),
    "verdict object": (_set(["rounds", -1, "verification", "qualified"], {"x": 1}), ".verification.qualified`"),
    "huge score": (_set(["rounds", -1, "verification", "score"], 10**400), "'verification.score'"),
    "status": (_set(["status"], "maybe"), "status 'maybe'"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_a_malformed_entry_is_a_clear_error_or_a_recorded_skip(run, tmp_path, capsys, case):
    change, field = MALFORMED[case]
    data = conversations(run)
    key, entry = accepted(data)
    change(entry)
    write_conversations(run, data)
    code, err, out = build(tmp_path, capsys, run)
    assert_refused(code, err, out, str(run / EDIT / CONV), repr(key), field)
    code, err, out = build(tmp_path, capsys, run, "--unsafe", "skip", out="skipped")
    refused = assert_skipped(code, out, repr(key))
    assert refused["by_reason"] == {"malformed entry": 1}


@pytest.mark.parametrize("case", ["non-utf8", "duplicate key", "syntax"])
def test_a_file_that_cannot_be_read_stops_the_build_whatever_the_policy(run, tmp_path, capsys, case):
    path = run / EDIT / CONV
    text = path.read_bytes()
    key, entry = accepted(run)
    if case == "non-utf8":  # in a thinking summary, which msgspec keeps raw: found before any row is written
        summary = entry["rounds"][0]["generate_prompt"]["thinking_summary"].encode()
        path.write_bytes(text.replace(summary, summary[:5] + b"\xff\xfe" + summary[5:], 1))
        names = (str(path), "not UTF-8")
    elif case == "duplicate key":
        twin = json.dumps({key: {**entry, "status": "failed"}})[1:-1]
        path.write_bytes(text.rstrip()[:-1].rstrip() + b",\n" + twin.encode() + b"\n}\n")
        names = (str(path), repr(key), "more than once")
    else:
        path.write_bytes(text[: len(text) // 2])
        names = (str(path),)
    for policy in ("error", "skip"):
        code, err, out = build(tmp_path, capsys, run, "--unsafe", policy, out=f"out-{policy}")
        assert_refused(code, err, out, *names)


def test_string_booleans_are_read_strictly(run, tmp_path, capsys):
    data = conversations(run)
    _, entry = next((k, e) for k, e in data.items() if e["status"] == "failed")
    entry["rounds"][-1]["edit_result"]["success"] = "false"  # truthy as a Python string: once counted a success
    write_conversations(run, data)
    code, err, out = build(tmp_path, capsys, run, "--configs", "conversations")
    assert code == 0, err
    rows = pq.read_table(next((out / "conversations").glob("*.parquet"))).to_pylist()
    row = next(r for r in rows if r["uid"] == entry["uid"])
    assert row["rounds"][-1]["edit_success"] is False and row["rounds"][-1]["image"] is None


def test_build_help_documents_the_policy(capsys):
    with pytest.raises(SystemExit):
        main(["build", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--unsafe {error,skip}" in text and "outside" in text and "not a JPEG or PNG" in text
