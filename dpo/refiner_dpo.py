"""DPO for the instruction writer / refiner: a vision-language model learns to write the instruction that was
accepted rather than the one that was rejected, from the same source image, task and history of failed rounds.

Data: the `dpo_pairs` config, converted by `medbanana.loaders.trl.to_refiner_dpo` (images = [source], a
conversational prompt = the pipeline's writer prompt with the earlier rounds and their verdicts, chosen / rejected
= the accepted / rejected instruction). Trainer: `trl.DPOTrainer`, unchanged.

The model is a folder written by `save_pretrained` or a Hub id, loaded with AutoModelForImageTextToText and the
AutoProcessor saved beside it (--trust_remote_code for models that need their own code). On a GPU, with a real model
(full fine-tuning, or LoRA with --use_peft):

    accelerate launch -m medbanana.dpo.refiner_dpo \
        --dataset_name ./medbanana-50k --model_name_or_path Qwen/Qwen2.5-VL-7B-Instruct --dtype bfloat16 \
        --use_peft --lora_r 16 --lora_alpha 32 --lora_target_modules q_proj k_proj v_proj o_proj \
        --max_image_side 512 --max_length 4096 --per_device_train_batch_size 2 --gradient_accumulation_steps 8 \
        --learning_rate 5e-6 --num_train_epochs 1 --beta 0.1 --activation_checkpointing true --output_dir refiner-dpo

Released data without source images (MIMIC-CXR is not redistributable): add --source_images /path/to/sources.
Every option can also come from a YAML file: `python -m medbanana.dpo.refiner_dpo --config refiner.yaml`.

On a CPU, end to end on the offline demo's dataset with a tiny random model (`tiny-random`: written to
OUTPUT_DIR/tiny-random-base, then loaded from there like any other folder):

    python -m medbanana.dpo.refiner_dpo --dataset_name demo-run/dataset --model_name_or_path tiny-random \
        --max_steps 2 --per_device_train_batch_size 2 --max_length 4096 --use_cpu --bf16 false \
        --report_to none --output_dir /tmp/refiner-dpo
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

from medbanana.dpo.common import (ScriptArguments, check_sequence_lengths, load_examples, load_vlm, model_location,
                                  run_recipe, train_and_save, trl_parser)
from medbanana.loaders.trl import to_refiner_dpo

TEXT_COLUMNS = ("prompt", "chosen", "rejected")


@dataclass
class RefinerScriptArguments(ScriptArguments):
    dataset_config: str = "dpo_pairs"


def build_trainer(script_args: RefinerScriptArguments, training_args, model_args):
    """The DPOTrainer, ready to `train()`: data converted and checked, model, reference and processor loaded."""
    from trl import DPOTrainer, get_peft_config
    from trl.trainer.dpo_trainer import DataCollatorForVisionPreference

    from medbanana.dpo.tiny import dataset_texts, save_tiny_vlm

    train_dataset, _ = load_examples(script_args, to_refiner_dpo)
    location = model_location(model_args.model_name_or_path, training_args.output_dir,
                              lambda folder: save_tiny_vlm(folder, dataset_texts(train_dataset, TEXT_COLUMNS)))
    model, processor = load_vlm(location, model_args, trust_remote_code=training_args.trust_remote_code)
    check_sequence_lengths(train_dataset, DataCollatorForVisionPreference(processor, max_length=None),
                           training_args.max_length, TEXT_COLUMNS)
    peft_config = get_peft_config(model_args)
    # With LoRA the reference is the model with its adapter disabled. Otherwise a frozen copy, so that TRL does not
    # load the whole model a second time from its name.
    ref_model = None if peft_config else copy.deepcopy(model)
    return DPOTrainer(model=model, ref_model=ref_model, args=training_args, train_dataset=train_dataset,
                      processing_class=processor, peft_config=peft_config)


def main(script_args, training_args, model_args):
    return train_and_save(build_trainer, "instruction writer / refiner", script_args, training_args, model_args)


def make_parser():
    return trl_parser(RefinerScriptArguments, "DPOConfig", __doc__)


if __name__ == "__main__":
    run_recipe(make_parser, main)
