"""The three recipes in dpo/ train on checkpoints loaded by path, as a downloaded model is: a Llava-style VLM, a
Qwen2.5-VL with its real processor, an InstructPix2Pix pipeline laid out as on the Hub (tests/checkpoints.py). Each
trains two optimisation steps on the offline demo's dataset, saves, and what it saved is loaded back and used."""

import math
import shutil
import subprocess
import sys

import pytest

pytest.importorskip("torch", reason="training needs the train extra: pip install 'medbanana[train]'")
pytest.importorskip("trl", reason="training needs the train extra: pip install 'medbanana[train]'")
pytest.importorskip("diffusers", reason="training needs the train extra: pip install 'medbanana[train]'")

import torch  # noqa: E402

from medbanana.dpo import editor_diffusion_dpo, judge_sft, refiner_dpo  # noqa: E402
from medbanana.dpo.tiny import TINY_MODEL_ID  # noqa: E402
from medbanana.loaders import load_medbanana  # noqa: E402

pytestmark = pytest.mark.slow

VLM_FAMILIES = ["llava", "qwen2_5_vl"]
TRAINER_OPTIONS = """\
max_steps: 2
per_device_train_batch_size: 2
learning_rate: 0.001
max_length: 8192
use_cpu: true
bf16: false
logging_steps: 1
save_strategy: "no"
report_to: none
dataloader_num_workers: 0
seed: 0
"""
LORA = ["--use_peft", "--lora_r", "4", "--lora_alpha", "8", "--lora_target_modules", "q_proj", "k_proj", "v_proj",
        "o_proj"]


def parse(module, tmp_path, dataset, model, *extra):
    config = tmp_path / "options.yaml"
    config.write_text(TRAINER_OPTIONS)
    return module.make_parser().parse_args_and_config(
        ["--config", str(config), "--dataset_name", str(dataset), "--model_name_or_path", str(model),
         "--output_dir", str(tmp_path / "out"), *extra])


def weights(model) -> dict:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def changed(before: dict, after: dict) -> set:
    return {name for name in before if not torch.equal(before[name], after[name])}


def losses(trainer) -> list[float]:
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def load_vlm_folder(folder):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    return AutoModelForImageTextToText.from_pretrained(folder), AutoProcessor.from_pretrained(folder)


def forward_logits(model, processor, example) -> torch.Tensor:
    """One forward pass on a training example's images and prompt, through the processor's chat template."""
    content = [{"type": "image"} for _ in example["images"]]
    messages = [{"role": "user", "content": content + [{"type": "text", "text": example["prompt"][0]["content"]}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True)
    inputs = processor(text=[text], images=example["images"], return_tensors="pt")
    with torch.no_grad():
        return model(**inputs).logits


def check_trained(trainer, steps: int = 2):
    assert trainer.state.global_step == steps
    assert len(losses(trainer)) == steps and all(math.isfinite(x) for x in losses(trainer))


@pytest.mark.parametrize("family", VLM_FAMILIES)
def test_refiner_dpo_trains_a_saved_checkpoint_and_its_output_loads_back(family, checkpoint, demo_dataset, tmp_path,
                                                                          capsys):
    folder = checkpoint(family)
    trainer = refiner_dpo.main(*parse(refiner_dpo, tmp_path, demo_dataset, folder))
    check_trained(trainer)
    assert trainer.train_dataset.column_names == ["images", "prompt", "chosen", "rejected"]
    base, _ = load_vlm_folder(folder)
    start = weights(base)
    assert trainer.ref_model is not None and trainer.ref_model is not trainer.model
    assert not changed(start, weights(trainer.ref_model))  # the reference is the checkpoint, and stays it
    trained, processor = load_vlm_folder(tmp_path / "out")
    assert type(trained) is type(base) and type(processor).__name__ == type(trainer.processing_class).__name__
    moved = changed(start, weights(trained))
    assert len(moved) > len(start) // 2 and any(".layers." in name for name in moved)
    assert not changed(weights(trainer.model), weights(trained))  # what was saved is what was trained
    logits = forward_logits(trained, processor, trainer.train_dataset[0])
    assert logits.shape[-1] == trained.config.get_text_config().vocab_size and torch.isfinite(logits).all()
    assert f"to {tmp_path / 'out'}" in capsys.readouterr().out


@pytest.mark.parametrize("family", VLM_FAMILIES)
def test_refiner_dpo_with_lora_trains_and_saves_only_the_adapter(family, checkpoint, demo_dataset, tmp_path):
    folder = checkpoint(family)
    trainer = refiner_dpo.build_trainer(*parse(refiner_dpo, tmp_path, demo_dataset, folder, *LORA))
    before = weights(trainer.model)
    trainer.train()
    check_trained(trainer)
    moved = changed(before, weights(trainer.model))
    assert moved and all("lora_" in name for name in moved)
    assert all(any(f".{module}.lora_" in name for name in moved) for module in ("q_proj", "k_proj", "v_proj",
                                                                                  "o_proj"))
    trainer.save_model(trainer.args.output_dir)
    out = tmp_path / "out"
    assert (out / "adapter_config.json").is_file() and not (out / "model.safetensors").exists()
    adapted, processor = load_vlm_folder(out)  # the base model from its folder, the adapter on top
    lora = {name: p for name, p in weights(adapted).items() if "lora_B" in name}
    assert lora and any(p.abs().sum() > 0 for p in lora.values())  # lora_B starts at zero: it learnt
    assert torch.isfinite(forward_logits(adapted, processor, trainer.train_dataset[0])).all()


@pytest.mark.parametrize("family", VLM_FAMILIES)
def test_judge_sft_trains_on_the_verdicts_and_its_output_loads_back(family, checkpoint, demo_dataset, tmp_path):
    folder = checkpoint(family)
    trainer = judge_sft.main(*parse(judge_sft, tmp_path, demo_dataset, folder))
    check_trained(trainer)
    assert trainer.train_dataset.num_rows == load_medbanana(demo_dataset, "judge").num_rows
    example = trainer.train_dataset[0]
    assert len(example["images"]) == 2 and example["completion"][0]["content"].startswith('{"has_disease"')
    base, _ = load_vlm_folder(folder)
    trained, processor = load_vlm_folder(tmp_path / "out")
    assert len(changed(weights(base), weights(trained))) > len(weights(base)) // 2
    assert torch.isfinite(forward_logits(trained, processor, example)).all()


def test_judge_sft_as_a_user_types_it_trains_a_saved_checkpoint(checkpoint, demo_dataset, tmp_path):
    """`python -m medbanana.dpo.judge_sft ...` (the recipe's `run_recipe` entry point) in its own process, on a model
    folder written by save_pretrained: it trains, and the folder it writes loads back."""
    config = tmp_path / "options.yaml"
    config.write_text(TRAINER_OPTIONS)
    folder = checkpoint("llava")
    done = subprocess.run([sys.executable, "-m", "medbanana.dpo.judge_sft", "--config", str(config), "--dataset_name",
                           str(demo_dataset), "--model_name_or_path", str(folder), "--output_dir", str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    base, _ = load_vlm_folder(folder)
    trained, _ = load_vlm_folder(tmp_path / "out")
    assert len(changed(weights(base), weights(trained))) > len(weights(base)) // 2


def test_judge_sft_with_lora_on_qwen(checkpoint, demo_dataset, tmp_path):
    trainer = judge_sft.build_trainer(*parse(judge_sft, tmp_path, demo_dataset, checkpoint("qwen2_5_vl"), *LORA))
    before = weights(trainer.model)
    trainer.train()
    check_trained(trainer)
    moved = changed(before, weights(trainer.model))
    assert moved and all("lora_" in name for name in moved)


@pytest.mark.parametrize("config", ["sft", "failed"])
def test_judge_sft_refuses_a_config_with_one_outcome_only(config, checkpoint, demo_dataset, tmp_path):
    args = parse(judge_sft, tmp_path, demo_dataset, checkpoint("llava"), "--dataset_config", config)
    with pytest.raises(ValueError, match="--dataset_config judge"):
        judge_sft.build_trainer(*args)


def test_a_max_length_that_would_cut_image_tokens_is_refused_before_training(checkpoint, demo_dataset, tmp_path):
    args = parse(judge_sft, tmp_path, demo_dataset, checkpoint("qwen2_5_vl"), "--max_length", "64")
    with pytest.raises(ValueError, match="raise --max_length to at least"):
        judge_sft.build_trainer(*args)


def test_tiny_random_is_saved_to_a_folder_and_loaded_from_it(demo_dataset, tmp_path):
    trainer = refiner_dpo.build_trainer(*parse(refiner_dpo, tmp_path, demo_dataset, TINY_MODEL_ID))
    folder = tmp_path / "out" / "tiny-random-base"
    assert (folder / "config.json").is_file() and (folder / "processor_config.json").is_file()
    assert trainer.model.config._name_or_path == str(folder)
    base, _ = load_vlm_folder(folder)
    assert not changed(weights(base), weights(trainer.model))


def editor_options(dataset, model, out, *extra) -> list[str]:
    return ["--dataset_name", str(dataset), "--model_name_or_path", str(model), "--resolution", "64",
            "--train_batch_size", "2", "--learning_rate", "0.001", "--checkpointing_steps", "1", "--logging_steps",
            "1", "--use_cpu", "true", "--output_dir", str(out), *extra]


def test_editor_diffusion_dpo_trains_a_hub_style_pipeline_resumes_and_the_result_edits(checkpoint, demo_dataset,
                                                                                         tmp_path, capsys):
    from diffusers import StableDiffusionInstructPix2PixPipeline, UNet2DConditionModel
    from PIL import Image

    folder, out = checkpoint("instruct_pix2pix"), tmp_path / "out"
    options = editor_options(demo_dataset, folder, out)
    (args,) = editor_diffusion_dpo.make_parser().parse_args_and_config(options + ["--max_train_steps", "2"])
    parts = editor_diffusion_dpo.prepare(args)
    unet = parts["accelerator"].unwrap_model(parts["unet"])
    start = weights(UNet2DConditionModel.from_pretrained(folder / "unet"))
    assert not changed(start, weights(unet))  # the folder's UNet, not a fresh one
    history = editor_diffusion_dpo.train(args, parts)
    assert [h["step"] for h in history] == [1, 2] and all(math.isfinite(h["loss"]) for h in history)
    assert history[0]["loss"] == pytest.approx(math.log(2), abs=1e-4)  # policy == reference at the first step
    assert len(changed(start, weights(unet))) > len(start) // 2
    assert not changed(start, weights(parts["reference"]))
    assert {p.name for p in out.glob("checkpoint-*")} == {"checkpoint-1", "checkpoint-2"}

    (resumed,) = editor_diffusion_dpo.make_parser().parse_args_and_config(
        options + ["--max_train_steps", "3", "--resume_from_checkpoint", "latest"])
    assert [h["step"] for h in editor_diffusion_dpo.main(resumed)] == [3]
    printed = capsys.readouterr().out
    pairs = load_medbanana(demo_dataset, "dpo_pairs")
    assert f"trained on {pairs.num_rows} pairs" in printed and f"saved the trained editor to {out}" in printed

    pipeline = StableDiffusionInstructPix2PixPipeline.from_pretrained(out, safety_checker=None)
    assert type(pipeline.tokenizer).__name__ == "CLIPTokenizer"  # the base pipeline's own parts, as they were
    assert type(pipeline.scheduler).__name__ == "EulerAncestralDiscreteScheduler"
    assert len(changed(start, weights(pipeline.unet))) > len(start) // 2
    assert not changed(weights(UNet2DConditionModel.from_pretrained(out / "unet")), weights(pipeline.unet))
    edited = pipeline("Add a small left pleural effusion.", image=Image.new("RGB", (64, 64), (90, 90, 90)),
                      num_inference_steps=2, generator=torch.Generator().manual_seed(0)).images[0]
    assert edited.size == (64, 64)


def test_editor_diffusion_dpo_says_which_pairs_it_left_out_and_why(checkpoint, demo_dataset, tmp_path, capsys):
    pairs = load_medbanana(demo_dataset, "dpo_pairs")
    refused = pairs.map(lambda row, i: {"rejected_image": None if i == 0 else row["rejected_image"]},
                        with_indices=True, features=pairs.features)
    folder = tmp_path / "with-refusal"  # the demo dataset, one pair's rejected attempt refused by the editor
    shutil.copytree(demo_dataset, folder)
    refused.to_parquet(folder / "dpo_pairs" / "train-00000-of-00001.parquet")
    (args,) = editor_diffusion_dpo.make_parser().parse_args_and_config(
        editor_options(folder, checkpoint("instruct_pix2pix"), tmp_path / "out", "--max_train_steps", "1"))
    editor_diffusion_dpo.main(args)
    printed = capsys.readouterr().out
    assert f"trained on {pairs.num_rows - 1} pairs" in printed
    assert "1 with no rejected_image: the editor refused the rejected instruction" in printed


def test_editor_diffusion_dpo_refuses_a_pipeline_that_is_not_instruct_pix2pix(checkpoint, demo_dataset, tmp_path):
    (args,) = editor_diffusion_dpo.make_parser().parse_args_and_config(
        editor_options(demo_dataset, checkpoint("stable_diffusion"), tmp_path / "out", "--max_train_steps", "1"))
    with pytest.raises(ValueError, match="StableDiffusionPipeline whose UNet takes 4 input channels"):
        editor_diffusion_dpo.prepare(args)
