import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests/paths.py, scripted.py and other test helpers

from paths import ROOT, SHARED_SAMPLES  # noqa: E402, F401 (tests import SHARED_SAMPLES from here)


def write_jpeg(path: Path, value: int = 128, size: int = 32) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(value)
    Image.fromarray(rng.integers(0, 255, (size, size, 3), dtype=np.uint8)).save(path, quality=95)
    return path


@pytest.fixture
def tiny_sources(tmp_path) -> Path:
    """Two dataset folders in the original input layout with tiny random JPEGs."""
    root = tmp_path / "sources"
    for i in range(2):
        write_jpeg(root / "MIMIC_tiny" / "normal" / f"n{i}.jpeg", i)
    write_jpeg(root / "MIMIC_tiny" / "Pneumothorax" / "p0.jpeg", 10)
    write_jpeg(root / "MIMIC_tiny" / "Pleural_Effusion" / "e0.jpg", 11)
    write_jpeg(root / "ODIR_tiny" / "normal" / "0_left.jpeg", 20)
    write_jpeg(root / "ODIR_tiny" / "Glaucoma" / "1_right.jpeg", 21)
    return root


# --- fake server fixtures (the helpers behind them: tests/fake_runs.py) -------------------------------------

@pytest.fixture(scope="module")
def echo_gemini():
    """A fake Gemini server with the echo engine (deterministic verdicts, no image work), one per test module:
    each test resets it with its own faults."""
    from medbanana.generation.testing.fake_gemini import FakeGemini

    with FakeGemini(engine="echo") as server:
        yield server


@pytest.fixture
def sleeps():
    """Back-off sleeps recorded instead of slept: give it as a backend's `sleep`; it lists the seconds asked for."""
    from fake_runs import RecordedSleeps

    return RecordedSleeps()


# --- builder fixtures: synthetic runs in the original layout and what their JSON says -----------------------

BUILDER_OUR_DATASETS = ("mimic_ours_cxr", "brain_ours_mri", "odir_ours_fundus")


@pytest.fixture(scope="session")
def builder_original_run(tmp_path_factory) -> Path:
    """A run written exactly like the original scripts (plus source images in the input layout beside it)."""
    from medbanana.builder.synthetic_run import make_synthetic_run

    root = tmp_path_factory.mktemp("builder_original")
    make_synthetic_run(root / "run", flavor="original", tasks_per_folder=8, sources_dir=root / "sources", seed=3)
    return root / "run"


@pytest.fixture(scope="session")
def builder_ours_run(tmp_path_factory) -> Path:
    """A run with our extra fields (uid, modality, scores, an editor refusal per few tasks)."""
    from medbanana.builder.synthetic_run import make_synthetic_run

    root = tmp_path_factory.mktemp("builder_ours")
    make_synthetic_run(root / "run", flavor="ours", tasks_per_folder=8, datasets=BUILDER_OUR_DATASETS,
                       sources_dir=root / "sources", seed=4)
    return root / "run"


def builder_json_counts(run_dir: Path) -> dict:
    """Row counts every config must have, read straight from the run's JSON with the json module."""
    import json

    counts = dict.fromkeys(("tasks", "attempts", "sft", "failed", "dpo_pairs", "judge", "api_failed_only"), 0)
    for out in sorted(p for p in Path(run_dir).iterdir() if p.name.endswith(("-edit", "-remove"))):
        conversations = json.loads((out / "all_conversations.json").read_text())
        progress = json.loads((out / "progress.json").read_text())
        counts["tasks"] += len(set(conversations) | set(progress))
        counts["api_failed_only"] += len(set(progress) - set(conversations))
        for entry in conversations.values():
            rounds = entry["rounds"]
            counts["attempts"] += len(rounds)
            counts["judge"] += sum(r.get("verification") is not None for r in rounds)
            if entry["status"] == "success":
                counts["sft"] += 1
                counts["dpo_pairs"] += len(rounds) - 1  # accepted at round k = len(rounds): k-1 pairs
    counts["failed"] = counts["attempts"] - counts["sft"]
    counts["conversations"] = counts["tasks"]
    return counts


@pytest.fixture(scope="session")
def builder_counts():
    return builder_json_counts


# --- recipe fixtures: the offline demo, built, and tiny checkpoint folders -----------------------------------

@pytest.fixture(scope="session")
def demo_run_root(tmp_path_factory) -> Path:
    """A folder holding `demo-run/` as `medbanana demo --out demo-run` leaves it (small: 1 normal and 1 diseased
    source per class at 256 px), `demo-run/dataset` built with its sources."""
    from medbanana.demo import run_demo
    from medbanana.loaders import load_medbanana

    root = tmp_path_factory.mktemp("recipes")
    run_demo(root / "demo-run", n_normal=1, n_diseased=1, size=256, quiet=True)
    pairs = load_medbanana(root / "demo-run" / "dataset", "dpo_pairs")
    assert pairs.num_rows >= 2, "the demo gave fewer than two preference pairs: nothing to train two steps on"
    return root


@pytest.fixture(scope="session")
def demo_dataset(demo_run_root) -> Path:
    return demo_run_root / "demo-run" / "dataset"


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory, demo_dataset):
    """checkpoint(family) -> a folder written by save_pretrained: "llava" (what `tiny-random` writes), "qwen2_5_vl",
    "instruct_pix2pix" or "stable_diffusion" (the last two as laid out on the Hub; tests/checkpoints.py)."""
    import datasets
    from checkpoints import save_instruct_pix2pix, save_qwen2_5_vl

    from medbanana.dpo.tiny import save_tiny_vlm

    root = tmp_path_factory.mktemp("checkpoints")
    prompts = ROOT / "generation" / "prompts"
    corpus = [path.read_text() for path in sorted(prompts.glob("*.txt"))]
    for config in ("dpo_pairs", "judge"):  # the dataset's own texts, read as plain columns
        table = datasets.load_dataset(str(demo_dataset), config, split="train")
        corpus += [value for name in ("prompt", "chosen_instruction", "rejected_instruction", "instruction", "reason")
                   if name in table.column_names for value in table[name] if value]
    builders = {"llava": lambda folder: save_tiny_vlm(folder, corpus),
                "qwen2_5_vl": lambda folder: save_qwen2_5_vl(folder, corpus),
                "instruct_pix2pix": save_instruct_pix2pix,
                "stable_diffusion": lambda folder: save_instruct_pix2pix(folder, in_channels=4)}
    made = {}

    def folder_of(family: str) -> Path:
        if family not in made:
            made[family] = root / family
            builders[family](made[family])
        return made[family]

    return folder_of
