"""The prompts every model backend sends, and the reading of their answers (no API client is imported here).

The prompt texts live in generation/prompts/*.txt, each starting with a line `version: N`; a run records the
versions its backends used. Building a prompt and parsing an answer are small separate functions, shared by the
Gemini and the OpenAI-compatible backends, the training-data loaders (loaders/trl.py) and evaluation.

The judge's answer has the verdict's booleans as `records.VERDICT_BOOLEANS` declares them, plus a reason, and
becomes a `records.Verdict` through `verdict_from_answer` alone.
"""

from __future__ import annotations

import json
import re
import string
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources

from pydantic import BaseModel, Field, create_model

from .records import VERDICT_BOOLEANS, Attempt, Task, Usage, Verdict, rubric_score
from .taxonomy import load_taxonomy

PROMPT_NAMES = ("writer_add", "writer_remove", "writer_refine", "editor", "judge")  # generation runs
WRITER_PROMPTS = ("writer_add", "writer_remove", "writer_refine")


@dataclass(frozen=True)
class Prompt:
    name: str
    version: str
    template: string.Template

    @property
    def tag(self) -> str:
        return f"{self.name}/{self.version}"

    def render(self, **fields) -> str:
        return self.template.substitute(fields)


def parse_prompt(name: str, text: str) -> Prompt:
    first, _, body = text.partition("\n")
    match = re.fullmatch(r"version:\s*(\S+)", first.strip())
    if not match:
        raise ValueError(f"prompt {name}.txt must start with a line 'version: N', not {first!r}")
    return Prompt(name, match.group(1), string.Template(body.strip()))


@lru_cache(maxsize=None)
def load_prompt(name: str) -> Prompt:
    text = resources.files("medbanana.generation").joinpath("prompts", f"{name}.txt").read_text(encoding="utf-8")
    return parse_prompt(name, text)


def prompt_versions(names=PROMPT_NAMES) -> dict[str, str]:
    """The prompts' versions (every generation prompt by default), to record in a run's configuration."""
    return {name: load_prompt(name).version for name in names}


def task_fields(task: Task) -> dict[str, str]:
    taxonomy = load_taxonomy()
    label = taxonomy.target(task.disease, task.modality)
    modality = taxonomy.modality(task.modality)
    return {"view": modality.view, "modality": modality.display, "finding": label.name,
            "direction": task.direction, "region": label.region_text, "signs": "; ".join(label.signs)}


def history_json(history: list[Attempt]) -> str:
    """Earlier rounds for the refinement prompt: instruction plus verdict, edit error, or why the geometry guard
    rejected the edit before judging (`frame_moved`), oldest first."""
    rounds = []
    for attempt in sorted(history, key=lambda a: a.round):
        entry = {"round": attempt.round, "instruction": attempt.instruction.text}
        if attempt.edit_error:
            entry["edit_error"] = attempt.edit_error
        if attempt.frame_rejected and attempt.verdict:
            entry["frame_moved"] = attempt.verdict.reason
        elif attempt.verdict:
            verdict = attempt.verdict
            entry["verdict"] = {**{name: getattr(verdict, name) for name in VERDICT_BOOLEANS}, "reason": verdict.reason}
        rounds.append(entry)
    return json.dumps(rounds, indent=1, ensure_ascii=False)


def writer_prompt(task: Task, history: list[Attempt]) -> tuple[Prompt, str]:
    if history:
        prompt = load_prompt("writer_refine")
        return prompt, prompt.render(**task_fields(task), history=history_json(history))
    prompt = load_prompt(f"writer_{task.direction}")
    return prompt, prompt.render(**task_fields(task))


def editor_prompt(task: Task, instruction: str) -> str:
    return load_prompt("editor").render(**task_fields(task), instruction=instruction.strip())


def judge_prompt(task: Task, instruction: str) -> str:
    return load_prompt("judge").render(**task_fields(task), instruction=instruction.strip())


def score_prompt(task: Task, instruction: str, with_ground_truth: bool) -> str:
    """The 0-10 scoring prompt (evaluation); the images are attached in the order it names."""
    images = ("The attached images are, in order: the ORIGINAL, a GROUND-TRUTH edit made by experts for the same "
              "instruction, and the EDITED result." if with_ground_truth else
              "The attached images are, in order: the ORIGINAL and the EDITED result.")
    return load_prompt("eval_score").render(**task_fields(task), instruction=instruction.strip(), images=images)


def reask_note(problem: str, number: int, tries: int) -> str:
    """What a re-ask adds to the prompt: a different payload every time, so the request cache cannot return the
    same unusable answer."""
    return (f"Your previous answer could not be used ({problem}). This is try {number + 1} of {tries}: "
            f"answer again, exactly in the requested format.")


# ---------------------------------------------------------------- answers

# The verdict's booleans in records' order, then the reason: the JSON the judge prompt asks for.
JudgeAnswer = create_model("JudgeAnswer", **dict.fromkeys(VERDICT_BOOLEANS, (bool, ...)), reason=(str, ...))


class ScoreAnswer(BaseModel):
    editing_accuracy: int = Field(ge=0, le=10)
    visual_quality: int = Field(ge=0, le=10)
    reason: str


def _json_answer(text: str):
    body = re.sub(r"^```(?:json)?\s*|\s*```$", "", text.strip())
    raw = json.loads(body)
    return raw[0] if isinstance(raw, list) and len(raw) == 1 else raw


def parse_scores(text: str) -> ScoreAnswer:
    """The scorer's JSON answer; ValueError when it is not two integer scores in 0-10 and a reason."""
    return ScoreAnswer.model_validate(_json_answer(text))


def parse_verdict(text: str) -> JudgeAnswer:
    """The judge's JSON answer (bare or in a ```json fence); ValueError when it is not a complete verdict."""
    return JudgeAnswer.model_validate(_json_answer(text))


def parse_verdict_tolerant(text: str) -> JudgeAnswer:
    """parse_verdict, else the outermost {...} of an answer that wraps its JSON in prose; ValueError if neither."""
    try:
        return parse_verdict(text)
    except ValueError as first:
        start, end = text.find("{"), text.rfind("}")
        if start < 0 or end <= start:
            raise first
        return parse_verdict(text[start:end + 1])


def verdict_from_answer(ans: JudgeAnswer, task: Task, *, thinking: str, model: str, usage: Usage,
                        details: dict) -> Verdict:
    """A judge's parsed answer as a Verdict. Compliance is enforced on our side: `qualified` needs the disease
    present after add and absent after remove; the score is the 40/25/20/15 rubric."""
    verdict = Verdict(**{name: getattr(ans, name) for name in VERDICT_BOOLEANS}, reason=ans.reason,
                      thinking_summary=thinking, model=model, usage=usage, details=details)
    compliant = verdict.compliance(task.direction)
    if verdict.qualified and not compliant:
        verdict.qualified = False
        verdict.details["qualified_overridden"] = (
            f"has_disease must be {'true' if task.direction == 'add' else 'false'} after {task.direction}")
    verdict.score = rubric_score(compliant, ans.structure_reasonable, ans.looks_realistic, ans.fidelity_preserved)
    return verdict


def clean_instruction(text: str) -> str:
    """The writer's answer without a label or wrapping quotes; ValueError when nothing is left."""
    text = re.sub(r"^\s*(new\s+)?instruction\s*:\s*", "", text.strip(), flags=re.IGNORECASE).strip()
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "\"'":
        text = text[1:-1].strip()
    if not text:
        raise ValueError("the answer holds no instruction")
    return text
