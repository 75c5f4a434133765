"""SFT of an open judge: a vision-language model learns to give the rubric verdict (has_disease,
structure_reasonable, looks_realistic, fidelity_preserved, qualified, reason) for an edit, as the LLM judge did.

Data: the `judge` config (every judged attempt, accepted or not), converted by
`medbanana.loaders.trl.to_judge_sft` (images = [source, edited], prompt = the pipeline's judge prompt for the
instruction, completion = the verdict JSON; the loss falls on the verdict only). Trainer: `trl.SFTTrainer`,
unchanged. The trained model answers the same prompt as the pipeline's judge.

The model is a folder written by `save_pretrained` or a Hub id, loaded with AutoModelForImageTextToText and the
AutoProcessor saved beside it (--trust_remote_code for models that need their own code). Train on `judge`: `sft` and
`failed` hold one outcome only and are refused. On a GPU, with a real model (full fine-tuning, or LoRA):

    accelerate launch -m medbanana.dpo.judge_sft \
        --dataset_name ./medbanana-50k --model_name_or_path Qwen/Qwen2.5-VL-3B-Instruct --dtype bfloat16 \
        --use_peft --lora_r 16 --lora_alpha 32 --lora_target_modules q_proj k_proj v_proj o_proj \
        --max_image_side 448 --max_length 2048 --per_device_train_batch_size 4 --gradient_accumulation_steps 4 \
        --learning_rate 1e-4 --num_train_epochs 1 --activation_checkpointing true --output_dir open-judge

Released data without source images (MIMIC-CXR is not redistributable): add --source_images /path/to/sources.
Every option can also come from a YAML file: `python -m medbanana.dpo.judge_sft --config judge.yaml`.

On a CPU, end to end on the offline demo's dataset with a tiny random model (`tiny-random`: written to
OUTPUT_DIR/tiny-random-base, then loaded from there like any other folder):

    python -m medbanana.dpo.judge_sft --dataset_name demo-run/dataset --model_name_or_path tiny-random \
        --max_steps 2 --per_device_train_batch_size 2 --use_cpu --bf16 false --report_to none \
        --output_dir /tmp/open-judge
"""

from __future__ import annotations

from dataclasses import dataclass

from medbanana.dpo.common import (ScriptArguments, check_sequence_lengths, load_examples, load_vlm, model_location,
                                  run_recipe, train_and_save, trl_parser)
from medbanana.loaders.trl import to_judge_sft
from ..generation.failures import UsageError

TEXT_COLUMNS = ("prompt", "completion")
# Configs that hold one outcome only: a judge trained on them learns to give that outcome whatever it sees.
ONE_SIDED = {"sft": "accepted edits only, so it would learn to answer qualified=true to everything",
             "failed": "rejected attempts only, so it would learn to answer qualified=false to everything"}


@dataclass
class JudgeScriptArguments(ScriptArguments):
    dataset_config: str = "judge"


def build_trainer(script_args: JudgeScriptArguments, training_args, model_args):
    """The SFTTrainer, ready to `train()`: data converted and checked, model and processor loaded."""
    from trl import SFTTrainer, get_peft_config
    from trl.trainer.sft_trainer import DataCollatorForVisionLanguageModeling

    from medbanana.dpo.tiny import dataset_texts, save_tiny_vlm

    if script_args.dataset_config in ONE_SIDED:
        raise UsageError(f"--dataset_config {script_args.dataset_config} holds "
                         f"{ONE_SIDED[script_args.dataset_config]}; train the judge on --dataset_config judge "
                         "(every judged attempt, accepted and rejected)")
    # an attempt whose image file went missing has nothing to judge: leave it out rather than fail
    train_dataset, _ = load_examples(script_args, to_judge_sft,
                                     drop_missing={"edited_image": "the attempt's image file was missing"})
    location = model_location(model_args.model_name_or_path, training_args.output_dir,
                              lambda folder: save_tiny_vlm(folder, dataset_texts(train_dataset, TEXT_COLUMNS)))
    model, processor = load_vlm(location, model_args, trust_remote_code=training_args.trust_remote_code)
    check_sequence_lengths(train_dataset, DataCollatorForVisionLanguageModeling(processor, max_length=None),
                           training_args.max_length, TEXT_COLUMNS)
    return SFTTrainer(model=model, args=training_args, train_dataset=train_dataset, processing_class=processor,
                      peft_config=get_peft_config(model_args))


def main(script_args, training_args, model_args):
    return train_and_save(build_trainer, "judge", script_args, training_args, model_args)


def make_parser():
    return trl_parser(JudgeScriptArguments, "SFTConfig", __doc__)


if __name__ == "__main__":
    run_recipe(make_parser, main)
