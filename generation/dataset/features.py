"""The schema of every published config, declared once as `datasets.Features`.

The parquet writer (`builder.parquet`), the loading builder (`medbanana_50k.py`) and the dataset card all take their
columns from `CONFIG_FEATURES`; nothing infers a schema from data.

Conventions: every config starts with the identity columns; verdict columns are flat where a row holds one verdict
(sft, failed, judge) and nested structs where it holds several (dpo_pairs, conversations). Booleans the original
judge did not produce (`fidelity_preserved`, `score`) are null for released data, never guessed.
"""

from __future__ import annotations

from datasets import Features, Image, List, Value

from ..records import VERDICT_BOOLEANS, VERDICT_COLUMNS
from .configs import REVIEW_CONFIG

IDENTITY = {
    "uid": Value("string"),  # "{dataset}/{add|remove}/{source_id}-{disease}": one editing task, unique in a build
    "source_id": Value("string"),  # stem of the source image file
    "dataset": Value("string"),  # source dataset folder name {D}
    "modality": Value("string"),  # chest_xray | brain_mri | fundus
    "disease": Value("string"),  # released folder name of the target, e.g. Pleural_Effusion
    "task": Value("string"),  # the direction, add | remove (the released column name; docs/concepts.md)
    "source_path": Value("string"),  # source image path relative to the sources root, when the run recorded it
}

# the verdict's columns as records declares them (names, order); a score is stored as float32
VERDICT = {name: Value({bool: "bool", float: "float32", str: "string"}[kind])
           for name, kind in VERDICT_COLUMNS.items()}

HISTORY_ITEM = {"round": Value("int32"), "instruction": Value("string"), "edit_error": Value("string"), **VERDICT}

ROUND_ITEM = {
    "round": Value("int32"),
    "instruction": Value("string"),
    "writer_thinking": Value("string"),
    "edit_success": Value("bool"),
    "edit_error": Value("string"),
    "image": Value("string"),  # path of the attempt's image relative to the run directory
    "accepted": Value("bool"),
    **VERDICT,
    "judge_thinking": Value("string"),
    "judge_model": Value("string"),
    "seconds": Value("float32"),
}

# computed from the images, not annotated (generation/masks.py: MASK_METHOD): stored by the run when it wrote each
# image, else computed by the build from the source; null when neither (generation/rundir/stored_masks.py)
MASKS = {
    "edit_mask": Image(),  # PNG (L, 0/255) at the edit's size: where the edit differs from its source beyond noise
    "region_mask": Image(),  # PNG (L, 0/255) at the source's size: the target's anatomical region on the source
}

# measured, not annotated (generation/geometry.py: METHOD): by the run's geometry guard when it made each edit, else
# by the build from the source; null when neither (generation/rundir/alignment.py). At the source's resolution.
ALIGNMENT = {
    "aligned": Value("bool"),  # the row's edited image lies on its source's grid (true for an edit warped back)
    "shift_px": Value("float32"),  # how far the editor moved the frame's centre, px
    "scale": Value("float32"),  # the editor's zoom (geometric mean of the per-axis scales; 1 = none)
    "rotation_deg": Value("float32"),  # the editor's turn, degrees (positive: clockwise as seen)
}

CONFIG_FEATURES: dict[str, Features] = {
    "sft": Features({
        **IDENTITY,
        "instruction": Value("string"),
        "source_image": Image(),
        "edited_image": Image(),
        **MASKS,
        **ALIGNMENT,
        "success_round": Value("int32"),
        **VERDICT,
    }),
    "failed": Features({
        **IDENTITY,
        "round": Value("int32"),
        "instruction": Value("string"),
        "source_image": Image(),
        "edited_image": Image(),  # null when the editor produced no image (edit_error says why)
        **MASKS,
        **ALIGNMENT,
        "edit_error": Value("string"),
        **VERDICT,
        "task_status": Value("string"),  # outcome of the whole task: success | failed | api_failed
        "success_round": Value("int32"),
    }),
    "dpo_pairs": Features({
        **IDENTITY,
        "prompt": Value("string"),  # the task sentence, e.g. "Add a pleural effusion to this chest X-ray."
        "history": List(HISTORY_ITEM),  # the attempts before the rejected one, oldest first
        "source_image": Image(),
        "chosen_image": Image(),
        "rejected_image": Image(),  # null when the rejected instruction made the editor refuse
        "chosen_instruction": Value("string"),
        "rejected_instruction": Value("string"),
        "chosen_round": Value("int32"),
        "rejected_round": Value("int32"),
        "rejected_edit_error": Value("string"),
        "chosen_verdict": dict(VERDICT),
        "rejected_verdict": dict(VERDICT),
    }),
    "conversations": Features({
        **IDENTITY,
        "source_sha256": Value("string"),
        "run": Value("string"),  # name of the run directory the task came from
        "status": Value("string"),  # success | failed | api_failed
        "success_round": Value("int32"),
        "num_rounds": Value("int32"),
        "final_prompt": Value("string"),
        "final_image": Value("string"),
        "api_failure": {"step": Value("string"), "round": Value("int32"), "error": Value("string"),
                        "kind": Value("string")},  # why calls stopped for good (api_failed tasks)
        "models": {"writer": Value("string"), "editor": Value("string"), "judge": Value("string")},
        "seed": Value("int64"),
        "rounds": List(ROUND_ITEM),
    }),
    "judge": Features({
        **IDENTITY,
        "round": Value("int32"),
        "instruction": Value("string"),
        "source_image": Image(),
        "edited_image": Image(),
        **MASKS,
        **ALIGNMENT,
        "accepted": Value("bool"),
        **VERDICT,
        "judge_thinking": Value("string"),
        "judge_model": Value("string"),
    }),
    REVIEW_CONFIG: Features({
        **IDENTITY,
        "round": Value("int32"),  # the attempt reviewed (null for a source shown as real in a realism review)
        "review": Value("string"),  # the review folder's name: one review's answers share it
        "mode": Value("string"),  # rubric | realism
        "item_id": Value("string"),
        "shown": Value("string"),  # pair (rubric: source and edit) | real | edited (realism: the one image shown)
        "rater": Value("string"),  # a pseudonym (rater-1, rater-2, ...: by first answer in this build)
        "answered_at": Value("string"),  # UTC, ISO 8601
        "seconds": Value("float32"),  # from showing the item to the answer
        **{name: Value("bool") for name in VERDICT_BOOLEANS},  # rubric answers; null in realism reviews
        "reason": Value("string"),
        "guess": Value("string"),  # realism: real | edited
        "confidence": Value("int32"),  # realism: 1 (a guess) to 5 (certain)
    }),
}

CONFIG_DESCRIPTIONS = {
    "sft": "One row per accepted edit: the source, the accepted instruction, the edited image and its verdict.",
    "failed": "One row per rejected attempt (failed tasks and the earlier rounds of successful ones), with the "
              "verdict that rejected it and the task's outcome.",
    "dpo_pairs": "One row per (accepted, rejected) pair of the same task: same source image, same direction. "
                 "A task accepted at round k gives k-1 pairs.",
    "conversations": "One row per task with every round (instructions, verdicts, thinking summaries, image paths) "
                     "and the outcome; no image bytes.",
    "judge": "One row per judged attempt, accepted or not: source, edit, instruction and the verdict as labels, "
             "for training a verifier (an edit the geometry guard rejected before the judge is in `failed` only).",
    REVIEW_CONFIG: "One row per expert answer of a blind review (`medbanana review`): the rubric's answers for an "
                   "edit (join with `judge` on uid and round), or a real-or-edited guess; raters pseudonymised.",
}


def image_columns(config: str) -> tuple[str, ...]:
    return tuple(name for name, feature in CONFIG_FEATURES[config].items() if isinstance(feature, Image))
