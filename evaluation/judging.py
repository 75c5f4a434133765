"""Judge-based scores through the project's judge backends (`simulator`, `gemini`, or any registered one).

EA (editing accuracy) and VQ (visual quality) are MedEBench's 0-10 judge scores, reported /10. A backend that
scores (has `score(task, source, edited, instruction, ground_truth)` -> records.EditScores) gives them directly:

* gemini: the judge model answers prompts/eval_score.txt (with the ground-truth edit when the sample has one)
  through a JSON schema of two integers 0-10 and a reason;
* simulator: continuous scores from the pixel judge's measurements (generation/backends/simulator/scores.py).

A backend that cannot score (e.g. openai) falls back to its rubric verdict's passes (10 = pass, 0 = fail): EA from
instruction compliance, VQ from structural plausibility and realism weighed 25:20 as in the rubric. Either way the
rubric verdict is asked for too, for CP (judge) (fidelity preserved, 10 or 0) and the qualified rate. Which method
was used, and the prompts' versions and templates, are recorded once per evaluation (`judge_description`), and
each record keeps the prompts sent. What a backend sends and how it scores are its class attributes (`prompts`,
`scoring_prompt`, `scoring_mapping`), so no backend is named here.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from ..generation import backends
from ..generation.prompts import judge_prompt, load_prompt, score_prompt
from ..generation.records import (RUBRIC_WEIGHTS, VERDICT_BOOLEANS, EditedImage, EditScores, SourceImage, Task,
                                  Verdict)
from .inputs import Sample, image_bytes
from ..generation.failures import UsageError

SCALE = 10.0


def make_judge(backend: str, *, model: str | None = None, temperature: float | None = None, **transport_options):
    """A judge backend by name. An API judge (one that sends `prompts`, e.g. gemini) takes a model, a temperature
    and transport options (see its transport); a judge that sends no prompt takes none of them."""
    options = {k: v for k, v in transport_options.items() if v is not None}
    if not getattr(backends.backend_class("judge", backend), "prompts", ()):
        if model or temperature is not None:
            raise UsageError(f"--judge-model and --temperature apply to an API judge (e.g. gemini), not {backend!r}")
        return backends.create("judge", backend)
    try:
        return backends.create("judge", backend, temperature=temperature, **({"model": model} if model else {}),
                               **options)
    except TypeError as exc:  # an option the backend or its transport does not take
        raise UsageError(f"options of the {backend} judge: {exc}") from None


def can_score(judge) -> bool:
    """Whether the backend gives 0-10 scores itself (else EA and VQ come from its verdict's passes)."""
    return callable(getattr(judge, "score", None))


def judge_description(judge) -> dict:
    """What to record once per evaluation: backend, model, the verdict prompt's name, version and template, and
    how EA / VQ are obtained (`scores`: method scorer | verdict_passes, with the scoring prompt where there is one)."""
    info = {"backend": getattr(judge, "name", type(judge).__name__), "model": getattr(judge, "model", None),
            "prompt": None, "prompt_template": None}
    scoring = {"method": "scorer" if can_score(judge) else "verdict_passes", "prompt": None, "prompt_template": None}
    if "judge" in getattr(judge, "prompts", ()):
        prompt = load_prompt("judge")
        info.update(prompt=prompt.tag, prompt_template=prompt.template.template,
                    temperature=getattr(judge, "temperature", None))
    if can_score(judge) and getattr(judge, "scoring_prompt", ""):
        score_template = load_prompt(judge.scoring_prompt)
        scoring.update(prompt=score_template.tag, prompt_template=score_template.template.template)
    elif can_score(judge) and getattr(judge, "scoring_mapping", ""):
        scoring["mapping"] = judge.scoring_mapping
    return {**info, "scores": scoring}


def scores_note(description: dict) -> str:
    """The report's note on how EA, VQ and CP (judge) were obtained."""
    scoring = description.get("scores") or {}
    if scoring.get("method") == "scorer":
        how = (f"scored 0-10 by the {description.get('backend')} judge"
               + (f" (prompt {scoring['prompt']})" if scoring.get("prompt") else
                  f" ({scoring['mapping']})" if scoring.get("mapping") else ""))
    else:
        how = ("the judge's rubric passes on 0-10, as this backend cannot score (EA: compliance; VQ: structure and "
               "realism 25:20)")
    return (f"EA (editing accuracy) and VQ (visual quality): {how}; CP (judge): the verdict's fidelity pass (10 or "
            "0). Averages are reported /10.")


def task_of(sample: Sample) -> Task:
    return Task(dataset=sample.dataset, modality=sample.modality, disease=sample.disease,
                direction=sample.direction, source_path=Path(sample.id))


def rendered_prompt(judge, sample: Sample) -> str | None:
    """The verdict prompt the judge sends for this sample (None for a judge that sends none)."""
    if "judge" not in getattr(judge, "prompts", ()):
        return None
    try:
        return judge_prompt(task_of(sample), sample.instruction)
    except ValueError:  # not a taxonomy target: the judge call fails the same way and says so
        return None


def rendered_score_prompt(judge, sample: Sample) -> str | None:
    if not getattr(judge, "scoring_prompt", ""):
        return None
    try:
        return score_prompt(task_of(sample), sample.instruction, sample.ground_truth is not None)
    except ValueError:
        return None


def scores(verdict: Verdict, direction: str) -> dict:
    """EA, VQ and CP (judge) on 0-10 from a verdict's passes (the fallback; see the module docstring)."""
    w = RUBRIC_WEIGHTS
    visual = (w["structure_reasonable"] * verdict.structure_reasonable
              + w["looks_realistic"] * verdict.looks_realistic) / (w["structure_reasonable"] + w["looks_realistic"])
    return {"ea": SCALE * verdict.compliance(direction), "vq": round(SCALE * visual, 4),
            "cp_judge": SCALE * verdict.fidelity_preserved}


def labels(verdict: Verdict) -> dict[str, bool]:
    """The verdict's five booleans (what repeat consistency and human agreement compare)."""
    return {name: bool(getattr(verdict, name)) for name in VERDICT_BOOLEANS}


async def judge_once(judge, sample: Sample, source: bytes | SourceImage, edited: bytes | EditedImage) -> Verdict:
    source, edited = _images(sample, source, edited)
    return await judge.judge(task_of(sample), source, edited, sample.instruction)


async def score_once(judge, sample: Sample, source: bytes | SourceImage, edited: bytes | EditedImage) -> EditScores:
    truth = SourceImage(Path(sample.id), data=image_bytes(sample.ground_truth)) \
        if sample.ground_truth is not None else None
    source, edited = _images(sample, source, edited)
    return await judge.score(task_of(sample), source, edited, sample.instruction, truth)


def _images(sample: Sample, source: bytes | SourceImage, edited: bytes | EditedImage,
            arrays: tuple | None = None) -> tuple[SourceImage, EditedImage]:
    """The images as a judge takes them (given images as they are); `arrays`: their decoded RGB, when the caller
    decoded them already (a local judge then decodes nothing again)."""
    if isinstance(source, bytes):
        source = SourceImage(Path(sample.id), data=source)
    if isinstance(edited, bytes):
        edited = EditedImage(data=edited, mime_type=SourceImage(Path("edited"), data=edited).mime_type)
    if arrays is not None:  # cached_property: the instance's own attribute from now on
        source.array, edited.array = arrays
    return source, edited


async def judge_record(judge, sample: Sample, source: bytes, edited: bytes, arrays: tuple | None = None) -> dict:
    """The judge's fields of a sample's record: the verdict's, and with a scoring backend its EA / VQ (`scores`),
    both asked at once, of the same images (`arrays`: their RGB as `SourceImage.array` decodes them, when the
    caller has it); a failed call is recorded in `judge_error` (which call, why), never raised."""
    scoring = can_score(judge)
    out, errors = {"judge_prompt": rendered_prompt(judge, sample)}, []
    images = _images(sample, source, edited, arrays)
    calls = [judge_once(judge, sample, *images)]
    if scoring:
        out["score_prompt"] = rendered_score_prompt(judge, sample)
        calls.append(score_once(judge, sample, *images))
    # API errors and backend bugs alike become data
    verdict, *graded = await asyncio.gather(*calls, return_exceptions=True)
    if isinstance(verdict, Exception):
        errors.append(f"verdict: {type(verdict).__name__}: {verdict}")
    else:
        derived = scores(verdict, sample.direction)
        out.update(derived if not scoring else {"cp_judge": derived["cp_judge"]}, qualified=verdict.qualified,
                   verdict={**labels(verdict), "score": round(float(verdict.score), 4), "reason": verdict.reason,
                            "model": verdict.model},
                   judge_prompt_version=verdict.details.get("prompt"))
    for result in graded:
        if isinstance(result, Exception):
            errors.append(f"scores: {type(result).__name__}: {result}")
        else:
            out.update(ea=result.editing_accuracy, vq=result.visual_quality,
                       scores={"reason": result.reason, "model": result.model,
                               "prompt_version": result.details.get("prompt")})
    if errors:
        out["judge_error"] = "; ".join(errors)
    return out
