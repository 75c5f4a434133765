"""The offline simulator backend: region-aware editor, pixel judge, template writer/refiner and demo phantoms."""

import asyncio
import itertools
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from medbanana.generation import backends
from medbanana.generation.records import (Attempt, EditedImage, SourceImage, Task, decode_rgb, encode_jpeg,
                                          rubric_score)
from medbanana.generation.backends.simulator.editor import SimulatedEditor
from medbanana.generation.backends.simulator.imaging import WORK, luminance
from medbanana.generation.raster import resize_rgb
from medbanana.generation.backends.simulator.judge import PixelJudge
from medbanana.generation.backends.simulator.findings import synthesise_disease_source
from medbanana.generation.backends.simulator.lesions import make_canvas, spec_for
from medbanana.generation.backends.simulator.params import SCALES, EditParams, parse
from medbanana.generation.backends.simulator.phantoms import DATASETS, NORMAL_FOLDER, normal_source, write_demo_sources
from medbanana.generation.backends.simulator.writer import TemplateWriter, compose, first_params, refine
from medbanana.generation.taxonomy import load_taxonomy
from paths import SHARED_SAMPLES

TAXONOMY = load_taxonomy()


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict:
    """One clean (look 0) normal phantom per modality at 512², written as JPEG like any source."""
    root = tmp_path_factory.mktemp("phantoms")
    out = {}
    for modality in DATASETS:
        rgb, _ = normal_source(modality, 0, size=512)
        path = root / f"{modality}.jpeg"
        path.write_bytes(encode_jpeg(rgb))
        out[modality] = path
    return out


def _task(modality, disease, path, direction="add"):
    return Task("test", modality, disease, direction, Path(path))


def _instruction(task, **levels):
    return compose(task, replace(first_params(task), **levels))


def _change_in_and_out(task, source, edited):
    """(strong change inside the target region: its 99.5th percentile |grey change|, share of the visible change
    energy (> 3 grey levels) that lies inside the region grown by 12 px), on the judge's working grid."""
    from scipy import ndimage

    canvas = make_canvas(source.array, task.modality)
    region = canvas.regions[spec_for(task.disease).region]
    delta = np.abs(luminance(resize_rgb(edited.array, WORK)) - canvas.lum)
    near = ndimage.binary_dilation(region, iterations=12)
    visible = np.where(delta > 3, delta, 0)
    return float(np.percentile(delta[region], 99.5)), float(visible[near].sum() / max(visible.sum(), 1e-6))


def test_registry_builds_all_three_with_no_arguments():
    assert isinstance(backends.create("writer", "simulator"), TemplateWriter)
    assert isinstance(backends.create("editor", "simulator"), SimulatedEditor)
    assert isinstance(backends.create("judge", "simulator"), PixelJudge)


@pytest.mark.slow
@pytest.mark.parametrize("modality", list(DATASETS))
def test_every_target_changes_its_region_and_little_else(sources, modality):
    editor = SimulatedEditor(jitter=0)  # no global drift: what changes outside is spill
    source = SourceImage(sources[modality])
    for label in TAXONOMY.modality(modality).targets:
        task = _task(modality, label.folder, source.path)
        edited = editor.edit_sync(task, source, _instruction(task, intensity=3), seed=1)
        assert edited.array.shape == source.array.shape
        peak, share = _change_in_and_out(task, source, edited)
        assert peak > 8, f"{label.folder}: no visible change in its region ({peak:.1f} grey levels)"
        assert share > 0.9, f"{label.folder}: only {share:.0%} of the change lies in its region"
        assert edited.details["params"]["intensity"] == "marked"


def test_editor_reads_strength_from_the_instruction(sources):
    editor = SimulatedEditor(jitter=0)
    source = SourceImage(sources["chest_xray"])
    task = _task("chest_xray", "Consolidation", source.path)
    faint = editor.edit_sync(task, source, _instruction(task, intensity=0), seed=3)
    dense = editor.edit_sync(task, source, _instruction(task, intensity=4), seed=3)
    assert _change_in_and_out(task, source, dense)[0] > 2.5 * _change_in_and_out(task, source, faint)[0]
    assert (faint.details["realised"]["intensity"], dense.details["realised"]["intensity"]) == (0.35, 1.5)


def test_editor_and_judge_are_deterministic(sources):
    source = SourceImage(sources["fundus"])
    task = _task("fundus", "Diabetes", source.path)
    text = _instruction(task)
    first, again = (SimulatedEditor().edit_sync(task, source, text, seed=11) for _ in range(2))
    other = SimulatedEditor().edit_sync(task, source, text, seed=12)
    assert first.data == again.data and first.details == again.details
    assert other.data != first.data
    verdicts = [PixelJudge().judge_sync(task, source, first, text) for _ in range(2)]
    assert verdicts[0] == verdicts[1]


def test_judge_fails_unchanged_and_tiny_edits(sources):
    judge = PixelJudge()
    source = SourceImage(sources["chest_xray"])
    task = _task("chest_xray", "Lung_Lesion", source.path)
    unchanged = judge.judge_sync(task, source, EditedImage(encode_jpeg(source.array)))
    assert not unchanged.has_disease and not unchanged.qualified
    assert "too subtle" in unchanged.reason.lower()
    assert unchanged.score == pytest.approx(rubric_score(False, True, True, True))
    tiny = source.array.astype(np.int16)
    y, x = np.mgrid[:512, :512]
    tiny[(y - 230) ** 2 + (x - 150) ** 2 < 12**2] += 3
    verdict = judge.judge_sync(task, source, EditedImage(encode_jpeg(np.clip(tiny, 0, 255))))
    assert not verdict.has_disease and not verdict.qualified and "too subtle" in verdict.reason.lower()


def test_judge_fails_a_hard_edged_paste(sources):
    source = SourceImage(sources["chest_xray"])
    task = _task("chest_xray", "Lung_Lesion", source.path)
    canvas = make_canvas(source.array, "chest_xray")
    ys, xs = np.nonzero(canvas.regions["lung_mid"] & (np.arange(WORK)[None, :] < WORK // 2))
    cy, cx = int(np.median(ys)), int(np.median(xs))  # working grid = 512 = source size here
    pasted = source.array.astype(np.int16)
    y, x = np.mgrid[:512, :512]
    pasted[(y - cy) ** 2 + (x - cx) ** 2 < 22**2] += 45
    verdict = PixelJudge().judge_sync(task, source, EditedImage(encode_jpeg(np.clip(pasted, 0, 255))))
    assert verdict.has_disease  # plainly visible ...
    assert not verdict.looks_realistic and not verdict.qualified  # ... but cut out
    assert "hard edges" in verdict.reason.lower()


def test_judge_passes_a_good_edit(sources):
    source = SourceImage(sources["chest_xray"])
    task = _task("chest_xray", "Consolidation", source.path)
    text = _instruction(task, intensity=3, softness=2, grain=2)
    edited = SimulatedEditor(jitter=0).edit_sync(task, source, text, seed=5)
    verdict = PixelJudge().judge_sync(task, source, edited, text)
    assert verdict.qualified, verdict.reason
    assert (verdict.has_disease, verdict.structure_reasonable, verdict.looks_realistic,
            verdict.fidelity_preserved) == (True, True, True, True)
    assert verdict.score == pytest.approx(1.0)
    assert verdict.details["cnr"] >= PixelJudge().thresholds.cnr_min


def _drive(task, source, rounds=5, seed=0):
    """The per-task loop in miniature: write from the full history, edit the original, judge."""
    writer, editor, judge = TemplateWriter(), SimulatedEditor(), PixelJudge()
    history = []
    for round_no in range(1, rounds + 1):
        instruction = asyncio.run(writer.write(task, source, history))
        edited = asyncio.run(editor.edit(task, source, instruction.text, seed + round_no))
        verdict = asyncio.run(judge.judge(task, source, edited, instruction.text))
        history.append(Attempt(round=round_no, instruction=instruction, verdict=verdict, accepted=verdict.qualified))
        if verdict.qualified:
            break
    return history


def test_refinement_turns_a_too_subtle_edit_into_a_pass(sources):
    path = sources["chest_xray"].with_name("s3.jpeg")  # a source whose seeded first round asks for a subtle finding
    path.write_bytes(sources["chest_xray"].read_bytes())
    source = SourceImage(path)
    task = _task("chest_xray", "Lung_Opacity", source.path)
    history = _drive(task, source)
    assert "too subtle" in history[0].verdict.reason.lower()
    assert history[-1].verdict.qualified and len(history) > 1
    asked = [parse(a.instruction.text) for a in history]
    assert asked[-1].intensity > asked[0].intensity  # the refiner asked for a stronger finding
    assert len(set(asked)) == len(asked)  # and never repeated a parameter set


def test_refiner_reacts_to_each_failure_reason():
    task = _task("chest_xray", "Lung_Lesion", "/nonexistent/s1.jpeg")
    base = first_params(task)

    def after(reason):
        from medbanana.generation.records import Instruction, Verdict

        verdict = Verdict(False, True, True, True, False, reason)
        return refine(task, [Attempt(1, Instruction(compose(task, base)), verdict)])[0]

    assert after("Change too subtle in the mid lung zone.").intensity == base.intensity + 1
    assert after("Hard edges at the lesion border.").softness == base.softness + 1
    assert after("Grain mismatch: the edited area is smoother than the surrounding grain.").grain == base.grain + 1
    spilled = after("Change spills outside the mid lung zone.")
    assert spilled.size == base.size - 1 and spilled.inward
    assert after("Global intensity shift (+3.1 grey levels).").tone == 1


def test_instruction_vocabulary_round_trips_and_states_the_rules():
    task = _task("chest_xray", "Pleural_Effusion", "/nonexistent/s1.jpeg")
    for direction in ("add", "remove"):
        t = replace(task, direction=direction)
        for levels in itertools.product(*(range(len(SCALES[d])) for d in ("intensity", "size", "softness", "grain"))):
            params = EditParams(*levels, tone=levels[0] % 2, side="left", inward=levels[1] % 2 == 0)
            assert parse(compose(t, params)) == params
    text = compose(task, first_params(task))
    for rule in ("unchanged", "no text, arrows or annotations", "smallest change", "costophrenic angle"):
        assert rule in text


def test_remove_on_a_diseased_phantom_clears_the_lesion(sources):
    rgb = decode_rgb(sources["brain_mri"].read_bytes())
    diseased, lesion = synthesise_disease_source(rgb, "brain_mri", "glioma", seed=7)
    path = sources["brain_mri"].with_name("glioma_source.jpeg")
    path.write_bytes(encode_jpeg(diseased))
    source = SourceImage(path)
    task = _task("brain_mri", "glioma", path, direction="remove")
    judge = PixelJudge()
    before = judge.judge_sync(task, source, EditedImage(encode_jpeg(source.array)))
    assert before.has_disease and not before.qualified and "still visible" in before.reason
    history = _drive(task, source)
    last = history[-1].verdict
    assert not last.has_disease and last.qualified, [a.verdict.reason for a in history]
    assert last.details["evidence_after"] < 0.25 * last.details["evidence_before"]
    assert lesion["disease"] == "glioma" and "centre_x" in lesion


@pytest.mark.slow
def test_simulator_copes_with_tiny_and_odd_sources(tmp_path):
    rng = np.random.default_rng(0)
    for size in ((32, 32), (300, 200)):
        path = tmp_path / f"odd_{size[0]}.jpeg"
        Image.fromarray(rng.integers(0, 255, size + (3,), dtype=np.uint8)).save(path, quality=95)
        source = SourceImage(path)
        for modality, disease in (("chest_xray", "Pneumothorax"), ("fundus", "Glaucoma"), ("brain_mri", "meningioma")):
            task = _task(modality, disease, path)
            edited = SimulatedEditor().edit_sync(task, source, _instruction(task), seed=1)
            assert decode_rgb(edited.data).shape == source.array.shape
            verdict = PixelJudge().judge_sync(task, source, edited)
            assert isinstance(verdict.qualified, bool) and verdict.reason


@pytest.mark.slow
def test_demo_sources_follow_the_input_layout(tmp_path):
    records = write_demo_sources(tmp_path, n_normal=1, n_diseased=1, size=256, seed=3)
    targets = TAXONOMY.targets
    assert len(records) == 3 + len(targets)
    for modality, dataset in DATASETS.items():
        assert TAXONOMY.infer_modality(dataset) == modality
        assert len(list((tmp_path / dataset / NORMAL_FOLDER[modality]).glob("*.jpeg"))) == 1
        for label in TAXONOMY.modality(modality).targets:
            assert len(list((tmp_path / dataset / label.folder).glob("*.jpeg"))) == 1
    for record in records:
        path = tmp_path / record["path"]
        with Image.open(path) as im:
            assert (im.format, im.mode, im.size) == ("JPEG", "RGB", (256, 256))
        assert record["origin"] in ("synthetic phantom", "skimage.data.retina()")
        assert record["dataset"] in DATASETS.values() and record["seed"] == 3
        assert ("lesion" in record) == (record["label"] not in NORMAL_FOLDER.values())
    again = tmp_path / "again"
    write_demo_sources(again, n_normal=1, n_diseased=0, size=256, seed=3)
    first = tmp_path / records[0]["path"]
    assert (again / records[0]["path"]).read_bytes() == first.read_bytes()  # seeded: same files


@pytest.mark.slow
@pytest.mark.skipif(not SHARED_SAMPLES.is_dir(), reason=f"real sample images not found at {SHARED_SAMPLES}")
def test_real_samples_as_sources():
    picks = {"chest_xray": ("Chest-XRay-remove/normal", "Consolidation"),
             "brain_mri": ("Brain-MRI-edit/meningioma", "pituitary"),
             "fundus": ("Fundus-remove/normal", "AMD")}
    judge = PixelJudge()
    for modality, (folder, disease) in picks.items():
        path = sorted((SHARED_SAMPLES / folder).glob("*.jpeg"))[0]
        source = SourceImage(path)
        task = _task(modality, disease, path)
        edited = SimulatedEditor(jitter=0).edit_sync(task, source, _instruction(task, intensity=3), seed=2)
        peak, share = _change_in_and_out(task, source, edited)
        assert peak > 8 and share > 0.9, (path.name, peak, share)
        verdict = judge.judge_sync(task, source, edited)
        assert verdict.has_disease, (path.name, verdict.reason)
        assert not judge.judge_sync(task, source, EditedImage(encode_jpeg(source.array))).has_disease
    # a released edit that added a glioma is a diseased source: removing it lowers the lesion evidence
    path = sorted((SHARED_SAMPLES / "Brain-MRI-edit" / "glioma").glob("*.jpeg"))[0]
    source = SourceImage(path)
    task = _task("brain_mri", "glioma", path, direction="remove")
    edited = SimulatedEditor(jitter=0).edit_sync(task, source, _instruction(task), seed=2)
    verdict = judge.judge_sync(task, source, edited)
    assert verdict.details["lesion_pixels"] > 0
    assert verdict.details["evidence_after"] < 0.5 * verdict.details["evidence_before"]
