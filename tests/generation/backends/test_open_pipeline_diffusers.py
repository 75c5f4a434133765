"""The diffusers editor on the CPU with a tiny randomly initialised InstructPix2Pix pipeline built from configs
(dpo/tiny.py): the real pipeline code path, two inference steps, valid images out."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

pytest.importorskip("diffusers", reason="the diffusers editor needs `pip install 'medbanana[train]'`")

from medbanana.generation import backends  # noqa: E402
from medbanana.generation.backends.diffusers_editor import DiffusersEditor, working_size  # noqa: E402
from medbanana.generation.records import SourceImage, Task, decode_rgb, encode_jpeg  # noqa: E402

INSTRUCTIONS = ["Add a small left pleural effusion with a meniscus at the costophrenic angle.",
                "Remove the effusion and restore a sharp costophrenic angle."]


@pytest.fixture(scope="module")
def tiny_pipeline():
    from medbanana.dpo.tiny import tiny_instruct_pix2pix

    return tiny_instruct_pix2pix(INSTRUCTIONS, resolution=64)


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> list[SourceImage]:
    rng = np.random.default_rng(1)
    folder = tmp_path_factory.mktemp("src")
    out = []
    for i, (h, w) in enumerate([(128, 128), (128, 128), (96, 128)]):
        path = folder / f"scan{i}.jpeg"
        path.write_bytes(encode_jpeg(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)))
        out.append(SourceImage(path))
    return out


def make_task(source: SourceImage) -> Task:
    return Task("cxr_demo", "chest_xray", "Pleural_Effusion", "add", source.path)


def editor_with(pipeline, **options) -> DiffusersEditor:
    return DiffusersEditor(pipeline=pipeline, steps=2, resolution=64, device="cpu", **options)


def test_registry_names_the_diffusers_editor():
    assert backends.available("editor").count("diffusers") == 1
    assert "diffusers" not in backends.available("judge")


@pytest.mark.slow
def test_concurrent_edits_are_batched_and_come_back_at_the_source_size(tiny_pipeline, sources):
    editor = editor_with(tiny_pipeline, batch_size=4)

    async def edits():
        return await asyncio.gather(*(editor.edit(make_task(s), s, INSTRUCTIONS[i % 2], seed=i)
                                      for i, s in enumerate(sources)))

    edited = asyncio.run(edits())
    for source, result in zip(sources, edited):
        array = decode_rgb(result.data)
        assert result.data[:3] == b"\xff\xd8\xff" and array.shape == source.array.shape
        assert array.std() > 0  # an image, not a blank
        assert result.details["steps"] == 2 and result.details["pipeline"] == "StableDiffusionInstructPix2PixPipeline"
    # the two square sources share one batch; the 96x128 one runs at its own working size
    assert [r.details["batch_size"] for r in edited] == [2, 2, 1]
    assert edited[2].details["working_size"] == [64, 48]
    assert not any(r.details["prompt_truncated"] for r in edited)  # both fit the tiny tokenizer's 32 tokens
    assert editor.batches_run == 2


@pytest.mark.slow
def test_the_seed_decides_the_edit(tiny_pipeline, sources):
    editor = editor_with(tiny_pipeline, batch_size=1)
    source, task = sources[0], make_task(sources[0])

    async def three():
        return [await editor.edit(task, source, INSTRUCTIONS[0], seed=s) for s in (7, 7, 8)]

    a, b, c = (decode_rgb(r.data).astype(int) for r in asyncio.run(three()))
    assert np.array_equal(a, b)
    assert np.abs(a - c).mean() > 0
    long = asyncio.run(editor.edit(task, source, " ".join([INSTRUCTIONS[0]] * 3), seed=7))
    assert long.details["prompt_truncated"]  # 42 tokens, the text encoder reads 32


def test_a_saved_pipeline_loads_by_path_and_its_class_is_checked(tiny_pipeline, tmp_path):
    tiny_pipeline.save_pretrained(tmp_path / "tiny-ip2p")
    editor = DiffusersEditor(model=str(tmp_path / "tiny-ip2p"), steps=2, resolution=64, device="cpu")
    assert type(editor.pipeline).__name__ == "StableDiffusionInstructPix2PixPipeline"
    assert editor.model.endswith("tiny-ip2p")
    with pytest.raises(ValueError, match="does not edit by instruction"):
        DiffusersEditor(pipeline=object(), device="cpu")


def test_a_missing_model_names_the_id_and_the_offline_setting(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(FileNotFoundError) as caught:
        DiffusersEditor(model="no-such-org/no-such-ip2p-model", device="cpu")
    assert "no-such-org/no-such-ip2p-model" in str(caught.value) and "HF_HUB_OFFLINE" in str(caught.value)


def test_a_failing_batch_becomes_an_api_error_for_each_task(tiny_pipeline, sources, monkeypatch):
    editor = editor_with(tiny_pipeline, batch_size=2)

    def out_of_memory(jobs):
        raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(editor, "_infer", out_of_memory)

    async def edits():
        return await asyncio.gather(*(editor.edit(make_task(s), s, INSTRUCTIONS[0], seed=0) for s in sources[:2]),
                                    return_exceptions=True)

    errors = asyncio.run(edits())
    assert [type(e).__name__ for e in errors] == ["APIError", "APIError"]
    assert {e.kind for e in errors} == {"out_of_memory"}


def test_working_size_keeps_the_aspect_in_multiples_of_8():
    assert working_size(1024, 1024, 512) == (512, 512)
    w, h = working_size(1000, 700, 512)
    assert w == 512 and h % 8 == 0 and abs(h / w - 0.7) < 0.02


# ---------------------------------------------------------------- attention-grounding diagnostics

def test_disease_tokens_are_found_in_the_instruction(tiny_pipeline):
    from medbanana.generation.backends.attention import disease_words, token_positions

    tokenizer = tiny_pipeline.tokenizer
    words = disease_words("Pleural_Effusion", "chest_xray")
    assert {"pleural", "effusion"} <= set(words)
    positions = token_positions(tokenizer, INSTRUCTIONS[0], words)
    tokens = tokenizer.convert_ids_to_tokens(tokenizer(INSTRUCTIONS[0]).input_ids)
    assert sorted(tokens[p] for p in positions) == ["effusion", "pleural"]
    assert token_positions(tokenizer, "Add a small opacity.", words) == []


@pytest.mark.slow
def test_recorded_maps_have_the_image_aspect_and_values_in_0_1(tiny_pipeline, sources):
    import torch
    from PIL import Image

    from medbanana.generation.backends import attention

    unet = tiny_pipeline.unet
    before = {name: type(p).__name__ for name, p in unet.attn_processors.items()}
    positions = [attention.token_positions(tiny_pipeline.tokenizer, INSTRUCTIONS[0], ["pleural", "effusion"])]
    recorder = attention.CrossAttentionRecorder(positions, (24, 32))  # a 64x48 working image, VAE stride 2
    image = Image.fromarray(sources[2].array).resize((64, 48))
    with attention.recording(unet, recorder), torch.inference_mode():
        tiny_pipeline(prompt=[INSTRUCTIONS[0]], image=[image], num_inference_steps=2,
                      generator=[torch.Generator("cpu").manual_seed(0)])
    assert {name: type(p).__name__ for name, p in unet.attn_processors.items()} == before  # restored
    assert recorder.counts[0] > 0
    heat = attention.heat_map(recorder.maps()[0], (128, 96))
    assert heat.shape == (96, 128) and heat.min() == 0.0 and heat.max() == 1.0
    mask = attention.attention_mask(heat)
    assert 0 < mask.sum() < mask.size
    assert attention.iou(mask, mask) == 1.0 and attention.iou(mask, ~mask) == 0.0


def test_the_editor_reports_iou_and_writes_overlays(tiny_pipeline, sources, tmp_path):
    from PIL import Image

    from medbanana.evaluation.attention import summarise

    editor = editor_with(tiny_pipeline, attention_dir=tmp_path / "attention")
    source = sources[2]

    async def two():
        return [await editor.edit(make_task(source), source, text, seed=3)
                for text in (INSTRUCTIONS[0], "Add a small opacity.")]

    grounded, ungrounded = (r.details["attention"] for r in asyncio.run(two()))
    assert 0.0 <= grounded["iou"] <= 1.0 and grounded["mislocalised"] == (grounded["iou"] < 0.1)
    with Image.open(grounded["overlay"]) as overlay:
        assert overlay.size == (128, 96)
    assert ungrounded["iou"] is None and "no disease word" in ungrounded["reason"]
    summary = summarise([{"disease": "Pleural_Effusion", "iou": 0.05, "roi": "edit_mask"},
                         {"disease": "Pleural_Effusion", "iou": 0.5, "roi": "region"},
                         {"disease": "Glaucoma", "iou": None, "roi": None}])  # not scored: left out
    assert summary == {"Pleural_Effusion": {"n": 2, "mean_iou": 0.275, "mislocalisation_rate": 0.5,
                                            "roi": {"edit_mask": 1, "region": 1}}}
