"""The recipes take a Hub model id as they take a folder: with HF_ENDPOINT pointing at a stand-in of the Hub on
127.0.0.1 (tests/hub_models.py), each downloads its checkpoint into an empty cache and trains one step on it."""

import os
import subprocess
import sys

import pytest

pytest.importorskip("trl", reason="training needs the train extra: pip install 'medbanana[train]'")
pytest.importorskip("diffusers", reason="training needs the train extra: pip install 'medbanana[train]'")

from hub_models import ModelHub  # noqa: E402

pytestmark = pytest.mark.slow

RUNS = {
    "refiner_dpo": ("qwen2_5_vl", "model.safetensors",
                    ["--max_steps", "1", "--per_device_train_batch_size", "2", "--max_length", "8192", "--use_cpu",
                     "--bf16", "false", "--report_to", "none"]),
    "judge_sft": ("llava", "model.safetensors",
                  ["--max_steps", "1", "--per_device_train_batch_size", "2", "--use_cpu", "--bf16", "false",
                   "--report_to", "none"]),
    "editor_diffusion_dpo": ("instruct_pix2pix", "unet/diffusion_pytorch_model.safetensors",
                             ["--resolution", "64", "--train_batch_size", "2", "--max_train_steps", "1",
                              "--use_cpu", "true"]),
}


@pytest.mark.parametrize("recipe", sorted(RUNS))
def test_a_recipe_downloads_its_model_by_hub_id_and_trains(recipe, checkpoint, demo_dataset, tmp_path):
    family, weights, options = RUNS[recipe]
    repo = f"tiny-org/{family.replace('_', '-')}"
    out = tmp_path / "out"
    with ModelHub({repo: checkpoint(family)}) as hub:
        env = {**os.environ, "HF_ENDPOINT": hub.endpoint, "HF_HOME": str(tmp_path / "hf-home"),
               "HF_HUB_OFFLINE": "0", "HF_HUB_DISABLE_TELEMETRY": "1"}
        done = subprocess.run([sys.executable, "-m", f"medbanana.dpo.{recipe}", "--dataset_name", str(demo_dataset),
                               "--model_name_or_path", repo, "--output_dir", str(out), *options],
                              env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        assert (repo, weights) in hub.downloads  # the weights came from the endpoint, into the empty cache
    assert any((tmp_path / "hf-home").rglob(weights.rsplit("/", 1)[-1]))
    assert "saved the trained" in done.stdout and not (out / "tiny-random-base").exists()
    assert (out / ("model_index.json" if recipe == "editor_diffusion_dpo" else "config.json")).is_file()


def test_an_unknown_hub_id_fails_with_the_hubs_answer(demo_dataset, tmp_path, checkpoint):
    with ModelHub({"tiny-org/llava": checkpoint("llava")}) as hub:
        env = {**os.environ, "HF_ENDPOINT": hub.endpoint, "HF_HOME": str(tmp_path / "hf-home"),
               "HF_HUB_OFFLINE": "0"}
        done = subprocess.run([sys.executable, "-m", "medbanana.dpo.judge_sft", "--dataset_name", str(demo_dataset),
                               "--model_name_or_path", "tiny-org/no-such-model", "--output_dir",
                               str(tmp_path / "out"), "--use_cpu"], env=env, capture_output=True, text=True,
                              timeout=300)
    assert done.returncode != 0 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert "error: tiny-org/no-such-model is not a local folder and is not a valid model identifier" in done.stderr
