"""Loading helpers for the published configs.

`load_medbanana(path_or_repo, config)` loads one config with its schema checked; `to_pandas(ds)` gives the metadata
without decoding images; the converters in `medbanana.loaders.trl` (`to_refiner_dpo`, `to_judge_sft`,
`to_editor_sft`, `to_diffusion_dpo`, and `convert` to apply one to a dataset) feed TRL and diffusers directly.
`attach_sources(ds, DIR)` fills `source_image` of an already-published dataset from source images the user holds
(sources such as MIMIC-CXR are not redistributable), matched by task identity exactly as `medbanana build
--source-images DIR` does.
"""

from __future__ import annotations

import warnings
from pathlib import Path

from ..generation.rundir.source_index import SourceIndex, looked_for
from .hub import load_medbanana, to_pandas
from .trl import convert, to_diffusion_dpo, to_editor_sft, to_judge_sft, to_refiner_dpo
from ..generation.failures import UsageError

__all__ = ["attach_sources", "load_medbanana", "to_pandas", "convert", "to_refiner_dpo", "to_judge_sft",
           "to_editor_sft", "to_diffusion_dpo"]

_IDENTITY = ["dataset", "task", "disease", "source_id", "source_path"]


def attach_sources(ds, source_dir: str | Path, *, strict: bool = False):
    """Return `ds` (Dataset, IterableDataset or DatasetDict) with `source_image` filled from `source_dir`.

    `source_dir` follows the original input layout (`{D}/normal/<stem>.jpg`, `{D}/{Disease}/<stem>.jpg`) or is any
    tree of files named by source id. The files' bytes go in as they are. Rows without a match keep a null
    `source_image` (counted in a warning), or raise a ValueError when `strict`; a folder with no image, or (not
    streaming) matching no row, is a ValueError. Other columns, images included, are not touched.
    Only files inside `source_dir` are read (a symlink leading out of it is refused) and only JPEG or PNG images
    are attached: either refusal raises `medbanana.generation.rundir.confined.Refused` (a ValueError) naming the file.
    """
    if isinstance(ds, dict):  # DatasetDict / IterableDatasetDict
        return type(ds)({split: attach_sources(part, source_dir, strict=strict) for split, part in ds.items()})
    columns = ds.column_names or list(ds.features)
    if "source_image" not in columns:
        raise UsageError("this config has no source_image column (conversations has none); "
                         "use sft, failed, dpo_pairs or judge")
    index = SourceIndex(Path(source_dir))
    if not len(index):  # the wrong folder: said now rather than as a dataset of nulls
        raise UsageError(f"no source image to attach: {source_dir} holds no JPEG or PNG file")

    def fill(dataset, task, disease, source_id, source_path):
        value = index.image_value(dataset, task, disease, source_id, source_path)
        if value is None and strict:
            raise UsageError(f"no source image for {dataset}/{task}/{source_id} ({disease}) in {source_dir}")
        return {"source_image": value}

    if not hasattr(ds, "cache_files"):  # streaming: map's output is typed only by a cast afterwards
        return ds.map(fill, input_columns=_IDENTITY).cast(ds.features)  # lazy: only `strict` can check matches
    filled = ds.map(fill, input_columns=_IDENTITY, features=ds.features, writer_batch_size=100,
                    new_fingerprint=_fingerprint(ds, source_dir))
    _count_matches(filled, source_dir)
    return filled


def _count_matches(ds, source_dir) -> None:
    """No match at all is a ValueError (the folder is not the one these rows came from); a partial match is a
    warning with the count. Read from the column's null count: also right when map's result came from cache."""
    total = ds.num_rows
    matched = total - ds.data.column("source_image").null_count
    if total and not matched:
        first = ds.select_columns(_IDENTITY)[0]
        raise UsageError(f"no source image in {source_dir} for any of the {total:,} rows; looked for e.g. "
                         f"{looked_for(*(first[c] for c in _IDENTITY))}")
    if matched < total:
        warnings.warn(f"attach_sources: {matched:,} of {total:,} rows got a source image from {source_dir}; the "
                      f"other {total - matched:,} keep a null source_image (strict=True makes that an error)",
                      stacklevel=3)


def _fingerprint(ds, source_dir) -> str:
    import hashlib

    return hashlib.sha256(f"{ds._fingerprint}|attach_sources|{Path(source_dir).resolve()}".encode()).hexdigest()[:32]
