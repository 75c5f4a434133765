"""`medbanana build`: row counts against the JSON, identity columns, nulls, byte identity, splits, shards."""

import hashlib
import json
import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from datasets import Image, load_dataset

from medbanana.builder.build import build
from medbanana.generation.dataset.output import BuildError
from medbanana.generation.dataset.configs import CONFIG_NAMES
from medbanana.generation.dataset.features import CONFIG_FEATURES
from medbanana.generation.rundir import layout
from paths import SHARED_SAMPLES



def load(folder, config, cache, split=None):
    return load_dataset(str(folder), config, split=split, cache_dir=str(cache))


def raw_images(ds, column):
    return ds.cast_column(column, Image(decode=False))[column]


@pytest.fixture(scope="module")
def built_both(builder_original_run, builder_ours_run, tmp_path_factory):
    out = tmp_path_factory.mktemp("built") / "medbanana-50k"
    info = build([builder_original_run, builder_ours_run], out, max_shard_size="150KB", quiet=True)
    return out, info


@pytest.mark.slow
def test_every_config_loads_with_the_row_counts_the_json_implies(built_both, builder_original_run,
                                                                  builder_ours_run, builder_counts, tmp_path):
    out, info = built_both
    expected = {k: builder_counts(builder_original_run)[k] + builder_counts(builder_ours_run)[k]
                for k in CONFIG_NAMES}
    assert expected["dpo_pairs"] > 0 and expected["failed"] > expected["sft"] > 0
    for config in CONFIG_NAMES:
        ds = load(out, config, tmp_path, split="train")
        assert len(ds) == expected[config], config
        assert info["configs"][config]["train"]["rows"] == expected[config]
        assert set(ds.features) == set(CONFIG_FEATURES[config])
    assert not list(out.rglob("*.py"))  # nothing trips datasets' "scripts are no longer supported"


def test_identity_columns_and_nulls_of_released_data(built_both, builder_original_run, tmp_path):
    out, _ = built_both
    sft = load(out, "sft", tmp_path, split="train").remove_columns(["edited_image", "source_image"])
    released = [r for r in sft if r["dataset"] == "MIMIC_synthetic_cxr"]
    assert released and all(r["modality"] == "chest_xray" for r in released)
    for row in released:
        assert row["uid"] == f"{row['dataset']}/{row['task']}/{row['source_id']}-{row['disease']}"
        assert row["fidelity_preserved"] is None and row["score"] is None  # the original judge had neither
        assert row["qualified"] is True and row["reason"]
    ours = [r for r in sft if r["dataset"].endswith("_ours_mri")]
    assert ours and all(r["modality"] == "brain_mri" and r["score"] is not None for r in ours)
    assert all(r["source_path"].startswith(r["dataset"] + "/") for r in ours)
    conversations = load(out, "conversations", tmp_path, split="train")
    api_failed = [r for r in conversations if r["status"] == "api_failed"]
    assert api_failed and all(r["rounds"] == [] and r["api_failure"]["step"] == "edit_image" for r in api_failed)
    success = [r for r in conversations if r["status"] == "success"]
    assert all(r["success_round"] == r["num_rounds"] and r["rounds"][-1]["accepted"] for r in success)
    # every text of every round, as the JSON has it
    source = json.loads((builder_original_run / "MIMIC_synthetic_cxr-remove" / "all_conversations.json").read_text())
    rows = {r["uid"].rsplit("/", 1)[1]: r for r in conversations if r["dataset"] == "MIMIC_synthetic_cxr"
            and r["task"] == "remove"}
    assert set(source) <= set(rows)
    for key, entry in source.items():
        got = rows[key]["rounds"]
        assert [g["instruction"] for g in got] == [r["generate_prompt"]["prompt"] for r in entry["rounds"]]
        assert [g["writer_thinking"] for g in got] == [r["generate_prompt"]["thinking_summary"]
                                                       for r in entry["rounds"]]
        assert [(g["judge_thinking"], g["reason"]) for g in got] == [
            (r["verification"]["thinking_summary"], r["verification"]["reason"]) for r in entry["rounds"]]


def test_images_are_the_original_jpeg_bytes(built_both, builder_original_run, builder_ours_run, tmp_path):
    out, _ = built_both
    runs = {"MIMIC_synthetic_cxr": builder_original_run, "mimic_ours_cxr": builder_ours_run}
    checked = 0
    for config, columns in (("sft", ["edited_image"]), ("failed", ["edited_image"]),
                            ("dpo_pairs", ["chosen_image", "rejected_image"])):
        ds = load(out, config, tmp_path, split="train")
        for column in columns:
            for row, image in zip(ds.remove_columns([c for c in ds.column_names if "image" in c]), raw_images(ds, column)):
                if image is None or row["dataset"] not in runs:
                    continue
                run = runs[row["dataset"]]
                accepted = column != "rejected_image" and config != "failed"
                number = row.get("success_round") if accepted else row.get("round", row.get("rejected_round"))
                rel = layout.attempt_image_relpath(row["dataset"], row["task"], row["source_id"], row["disease"],
                                                   number, accepted)
                assert image["path"] == rel
                assert hashlib.sha256(image["bytes"]).digest() == hashlib.sha256((run / rel).read_bytes()).digest()
                checked += 1
    assert checked > 40


def test_editor_refusals_are_failed_rows_without_image_and_not_judged(built_both, tmp_path):
    out, _ = built_both
    failed = load(out, "failed", tmp_path, split="train")
    refused = [i for i, e in enumerate(failed["edit_error"]) if e]
    assert refused
    images = raw_images(failed, "edited_image")
    assert all(images[i] is None and failed[i]["qualified"] is None for i in refused)
    judge = load(out, "judge", tmp_path, split="train")
    assert all(row is not None for row in raw_images(judge, "edited_image"))


def test_dpo_pairs_come_from_one_task_with_history_before_the_rejected_round(built_both, tmp_path):
    out, _ = built_both
    pairs = load(out, "dpo_pairs", tmp_path, split="train").remove_columns(
        ["source_image", "chosen_image", "rejected_image"])
    for row in pairs:
        assert row["rejected_round"] < row["chosen_round"]
        assert row["chosen_verdict"]["qualified"] and not row["rejected_verdict"]["qualified"]
        assert [h["round"] for h in row["history"]] == list(range(1, row["rejected_round"]))
        verb = "Add" if row["task"] == "add" else "Remove"
        assert row["prompt"].startswith(verb) and row["prompt"].endswith(".")


def test_shards_are_bounded_named_for_the_hub_and_carry_the_features(built_both):
    out, info = built_both
    shards = sorted((out / "judge").glob("train-*.parquet"))
    assert len(shards) >= 2
    n = len(shards)
    assert [s.name for s in shards] == [f"train-{i:05d}-of-{n:05d}.parquet" for i in range(n)]
    for shard in shards:
        meta = pq.ParquetFile(shard)
        assert shard.stat().st_size <= 150_000 + 20_000  # one row group may overshoot by its last rows
        assert all(meta.metadata.row_group(i).num_rows <= 100 for i in range(meta.num_row_groups))
        features = json.loads(meta.schema_arrow.metadata[b"huggingface"])["info"]["features"]
        assert features["edited_image"]["_type"] == "Image"


@pytest.mark.slow
def test_test_split_never_shares_a_source_image(builder_original_run, tmp_path):
    out = tmp_path / "split"
    info = build([builder_original_run], out, test_fraction=0.3, quiet=True)
    for config in ("sft", "failed", "conversations", "judge"):
        ds = load(out, config, tmp_path / "cache")
        train, test = set(ds["train"]["source_id"]), set(ds["test"]["source_id"])
        assert train and test and not train & test, config
        assert len(ds["train"]) + len(ds["test"]) == sum(v["rows"] for v in info["configs"][config].values())


@pytest.mark.slow
def test_parallel_build_writes_the_same_rows(builder_ours_run, tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    build([builder_ours_run], one, quiet=True, configs=["failed", "conversations"])
    build([builder_ours_run], two, quiet=True, configs=["failed", "conversations"], num_proc=2)
    for config, key in (("failed", ["uid", "round"]), ("conversations", ["uid"])):
        a = load(one, config, tmp_path / "c", split="train").to_pandas()
        b = load(two, config, tmp_path / "c", split="train").to_pandas()
        a, b = (df.sort_values(key).reset_index(drop=True) for df in (a, b))
        assert a[key].equals(b[key]), config
    imgs = load(two, "failed", tmp_path / "c", split="train").cast_column("edited_image", Image(decode=False))
    assert sorted(i["path"] for i in imgs["edited_image"] if i) == sorted(
        i["path"] for i in load(one, "failed", tmp_path / "c", split="train").cast_column(
            "edited_image", Image(decode=False))["edited_image"] if i)


def test_partition_plan_covers_every_task_once(builder_ours_run):
    from medbanana.builder.build import discover_all, plan_partitions
    from medbanana.generation.rundir.runs import read_tasks

    units = discover_all([builder_ours_run])
    all_uids = sorted(t.uid for u in units for t in read_tasks(u))
    for parts in (1, 4, len(units) + 3):
        plan = plan_partitions(units, parts)
        assert len(plan) == min(parts, len(all_uids))
        uids = sorted(t.uid for items in plan for unit, block, blocks in items
                      for t in read_tasks(unit, block, blocks))
        assert uids == all_uids, parts
        if parts <= len(units):  # whole units: each JSON file is decoded by one worker only
            assert all(blocks == 1 for items in plan for _u, _b, blocks in items)


@pytest.mark.slow
def test_source_images_are_embedded_only_when_asked(builder_ours_run, tmp_path):
    sources = builder_ours_run.parent / "sources"
    out = tmp_path / "with-sources"
    build([builder_ours_run], out, source_images=sources, configs=["sft"], quiet=True)
    ds = load(out, "sft", tmp_path / "c", split="train")
    images = raw_images(ds, "source_image")
    assert all(images)
    for row, image in zip(ds.remove_columns(["source_image", "edited_image"]), images):
        assert image["bytes"] == (sources / row["source_path"]).read_bytes()


def test_missing_image_files_give_null_images_and_are_reported(builder_original_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(builder_original_run, run)
    victim = next(run.glob("*-edit-failed/*/*-failed-1.jpeg"))
    victim.unlink()
    info = build([run], tmp_path / "out", configs=["failed"], quiet=True)
    assert info["stats"]["missing_images"] == 1
    assert info["stats"]["missing_image_examples"][0].endswith(victim.name)
    failed = load(tmp_path / "out", "failed", tmp_path / "c", split="train")
    paths = [i["path"] if i else None for i in raw_images(failed, "edited_image")]
    assert paths.count(None) == 1 and victim.relative_to(run).as_posix() not in paths


@pytest.mark.slow
def test_output_folder_rules(builder_original_run, tmp_path):
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(BuildError, match="not empty"):
        build([builder_original_run], foreign, quiet=True)
    assert (foreign / "notes.txt").read_text() == "mine"
    out = tmp_path / "medbanana_50k"  # named like the loading builder module: must still load
    build([builder_original_run], out, configs=["sft"], quiet=True)
    build([builder_original_run], out, configs=["conversations"], quiet=True)  # replaces the earlier build
    assert not (out / "sft").exists() and (out / "conversations").is_dir()
    assert not list(tmp_path.glob(".medbanana_50k.*"))  # no staging left behind
    assert len(load(out, "conversations", tmp_path / "c", split="train")) > 0
    with pytest.raises(BuildError, match="is in both"):
        build([builder_original_run, builder_original_run], tmp_path / "twice", quiet=True)
    with pytest.raises(BuildError, match="no .*-edit"):
        build([tmp_path / "foreign"], tmp_path / "x", quiet=True)
    broken = tmp_path / "broken"
    shutil.copytree(builder_original_run, broken)
    (broken / "MIMIC_synthetic_cxr-edit" / "all_conversations.json").write_text('{"a": {"rounds": [{"round": "x"')
    with pytest.raises(BuildError, match="MIMIC_synthetic_cxr-edit/all_conversations.json"):
        build([broken], tmp_path / "y", quiet=True)
    assert not (tmp_path / "y").exists() and not list(tmp_path.glob(".y.*"))


def test_a_killed_builds_staging_folder_goes_with_the_next_build(builder_original_run, tmp_path):
    """A build killed with SIGKILL leaves `.NAME.building-PID` beside --out; the next build of that folder (which
    holds its write lock, so no live build owns it) removes it, and nothing of other folders' builds."""
    out = tmp_path / "ds"
    stale = tmp_path / ".ds.building-999999"
    (stale / "sft").mkdir(parents=True)
    (stale / "sft" / "train-00000-of-00001.parquet").write_bytes(b"half a shard")
    others = [tmp_path / ".ds2.building-999999", tmp_path / ".ds.building-notapid"]
    for folder in others:
        folder.mkdir()
    build([builder_original_run], out, configs=["sft"], quiet=True)
    assert (out / "sft").is_dir() and not stale.exists()
    assert all(folder.is_dir() for folder in others)  # another folder's build, and a name no build makes


def _records_from_json(run: Path) -> list[dict]:
    """The paper's §5.2 records, derived from a run's all_conversations.json."""
    records = []
    for out in sorted(p for p in run.iterdir() if p.name.endswith(("-edit", "-remove"))):
        dataset, word = out.name.rsplit("-", 1)
        for entry in json.loads((out / "all_conversations.json").read_text()).values():
            rounds = [{"round": r["round"], "instruction": r["generate_prompt"]["prompt"],
                       "verdict": {k: r["verification"][k] for k in ("has_disease", "structure_reasonable",
                                                                     "looks_realistic", "qualified", "reason")}}
                      for r in entry["rounds"]]
            records.append({"image_id": entry["image"].rsplit(".", 1)[0], "dataset": dataset,
                            "modality": "chest_xray" if "MIMIC" in dataset else None, "disease": entry["disease"],
                            "task": "add" if word == "edit" else "remove", "rounds": rounds,
                            "outcome": entry["status"],
                            "success_round": len(rounds) if entry["status"] == "success" else None,
                            "output_path": "elsewhere/not/used.jpeg"})
    return records


@pytest.mark.slow
def test_paper_record_schema_builds_the_same_sft_and_pairs(builder_original_run, builder_counts, tmp_path):
    run = tmp_path / "records-run"
    shutil.copytree(builder_original_run, run, ignore=shutil.ignore_patterns("*.json"))
    records = _records_from_json(builder_original_run)
    (run / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    build([run], tmp_path / "out", configs=["sft", "dpo_pairs", "judge"], quiet=True)
    expected = builder_counts(builder_original_run)
    for config in ("sft", "dpo_pairs", "judge"):
        assert len(load(tmp_path / "out", config, tmp_path / "c", split="train")) == expected[config], config
    sft = load(tmp_path / "out", "sft", tmp_path / "c", split="train")
    assert set(sft["modality"]) == {"chest_xray", "brain_mri", "fundus"}  # null modality inferred from folder
    assert all(raw_images(sft, "edited_image"))


def test_image_only_release_folder_builds_sft(builder_original_run, tmp_path):
    release = tmp_path / "release"
    for src in builder_original_run.glob("*-edit/*/*.jpeg"):
        dst = release / src.relative_to(builder_original_run).as_posix().replace("MIMIC_synthetic_cxr", "Chest-XRay")
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(src, dst)
    n_files = len(list(release.rglob("*.jpeg")))
    build([release], tmp_path / "out", quiet=True)
    sft = load(tmp_path / "out", "sft", tmp_path / "c", split="train")
    assert len(sft) == n_files
    with pytest.raises(ValueError, match="sft"):  # no pairs without rounds: not declared, datasets says so
        load(tmp_path / "out", "dpo_pairs", tmp_path / "c")
    assert "`dpo_pairs` train" in (tmp_path / "out" / "README.md").read_text()
    rows = sft.remove_columns(["edited_image", "source_image"])
    assert all(r["instruction"] is None and r["success_round"] is None for r in rows)
    assert {r["modality"] for r in rows if r["dataset"] == "Chest-XRay"} == {"chest_xray"}


@pytest.mark.skipif(not SHARED_SAMPLES.is_dir(), reason="../shared/samples (released sample edits) not present")
def test_released_sample_folders_build_byte_identical(tmp_path):
    build([SHARED_SAMPLES], tmp_path / "out", configs=["sft"], quiet=True)
    sft = load(tmp_path / "out", "sft", tmp_path / "c", split="train")
    files = sorted(p for p in SHARED_SAMPLES.rglob("*") if p.suffix.lower() in (".jpeg", ".jpg"))
    assert len(sft) == len(files)
    by_path = {i["path"]: i["bytes"] for i in raw_images(sft, "edited_image")}
    for path in files:
        assert by_path[path.relative_to(SHARED_SAMPLES).as_posix()] == path.read_bytes()
    assert set(sft["modality"]) == {"chest_xray", "brain_mri", "fundus"}
    assert sft[0]["edited_image"].size == (1024, 1024)
