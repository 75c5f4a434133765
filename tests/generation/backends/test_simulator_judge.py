"""The pixel judge confirms a removal only for a lesion it can see in the source (issue 14, item 7).

Sources are the demo's own diseased phantoms (phantoms.write_demo_sources: index 100 + 10 x target, seed 0), built
in memory so that each case is the file the demo writes.
"""

import asyncio
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from medbanana.generation.records import Attempt, EditedImage, SourceImage, Task, encode_jpeg
from medbanana.generation.backends.simulator import scores
from medbanana.generation.backends.simulator.editor import SimulatedEditor
from medbanana.generation.backends.simulator.judge import PixelJudge
from medbanana.generation.backends.simulator.findings import synthesise_disease_source
from medbanana.generation.backends.simulator.phantoms import DATASETS, normal_source
from medbanana.generation.backends.simulator.writer import TemplateWriter, compose, first_params
from medbanana.generation.taxonomy import load_taxonomy

TAXONOMY = load_taxonomy()
ALL_TARGETS = [(m, label.folder) for m in DATASETS for label in TAXONOMY.modality(m).targets]


def _demo_source(modality: str, disease: str, size: int) -> tuple[SourceImage, np.ndarray, dict]:
    """(the diseased demo source, the normal phantom it was drawn on, the lesion's facts), as the demo seed 0."""
    t = [label.folder for label in TAXONOMY.modality(modality).targets].index(disease)
    index = 100 + 10 * t
    normal, _ = normal_source(modality, index, size=size, seed=0)
    diseased, lesion = synthesise_disease_source(normal, modality, disease, seed=index)
    data = encode_jpeg(diseased, quality=95)
    return SourceImage(Path(f"{modality}_{index}_{disease}.jpeg"), data=data), normal, lesion


def _remove(modality: str, disease: str, source: SourceImage) -> Task:
    return Task("test", modality, disease, "remove", source.path)


def test_demo_pituitary_removal_that_removed_nothing_is_not_accepted():
    # The demo's BrainTumor_demo_phantom/pituitary/phantom_mri_120.jpeg at its size (1024).
    source, normal, lesion = _demo_source("brain_mri", "pituitary", 1024)
    size = source.array.shape[0]
    cx, cy = int(lesion["centre_x"] * size), int(lesion["centre_y"] * size)
    patch = (slice(cy - 10, cy + 11), slice(cx - 10, cx + 11))
    gain = source.array[patch][..., 0].astype(float).mean() - normal[patch][..., 0].astype(float).mean()
    assert gain > 20, "the pituitary lesion is plainly there in the source"
    # The do-nothing edit of the issue: the source with a grey level of drift, re-encoded (<= 2 grey levels).
    unchanged = np.clip(source.array.astype(np.int16) + 1, 0, 255).astype(np.uint8)
    edited = EditedImage(encode_jpeg(unchanged, quality=95))
    assert np.abs(edited.array.astype(int) - source.array.astype(int)).max() <= 3
    judge = PixelJudge()
    task = _remove("brain_mri", "pituitary", source)
    verdict = judge.judge_sync(task, source, edited)
    assert not verdict.qualified and verdict.has_disease, verdict.reason
    assert "could not be found in the sella of the source" in verdict.reason
    assert "removal cannot be confirmed" in verdict.reason
    assert verdict.score < 1.0 and not verdict.details["lesion_in_source"]
    assert judge.score_sync(task, source, edited).editing_accuracy == 0.0  # no EA 10/10 in eval either


@pytest.mark.parametrize("modality,disease", [("brain_mri", "glioma"), ("chest_xray", "Atelectasis"),
                                              ("fundus", "Glaucoma")])
def test_a_real_removal_by_the_simulator_editor_still_passes(modality, disease):
    source, _, _ = _demo_source(modality, disease, 512)
    task = _remove(modality, disease, source)
    writer, editor, judge = TemplateWriter(), SimulatedEditor(), PixelJudge()
    history = []
    for round_no in range(1, 6):  # the per-task loop in miniature, as in generation
        instruction = asyncio.run(writer.write(task, source, history))
        edited = editor.edit_sync(task, source, instruction.text, seed=round_no)
        verdict = judge.judge_sync(task, source, edited, instruction.text)
        history.append(Attempt(round=round_no, instruction=instruction, verdict=verdict, accepted=verdict.qualified))
        if verdict.qualified:
            break
    details = verdict.details
    assert verdict.qualified and not verdict.has_disease, [a.verdict.reason for a in history]
    assert details["lesion_in_source"] and details["evidence_before"] >= judge.thresholds.evidence_min
    assert details["evidence_after"] <= judge.thresholds.reduction_max * details["evidence_before"]
    assert "removed in the" in verdict.reason
    assert judge.score_sync(task, source, edited).editing_accuracy >= scores.RAMP_AT_THRESHOLD


@pytest.mark.slow
@pytest.mark.parametrize("modality", list(DATASETS))
def test_an_edit_identical_to_the_source_is_never_accepted_for_a_removal(modality):
    judge = PixelJudge()
    normal, _ = normal_source(modality, 0, size=256, seed=0)
    healthy = SourceImage(Path(f"{modality}_normal.jpeg"), data=encode_jpeg(normal, quality=95))
    for m, disease in ALL_TARGETS:
        if m != modality:
            continue
        diseased, _, _ = _demo_source(modality, disease, 256)
        for source in (diseased, healthy):  # with the finding, and with none to remove
            task = _remove(modality, disease, source)
            verdict = judge.judge_sync(task, source, EditedImage(source.data))
            assert verdict.has_disease and not verdict.qualified, (disease, source.path.name, verdict.reason)
            assert "still visible" in verdict.reason or "could not be found" in verdict.reason
            values = scores.scores(verdict.details, "remove", modality, judge.thresholds)
            assert values["editing_accuracy"] < scores.RAMP_AT_THRESHOLD, (disease, values)


def test_a_removal_must_take_the_evidence_below_the_floor_and_to_half_of_the_source():
    source, _, _ = _demo_source("brain_mri", "glioma", 256)
    task = _remove("brain_mri", "glioma", source)
    judge = PixelJudge()
    m = judge.judge_sync(task, source, EditedImage(source.data)).details
    t = judge.thresholds
    assert m["lesion_in_source"] and m["evidence_before"] > 2 * t.evidence_min
    gone = judge.verdict(task, {**m, "evidence_after": 0.2 * t.evidence_min, "mismatch_after": 0.0})
    assert not gone.has_disease
    left = judge.verdict(task, {**m, "evidence_after": 1.1 * t.evidence_min})
    assert left.has_disease and "still visible" in left.reason
    # Just under the floor but barely reduced: a faint lesion in the source is not "removed" by a tiny change.
    faint = {**m, "evidence_before": 1.2 * t.evidence_min, "evidence_after": 0.95 * t.evidence_min,
             "mismatch_after": 0.0}
    assert judge.verdict(task, faint).has_disease
    # Nothing seen in the source: not passed, however clean the edit looks.
    unseen = {**m, "lesion_in_source": False, "evidence_after": 0.0, "mismatch_after": 0.0}
    verdict = judge.verdict(task, unseen)
    assert verdict.has_disease and not verdict.qualified and "cannot be confirmed" in verdict.reason
    assert scores.editing_accuracy(unseen, "remove", t) == 0.0


@pytest.mark.parametrize("modality,disease", [("brain_mri", "pituitary"), ("chest_xray", "Lung_Lesion"),
                                              ("fundus", "Glaucoma")])
def test_the_add_direction_is_unchanged(modality, disease):
    normal, _ = normal_source(modality, 0, size=512, seed=0)
    source = SourceImage(Path(f"{modality}_normal.jpeg"), data=encode_jpeg(normal, quality=95))
    task = Task("test", modality, disease, "add", source.path)
    judge = PixelJudge()
    unchanged = judge.judge_sync(task, source, EditedImage(source.data))
    assert not unchanged.has_disease and not unchanged.qualified
    assert "no visible change" in unchanged.reason or "too subtle" in unchanged.reason
    assert "lesion_in_source" not in unchanged.details  # the source measurement is a removal's
    text = compose(task, replace(first_params(task), intensity=3))
    edited = SimulatedEditor(jitter=0).edit_sync(task, source, text, seed=1)
    verdict = judge.judge_sync(task, source, edited, text)
    assert verdict.has_disease, verdict.reason
    assert verdict.details["cnr"] >= judge.thresholds.cnr_min
