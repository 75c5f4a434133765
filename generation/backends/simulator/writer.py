"""Template instruction writer and rule-based refiner (deterministic given the task and the history).

`first_params` is the smallest convincing change: a subtle finding of medium size with the target's usual margins,
matched grain, on a side chosen from the task key. Round 1 starts from a variation of it seeded by the task key
(`opening_params`) over the levels later rounds reach, so that a first instruction reads like a refined one: a rater
of a blind review cannot tell the round from the wording. Every instruction states the fidelity and negative rules of
the prompt templates (keep everything else, no text/arrows/labels, no painted patches) and is self-contained: it
never mentions attempts, rounds, the judge or feedback (those go to the thinking summary). Later rounds read every
earlier instruction (parsed back into parameters) and verdict, adjust the parameters by the failure reasons in the
last verdict, and never repeat a parameter set that was already tried.
"""

from __future__ import annotations

import hashlib
from dataclasses import replace

from ..base import InstructionWriter
from ...records import Attempt, Instruction, SourceImage, Task
from ...taxonomy import load_taxonomy
from .params import EditParams, parse

# Targets whose region exists on both sides; the writer picks one.
SIDED_REGIONS = {"lung_mid", "lung_apex", "costophrenic_angle", "ribs_lateral", "cerebral_hemisphere",
                 "convexity_dura"}
# Margins a finding usually has: well-defined masses, soft opacities, diffuse haze.
DEFAULT_SOFTNESS = {"Lung_Lesion": 1, "meningioma": 1, "pituitary": 1, "Fracture": 1, "Glaucoma": 2,
                    "Edema": 3, "Cataract": 3, "Lung_Opacity": 3, "Pneumonia": 3}
HEALTHY = {"chest_xray": "normally aerated lung with its usual vessel markings",
           "brain_mri": "normal brain tissue with its usual grey and white matter pattern",
           "fundus": "normal retina with its usual colour and vessels"}
SIDE_WORDS = {"chest_xray": ("lung", "hemithorax"), "brain_mri": ("hemisphere", "hemisphere")}


def first_params(task: Task) -> EditParams:
    label = load_taxonomy().target(task.disease, task.modality)
    side = ""
    if label.region in SIDED_REGIONS:
        side = "right" if hashlib.sha256(task.key.encode()).digest()[0] % 2 == 0 else "left"
    # Add: a subtle finding (the smallest convincing change). Remove: the prompt asks for complete removal.
    intensity = 1 if task.direction == "add" else 3
    return EditParams(intensity=intensity, size=1, softness=DEFAULT_SOFTNESS.get(task.disease, 2), grain=1,
                      side=side)


# Round 1's seeded levels: (add, remove) choices per dimension, or offsets from first_params for softness
OPENING = {"intensity": ((1, 2, 2, 3), (3, 3, 4)), "size": ((1, 1, 2), (1, 2, 3)), "grain": ((1, 2), (1, 2)),
           "tone": ((0, 1), (0, 1))}
SOFTNESS_OFFSETS = (-1, 0, 0, 1)


def opening_params(task: Task) -> EditParams:
    """Round 1's parameters: first_params varied by the task key over the levels refinement reaches."""
    base, seed = first_params(task), hashlib.sha256(f"opening|{task.key}".encode()).digest()
    column = 0 if task.direction == "add" else 1
    levels = {name: choices[column][seed[n] % len(choices[column])] for n, (name, choices) in
              enumerate(OPENING.items())}
    softness = base.step("softness", SOFTNESS_OFFSETS[seed[len(OPENING)] % len(SOFTNESS_OFFSETS)]).softness
    return replace(base, **levels, softness=softness, inward=seed[len(OPENING) + 1] % 4 == 0)


def refine(task: Task, history: list[Attempt]) -> tuple[EditParams, list[str]]:
    """Parameters for the next round from the whole history, and the notes that explain the change."""
    tried = [parse(a.instruction.text) for a in history]
    last = history[-1]
    params = tried[-1]
    notes: list[str] = []
    if last.verdict is None:
        notes.append(f"round {last.round} produced no image ({last.edit_error}); describing the change anew")
        return _untried(params.step("size", -1), tried, notes), notes
    reason = last.verdict.reason.lower()
    earlier = " ".join(a.verdict.reason.lower() for a in history[:-1] if a.verdict)
    if "too subtle" in reason or "no visible change" in reason or "still visible" in reason:
        if params.at_limit("intensity", +1) or ("saturates" in earlier or "implausible density" in earlier):
            params = params.step("size", +1)
            notes.append("stronger wording did not help before; enlarging the area instead")
        else:
            params = params.step("intensity", +1)
            notes.append("the finding was not convincing; asking for a stronger one")
        if "still visible" in reason and "still visible" in earlier:
            params = params.step("size", +1)
    if "wrong way" in reason or "outside the anatomy" in reason or "implausible extent" in reason:
        params = replace(params.step("size", -1), inward=True)
        notes.append("keeping the change inside the target anatomy")
    if "saturates" in reason or "implausible density" in reason:
        params = params.step("intensity", -1).step("size", +1)
        notes.append("the density was implausible; lowering it and spreading it wider")
    if "anatomy in the edited area was erased" in reason:
        params = replace(params.step("size", -1).step("grain", +1), inward=True)
        notes.append("normal structures were wiped out; repairing a tighter area and keeping the texture")
    if "does not match the surrounding tissue" in reason:
        params = params.step("intensity", -1).step("softness", +1)
        notes.append("the repair overshot the surrounding tissue; blending it in more gently")
    if "hard edges" in reason:
        params = params.step("softness", +1)
        notes.append("the border looked cut out; asking for softer margins")
    if "smoother than the surrounding grain" in reason:
        params = params.step("grain", +1) if not params.at_limit("grain", +1) else params.step("intensity", -1)
        notes.append("the texture was too smooth; asking to reproduce the image's own grain")
    if "noisier than the surrounding grain" in reason:
        params = params.step("grain", -1)
        notes.append("the texture was too noisy; asking for a calmer texture")
    if "spills outside" in reason or "structures outside" in reason:
        params = replace(params.step("size", -1), inward=True)
        notes.append("the change reached beyond the target area; making it smaller and more localised")
    if "global intensity shift" in reason:
        params = replace(params, tone=1)
        notes.append("the overall brightness drifted; insisting on unchanged overall brightness")
    return _untried(params, tried, notes), notes


def _untried(params: EditParams, tried: list[EditParams], notes: list[str]) -> EditParams:
    """`params` if new, else the nearest variation nobody tried yet (a failed set is never asked for again)."""
    if params not in tried:
        return params
    flips = [replace(params, side="left" if params.side == "right" else "right")] if params.side else []
    variations = [params.step("size", +1), params.step("softness", +1), params.step("grain", +1),
                  params.step("size", -1), replace(params, inward=not params.inward), *flips,
                  params.step("intensity", +1), params.step("softness", -1), params.step("intensity", -1)]
    for candidate in variations:
        if candidate not in tried:
            notes.append("that combination was already tried; varying it")
            return candidate
    return params


def _side_phrase(task: Task, params: EditParams) -> str:
    if not params.side or task.modality not in SIDE_WORDS:
        return ""
    organ = SIDE_WORDS[task.modality][0]
    image_side = "left" if params.side == "right" else "right"
    return f" of the patient's {params.side} {organ} ({image_side} side of the image)"


def compose(task: Task, params: EditParams) -> str:
    """The instruction text for these parameters (phrases from params.py, so the editor reads them back): the same
    self-contained wording in every round."""
    taxonomy = load_taxonomy()
    label = taxonomy.target(task.disease, task.modality)
    view = taxonomy.modality(task.modality).view
    signs = ", ".join(label.signs[:-1]) + (" and " if len(label.signs) > 1 else "") + label.signs[-1]
    d = task.direction
    where = f"{label.region_text}{_side_phrase(task, params)}"
    inward = ", well inside that area" if params.inward else ""
    if d == "add":
        lines = [taxonomy.task_sentence(task.disease, task.modality, d, where=view),
                 f"In {where}{inward}, create a {params.phrase('intensity', d)}, {params.phrase('size', d)} "
                 f"finding that shows {signs}.",
                 f"Give it {params.phrase('softness', d)}, {params.phrase('grain', d)}."]
        goal = f"makes {label.noun('remove')} unmistakable"
    else:
        lines = [f"Take {label.noun(d)} out of this {view}.",
                 f"In {where}{inward}, where it shows as {signs}, {params.phrase('intensity', d)} and put "
                 f"{HEALTHY[task.modality]} in its place, clearing {params.phrase('size', d)} around it.",
                 f"Blend the repair in with {params.phrase('softness', d)}, {params.phrase('grain', d)}."]
        goal = "leaves this area looking normal"
    keep = ("Keep everything outside that area unchanged: other anatomy, patient position, exposure, contrast, "
            "borders, labels and text markers; add no text, arrows or annotations and keep the view and orientation.")
    if params.tone:
        keep += " Keep identical global brightness, contrast and histogram across the whole image."
    lines += [keep, f"Make the smallest change that {goal}, with no blurred or painted patches."]
    return " ".join(lines)


class TemplateWriter(InstructionWriter):
    """Round 1 from templates; later rounds from the full history (see `refine`); why a round changed what it asks
    goes to the thinking summary, never into the instruction."""

    name = "simulator"

    def __init__(self, *, model: str = "medbanana-template-writer-1"):
        self.model = model

    async def write(self, task: Task, source: SourceImage, history: list[Attempt]) -> Instruction:
        if not history:
            params = opening_params(task)
            summary = f"Round 1: a seeded starting point ({_summary(params)})."
            return Instruction(text=compose(task, params), thinking_summary=summary, model=self.model)
        params, notes = refine(task, history)
        failures = "; ".join(f"round {a.round}: {a.verdict.reason if a.verdict else a.edit_error}" for a in history)
        summary = f"Round {len(history) + 1} after {failures}: {'; '.join(notes) or 'no change'} -> {_summary(params)}."
        return Instruction(text=compose(task, params), thinking_summary=summary, model=self.model)


def _summary(params: EditParams) -> str:
    return ", ".join(f"{k}={v}" for k, v in params.as_dict().items() if v not in ("", False, 0))
