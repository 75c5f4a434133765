"""Tiny randomly initialised models built from configs, so that every recipe runs on a CPU with no download.

For the model id `tiny-random` (`TINY_MODEL_ID`) a recipe writes one of these to a folder with `save_pretrained`
and loads it from there, as it loads any downloaded model. The tokenizer is a word-level vocabulary learnt from the
training texts themselves, so no word of the prompts maps to an unknown token. The shapes are the real ones (a
Llava-style image-text-to-text model with a CLIP vision tower; an InstructPix2Pix pipeline: UNet with 8 input
channels, VAE, CLIP text encoder, DDPM scheduler), only very small.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

TINY_MODEL_ID = "tiny-random"
IMAGE_TOKEN = "<image>"
SPECIAL_TOKENS = ["<pad>", "<unk>", "<s>", "</s>", IMAGE_TOKEN, "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
# Renders string contents and TRL's structured contents ({"type": "image"} / {"type": "text", "text": ...}).
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<image>{% else %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def tiny_tokenizer(corpus: Iterable[str], *, model_max_length: int = 8192):
    """A word-level `PreTrainedTokenizerFast` with a chat template, its vocabulary learnt from `corpus`."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel(unk_token="<unk>"))
    backend.normalizer = normalizers.Lowercase()
    backend.pre_tokenizer = pre_tokenizers.Whitespace()  # words and runs of punctuation
    backend.train_from_iterator(corpus, trainers.WordLevelTrainer(special_tokens=SPECIAL_TOKENS))
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", pad_token="<pad>", bos_token="<s>",
                                   eos_token="</s>", extra_special_tokens={"image_token": IMAGE_TOKEN},
                                   chat_template=CHAT_TEMPLATE, model_max_length=model_max_length)


def tiny_vlm(corpus: Iterable[str], *, image_size: int = 32, patch_size: int = 8, seed: int = 0):
    """(model, processor): a LlavaForConditionalGeneration with a 1-layer CLIP tower and a 2-layer Llama."""
    from transformers import (CLIPImageProcessorPil, CLIPVisionConfig, LlamaConfig, LlavaConfig,
                              LlavaForConditionalGeneration, LlavaProcessor)

    tokenizer = tiny_tokenizer(corpus)
    image_processor = CLIPImageProcessorPil(size={"shortest_edge": image_size},
                                            crop_size={"height": image_size, "width": image_size})
    # CLIP prepends a CLS token; the "default" strategy drops it again (num_additional_image_tokens=1).
    processor = LlavaProcessor(image_processor=image_processor, tokenizer=tokenizer, patch_size=patch_size,
                               vision_feature_select_strategy="default", num_additional_image_tokens=1,
                               image_token=IMAGE_TOKEN, chat_template=CHAT_TEMPLATE)
    vision = CLIPVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                              image_size=image_size, patch_size=patch_size, projection_dim=16)
    text = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=8192,
                       pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                       eos_token_id=tokenizer.eos_token_id)
    config = LlavaConfig(vision_config=vision, text_config=text, vision_feature_layer=-1,
                         vision_feature_select_strategy="default",
                         image_token_index=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN))
    torch.manual_seed(seed)
    return LlavaForConditionalGeneration(config), processor


def save_tiny_vlm(folder: Path, corpus: Iterable[str], **options) -> None:
    """`tiny_vlm` written to `folder` (model and processor), as a downloaded checkpoint is laid out."""
    model, processor = tiny_vlm(corpus, **options)
    model.save_pretrained(folder)
    processor.save_pretrained(folder)


def tiny_instruct_pix2pix(corpus: Iterable[str], *, resolution: int = 64, seed: int = 0):
    """A StableDiffusionInstructPix2PixPipeline: tokenizer, text_encoder, vae, unet (8 input channels), scheduler;
    no safety checker."""
    from diffusers import (AutoencoderKL, DDPMScheduler, StableDiffusionInstructPix2PixPipeline,
                           UNet2DConditionModel)
    from transformers import CLIPTextConfig, CLIPTextModel

    tokenizer = tiny_tokenizer(corpus, model_max_length=32)
    torch.manual_seed(seed)
    text_encoder = CLIPTextModel(CLIPTextConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=2,
        max_position_embeddings=tokenizer.model_max_length, pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id))
    vae = AutoencoderKL(block_out_channels=(8, 16), down_block_types=("DownEncoderBlock2D",) * 2,
                        up_block_types=("UpDecoderBlock2D",) * 2, latent_channels=4, norm_num_groups=8,
                        sample_size=resolution)
    unet = UNet2DConditionModel(
        sample_size=resolution // 2, in_channels=8, out_channels=4, layers_per_block=1, block_out_channels=(16, 32),
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=32, attention_head_dim=4, norm_num_groups=8)
    scheduler = DDPMScheduler(num_train_timesteps=1000, beta_schedule="scaled_linear", beta_start=0.00085,
                              beta_end=0.012, prediction_type="epsilon")
    return StableDiffusionInstructPix2PixPipeline(
        tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, unet=unet, scheduler=scheduler, safety_checker=None,
        feature_extractor=None, requires_safety_checker=False)


def dataset_texts(ds, columns: Iterable[str]) -> Iterator[str]:
    """Every text of `columns` (strings, or conversations whose contents are strings), images never read."""
    columns = [c for c in columns if c in ds.column_names]
    for row in ds.select_columns(columns):
        for value in row.values():
            if isinstance(value, str):
                yield value
            elif isinstance(value, list):
                yield from (message["content"] for message in value if isinstance(message.get("content"), str))
