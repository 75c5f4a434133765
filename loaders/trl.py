"""Per-example converters from medbanana configs to what a trainer takes, and `convert` to apply one to a dataset.

Each converter is a pure function of one row, usable as `ds.map(converter, remove_columns=ds.column_names)`, and
returns exactly the trainer's columns:

  to_refiner_dpo    dpo_pairs -> images, prompt, chosen, rejected        trl.DPOTrainer (vision, conversational)
  to_judge_sft      judge     -> images, prompt, completion (or messages) trl.SFTTrainer (vision)
  to_editor_sft     sft       -> original_image, edit_prompt, edited_image diffusers' InstructPix2Pix training script
  to_diffusion_dpo  dpo_pairs -> original_image, edit_prompt, chosen_image, rejected_image   dpo/editor_diffusion_dpo

The text the refiner and the judge are trained on is the generation pipeline's own prompt (generation/prompts),
filled in for the row, so a trained model answers exactly what the pipeline asks its writer and judge. Images pass
through as they come (PIL images, or `{"bytes", "path"}` dicts when loaded with `decode_images=False`, which `convert`
uses so that no image is decoded and re-encoded); `max_side` shrinks them to fit a square of that side.
"""

from __future__ import annotations

import io
import json
from collections.abc import Callable
from pathlib import Path

from datasets import Features, Image, IterableDataset, List, Value

from ..generation.prompts import JudgeAnswer, judge_prompt, writer_prompt
from ..generation.records import Attempt, Instruction, Task, Verdict
from ..generation.failures import UsageError

MESSAGES = List({"role": Value("string"), "content": Value("string")})
_ATTACH_HINT = ("source images of released data are not redistributable: attach yours with "
                "medbanana.loaders.attach_sources(ds, DIR), or build with `medbanana build --source-images DIR`")


def to_refiner_dpo(example: dict, *, max_side: int | None = None) -> dict:
    """A dpo_pairs row -> a vision DPO example that trains the instruction writer / refiner.

    The prompt is what the writer saw when it wrote the rejected instruction: the task, and the earlier rounds with
    their verdicts when the rejected one is not the first; chosen is the accepted instruction of the same task.

    >>> from PIL import Image
    >>> row = {"modality": "chest_xray", "disease": "Pleural_Effusion", "task": "add", "dataset": "MIMIC",
    ...        "source_image": Image.new("RGB", (64, 64)), "chosen_instruction": "Blunt the right angle.",
    ...        "rejected_instruction": "Add fluid.", "history": []}
    >>> out = to_refiner_dpo(row)
    >>> sorted(out), len(out["images"]), out["chosen"]
    (['chosen', 'images', 'prompt', 'rejected'], 1, [{'role': 'assistant', 'content': 'Blunt the right angle.'}])
    >>> "Pleural Effusion" in out["prompt"][0]["content"], "<history>" in out["prompt"][0]["content"]
    (True, False)
    >>> row["history"] = [{"round": 1, "instruction": "Add a little fluid.", "edit_error": None,
    ...     "qualified": False, "has_disease": False, "structure_reasonable": True, "looks_realistic": True,
    ...     "fidelity_preserved": True, "score": 0.6, "reason": "no effusion visible"}]
    >>> "no effusion visible" in to_refiner_dpo(row)["prompt"][0]["content"]
    True
    """
    source = _image(example, "source_image", max_side, _ATTACH_HINT)
    chosen, rejected = _text(example, "chosen_instruction"), _text(example, "rejected_instruction")
    history = [_attempt(item) for item in example.get("history") or []]
    _, prompt = writer_prompt(_task(example), history)
    return {"images": [source], "prompt": [{"role": "user", "content": prompt}],
            "chosen": [{"role": "assistant", "content": chosen}],
            "rejected": [{"role": "assistant", "content": rejected}]}


def to_judge_sft(example: dict, *, max_side: int | None = None, as_messages: bool = False) -> dict:
    """A judge row -> a vision SFT example that trains a verifier: [source, edited] + rubric -> verdict JSON.

    Prompt-completion by default, so that SFTTrainer puts the loss on the verdict only; `as_messages=True` gives
    one `messages` conversation instead. The answer holds the verdict fields the judge recorded (nulls left out:
    the original scripts' judge gave no `fidelity_preserved`).

    >>> from PIL import Image
    >>> row = {"modality": "fundus", "disease": "Glaucoma", "task": "remove", "dataset": "ODIR",
    ...        "instruction": "Shrink the optic cup.", "source_image": Image.new("RGB", (8, 8)),
    ...        "edited_image": Image.new("RGB", (8, 8)), "has_disease": False, "structure_reasonable": True,
    ...        "looks_realistic": True, "fidelity_preserved": None, "qualified": True, "reason": "cup is normal"}
    >>> out = to_judge_sft(row)
    >>> sorted(out), len(out["images"])
    (['completion', 'images', 'prompt'], 2)
    >>> answer = json.loads(out["completion"][0]["content"])
    >>> list(answer)
    ['has_disease', 'structure_reasonable', 'looks_realistic', 'qualified', 'reason']
    >>> answer["qualified"], answer["reason"]
    (True, 'cup is normal')
    >>> [m["role"] for m in to_judge_sft(row, as_messages=True)["messages"]]
    ['user', 'assistant']
    """
    source = _image(example, "source_image", max_side, _ATTACH_HINT)
    edited = _image(example, "edited_image", max_side, "this attempt has no edited image; drop such rows first")
    answer = {field: example.get(field) for field in JudgeAnswer.model_fields}
    if answer["qualified"] is None:
        raise UsageError("this row has no verdict (qualified is null); drop unjudged rows first")
    completion = json.dumps({k: v for k, v in answer.items() if v is not None}, ensure_ascii=False)
    prompt = [{"role": "user", "content": judge_prompt(_task(example), _text(example, "instruction"))}]
    answer_turn = [{"role": "assistant", "content": completion}]
    if as_messages:
        return {"images": [source, edited], "messages": prompt + answer_turn}
    return {"images": [source, edited], "prompt": prompt, "completion": answer_turn}


def to_editor_sft(example: dict, *, max_side: int | None = None) -> dict:
    """An sft row -> (original_image, edit_prompt, edited_image), the columns of diffusers' InstructPix2Pix script.

    >>> from PIL import Image
    >>> row = {"instruction": "Add a small bleed.", "source_image": Image.new("RGB", (8, 8)),
    ...        "edited_image": Image.new("RGB", (8, 8))}
    >>> sorted(to_editor_sft(row))
    ['edit_prompt', 'edited_image', 'original_image']
    """
    return {"original_image": _image(example, "source_image", max_side, _ATTACH_HINT),
            "edit_prompt": _text(example, "instruction"),
            "edited_image": _image(example, "edited_image", max_side, "this row has no edited image")}


def to_diffusion_dpo(example: dict, *, max_side: int | None = None, prompt: str = "task") -> dict:
    """A dpo_pairs row -> (original_image, edit_prompt, chosen_image, rejected_image) for Diffusion-DPO.

    Both images must be judged under one condition: `prompt="task"` uses the task sentence of the pair (e.g.
    "Add a pleural effusion to this chest X-ray."), `prompt="chosen"` the accepted instruction.

    >>> from PIL import Image
    >>> blank = Image.new("RGB", (8, 8))
    >>> row = {"prompt": "Remove Glioma from this brain MRI.", "chosen_instruction": "Fill the mass.",
    ...        "source_image": blank, "chosen_image": blank, "rejected_image": blank}
    >>> to_diffusion_dpo(row)["edit_prompt"], to_diffusion_dpo(row, prompt="chosen")["edit_prompt"]
    ('Remove Glioma from this brain MRI.', 'Fill the mass.')
    >>> to_diffusion_dpo({**row, "rejected_image": None})  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: rejected_image is missing: the editor produced no image for the rejected instruction; drop such...
    """
    if prompt not in ("task", "chosen"):
        raise UsageError(f"prompt is 'task' or 'chosen', not {prompt!r}")
    refused = ("the editor produced no image for the rejected instruction; drop such rows first: "
               'ds.filter(lambda image: image is not None, input_columns=["rejected_image"])')
    return {"original_image": _image(example, "source_image", max_side, _ATTACH_HINT),
            "edit_prompt": _text(example, "prompt" if prompt == "task" else "chosen_instruction"),
            "chosen_image": _image(example, "chosen_image", max_side, "the accepted edit's image file was missing"),
            "rejected_image": _image(example, "rejected_image", max_side, refused)}


# What each converter needs, and the features of what it returns (images typed, so bytes dicts stay images).
NEEDS = {
    to_refiner_dpo: ("dpo_pairs", ("modality", "disease", "task", "history", "source_image", "chosen_instruction",
                                   "rejected_instruction")),
    to_judge_sft: ("judge", ("modality", "disease", "task", "instruction", "source_image", "edited_image",
                             "qualified")),
    to_editor_sft: ("sft", ("instruction", "source_image", "edited_image")),
    to_diffusion_dpo: ("dpo_pairs", ("prompt", "chosen_instruction", "source_image", "chosen_image",
                                     "rejected_image")),
}


def output_features(converter: Callable, **kwargs) -> Features:
    if converter is to_refiner_dpo:
        return Features({"images": List(Image()), "prompt": MESSAGES, "chosen": MESSAGES, "rejected": MESSAGES})
    if converter is to_judge_sft:
        text = {"messages": MESSAGES} if kwargs.get("as_messages") else {"prompt": MESSAGES, "completion": MESSAGES}
        return Features({"images": List(Image()), **text})
    if converter is to_editor_sft:
        return Features({"original_image": Image(), "edit_prompt": Value("string"), "edited_image": Image()})
    if converter is to_diffusion_dpo:
        return Features({"original_image": Image(), "edit_prompt": Value("string"), "chosen_image": Image(),
                         "rejected_image": Image()})
    raise UsageError(f"not a medbanana converter: {converter!r}")


def convert(ds, converter: Callable, **kwargs):
    """`ds.map(converter)` keeping only the converter's columns, with image bytes passed on undecoded.

    Works on a Dataset or IterableDataset; keyword arguments go to the converter (`max_side`, `prompt`, ...),
    except `num_proc`, which goes to `map`.
    """
    if converter not in NEEDS:
        raise UsageError(f"not a medbanana converter: {converter!r}")
    config, needed = NEEDS[converter]
    features = ds.features or {}
    missing = [column for column in needed if column not in features]
    if missing:
        raise UsageError(f"{converter.__name__} needs the {config} config (missing columns: {', '.join(missing)})")
    for name, feature in features.items():
        if isinstance(feature, Image) and feature.decode:
            ds = ds.cast_column(name, Image(decode=False))
    map_kwargs = {"num_proc": kwargs.pop("num_proc")} if "num_proc" in kwargs else {}
    output = output_features(converter, **kwargs)
    if isinstance(ds, IterableDataset):  # its map only records `features`; cast makes images decode
        return ds.map(converter, fn_kwargs=kwargs, remove_columns=list(features)).cast(output)
    return ds.map(converter, fn_kwargs=kwargs, remove_columns=list(features), features=output, **map_kwargs)


# ---------------------------------------------------------------- helpers

def _task(example: dict) -> Task:
    return Task(dataset=example.get("dataset") or "", modality=_text(example, "modality"),
                disease=_text(example, "disease"), direction=_text(example, "task"), source_path=Path(""))


def _attempt(item: dict) -> Attempt:
    verdict = None
    if item.get("qualified") is not None:  # judged; null booleans (not produced by the original judge) stay null
        verdict = Verdict(has_disease=item.get("has_disease"), structure_reasonable=item.get("structure_reasonable"),
                          looks_realistic=item.get("looks_realistic"),
                          fidelity_preserved=item.get("fidelity_preserved"), qualified=item["qualified"],
                          reason=item.get("reason") or "")
    return Attempt(round=item["round"], instruction=Instruction(item.get("instruction") or ""), verdict=verdict,
                   edit_error=item.get("edit_error") or "")


def _text(example: dict, column: str) -> str:
    value = example.get(column)
    if not value:
        raise UsageError(f"{column} is missing in this row (an image-only release has no instructions or "
                         "verdicts); such rows cannot be converted")
    return value


def _image(example: dict, column: str, max_side: int | None, hint: str):
    """The image as it came (PIL, or a `{"bytes", "path"}` dict), shrunk to fit `max_side` when larger.

    A shrunk dict comes back as JPEG q95 bytes: datasets would store a PIL image as PNG, ten times slower to
    write for a scan, or re-save a JPEG at quality 75.
    """
    from PIL import Image as PILImage

    value = example.get(column)
    if value is None:
        raise ValueError(f"{column} is missing: {hint}")
    if max_side is None:
        return value
    if isinstance(value, PILImage.Image):
        if max(value.size) <= max_side:
            return value
        small = value.copy()  # never change the caller's image
        small.thumbnail((max_side, max_side))
        return small
    image = _open(value)  # lazy: reads the header only
    if max(image.size) <= max_side:
        return value  # bytes passed on as they are
    image.draft(image.mode, (max_side, max_side))  # JPEG: decode at 1/2, 1/4 or 1/8 scale directly (5x faster)
    image.thumbnail((max_side, max_side))
    buffer = io.BytesIO()
    if image.mode in ("L", "RGB"):
        image.save(buffer, format="JPEG", quality=95)
    else:
        image.save(buffer, format="PNG")
    return {"bytes": buffer.getvalue(), "path": None}


def _open(value):
    from PIL import Image as PILImage

    if isinstance(value, dict) and value.get("bytes"):
        return PILImage.open(io.BytesIO(value["bytes"]))
    if isinstance(value, dict) and value.get("path"):
        return PILImage.open(value["path"])
    raise UsageError(f"not an image: {type(value).__name__}")
