"""The dataset card, the manifest and `verify`, the CLI handlers, the loading builder and `attach_sources`."""

import argparse
import hashlib
import json
import shutil
from collections import Counter

import pytest
import yaml
from datasets import Image, load_dataset

from medbanana.builder import commands
from medbanana.builder.build import build
from medbanana.generation.dataset.configs import CONFIG_NAMES
from medbanana.generation.dataset.features import CONFIG_FEATURES
from medbanana.generation.dataset.manifest import MANIFEST, verify_manifest
from medbanana.loaders import attach_sources
from medbanana.medbanana_50k import MedBanana50k


def front_matter(readme: str) -> dict:
    assert readme.startswith("---\n")
    return yaml.safe_load(readme.split("---\n", 2)[1])


@pytest.fixture(scope="module")
def built(builder_ours_run, tmp_path_factory):
    out = tmp_path_factory.mktemp("card") / "ds"
    info = build([builder_ours_run], out, test_fraction=0.25, quiet=True)
    return out, info


def test_readme_declares_every_config_with_real_statistics(built, builder_ours_run, builder_counts):
    out, info = built
    readme = (out / "README.md").read_text()
    meta = front_matter(readme)
    declared = {c["config_name"]: c for c in meta["configs"]}
    assert set(declared) == {c for c, splits in info["configs"].items() if any(v["rows"] for v in splits.values())}
    assert declared["sft"].get("default") is True
    for name, config in declared.items():
        for item in config["data_files"]:
            assert list(out.glob(item["path"])), item  # every pattern matches shards
    infos = {i["config_name"]: i for i in meta["dataset_info"]}
    for name in declared:
        splits = {s["name"]: s["num_examples"] for s in infos[name]["splits"]}
        assert splits == {s: v["rows"] for s, v in info["configs"][name].items() if v["rows"]}
        assert [f["name"] for f in infos[name]["features"]] == list(CONFIG_FEATURES[name])
    assert meta["license"] == ["cc-by-4.0", "odc-by"] and "medical" in meta["tags"]
    counts = builder_counts(builder_ours_run)
    assert f"**{counts['tasks']:,} tasks**" in readme
    assert f"a task accepted at round k gives k-1 pairs, {counts['dpo_pairs']:,} in all" in readme
    for section in ("## Intended use", "## Out-of-scope use", "## Ethics and limitations", "## Licenses",
                    "CC BY 4.0", "ODC-By 1.0", 'load_dataset("<this repo or folder>", "judge"'):
        assert section in readme
    assert "${" not in readme


def test_manifest_lists_every_file_and_verify_catches_changes(built, tmp_path, capsys):
    out, _ = built
    listed = {line.split("  ", 1)[1] for line in (out / MANIFEST).read_text().splitlines()}
    on_disk = {p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file() and p.name != MANIFEST}
    assert listed == on_disk and "README.md" in listed
    assert verify_manifest(out).ok

    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    shard = next((copy / "sft").glob("*.parquet"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    (copy / "extra.txt").write_text("x")
    report = verify_manifest(copy)
    assert report.changed == [shard.relative_to(copy).as_posix()] and report.unlisted == ["extra.txt"]
    parser = argparse.ArgumentParser()
    commands.register(parser.add_subparsers())
    args = parser.parse_args(["verify", str(copy)])
    assert args.func(args) == 1 and "FAILED" in capsys.readouterr().out
    args = parser.parse_args(["verify", str(out)])
    assert args.func(args) == 0 and "OK" in capsys.readouterr().out


def test_cli_build_help_and_handler(builder_original_run, tmp_path, capsys):
    parser = argparse.ArgumentParser(prog="medbanana")
    commands.register(parser.add_subparsers())
    with pytest.raises(SystemExit):
        parser.parse_args(["build", "--help"])
    text = capsys.readouterr().out
    for option in ("--out", "--source-images", "--test-fraction", "--max-file-size", "--workers", "-q"):
        assert option in text
    with pytest.raises(SystemExit):
        parser.parse_args(["upload", "--help"])
    assert "--private" in capsys.readouterr().out
    args = parser.parse_args(["build", str(builder_original_run), "--out", str(tmp_path / "o"), "-q",
                              "--configs", "sft,conversations", "--max-file-size", "1MB"])
    assert args.func(args) == 0
    assert sorted(p.name for p in (tmp_path / "o").iterdir() if p.is_dir()) == ["conversations", "sft"]
    args = parser.parse_args(["build", str(tmp_path / "nowhere"), "--out", str(tmp_path / "o2"), "-q"])
    assert args.func(args) == 2
    assert "not found" in capsys.readouterr().err and not (tmp_path / "o2").exists()


@pytest.mark.parametrize("config", ["dpo_pairs", "conversations"])
def test_loading_builder_yields_the_rows_of_the_parquet_build(built, builder_ours_run, tmp_path, config):
    out, _ = built
    builder = MedBanana50k(config_name=config, data_dir=str(builder_ours_run), cache_dir=str(tmp_path),
                           test_fraction=0.25)
    builder.download_and_prepare()
    direct = builder.as_dataset()
    published = load_dataset(str(out), config, cache_dir=str(tmp_path / "c"))
    assert set(direct) == set(published)
    for split in published:
        a, b = direct[split], published[split]
        assert sorted(a["uid"]) == sorted(b["uid"]) and a.features == b.features
    if config == "dpo_pairs":
        a = direct["train"].cast_column("chosen_image", Image(decode=False))["chosen_image"]
        b = published["train"].cast_column("chosen_image", Image(decode=False))["chosen_image"]
        digest = lambda images: sorted(hashlib.sha256(i["bytes"]).hexdigest() for i in images)  # noqa: E731
        assert digest(a) == digest(b)


def test_attach_sources_fills_source_images_later_without_touching_edits(built, builder_ours_run, tmp_path):
    out, _ = built
    ds = load_dataset(str(out), "judge", split="train", cache_dir=str(tmp_path))
    assert all(s is None for s in ds.cast_column("source_image", Image(decode=False))["source_image"])
    sources = builder_ours_run.parent / "sources"
    attached = attach_sources(ds, sources)
    raw = attached.cast_column("source_image", Image(decode=False))
    for row, image in zip(ds.remove_columns(["source_image", "edited_image"]), raw["source_image"]):
        assert image["bytes"] == (sources / row["source_path"]).read_bytes()
    before = ds.cast_column("edited_image", Image(decode=False))["edited_image"]
    assert raw.cast_column("edited_image", Image(decode=False))["edited_image"] == before
    with pytest.raises(ValueError, match="no source image"):
        attach_sources(ds, tmp_path, strict=True)
    with pytest.raises(ValueError, match="no source_image column"):
        attach_sources(load_dataset(str(out), "conversations", split="train", cache_dir=str(tmp_path)), sources)
    both = attach_sources(load_dataset(str(out), "sft", cache_dir=str(tmp_path)), sources)
    assert set(both) == {"train", "test"} and both["test"][0]["source_image"] is not None
    streamed = load_dataset(str(out), "dpo_pairs", split="train", streaming=True)
    streamed = streamed.cast_column("chosen_image", Image(decode=False))
    row = next(iter(attach_sources(streamed, sources)))
    assert row["source_image"].size and row["chosen_image"]["bytes"][:2] == b"\xff\xd8"  # decoded; JPEG kept


def test_build_info_records_runs_and_statistics(built):
    out, info = built
    on_disk = json.loads((out / "medbanana-build.json").read_text())
    assert on_disk == info
    assert set(info["configs"]) == set(CONFIG_NAMES)
    assert info["stats"]["missing_images"] == 0
    assert info["stats"]["edit_errors"] > 0  # the ours flavour has editor refusals
    assert sum(r["count"] for r in info["stats"]["success_rounds"]) == sum(
        v["rows"] for v in info["configs"]["sft"].values())


def paper_table1_from_json(run_dir) -> dict:
    """Table 1 rows (modality, direction) -> markdown cells, counted from the run's JSON with the json module."""
    groups = {}
    for out in sorted(p for p in run_dir.iterdir() if p.name.endswith(("-edit", "-remove"))):
        conversations = json.loads((out / "all_conversations.json").read_text())
        progress = json.loads((out / "progress.json").read_text())
        modality = next(iter(conversations.values()))["modality"]
        group = groups.setdefault((modality, "add" if out.name.endswith("-edit") else "remove"),
                                  {"diseases": set(), "success": 0, "failed": 0, "api_failed": 0, "rounds": []})
        for key, status in progress.items():
            group["diseases"].add((modality, key.split("-", 1)[1]))
            group[status] += 1
            if status == "success":
                group["rounds"].append(len(conversations[key]["rounds"]))
    total = {"diseases": set().union(*(g["diseases"] for g in groups.values())),
             **{k: sum(g[k] for g in groups.values()) for k in ("success", "failed", "api_failed")},
             "rounds": [r for g in groups.values() for r in g["rounds"]]}

    def cells(g):
        decided = g["success"] + g["failed"]
        rate = f"{g['success'] / decided:.1%}" if decided else "–"
        mean = f"{sum(g['rounds']) / len(g['rounds']):.2f}" if g["rounds"] else "–"
        return f"{len(g['diseases'])} | {g['success']} | {g['failed']} | {g['api_failed']} | {rate} | {mean} |"

    return {**{key: f"| {key[0]} | {key[1]} | {cells(g)}" for key, g in groups.items()},
            ("total", ""): f"| total |  | {cells(total)}"}


def test_readme_embeds_table1_table2_and_figure3_listed_in_the_manifest(built, builder_ours_run):
    from PIL import Image as PILImage

    from medbanana.builder.reasons import reason_phrases

    out, info = built
    readme = (out / "README.md").read_text()
    for row in paper_table1_from_json(builder_ours_run).values():
        assert row in readme, row
    assert "### Table 2: rubric dimensions over all judged attempts" in readme
    # the most frequent failure reason, ties broken alphabetically, counted from the JSON
    reasons, rejected = Counter(), 0
    for conversations in builder_ours_run.glob("*/all_conversations.json"):
        for entry in json.loads(conversations.read_text()).values():
            for r in entry["rounds"]:
                if r["verification"] is not None and r["verification"]["qualified"] is False:
                    rejected += 1
                    reasons.update(set(reason_phrases(r["verification"]["reason"] or "")))
    top, n = min(reasons.items(), key=lambda kv: (-kv[1], kv[0]))
    assert f"| 1 | {top} | {n} | {n / rejected:.1%} |" in readme
    assert "](figure3.png)" in readme and info["figure"] == "figure3.png"
    figure = out / "figure3.png"
    with PILImage.open(figure) as im:
        im.verify()
        assert im.format == "PNG"
    listed = dict(reversed(line.split("  ", 1)) for line in (out / MANIFEST).read_text().splitlines())
    assert listed["figure3.png"] == hashlib.sha256(figure.read_bytes()).hexdigest()
    assert verify_manifest(out).ok


def test_card_counts_synthetic_content_marks_and_needs_no_matplotlib(builder_ours_run, tmp_path, monkeypatch):
    from medbanana.builder import build as build_module
    from medbanana.generation.rundir.provenance import mark_synthetic

    run = tmp_path / "run"
    shutil.copytree(builder_ours_run, run)
    images = sorted(run.glob("*/**/*.jp*g"))
    for image in images[::2]:
        image.write_bytes(mark_synthetic(image.read_bytes(), "r1", source_type="compositeSynthetic"))

    def no_matplotlib():
        raise ImportError("no matplotlib here")

    monkeypatch.setattr(build_module, "require_matplotlib", no_matplotlib)
    with pytest.warns(UserWarning, match="no Figure 3"):
        info = build([run], tmp_path / "ds", configs=["judge"], quiet=True)
    readme = (tmp_path / "ds" / "README.md").read_text()
    marked = len(images[::2])
    assert f"{marked:,} of the {len(images):,} edited images carry the mark" in readme
    assert f"digitalsourcetype/compositeSynthetic`: {marked:,} images" in readme
    assert info["figure"] is None and not (tmp_path / "ds" / "figure3.png").exists()
    assert "figure3.png" not in readme and "### Table 1" in readme
    assert verify_manifest(tmp_path / "ds").ok
