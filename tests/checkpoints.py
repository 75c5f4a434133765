"""Tiny checkpoints of model families the recipes are used with, written by `save_pretrained` with the libraries'
own classes and laid out as a downloaded model is. medbanana's code plays no part in making them: a recipe must
load them by path, knowing nothing of how they were made.

- a Qwen2.5-VL (`Qwen2_5_VLForConditionalGeneration`, `Qwen2_5_VLProcessor` with its image processor, a byte-level
  BPE `Qwen2Tokenizer` and a ChatML template with Qwen's vision tokens);
- an InstructPix2Pix pipeline as timbrooks/instruct-pix2pix is laid out (`CLIPTokenizer` from vocab.json and
  merges.txt, `CLIPTextModel`, `AutoencoderKL`, an 8-channel `UNet2DConditionModel`, Euler-ancestral sampler).
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Iterable
from pathlib import Path

QWEN_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
                "<|video_pad|>"]
# ChatML, as Qwen2.5-VL's own template writes it: an image is <|vision_start|><|image_pad|><|vision_end|>.
QWEN_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def save_qwen2_5_vl(folder: Path, corpus: Iterable[str], *, seed: int = 0) -> None:
    """A 2-layer Qwen2.5-VL whose tokenizer's merges are learnt from `corpus`; images of at most 56x56 pixels
    (4 image tokens after the 2x2 merge)."""
    import torch
    from tokenizers import ByteLevelBPETokenizer
    from transformers import (Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2_5_VLProcessor,
                              Qwen2Tokenizer, Qwen2VLImageProcessor, Qwen2VLVideoProcessor)

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(corpus, vocab_size=2000, special_tokens=QWEN_SPECIAL)
    state = json.loads(bpe._tokenizer.to_str())["model"]
    tokenizer = Qwen2Tokenizer(vocab=state["vocab"], merges=[tuple(m) for m in state["merges"]],
                               extra_special_tokens={"image_token": "<|image_pad|>", "video_token": "<|video_pad|>",
                                                     "vision_bos_token": "<|vision_start|>",
                                                     "vision_eos_token": "<|vision_end|>"})
    pixels = {"min_pixels": 28 * 28, "max_pixels": 56 * 56}
    processor = Qwen2_5_VLProcessor(image_processor=Qwen2VLImageProcessor(**pixels), tokenizer=tokenizer,
                                    video_processor=Qwen2VLVideoProcessor(**pixels), chat_template=QWEN_TEMPLATE)
    ids = dict(zip(QWEN_SPECIAL, tokenizer.convert_tokens_to_ids(QWEN_SPECIAL)))
    config = Qwen2_5_VLConfig(
        text_config={"vocab_size": len(tokenizer), "hidden_size": 32, "intermediate_size": 64,
                     "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
                     "max_position_embeddings": 8192, "bos_token_id": ids["<|endoftext|>"],
                     "eos_token_id": ids["<|im_end|>"], "pad_token_id": ids["<|endoftext|>"],
                     # multimodal rotary sections (time, height, width) add up to head_dim / 2 = 8
                     "rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 3, 3]}},
        vision_config={"depth": 2, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2, "out_hidden_size": 32,
                       "fullatt_block_indexes": [1], "window_size": 56},
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"])
    torch.manual_seed(seed)
    Qwen2_5_VLForConditionalGeneration(config).save_pretrained(folder)
    processor.save_pretrained(folder)


def save_instruct_pix2pix(folder: Path, *, seed: int = 0, in_channels: int = 8) -> None:
    """An InstructPix2Pix pipeline folder for 64x64 images; `in_channels=4` gives a plain text-to-image
    StableDiffusionPipeline instead (the kind of model the editor recipe must refuse)."""
    import torch
    from diffusers import (AutoencoderKL, EulerAncestralDiscreteScheduler, StableDiffusionInstructPix2PixPipeline,
                           StableDiffusionPipeline, UNet2DConditionModel)
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer

    # CLIP's vocabulary format: every byte as a symbol, alone and word-final ("</w>"); no merges, so a word is
    # spelt out letter by letter, which a tiny text encoder does not mind
    letters = sorted(ByteLevel.alphabet())
    vocab = letters + [letter + "</w>" for letter in letters] + ["<|startoftext|>", "<|endoftext|>"]
    with tempfile.TemporaryDirectory() as files:
        (Path(files) / "vocab.json").write_text(json.dumps({token: i for i, token in enumerate(vocab)}))
        (Path(files) / "merges.txt").write_text("#version: 0.2\n")
        tokenizer = CLIPTokenizer(vocab=f"{files}/vocab.json", merges=f"{files}/merges.txt", model_max_length=77)
    torch.manual_seed(seed)
    text_encoder = CLIPTextModel(CLIPTextConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=37,
                                                num_hidden_layers=2, num_attention_heads=4,
                                                max_position_embeddings=77, projection_dim=32,
                                                bos_token_id=tokenizer.bos_token_id,
                                                eos_token_id=tokenizer.eos_token_id,
                                                pad_token_id=tokenizer.pad_token_id))
    vae = AutoencoderKL(block_out_channels=(8, 16), down_block_types=("DownEncoderBlock2D",) * 2,
                        up_block_types=("UpDecoderBlock2D",) * 2, latent_channels=4, norm_num_groups=8,
                        sample_size=64)
    unet = UNet2DConditionModel(sample_size=32, in_channels=in_channels, out_channels=4, layers_per_block=1,
                                block_out_channels=(16, 32), down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
                                up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), cross_attention_dim=32,
                                attention_head_dim=4, norm_num_groups=8)
    scheduler = EulerAncestralDiscreteScheduler(num_train_timesteps=1000, beta_schedule="scaled_linear",
                                                beta_start=0.00085, beta_end=0.012, steps_offset=1)
    kind = StableDiffusionInstructPix2PixPipeline if in_channels == 8 else StableDiffusionPipeline
    kind(vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, unet=unet, scheduler=scheduler,
         safety_checker=None, feature_extractor=None, requires_safety_checker=False).save_pretrained(folder)
