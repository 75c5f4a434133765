"""Diffusion-DPO (Wallace et al. 2023) for an InstructPix2Pix-style editor, with diffusers: the policy UNet learns
to prefer the accepted edit over a rejected edit of the same source image, measured against a frozen reference.

TRL has no image-output preference training any more, so this is a plain accelerate loop. Per pair: the same noise
and timestep for both edits; loss = -log sigmoid(-beta/2 * ((e_w - e_l) - (e_w_ref - e_l_ref))), where e is the
denoising error of the chosen (w) or rejected (l) edit, conditioned like InstructPix2Pix on the source latents
(concatenated channels) and the edit prompt. Data: `dpo_pairs`, converted by `to_diffusion_dpo`; pairs whose
rejected instruction made the editor refuse (no rejected image) are left out. No flips: left and right matter.

The model is a StableDiffusionInstructPix2PixPipeline (a folder written by `save_pretrained` or a Hub id),
loaded whole with `from_pretrained`; training adds noise as DDPM does, from the pipeline's scheduler config. The
result, in --output_dir, is the same pipeline with the trained UNet. On a GPU:

    accelerate launch -m medbanana.dpo.editor_diffusion_dpo \
        --dataset_name ./medbanana-50k --model_name_or_path timbrooks/instruct-pix2pix --resolution 512 \
        --train_batch_size 4 --gradient_accumulation_steps 16 --learning_rate 1e-6 --beta_dpo 2500 \
        --max_train_steps 2000 --checkpointing_steps 500 --mixed_precision bf16 --gradient_checkpointing true \
        --output_dir editor-diffusion-dpo
    # then: StableDiffusionInstructPix2PixPipeline.from_pretrained("editor-diffusion-dpo")

Resume with --resume_from_checkpoint latest (or a checkpoint-N folder); --source_images DIR attaches the sources
of released data; options can come from a YAML file with --config. On a CPU, on the offline demo's dataset with a
tiny random pipeline (`tiny-random`: written to OUTPUT_DIR/tiny-random-base, then loaded from there):

    python -m medbanana.dpo.editor_diffusion_dpo --dataset_name demo-run/dataset --model_name_or_path tiny-random \
        --resolution 64 --train_batch_size 2 --max_train_steps 2 --use_cpu true --output_dir /tmp/editor-dpo
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path

from medbanana.dpo.common import (ScriptArguments, help_text, load_examples, model_location, require_training_stack,
                                  run_recipe, setup_errors)
from medbanana.loaders.trl import to_diffusion_dpo
from ..generation.failures import NotFound, UsageError

# pairs that cannot be trained on, and why their column is null
UNUSABLE = {"rejected_image": "the editor refused the rejected instruction and made no image",
            "chosen_image": "the accepted edit's image file was missing when the dataset was built"}


@dataclass
class DiffusionDPOArguments(ScriptArguments):
    max_image_side: int | None = field(default=None, metadata={"help": "Unused here: images go to --resolution."})
    model_name_or_path: str = field(default="timbrooks/instruct-pix2pix", metadata={
        "help": "A StableDiffusionInstructPix2PixPipeline: a folder written by save_pretrained, a Hub id, or "
                "tiny-random (a tiny random one, no download)."})
    revision: str | None = None
    trust_remote_code: bool = field(default=False, metadata={
        "help": "Let the model's repository run its own Python code while loading (custom pipeline components). "
                "Off: only the classes of diffusers and transformers themselves are used."})
    prompt: str = field(default="task", metadata={
        "help": "Condition both edits on the task sentence ('task') or on the accepted instruction ('chosen')."})
    output_dir: str = "editor-diffusion-dpo"
    resolution: int = 256
    beta_dpo: float = field(default=2500.0, metadata={"help": "beta of Diffusion-DPO: how far from the reference."})
    learning_rate: float = 1e-6
    adam_weight_decay: float = 1e-2
    max_grad_norm: float = 1.0
    train_batch_size: int = 4
    gradient_accumulation_steps: int = 1
    max_train_steps: int = 1000
    checkpointing_steps: int = 500
    resume_from_checkpoint: str | None = field(default=None, metadata={
        "help": "A checkpoint-N folder under --output_dir, or 'latest'."})
    mixed_precision: str = field(default="no", metadata={"help": "no | fp16 | bf16"})
    gradient_checkpointing: bool = False
    logging_steps: int = 10
    dataloader_num_workers: int = 0
    seed: int = 0
    use_cpu: bool = False


def load_editor(location: str, args: DiffusionDPOArguments, **components):
    """The StableDiffusionInstructPix2PixPipeline at `location` (float32, no safety checker), checked to be one."""
    import torch

    from medbanana.generation.backends.diffusers_editor import load_pipeline

    pipeline = load_pipeline(location, torch.float32, revision=args.revision,
                             trust_remote_code=args.trust_remote_code, **components)
    in_channels = getattr(getattr(pipeline, "unet", None), "config", {}).get("in_channels")
    if type(pipeline).__name__ != "StableDiffusionInstructPix2PixPipeline" or in_channels != 8:
        raise UsageError(f"{args.model_name_or_path} is a {type(pipeline).__name__} whose UNet takes {in_channels} "
                         "input channels: this recipe trains a StableDiffusionInstructPix2PixPipeline (8 channels: "
                         "noisy latents and source latents), e.g. timbrooks/instruct-pix2pix")
    return pipeline


def load_components(args: DiffusionDPOArguments, prompts) -> dict:
    """tokenizer, text_encoder, vae, unet and a DDPM noise scheduler of the pipeline (tiny-random built and saved
    first), and `location`, where it was loaded from."""
    from diffusers import DDPMScheduler

    from medbanana.dpo.tiny import tiny_instruct_pix2pix

    location = model_location(args.model_name_or_path, args.output_dir, lambda folder: tiny_instruct_pix2pix(
        prompts, resolution=args.resolution, seed=args.seed).save_pretrained(folder))
    pipeline = load_editor(location, args)
    # training adds noise as in DDPM whatever sampler the pipeline uses for inference (diffusers' scripts do too)
    return {"tokenizer": pipeline.tokenizer, "text_encoder": pipeline.text_encoder, "vae": pipeline.vae,
            "unet": pipeline.unet, "scheduler": DDPMScheduler.from_config(pipeline.scheduler.config),
            "location": location}


def prepare(args: DiffusionDPOArguments) -> dict:
    """Everything the loop needs, with the policy UNet, optimizer and data loader prepared by accelerate."""
    import torch
    from accelerate import Accelerator
    from accelerate.utils import set_seed

    accelerator = Accelerator(gradient_accumulation_steps=args.gradient_accumulation_steps, cpu=args.use_cpu,
                              mixed_precision=args.mixed_precision, project_dir=args.output_dir)
    set_seed(args.seed)
    pairs, left_out = load_examples(args, to_diffusion_dpo, drop_missing=UNUSABLE, prompt=args.prompt)
    parts = load_components(args, pairs.select_columns(["edit_prompt"])["edit_prompt"])
    weight_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(accelerator.mixed_precision, torch.float32)
    unet = parts["unet"]
    reference = copy.deepcopy(unet).requires_grad_(False).eval()  # the frozen initial editor
    cast = {} if weight_dtype is torch.float32 else {"dtype": weight_dtype}
    for frozen in (reference, parts["vae"], parts["text_encoder"]):
        frozen.requires_grad_(False).to(accelerator.device, **cast)
    if args.gradient_checkpointing:
        unet.enable_gradient_checkpointing()
    unet.train()
    loader = torch.utils.data.DataLoader(pairs.with_transform(_batch_transform(args, parts["tokenizer"])),
                                         batch_size=args.train_batch_size, shuffle=True, drop_last=False,
                                         num_workers=args.dataloader_num_workers)
    optimizer = torch.optim.AdamW(unet.parameters(), lr=args.learning_rate, weight_decay=args.adam_weight_decay)
    unet, optimizer, loader = accelerator.prepare(unet, optimizer, loader)
    return {**parts, "unet": unet, "reference": reference, "optimizer": optimizer, "loader": loader,
            "accelerator": accelerator, "weight_dtype": weight_dtype, "pairs": len(pairs), "left_out": left_out}


def dpo_loss(parts: dict, batch: dict, beta: float):
    """(loss, metrics) of one batch of pairs."""
    import torch
    import torch.nn.functional as F

    vae, scheduler, dtype = parts["vae"], parts["scheduler"], parts["weight_dtype"]
    n = batch["chosen"].shape[0]
    with torch.no_grad():
        edits = torch.cat([batch["chosen"], batch["rejected"]]).to(dtype)
        latents = vae.encode(edits).latent_dist.sample() * vae.config.scaling_factor
        # InstructPix2Pix conditions on the unscaled mode of the source latents
        source = vae.encode(batch["original"].to(dtype)).latent_dist.mode().repeat(2, 1, 1, 1)
        text = parts["text_encoder"](batch["input_ids"])[0].repeat(2, 1, 1)
    noise = torch.randn_like(latents[:n]).repeat(2, 1, 1, 1)
    timesteps = torch.randint(0, scheduler.config.num_train_timesteps, (n,), device=latents.device).repeat(2)
    noisy = scheduler.add_noise(latents, noise, timesteps)
    target = noise if scheduler.config.prediction_type == "epsilon" else scheduler.get_velocity(latents, noise,
                                                                                                  timesteps)
    model_input = torch.cat([noisy, source], dim=1)

    def errors(net):  # per-example denoising error, split into (chosen, rejected)
        prediction = net(model_input, timesteps, text).sample
        return F.mse_loss(prediction.float(), target.float(), reduction="none").mean(dim=(1, 2, 3)).chunk(2)

    chosen, rejected = errors(parts["unet"])
    with torch.no_grad():
        ref_chosen, ref_rejected = errors(parts["reference"])
    inside = -0.5 * beta * ((chosen - rejected) - (ref_chosen - ref_rejected))
    loss = -F.logsigmoid(inside).mean()
    return loss, {"loss": loss.item(), "implicit_accuracy": (inside > 0).float().mean().item(),
                  "mse_chosen": chosen.mean().item(), "mse_rejected": rejected.mean().item()}


def train(args: DiffusionDPOArguments, parts: dict) -> list[dict]:
    """Run to `max_train_steps` optimisation steps; returns the metrics of every step."""
    from tqdm.auto import tqdm

    accelerator, unet, optimizer, loader = parts["accelerator"], parts["unet"], parts["optimizer"], parts["loader"]
    step, skip = _resume(args, accelerator, len(loader))
    history = []
    progress = tqdm(total=args.max_train_steps, initial=step, desc="Diffusion-DPO steps",
                    disable=not accelerator.is_local_main_process)
    while step < args.max_train_steps:  # epochs
        batches = accelerator.skip_first_batches(loader, skip) if skip else loader
        skip = 0
        for batch in batches:
            with accelerator.accumulate(unet):
                loss, metrics = dpo_loss(parts, batch, args.beta_dpo)
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(unet.parameters(), args.max_grad_norm)
                optimizer.step()
                optimizer.zero_grad()
            if not accelerator.sync_gradients:
                continue
            step += 1
            history.append({"step": step, **metrics})
            progress.update(1)
            progress.set_postfix(loss=f"{metrics['loss']:.4f}", accuracy=f"{metrics['implicit_accuracy']:.2f}")
            if (step % args.logging_steps == 0 or step == args.max_train_steps) and not progress.disable:
                progress.write(str(history[-1]))
            if step % args.checkpointing_steps == 0:
                accelerator.save_state(str(Path(args.output_dir) / f"checkpoint-{step}"))
            if step >= args.max_train_steps:
                break
    progress.close()
    return history


def _resume(args, accelerator, batches_per_epoch: int) -> tuple[int, int]:
    """(optimisation steps done, batches to skip in the current epoch) after loading a checkpoint, if asked."""
    if not args.resume_from_checkpoint:
        return 0, 0
    path = Path(args.resume_from_checkpoint)
    if args.resume_from_checkpoint == "latest":
        found = sorted(Path(args.output_dir).glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
        if not found:
            raise NotFound(f"no checkpoint-N folder in {args.output_dir} to resume from")
        path = found[-1]
    accelerator.load_state(str(path))
    step = int(path.name.split("-")[1])
    return step, step * args.gradient_accumulation_steps % batches_per_epoch


def _batch_transform(args, tokenizer):
    import numpy as np
    import torch
    from PIL import Image, ImageOps

    def pixels(image) -> torch.Tensor:  # center crop to a square, resize, scale to [-1, 1]
        square = ImageOps.fit(image.convert("RGB"), (args.resolution, args.resolution), Image.Resampling.BICUBIC)
        return torch.from_numpy(np.asarray(square, dtype=np.float32) / 127.5 - 1.0).permute(2, 0, 1)

    def transform(batch: dict) -> dict:
        ids = tokenizer(batch["edit_prompt"], max_length=tokenizer.model_max_length, padding="max_length",
                        truncation=True, return_tensors="pt").input_ids
        return {"original": [pixels(i) for i in batch["original_image"]],
                "chosen": [pixels(i) for i in batch["chosen_image"]],
                "rejected": [pixels(i) for i in batch["rejected_image"]], "input_ids": list(ids)}

    return transform


def main(args: DiffusionDPOArguments) -> list[dict]:
    with setup_errors():
        parts = prepare(args)
    history = train(args, parts)
    accelerator = parts["accelerator"]
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        save(args, parts)
    return history


def save(args: DiffusionDPOArguments, parts: dict) -> None:
    """The base pipeline with the trained UNet, written to --output_dir (the UNet alone in its unet/ folder);
    the frozen parts are reloaded as they were, not in the training precision."""
    unet = parts["accelerator"].unwrap_model(parts["unet"])
    load_editor(parts["location"], args, unet=unet).save_pretrained(args.output_dir)
    skipped = "; ".join(f"{n} with {why}" for why, n in parts["left_out"].items()) or "none"
    print(f"trained on {parts['pairs']} pairs (left out: {skipped})\n"
          f"saved the trained editor to {args.output_dir}: "
          f"StableDiffusionInstructPix2PixPipeline.from_pretrained({args.output_dir!r}); "
          f"the UNet alone: UNet2DConditionModel.from_pretrained({str(Path(args.output_dir) / 'unet')!r})")


def make_parser():
    require_training_stack("torch", "diffusers", "accelerate", "trl")
    from trl import TrlParser

    return TrlParser((DiffusionDPOArguments,), **help_text(__doc__))


if __name__ == "__main__":
    run_recipe(make_parser, main)
