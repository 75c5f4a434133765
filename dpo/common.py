"""What the recipes share: their own arguments, loading and converting a config, loading a model by path or Hub id
(`tiny-random` included), a length preflight, and the parser and `main` of the TRL recipes (judge_sft.py,
refiner_dpo.py), which differ only in their trainer."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from medbanana.generation.extras import MissingExtra, install_hint, require
from ..generation.failures import NotFound, UsageError

TRAIN_HINT = install_hint("train")


def help_text(doc: str) -> dict:
    """ArgumentParser options that put the recipe's docstring (what it trains, the commands to run) above --help's
    option list, line breaks kept."""
    import argparse

    return {"description": doc, "formatter_class": argparse.RawDescriptionHelpFormatter}


def require_training_stack(*modules: str) -> None:
    """Import the training dependencies now, or MissingExtra naming the `train` extra."""
    require(*modules, needed_for="training", extra="train")


def run_recipe(make_parser: Callable, main: Callable) -> None:
    """`python -m medbanana.dpo.RECIPE ...`: a missing training dependency ends the command with one line naming the
    extra to install (exit 2), as the `medbanana` command does; everything else runs as `main` decides."""
    try:
        parser = make_parser()
    except MissingExtra as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    main(*parser.parse_args_and_config())


@dataclass
class ScriptArguments:
    """The recipe's own options, beside the trainer's and the model's: which rows, and how images are sized.

    `--trust_remote_code` (off by default) is TRL's own option of DPOConfig / SFTConfig, read from there."""

    dataset_name: str = field(metadata={"help": "A folder written by `medbanana build`, or a Hub dataset repo id."})
    dataset_config: str = field(default="dpo_pairs", metadata={"help": "The config to train on."})
    dataset_train_split: str = field(default="train", metadata={"help": "The split to train on."})
    source_images: str | None = field(default=None, metadata={
        "help": "Folder of your source images (e.g. MIMIC-CXR JPEGs) to attach to released data that ships without "
                "them; matched by task identity (medbanana.loaders.attach_sources)."})
    max_samples: int | None = field(default=None, metadata={"help": "Train on the first N rows only."})
    max_image_side: int | None = field(default=512, metadata={
        "help": "Shrink images to fit a square of this side before the processor sees them; bounds the number "
                "of image tokens (a 1024x1024 image is ~1,300 tokens for Qwen2.5-VL)."})


def load_examples(args: ScriptArguments, converter: Callable, *, drop_missing: Mapping[str, str] | None = None,
                  **kwargs):
    """(examples, left_out): the training rows of `args.dataset_config`, sources attached when asked, converted by
    `converter`; `left_out` counts the rows dropped, by reason.

    Rows with a null in a column of `drop_missing` (column -> why it can be null: an attempt the editor refused, a
    missing image file) are left out, counted and reported; a missing *source* image is an error, since the user
    must attach the sources.
    """
    from medbanana.loaders import attach_sources, convert, load_medbanana

    ds = load_medbanana(args.dataset_name, args.dataset_config, split=args.dataset_train_split,
                        decode_images=False)
    if args.source_images:
        ds = attach_sources(ds, args.source_images)
    left_out = {}
    for column, why in (drop_missing or {}).items():
        before = len(ds)
        ds = ds.filter(lambda value: value is not None, input_columns=[column])
        if len(ds) < before:
            left_out[f"no {column}: {why}"] = before - len(ds)
            print(f"left out {before - len(ds)} of {before} rows without {column} ({why})")
    if args.max_samples is not None:
        ds = ds.select(range(min(args.max_samples, len(ds))))
    if len(ds) == 0:
        raise UsageError(f"no rows to train on in {args.dataset_name} ({args.dataset_config}, "
                         f"{args.dataset_train_split})")
    return convert(ds, converter, max_side=args.max_image_side, **kwargs), left_out


def model_location(name_or_path: str, output_dir: str | Path, save_tiny: Callable[[Path], None]) -> str:
    """What to load with `from_pretrained`: a local folder or a Hub id as given.

    `tiny-random` (no download) is built by `save_tiny(folder)`, written with `save_pretrained` to
    OUTPUT_DIR/tiny-random-base and then loaded from there, exactly as a downloaded model is. A name that is
    written as a path (`./x`, `/x`, `~/x`, `a/b/c`) must be an existing folder.
    """
    from medbanana.loaders.hub import written_as_path

    from .tiny import TINY_MODEL_ID

    if name_or_path == TINY_MODEL_ID:
        folder = Path(output_dir) / "tiny-random-base"
        save_tiny(folder)
        print(f"{TINY_MODEL_ID}: a tiny randomly initialised model, saved to {folder} and loaded from there")
        return str(folder)
    local = Path(name_or_path).expanduser()
    if local.is_dir():
        return str(local)
    if written_as_path(name_or_path) or local.exists():
        raise NotFound(f"no model folder at {name_or_path} ({local.resolve()}): give a folder written "
                                "by save_pretrained, or a Hub model id such as Qwen/Qwen2.5-VL-3B-Instruct")
    return name_or_path


def load_vlm(location: str, model_args, *, trust_remote_code: bool = False):
    """(model, processor) of an image-text-to-text model: `AutoModelForImageTextToText` and the `AutoProcessor`
    saved beside it, from a folder or a Hub id; TRL's ModelConfig gives revision, dtype and attention."""
    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor

    where = {"revision": model_args.model_revision, "trust_remote_code": trust_remote_code}
    dtype = model_args.dtype if model_args.dtype in (None, "auto") else getattr(torch, model_args.dtype)
    processor = AutoProcessor.from_pretrained(location, **where)
    model = AutoModelForImageTextToText.from_pretrained(
        location, dtype=dtype, attn_implementation=model_args.attn_implementation, **where)
    return model, processor


def check_sequence_lengths(dataset, collator, max_length: int | None, text_columns: Iterable[str],
                           sample: int = 8) -> int:
    """Collate the `sample` examples with the longest texts, untruncated; returns the longest length in tokens.

    Raises when `max_length` would cut them: truncation drops image tokens or the answer, and training then fails
    with "Image features and image tokens do not match" or learns from a cut answer. The collator also checks that
    image placeholders match images.
    """
    columns = [c for c in text_columns if c in dataset.column_names]
    sizes = [sum(len(m["content"]) for value in row.values() for m in value)
             for row in dataset.select_columns(columns)]
    longest_rows = sorted(range(len(sizes)), key=sizes.__getitem__, reverse=True)[:sample]
    longest = 0
    for index in longest_rows:
        batch = collator([dataset[index]])
        longest = max(longest, int(batch["attention_mask"].sum(dim=1).max()))
    if max_length is not None and longest > max_length:
        raise UsageError(f"an example is {longest} tokens long (images included) but max_length is {max_length}: "
                         "truncation would cut image tokens or the answer; raise --max_length to at least "
                         f"{longest}, or lower --max_image_side")
    return longest


def without_spurious_warnings(parser):
    """The parser, set up so that a run with ordinary options prints no FutureWarning the user cannot act on.

    TRL's configs set the deprecated `gradient_checkpointing` (True) by default, so transformers warns on every run:
    leave it unset instead, so activation checkpointing is off unless `--activation_checkpointing true` is given
    (the old name still works, and still warns). TRL itself reads transformers' deprecated
    `is_gradient_checkpointing` property while training: that warning is silenced.
    """
    import warnings

    warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
    parser.set_defaults(gradient_checkpointing=None)
    return parser


def report_saved(trainer, what: str) -> None:
    """Say where the trained model went and how to load it."""
    out = trainer.args.output_dir
    adapter = (Path(out) / "adapter_config.json").is_file()
    kind = "LoRA adapter (loads on top of its base model)" if adapter else "model"
    print(f"saved the trained {what} ({kind}, processor beside it) to {out}: "
          f"AutoModelForImageTextToText.from_pretrained({out!r}), AutoProcessor.from_pretrained({out!r})")


@contextmanager
def setup_errors():
    """A setup that fails for a reason the user can fix (a folder or model id that is not there, a refused option,
    a model that will not load) ends the command with the message alone; errors while training keep their
    traceback."""
    try:
        yield
    except (OSError, ValueError) as exc:
        raise SystemExit(f"error: {exc}") from None


def trl_parser(script_arguments: type, trainer_config: str, doc: str):
    """A TRL recipe's TrlParser: its own arguments, TRL's `trainer_config` (a config class named in trl, such as
    "SFTConfig") and ModelConfig, with the recipe's docstring above --help's option list."""
    require_training_stack("torch", "transformers", "trl")
    import trl

    return without_spurious_warnings(trl.TrlParser((script_arguments, getattr(trl, trainer_config), trl.ModelConfig),
                                                   **help_text(doc)))


def train_and_save(build_trainer: Callable, what: str, script_args, training_args, model_args):
    """A TRL recipe's `main`: the trainer from `build_trainer` (a setup error ends the command with its message),
    trained (resumed from --resume_from_checkpoint when given), saved to --output_dir, where it went said as the
    trained `what`. Returns the trainer."""
    with setup_errors():
        trainer = build_trainer(script_args, training_args, model_args)
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    trainer.save_model(training_args.output_dir)
    report_saved(trainer, what)
    return trainer
