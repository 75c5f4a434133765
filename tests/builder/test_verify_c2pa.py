"""`medbanana verify --c2pa` over a dataset built from a signed run, and over the run itself; the card's paragraph;
signed images swapped between tasks and rounds on disk, reported `mismatched` (issue 26, item 8)."""

import hashlib
import json
import shutil

import pytest

pytest.importorskip("c2pa")
pytest.importorskip("cryptography")

import pyarrow.parquet as pq  # noqa: E402

from signed_runs import make_keys, one_scan_byte_changed, signed_run, without_manifest  # noqa: E402
from medbanana.cli import main  # noqa: E402


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    from medbanana.generation.backends.simulator.phantoms import write_demo_sources

    root = tmp_path_factory.mktemp("c2pa-build")
    keys = make_keys(root / "keys")
    write_demo_sources(root / "sources", n_normal=1, n_diseased=1, size=256)
    assert signed_run(root / "sources", root / "run", keys, "--limit", "8") == 0
    assert main(["build", str(root / "run"), "--out", str(root / "ds"), "-q"]) == 0
    return root, keys


@pytest.fixture(scope="module")
def swapped(built, tmp_path_factory):
    """A copy of the run with two tasks' accepted images exchanged, and two rounds of one task exchanged: the four
    images keep valid signatures from the same signer. Returns (run copy, {relative path: its bytes now})."""
    root, _ = built
    run = tmp_path_factory.mktemp("swapped") / "run"
    shutil.copytree(root / "run", run)
    images = {}  # uid -> {(round, accepted): image path}
    for line in (run / "medbanana-journal.jsonl").read_text().splitlines():
        entry = json.loads(line)
        if entry["type"] == "task":
            images[entry["uid"]] = {(r["round"], r["accepted"]): r["image"] for r in entry["record"]["rounds"]
                                    if r["image"]}
    accepted = [next(rel for (_, ok), rel in rounds.items() if ok) for rounds in images.values()
                if any(ok for _, ok in rounds)]
    failed = next(sorted(rel for (_, ok), rel in rounds.items() if not ok) for rounds in images.values()
                  if sum(not ok for _, ok in rounds) >= 2)
    changed = {}
    for a, b in (accepted[:2], failed[:2]):
        data_a, data_b = (run / a).read_bytes(), (run / b).read_bytes()
        (run / a).write_bytes(data_b)
        (run / b).write_bytes(data_a)
        changed.update({a: data_b, b: data_a})
    return run, changed


def mismatched_lines(out: str) -> list[str]:
    return [line.removeprefix("  mismatched: ") for line in out.splitlines() if line.startswith("  mismatched: ")]


@pytest.mark.slow
def test_verify_counts_every_generated_image_valid_and_the_card_names_the_certificate(built, capsys):
    root, keys = built
    assert main(["verify", str(root / "ds"), "--c2pa", "--trust", str(keys.ca), "--workers", "2"]) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if "C2PA:" in x)
    assert " 0 untrusted, 0 invalid, 0 missing" in line and not line.split("checked")[0].endswith(" 0 image(s) ")
    card = (root / "ds" / "README.md").read_text()
    assert keys.fingerprint in card and "Signed Content Credentials (C2PA)" in card
    assert main(["verify", "--run", str(root / "run"), "--trust", str(keys.ca)]) == 0


@pytest.mark.slow
def test_verify_names_untrusted_tampered_and_stripped_rows(built, tmp_path, capsys):
    root, keys = built
    other = make_keys(tmp_path / "other")
    assert main(["verify", str(root / "ds"), "--trust", str(other.ca), "--workers", "1"]) == 1
    assert "0 valid" in capsys.readouterr().out
    # a copy of the sft shard with row 0's image changed in one byte of its scan and row 1's manifest stripped
    ds = tmp_path / "ds"
    (ds / "sft").mkdir(parents=True)
    shard = next((root / "ds" / "sft").glob("*.parquet"))
    table = pq.read_table(shard)
    images = table.column("edited_image").to_pylist()
    assert len(images) >= 2
    images[0] = {**images[0], "bytes": one_scan_byte_changed(images[0]["bytes"])}
    images[1] = {**images[1], "bytes": without_manifest(images[1]["bytes"])}
    index = table.schema.get_field_index("edited_image")
    tampered = table.set_column(index, table.schema.field(index), [images])
    pq.write_table(tampered, ds / "sft" / shard.name)
    assert main(["verify", str(ds), "--c2pa", "--trust", str(keys.ca)]) == 1  # no SHA256SUMS: said, then checked
    out = capsys.readouterr().out
    assert "1 invalid, 1 missing" in out and f"sft/{shard.name} row 0 edited_image" in out
    out = _verify_dataset_c2pa(ds, keys.ca)
    assert out.counts["invalid"] == 1 and out.counts["missing"] == 1
    assert out.rows["invalid"] == [f"sft/{shard.name} row 0 edited_image"]
    assert out.rows["missing"] == [f"sft/{shard.name} row 1 edited_image"]
    assert "assertion.dataHash.mismatch" in out.failures


def _verify_dataset_c2pa(folder, ca):
    from medbanana.builder.c2pa_check import dataset_images, verify_c2pa

    return verify_c2pa(dataset_images(folder), trust=ca, workers=1)


@pytest.mark.slow
def test_a_stripped_image_in_a_run_is_missing(built, tmp_path, capsys):
    root, keys = built
    run = tmp_path / "run"
    shutil.copytree(root / "run", run)
    image = next(p for p in run.rglob("*.jpeg") if "-failed" not in p.parent.parent.name)
    image.write_bytes(without_manifest(image.read_bytes()))
    assert main(["verify", "--run", str(run), "--trust", str(keys.ca)]) == 1
    out = capsys.readouterr().out
    assert "1 missing" in out and image.relative_to(run).as_posix() in out


@pytest.mark.slow
def test_images_swapped_between_tasks_and_rounds_of_a_run_are_mismatched(built, swapped, capsys):
    root, keys = built
    run, changed = swapped
    assert main(["verify", "--run", str(run), "--trust", str(keys.ca)]) == 1
    out = capsys.readouterr().out
    total = sum(1 for p in run.rglob("*.jpeg"))
    assert f"{total - 4} valid, 0 untrusted, 0 invalid, 0 missing, 4 mismatched" in out
    lines = mismatched_lines(out)
    assert sorted(line.split(": ", 1)[0] for line in lines) == sorted(changed)
    tasks = [line for line in lines if "task_uid signed" in line]
    rounds = [line for line in lines if "round signed" in line]
    assert len(tasks) == 2 and len(rounds) == 2 and all("instruction_sha256 signed" in line for line in lines)
    assert all("task_uid" not in line for line in rounds)  # the same task's rounds: only round and instruction differ
    # the untouched run: every image valid, compared with its journal line
    assert main(["verify", "--run", str(root / "run"), "--trust", str(keys.ca)]) == 0
    assert "0 mismatched" in capsys.readouterr().out


@pytest.mark.slow
def test_a_dataset_built_from_swapped_images_names_each_mismatched_row(built, swapped, tmp_path, capsys):
    root, keys = built
    run, changed = swapped
    assert main(["build", str(run), "--out", str(tmp_path / "ds"), "-q"]) == 0
    assert main(["verify", str(tmp_path / "ds"), "--c2pa", "--trust", str(keys.ca)]) == 1
    out = capsys.readouterr().out
    assert out.startswith("OK: ")  # the files match their checksums; the images sit in the wrong rows
    swapped_digests = {hashlib.sha256(data).hexdigest() for data in changed.values()}
    rows, expected = 0, set()  # read back independently: every row holding one of the four images
    for shard in sorted((tmp_path / "ds").rglob("*.parquet")):
        table = pq.read_table(shard).to_pylist()
        for i, row in enumerate(table):
            for column in ("edited_image", "chosen_image", "rejected_image"):
                if (row.get(column) or {}).get("bytes"):
                    rows += 1
                    if hashlib.sha256(row[column]["bytes"]).hexdigest() in swapped_digests:
                        expected.add(f"{shard.relative_to(tmp_path / 'ds').as_posix()} row {i} {column}")
    assert len(expected) >= 4
    assert f"{rows - len(expected)} valid, 0 untrusted, 0 invalid, 0 missing, {len(expected)} mismatched" in out
    shown = [line.split(": ", 1)[0] for line in mismatched_lines(out)]
    assert set(shown) <= expected and len(shown) == min(len(expected), 10)


@pytest.mark.slow
def test_a_row_whose_embedded_source_is_another_scan_is_mismatched(built, tmp_path, capsys):
    root, keys = built
    assert main(["build", str(root / "run"), "--out", str(tmp_path / "ds"), "--source-images", str(root / "sources"),
                 "-q"]) == 0
    assert main(["verify", str(tmp_path / "ds"), "--c2pa", "--trust", str(keys.ca)]) == 0  # sources compared, equal
    shard = next((tmp_path / "ds" / "sft").glob("*.parquet"))
    table = pq.read_table(shard)
    sources = table.column("source_image").to_pylist()
    other = next(i for i, s in enumerate(sources) if s["bytes"] != sources[0]["bytes"])
    sources[0] = sources[other]
    index = table.schema.get_field_index("source_image")
    pq.write_table(table.set_column(index, table.schema.field(index), [sources]), shard)
    capsys.readouterr()
    assert main(["verify", str(tmp_path / "ds"), "--c2pa", "--trust", str(keys.ca)]) == 1
    lines = mismatched_lines(capsys.readouterr().out)
    assert len(lines) == 1 and lines[0].startswith(f"sft/{shard.name} row 0 edited_image: source_sha256 signed ")


def test_every_generated_image_column_is_compared_with_its_row():
    from medbanana.builder.c2pa_check import SIGNED_COLUMNS
    from medbanana.generation.dataset.features import CONFIG_FEATURES, MASKS, image_columns

    for config in CONFIG_FEATURES:  # sources are not ours, masks are computed by the build: neither is signed
        assert set(SIGNED_COLUMNS.get(config, {})) == set(image_columns(config)) - {"source_image", *MASKS}, config


@pytest.mark.slow
def test_an_image_no_journal_line_names_is_mismatched_and_a_run_without_journal_is_said(built, tmp_path, capsys):
    root, keys = built
    run = tmp_path / "run"
    shutil.copytree(root / "run", run)
    image = next(p for p in sorted(run.rglob("*.jpeg")) if "-failed" not in p.parent.parent.name)
    extra = image.with_name("extra_scan-" + image.name.split("-", 1)[1])
    shutil.copyfile(image, extra)
    assert main(["verify", "--run", str(run), "--trust", str(keys.ca)]) == 1
    lines = mismatched_lines(capsys.readouterr().out)
    assert lines == [f"{extra.relative_to(run).as_posix()}: no journal line names this image"]
    extra.unlink()
    config = json.loads((run / "medbanana-run.json").read_text())
    (run / "medbanana-run.json").write_text(json.dumps({**config, "run_id": "another-run"}))
    assert main(["verify", "--run", str(run), "--trust", str(keys.ca)]) == 1  # the images were signed by another run
    out = capsys.readouterr().out
    lines = mismatched_lines(out)
    assert f"0 valid, 0 untrusted, 0 invalid, 0 missing, {len(list(run.rglob('*.jpeg')))} mismatched" in out
    assert lines and all(f"run_id signed '{config['run_id']}', recorded 'another-run'" in x for x in lines)
    (tmp_path / "elsewhere.jsonl").write_text("")
    (run / "medbanana-journal.jsonl").unlink()
    (run / "medbanana-journal.jsonl").symlink_to(tmp_path / "elsewhere.jsonl")
    assert main(["verify", "--run", str(run), "--trust", str(keys.ca)]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "medbanana-journal.jsonl" in err and "outside" in err
    (run / "medbanana-journal.jsonl").unlink()
    assert main(["verify", "--run", str(run), "--trust", str(keys.ca)]) == 0  # intact, but nothing to compare with
    out = capsys.readouterr().out
    assert "0 mismatched" in out and "have no record (medbanana-journal.jsonl)" in out


@pytest.mark.slow
def test_a_merged_run_of_shards_signed_under_their_own_run_ids_is_valid(built, tmp_path, capsys):
    root, keys = built
    shards = [tmp_path / f"shard{i}" for i in (0, 1)]
    for i, shard in enumerate(shards):
        assert signed_run(root / "sources", shard, keys, "--limit", "4", "--shard", f"{i}/2") == 0
    run_ids = {json.loads((s / "medbanana-run.json").read_text())["run_id"] for s in shards}
    assert len(run_ids) == 2  # each shard signed its images with its own run id
    assert main(["merge", "--out", str(tmp_path / "merged"), *map(str, shards)]) == 0
    capsys.readouterr()
    assert main(["verify", "--run", str(tmp_path / "merged"), "--trust", str(keys.ca)]) == 0
    assert "0 invalid, 0 missing, 0 mismatched" in capsys.readouterr().out
    # a shard's image in another shard's task's place is still mismatched in the merged run
    accepted = sorted(p for p in (tmp_path / "merged").rglob("*.jpeg") if "-failed" not in p.parent.parent.name)
    first, second = accepted[0].read_bytes(), accepted[-1].read_bytes()
    accepted[0].write_bytes(second)
    accepted[-1].write_bytes(first)
    assert main(["verify", "--run", str(tmp_path / "merged"), "--trust", str(keys.ca)]) == 1
    assert len(mismatched_lines(capsys.readouterr().out)) == 2
