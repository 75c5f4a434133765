"""A `datasets.GeneratorBasedBuilder` that reads a run directory directly, with the same rows as `medbanana build`.

datasets 4+ no longer runs loading scripts from a folder or the Hub, so this builder is used by importing it:

    from medbanana.medbanana_50k import MedBanana50k

    builder = MedBanana50k(config_name="dpo_pairs", data_dir="demo-run/run", cache_dir="hf-cache")
    builder.download_and_prepare()
    ds = builder.as_dataset(split="train")

`data_dir` is a run directory in any layout `medbanana build` reads; `test_fraction=` and `source_images=` work
as the build options of the same names. For publishing, use `medbanana build` (parquet files + card) instead.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path

import datasets

from .generation.dataset.configs import CONFIG_NAMES, DEFAULT_CONFIG
from .generation.dataset.features import CONFIG_DESCRIPTIONS, CONFIG_FEATURES
from .generation.rundir.alignment import fill_geometry
from .generation.rundir.stored_masks import MaskFolders, Rejections, row_masks
from .builder.rows import IMAGE_CONFIGS, MASK_CONFIGS, ROW_ITERATORS, load_images, row_key, split_of
from .generation.rundir.runs import discover_units, read_tasks
from .generation.rundir.confined import Confined
from .generation.rundir.source_index import SourceIndex
from .generation.failures import UsageError

_DESCRIPTION = ("Instruction-based medical image edits (chest X-ray, brain MRI, fundus; add or remove a finding), "
                "judged with a medical rubric and refined over several rounds, keeping every attempt.")
_LICENSE = "Edited images CC BY 4.0; metadata ODC-By 1.0; source images keep their own terms."


@dataclass
class MedBanana50kConfig(datasets.BuilderConfig):
    test_fraction: float = 0.0
    source_images: str | None = None


class MedBanana50k(datasets.GeneratorBasedBuilder):
    BUILDER_CONFIG_CLASS = MedBanana50kConfig
    BUILDER_CONFIGS = [MedBanana50kConfig(name=name, description=CONFIG_DESCRIPTIONS[name]) for name in CONFIG_NAMES]
    DEFAULT_CONFIG_NAME = DEFAULT_CONFIG

    def _info(self) -> datasets.DatasetInfo:
        return datasets.DatasetInfo(description=_DESCRIPTION, features=CONFIG_FEATURES[self.config.name],
                                    license=_LICENSE)

    def _split_generators(self, dl_manager):
        if not self.config.data_dir:
            raise UsageError("MedBanana50k needs data_dir=<run directory> (ours or released Med-Banana data)")
        splits = [datasets.Split.TRAIN] + ([datasets.Split.TEST] if self.config.test_fraction > 0 else [])
        return [datasets.SplitGenerator(name=split, gen_kwargs={"split": str(split)}) for split in splits]

    def _generate_examples(self, split: str):
        config = self.config.name
        sources = SourceIndex(Path(self.config.source_images)) if self.config.source_images else None
        with_images = config in IMAGE_CONFIGS
        confined, folders, rejections = Confined(), MaskFolders(), Rejections()
        for unit in discover_units(Path(self.config.data_dir)):
            for task in read_tasks(unit):
                if split_of(task.source_id, self.config.test_fraction) != split:
                    continue
                images = load_images(task, confined) if with_images else {}
                source = None
                if sources is not None and with_images:
                    source = sources.image_value(task.dataset, task.direction, task.disease, task.source_id,
                                                 task.source_path, task.source_sha256)
                masks = (row_masks(task, images, source, confined, folders, rejections=rejections)
                         if config in MASK_CONFIGS else None)
                if config in MASK_CONFIGS:
                    fill_geometry(task, images, source)
                for row in ROW_ITERATORS[config](task, images, source, masks):
                    yield row_key(config, row), row
        if rejections.items:  # what `build` lists in medbanana-build.json
            kinds = ", ".join(f"{n} {kind}" for kind, n in rejections.kinds.most_common())
            warnings.warn(f"MedBanana50k ({split}): {len(rejections.items)} stored mask(s) rejected and computed or "
                          f"left null ({kinds}), e.g. {rejections.items[0]}", stacklevel=2)
