"""Load a published (or locally built) medbanana dataset, and read its metadata without touching image bytes."""

from __future__ import annotations

from pathlib import Path

import datasets
from datasets import Dataset, DatasetDict, IterableDataset, IterableDatasetDict

from ..generation.dataset.configs import PUBLISHED_CONFIGS, REVIEW_CONFIG
from ..generation.dataset.features import CONFIG_FEATURES, image_columns
from ..generation.dataset.folder import CARD, read_card, shard_files
from ..generation.dataset.hub import unreachable
from ..generation.rundir import layout
from ..generation.failures import NotFound, UsageError


def load_medbanana(path_or_repo: str | Path, config: str = "sft", *, split: str | None = "train",
                   streaming: bool = False, decode_images: bool = True, **load_kwargs):
    """`datasets.load_dataset` for one medbanana config, with its schema checked.

    `path_or_repo` is a folder written by `medbanana build` or a Hub dataset repo id (ORG/NAME: a bare name that is
    no folder here is refused, and so, at once, is an id when the Hub cannot be reached, unless HF_HUB_OFFLINE
    asks for datasets' cached copy). `split=None` gives every split (a DatasetDict). A folder's rows are its own
    regular shard files alone (generation/dataset/folder.py: the card's YAML never names a file, a link is refused; a
    refusal is a ValueError naming the file). `decode_images=False` gives images as `{"bytes", "path"}` dicts:
    nothing is decoded, and `ds.map` passes the bytes on as they are. Other keyword arguments go to `load_dataset`
    (e.g. `revision`).
    """
    if config not in CONFIG_FEATURES:
        raise UsageError(f"unknown config {config!r}; a medbanana dataset has {', '.join(PUBLISHED_CONFIGS)}")
    local = Path(path_or_repo).expanduser()
    if local.is_dir():
        ds = _load_folder(local, config, split, streaming, load_kwargs)
    elif written_as_path(str(path_or_repo)) or local.exists():
        raise NotFound(f"no dataset folder at {path_or_repo} ({local.resolve()}): give the folder written "
                                "by `medbanana build`, or a Hub dataset repo id")
    else:
        _check_hub_id(str(path_or_repo), load_kwargs.get("revision"))
        try:
            ds = datasets.load_dataset(str(path_or_repo), config, split=split, streaming=streaming, **load_kwargs)
        except (ConnectionError, datasets.exceptions.DatasetNotFoundError) as exc:
            raise NotFound(f"{path_or_repo!r} is not a folder in {Path.cwd()}, and it could not be loaded "
                                    f"as a Hub dataset repo id either ({exc})") from exc
    _check_columns(ds, config, path_or_repo)
    if not decode_images:
        for column in image_columns(config):
            ds = ds.cast_column(column, datasets.Image(decode=False))
    return ds


HUB_TIMEOUT = 10  # seconds to wait for the Hub's answer about a dataset before saying it cannot be reached


def _check_hub_id(name: str, revision: str | None) -> None:
    """Refuse at once, in one message that says what to do, a name that is neither a folder here nor a dataset the
    Hub can be asked about: without this, datasets would try the Hub five times (about 24 s) and then, offline,
    hand back whatever copy it cached under that name earlier, without a word. With HF_HUB_OFFLINE set the user
    asked for that cached copy, and gets it."""
    from huggingface_hub import HfApi, constants
    from huggingface_hub.errors import RepositoryNotFoundError

    here = f"not a folder in {Path.cwd()}"
    if "/" not in name:  # a Hub dataset id is ORG/NAME: a bare name can only have meant a folder
        raise NotFound(f"{name!r} is {here}: give the path of the folder `medbanana build` wrote (e.g. "
                                f"load_medbanana('/path/to/{name}')), or a Hub dataset id ORG/NAME")
    if constants.HF_HUB_OFFLINE:
        return
    api = HfApi()
    try:
        api.dataset_info(name, revision=revision, timeout=HUB_TIMEOUT)
    except RepositoryNotFoundError:
        raise NotFound(f"{name!r} is {here}, nor a dataset on {api.endpoint} (or one this token may not "
                                "read)") from None
    except Exception as exc:  # anything else the Hub answers (a gated dataset, a 5xx) is datasets' to tell
        if unreachable(exc):
            raise ConnectionError(f"{name!r} is {here}, and {api.endpoint} cannot be reached to load it from the "
                                  f"Hub ({type(exc).__name__}). A build loads by its folder's path; a copy datasets "
                                  "cached earlier loads with HF_HUB_OFFLINE=1 set before Python starts") from None


def to_pandas(ds):
    """The metadata of `ds` as a pandas DataFrame, image columns left out and never decoded.

    A DatasetDict gives one frame with a `split` column. Nested columns stay Python dicts and lists, e.g.
    success rate per disease from the conversations config:

    >>> rows = {"modality": ["fundus", "fundus", "fundus"], "disease": ["Glaucoma", "Glaucoma", "AMD"],
    ...         "status": ["success", "failed", "success"]}
    >>> df = to_pandas(Dataset.from_dict(rows))
    >>> df.assign(ok=df.status.eq("success")).groupby("disease").ok.mean().to_dict()
    {'AMD': 1.0, 'Glaucoma': 0.5}
    """
    import pandas as pd

    if isinstance(ds, (DatasetDict, IterableDatasetDict)):
        frames = [to_pandas(part).assign(split=name) for name, part in ds.items()]
        return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()
    images = [name for name, feature in (ds.features or {}).items() if isinstance(feature, datasets.Image)]
    if isinstance(ds, IterableDataset):  # undecoded first: removing a column does not stop its decoding
        for name in images:
            ds = ds.cast_column(name, datasets.Image(decode=False))
        return pd.DataFrame(list(ds.remove_columns(images)))
    if not isinstance(ds, Dataset):
        raise TypeError(f"to_pandas takes a datasets Dataset, IterableDataset or DatasetDict, not {type(ds).__name__}")
    kept = [name for name in ds.column_names if name not in images]
    return ds.select_columns(kept).to_pandas()


def written_as_path(name: str) -> bool:
    """`./x`, `/x`, `~/x` or `a/b/c` can only mean a folder (a Hub repo id is NAME or ORG/NAME)."""
    return name.startswith((".", "/", "~")) or name.count("/") > 1


def _load_folder(folder: Path, config: str, split, streaming: bool, load_kwargs: dict):
    """A local folder's config from its own shards alone (generation/dataset/folder.py): the card is checked, never
    followed."""
    if "data_files" in load_kwargs:
        raise UsageError("load_medbanana reads a dataset folder's own parquet files: pass split=, not data_files=")
    _check_built_folder(folder)
    read_card(folder)
    files = shard_files(folder, config, CONFIG_FEATURES[config])
    if not files:
        if config == REVIEW_CONFIG:
            raise UsageError(f"{folder} has no {config} config: build it with `medbanana build ... --reviews "
                             "REVIEW_DIR` (answers of `medbanana review`)")
        raise UsageError(f"{folder} has no {config} parquet files ({config}/<split>-00000-of-0000n.parquet): not a "
                         "folder written by `medbanana build`, or one built without that config")
    if split is not None and split not in files:
        raise UsageError(f"{folder} has no {split!r} split of {config} (it has {', '.join(sorted(files))})")
    try:  # the parquet builder: no card, no `.huggingface.yaml`, no `dataset_infos.json` takes part
        return datasets.load_dataset("parquet", data_files=files, split=split, streaming=streaming, **load_kwargs)
    except datasets.exceptions.DatasetsError as exc:  # e.g. shards whose schemas disagree
        raise UsageError(f"{folder / config}: its parquet files cannot be loaded together ({exc})") from None


def _check_built_folder(folder: Path) -> None:
    if (folder / layout.RUN_CONFIG).is_file() or layout.find_output_dirs(folder):
        raise UsageError(f"{folder} is a run directory, not a built dataset; build it first: "
                         f"medbanana build {folder} --out DATASET_DIR, then load DATASET_DIR")
    if not (folder / CARD).is_file():
        raise UsageError(f"{folder} has no {CARD}: not a folder written by `medbanana build`")


def _check_columns(ds, config: str, where) -> None:
    parts = ds.values() if isinstance(ds, (DatasetDict, IterableDatasetDict)) else [ds]
    expected = set(CONFIG_FEATURES[config])
    for part in parts:
        missing = expected - set(part.features or {})
        if missing:
            raise UsageError(f"{where} ({config}) lacks the columns {', '.join(sorted(missing))}: not a medbanana {config} "
                             "config, or one written by an older medbanana; rebuild it with `medbanana build`")
