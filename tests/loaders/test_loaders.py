"""Loaders: load_medbanana, to_pandas and the per-example converters (their doctests run here too)."""

import doctest
import io
import json
import os
import sys
from pathlib import Path

import datasets
import numpy as np
import pytest
from PIL import Image

from medbanana.generation.dataset.configs import CONFIG_NAMES
from medbanana.generation.dataset.features import CONFIG_FEATURES
from medbanana.generation.records import VERDICT_FIELDS
from medbanana.generation.prompts import parse_verdict
from medbanana.loaders import (attach_sources, convert, load_medbanana, to_diffusion_dpo, to_editor_sft,
                               to_judge_sft, to_pandas, to_refiner_dpo)
from medbanana.loaders import hub as hub_module
from medbanana.loaders import trl as trl_module


def jpeg(seed: int, size: int = 48) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 255, (size, size, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="JPEG", quality=90)
    return buf.getvalue()


def verdict(qualified: bool, **overrides) -> dict:
    base = {"qualified": qualified, "has_disease": qualified, "structure_reasonable": True, "looks_realistic": True,
            "fidelity_preserved": True, "score": 0.9 if qualified else 0.3,
            "reason": "effusion is clear" if qualified else "no fluid visible at the base"}
    return {**base, **overrides}


IDENTITY = {"uid": "MIMIC_x/add/n1-Pleural_Effusion", "source_id": "n1", "dataset": "MIMIC_x",
            "modality": "chest_xray", "disease": "Pleural_Effusion", "task": "add",
            "source_path": "MIMIC_x/normal/n1.jpg"}


def dpo_rows(source: bytes | None = jpeg(1)) -> dict:
    """Two pairs of one task accepted at round 3: rejected round 1 (no history) and round 2 (round 1 in history)."""
    first = {"round": 1, "instruction": "Add a little fluid.", "edit_error": None, **verdict(False)}
    rows = []
    for rejected_round, history in ((1, []), (2, [first])):
        rows.append({**IDENTITY, "prompt": "Add Pleural Effusion to this chest X-ray.", "history": history,
                     "source_image": None if source is None else {"bytes": source, "path": None},
                     "chosen_image": {"bytes": jpeg(2), "path": None},
                     "rejected_image": {"bytes": jpeg(3), "path": None} if rejected_round == 1 else None,
                     "chosen_instruction": "Blunt the right costophrenic angle with a meniscus.",
                     "rejected_instruction": f"Attempt {rejected_round}: add fluid.", "chosen_round": 3,
                     "rejected_round": rejected_round,
                     "rejected_edit_error": None if rejected_round == 1 else "IMAGE_SAFETY",
                     "chosen_verdict": verdict(True), "rejected_verdict": verdict(False)})
    return {name: [row[name] for row in rows] for name in CONFIG_FEATURES["dpo_pairs"]}


def judge_rows(source: bytes | None = jpeg(1)) -> dict:
    rows = [{**IDENTITY, "round": 1, "instruction": "Add a little fluid.", "accepted": False,
             "source_image": None if source is None else {"bytes": source, "path": None},
             "edited_image": {"bytes": jpeg(5, size=40), "path": None}, **verdict(False, fidelity_preserved=None),
             "judge_thinking": "", "judge_model": "gemini-2.5-pro"}]
    return {name: [row.get(name) for row in rows] for name in CONFIG_FEATURES["judge"]}


@pytest.mark.parametrize("module", [trl_module, hub_module])
def test_doctests_pass(module):
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0


def test_refiner_dpo_feeds_the_writer_prompt_with_history_and_keeps_image_bytes():
    ds = datasets.Dataset.from_dict(dpo_rows(), features=CONFIG_FEATURES["dpo_pairs"])
    out = convert(ds, to_refiner_dpo)
    assert out.column_names == ["images", "prompt", "chosen", "rejected"]
    raw = out.cast_column("images", datasets.List(datasets.Image(decode=False)))
    assert raw[0]["images"][0]["bytes"] == jpeg(1)  # passed on, not decoded and re-encoded
    first, second = out[0], out[1]
    assert isinstance(first["images"][0], Image.Image) and first["images"][0].size == (48, 48)
    assert [m["role"] for m in first["prompt"]] == ["user"]
    assert first["chosen"] == [{"role": "assistant", "content": "Blunt the right costophrenic angle with a meniscus."}]
    assert first["rejected"][0]["content"] == "Attempt 1: add fluid."
    assert "Pleural Effusion" in first["prompt"][0]["content"]
    assert "no fluid visible at the base" not in first["prompt"][0]["content"]  # round 1: nothing before it
    history = second["prompt"][0]["content"]
    assert "Add a little fluid." in history and "no fluid visible at the base" in history
    assert first["prompt"][0]["content"] != history


def test_max_side_shrinks_images_and_leaves_small_ones_as_they_are():
    ds = datasets.Dataset.from_dict(dpo_rows(), features=CONFIG_FEATURES["dpo_pairs"])
    small = convert(ds, to_refiner_dpo, max_side=16)
    assert small[0]["images"][0].size == (16, 16)
    stored = small.cast_column("images", datasets.List(datasets.Image(decode=False)))[0]["images"][0]["bytes"]
    assert stored[:2] == b"\xff\xd8"  # a shrunk JPEG stays JPEG
    decoded = {"source_image": Image.open(io.BytesIO(jpeg(1))), "chosen_instruction": "a",
               "rejected_instruction": "b", "modality": "chest_xray", "disease": "Pleural_Effusion", "task": "add",
               "history": []}
    assert to_refiner_dpo(decoded, max_side=16)["images"][0].size == (16, 16)
    assert decoded["source_image"].size == (48, 48)  # the caller's image is left alone
    untouched = convert(ds, to_refiner_dpo, max_side=64).cast_column(
        "images", datasets.List(datasets.Image(decode=False)))
    assert untouched[0]["images"][0]["bytes"] == jpeg(1)


def test_a_missing_source_image_says_to_attach_sources():
    ds = datasets.Dataset.from_dict(dpo_rows(source=None), features=CONFIG_FEATURES["dpo_pairs"])
    with pytest.raises(ValueError, match="attach_sources"):
        convert(ds, to_refiner_dpo)


def test_a_converter_on_the_wrong_config_names_the_right_one():
    ds = datasets.Dataset.from_dict(judge_rows(), features=CONFIG_FEATURES["judge"])
    with pytest.raises(ValueError, match="needs the dpo_pairs config"):
        convert(ds, to_refiner_dpo)


def test_judge_sft_answers_a_verdict_the_pipeline_parser_accepts():
    ds = datasets.Dataset.from_dict(judge_rows(), features=CONFIG_FEATURES["judge"])
    example = convert(ds, to_judge_sft)[0]
    assert sorted(example) == ["completion", "images", "prompt"]
    source, edited = example["images"]
    assert (source.size, edited.size) == ((48, 48), (40, 40))  # order: source first, as the judge prompt says
    assert "Add a little fluid." in example["prompt"][0]["content"]
    answer = json.loads(example["completion"][0]["content"])
    assert "fidelity_preserved" not in answer  # null in the data: left out, never guessed
    assert answer == {k: v for k, v in verdict(False).items() if k not in ("score", "fidelity_preserved")}
    full = convert(ds.map(lambda _: {"fidelity_preserved": False}), to_judge_sft)[0]["completion"][0]["content"]
    parsed = parse_verdict(full)
    assert (parsed.qualified, parsed.fidelity_preserved) == (False, False)
    assert parsed.reason == "no fluid visible at the base"
    messages = convert(ds, to_judge_sft, as_messages=True)[0]["messages"]
    assert [m["role"] for m in messages] == ["user", "assistant"]


def test_editor_and_diffusion_converters_give_the_image_editing_columns():
    sft = {**{k: [v] for k, v in IDENTITY.items()}, "instruction": ["Add fluid at the right base."],
           "source_image": [{"bytes": jpeg(1), "path": None}], "edited_image": [{"bytes": jpeg(2), "path": None}],
           "edit_mask": [None], "region_mask": [None],  # a build without sources: no masks, no alignment
           "aligned": [None], "shift_px": [None], "scale": [None], "rotation_deg": [None],
           "success_round": [1], **{f: [verdict(True)[f]] for f in VERDICT_FIELDS}}
    edits = convert(datasets.Dataset.from_dict(sft, features=CONFIG_FEATURES["sft"]), to_editor_sft)
    assert edits.column_names == ["original_image", "edit_prompt", "edited_image"]
    assert edits[0]["edit_prompt"] == "Add fluid at the right base."
    pairs = datasets.Dataset.from_dict(dpo_rows(), features=CONFIG_FEATURES["dpo_pairs"])
    with pytest.raises(ValueError, match="drop such rows first"):  # row 2: the editor refused, no rejected image
        convert(pairs, to_diffusion_dpo)
    kept = pairs.filter(lambda image: image is not None, input_columns=["rejected_image"])
    out = convert(kept, to_diffusion_dpo)
    assert out.column_names == ["original_image", "edit_prompt", "chosen_image", "rejected_image"]
    assert out[0]["edit_prompt"] == "Add Pleural Effusion to this chest X-ray."
    assert convert(kept, to_diffusion_dpo, prompt="chosen")[0]["edit_prompt"].startswith("Blunt")


def test_to_pandas_never_decodes_images():
    rows = judge_rows()
    rows["edited_image"] = [{"bytes": b"not an image at all", "path": None}]
    ds = datasets.Dataset.from_dict(rows, features=CONFIG_FEATURES["judge"])
    df = to_pandas(ds)
    assert "edited_image" not in df and "source_image" not in df
    assert df.loc[0, "instruction"] == "Add a little fluid." and not df.loc[0, "qualified"]
    both = to_pandas(datasets.DatasetDict({"train": ds, "test": ds}))
    assert sorted(both.split) == ["test", "train"]
    streamed = to_pandas(ds.to_iterable_dataset())
    assert list(streamed.instruction) == ["Add a little fluid."]


# ---------------------------------------------------------------- on a real build

@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """A synthetic run (our flavour) built twice: with sources embedded, and without (as for MIMIC data)."""
    from medbanana.builder.build import build
    from medbanana.builder.synthetic_run import make_synthetic_run

    root = tmp_path_factory.mktemp("loaders")
    make_synthetic_run(root / "run", flavor="ours", tasks_per_folder=6, image_size=40,
                       sources_dir=root / "sources", seed=11)
    build([root / "run"], root / "with", source_images=root / "sources", quiet=True)
    build([root / "run"], root / "without", quiet=True)
    return root


@pytest.mark.slow
def test_load_medbanana_checks_the_config_and_the_folder(built):
    for config in CONFIG_NAMES:  # what a build without --reviews holds (tests/builder/test_build_reviews.py: more)
        ds = load_medbanana(built / "with", config)
        assert isinstance(ds, datasets.Dataset) and set(ds.column_names) == set(CONFIG_FEATURES[config])
    with pytest.raises(ValueError, match="--reviews"):
        load_medbanana(built / "with", "human_review")
    with pytest.raises(ValueError, match="dpo_pairs"):
        load_medbanana(built / "with", "pairs")
    with pytest.raises(ValueError, match="build it first"):
        load_medbanana(built / "run", "sft")
    assert isinstance(load_medbanana(built / "with", "sft", split=None), datasets.DatasetDict)
    raw = load_medbanana(built / "with", "sft", decode_images=False)[0]
    assert set(raw["edited_image"]) == {"bytes", "path"} and raw["edited_image"]["bytes"][:2] == b"\xff\xd8"


def test_released_data_without_sources_converts_after_attach_sources(built):
    judge = load_medbanana(built / "without", "judge")
    assert judge.num_rows > 0 and all(v is None for v in judge.select_columns(["source_image"])["source_image"])
    with pytest.raises(ValueError, match="attach_sources"):
        convert(judge, to_judge_sft)
    attached = convert(attach_sources(judge, built / "sources"), to_judge_sft)
    assert attached.num_rows == judge.num_rows
    assert all(len(images) == 2 for images in attached.select_columns(["images"])["images"])


def test_streaming_loads_and_converts_without_materialising(built):
    pairs = load_medbanana(built / "with", "dpo_pairs", streaming=True)
    assert isinstance(pairs, datasets.IterableDataset)
    first = next(iter(convert(pairs, to_refiner_dpo)))
    assert sorted(first) == ["chosen", "images", "prompt", "rejected"]
    assert isinstance(first["images"][0], Image.Image)


def test_success_rate_per_disease_from_to_pandas_matches_the_json(built):
    df = to_pandas(load_medbanana(built / "with", "conversations"))
    rates = df.assign(ok=df.status.eq("success")).groupby(["modality", "disease"]).ok.mean()
    statuses = {}
    for progress in (built / "run").glob("*-*/progress.json"):
        for key, status in json.loads(progress.read_text()).items():
            statuses.setdefault(key.split("-", 1)[1], []).append(status == "success")
    assert {d: r for (_, d), r in rates.items()} == {d: sum(v) / len(v) for d, v in statuses.items()}


def test_recipes_without_the_training_stack_say_how_to_install_it(monkeypatch):
    from medbanana.dpo import editor_diffusion_dpo, judge_sft, refiner_dpo  # importable without torch

    monkeypatch.setitem(sys.modules, "trl", None)  # as if not installed
    for recipe in (refiner_dpo, judge_sft, editor_diffusion_dpo):
        with pytest.raises(ImportError, match=r"pip install 'medbanana\[train\]'"):
            recipe.make_parser()


@pytest.mark.slow
def test_a_folder_rewritten_in_place_loads_its_new_rows_and_an_unchanged_one_reuses_the_cache(demo_dataset, tmp_path,
                                                                                                 monkeypatch):
    """datasets 5.x keys a local folder's cache on its name and its card's YAML (schema, counts, sizes) alone: a
    shard rewritten under an unchanged card, as a rebuild in place with the same counts and sizes leaves it, must
    not load the earlier rows (the copy's name, `dataset`, is also the session's demo dataset's)."""
    import shutil

    shutil.copytree(demo_dataset, tmp_path / "dataset")
    monkeypatch.chdir(tmp_path)
    folder = Path("dataset")  # relative, as a user types it
    first = load_medbanana(folder, "sft")
    assert load_medbanana(folder, "sft").cache_files == first.cache_files  # unchanged: the same cache
    (shard,) = (folder / "sft").glob("*.parquet")
    card = (folder / "README.md").read_bytes()
    changed = datasets.Dataset.from_parquet(str(shard), cache_dir=str(tmp_path / "cache"))
    changed = changed.map(lambda row, i: {"instruction": f"rewritten {i}"}, with_indices=True)
    changed.to_parquet(str(shard))
    assert (folder / "README.md").read_bytes() == card
    again = load_medbanana(folder, "sft")
    assert again.num_rows == first.num_rows and again.cache_files != first.cache_files
    assert again["instruction"] == [f"rewritten {i}" for i in range(first.num_rows)]


@pytest.mark.slow
def test_a_name_that_is_no_folder_here_fails_at_once_with_what_to_do(tmp_path):
    """A bare name from another folder is refused naming the folder it looked in; an ORG/NAME id with the Hub out
    of reach (here a port nothing listens on) is one ConnectionError saying how to load a build or the cached copy,
    not datasets' five tries and a silently returned stale copy."""
    import socket
    import subprocess

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    code = ("import sys\nfrom medbanana.loaders import load_medbanana\ntry:\n    load_medbanana(sys.argv[1], 'sft')\n"
            "except Exception as exc:\n    print(type(exc).__name__, exc)")
    env = {**os.environ, "HF_ENDPOINT": f"http://127.0.0.1:{port}", "HF_HOME": str(tmp_path / "hf")}
    env.pop("HF_HUB_OFFLINE", None)
    env.pop("HF_DATASETS_OFFLINE", None)

    def load(name: str) -> str:
        return subprocess.run([sys.executable, "-c", code, name], capture_output=True, text=True, cwd=tmp_path,
                              env=env, timeout=120).stdout

    said = load("medbanana-50k")
    assert said.startswith("NotFound") and f"not a folder in {tmp_path}" in said and "ORG/NAME" in said  # a FileNotFoundError
    said = load("my-org/medbanana-50k")
    assert said.startswith("ConnectionError") and f"http://127.0.0.1:{port} cannot be reached" in said
    assert "HF_HUB_OFFLINE=1" in said and "folder's path" in said
