"""A run's per-image work (runners/image_work.py): the masks of an attempt are what a build computes, and the
region mask of a (source, taxonomy region) is made in the pool once, then handed to the later attempts' jobs."""

from __future__ import annotations

import asyncio
import io
from pathlib import Path

import numpy as np
from PIL import Image

from medbanana.generation import masks
from medbanana.generation.records import Task
from medbanana.generation.runners.image_work import ImageWork


def _jpeg(rgb: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(rgb).save(buffer, format="JPEG", quality=95)
    return buffer.getvalue()


def _scan(seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:256, 0:256] / 256
    grey = 100 + 50 * np.sin(5 * xx + seed) * np.cos(3 * yy) + rng.normal(0, 3, (256, 256))
    return np.repeat(np.clip(grey, 0, 255).astype(np.uint8)[..., None], 3, 2)


def test_a_region_mask_is_made_once_per_source_and_region_and_every_mask_is_what_a_build_computes(tmp_path):
    sources = {}
    for seed in (1, 2):
        path = tmp_path / f"s{seed}.jpeg"
        path.write_bytes(_jpeg(_scan(seed)))
        sources[seed] = path
    edited = _scan(1)
    edited[100:140, 60:110] = 230  # a bright patch: an edit to find
    edit = _jpeg(edited)
    # Atelectasis and Pneumonia share the lung region of chest X-ray; Pleural_Effusion is elsewhere
    jobs = [(1, "Atelectasis"), (1, "Pneumonia"), (1, "Pleural_Effusion"), (2, "Pneumonia"), (1, "Atelectasis")]
    tasks = [Task("MIMIC_t", "chest_xray", disease, "add", sources[seed]) for seed, disease in jobs]
    handed = []

    async def scenario():
        work = ImageWork(1, start_after=0)
        run = work.pool.run

        async def spied(function, *args, **kwargs):
            handed.append(args[-1])  # the region mask the job was given, or None
            return await run(function, *args, **kwargs)

        work.pool.run = spied
        try:
            return [await work._compute(task, edit, False) for task in tasks]
        finally:
            work.close()

    results = asyncio.run(scenario())
    regions = [region for _, region in results]
    assert all(regions) and all(edit_mask for edit_mask, _ in results)
    # made for the first of each (source, region), the other source's included; the later ones got it
    assert handed == [None, regions[0], None, None, regions[0]]
    assert regions[0] == regions[1] == regions[4] != regions[2]
    for task, (edit_mask, region) in zip(tasks, results):
        expected = masks.task_masks({"": {"bytes": edit, "path": None}},
                                    {"bytes": Path(task.source_path).read_bytes(), "path": None},
                                    task.modality, task.disease)
        assert edit_mask == expected.edits[""]["bytes"] and region == expected.region["bytes"]
