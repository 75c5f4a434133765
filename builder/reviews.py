"""`build --reviews DIR`: the answers of `medbanana review` folders as the `human_review` config.

Each answer is one row, tied to the built task by uid and round, so it joins with `judge`, `sft` and `failed`.
Rater names stay in the review folder: the dataset carries pseudonyms (`rater-1`, `rater-2`, ... in order of each
rater's first answer across the reviews of the build; one person keeps one pseudonym). Reasons are free text, kept
unless `--review-reasons drop`: the page asks raters not to write names or identifiers, but cannot check. An answer
to an item whose task is not in the build is left out and counted; a review none of whose items is in the build is an
error.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path

from ..generation.dataset.configs import REVIEW_CONFIG
from ..generation.dataset.features import CONFIG_FEATURES
from ..generation.dataset.output import BuildError
from .parquet import ConfigSchema
from .partition import ShardWriters
from ..generation.dataset.review_folder import ReviewFolder
from .rows import split_of
from .stats import BuildStats

REASONS = ("keep", "drop")  # `build --review-reasons`: a rater's reason is free text and may name someone


def split_sample_id(sample_id: str) -> tuple[str, int | None]:
    """`<uid>#<round>` -> (uid, round); a bare uid (a source shown as real) -> (uid, None).

    >>> split_sample_id("ODIR/add/12_left-AMD#3")
    ('ODIR/add/12_left-AMD', 3)
    >>> split_sample_id("ODIR/add/12_left-AMD")
    ('ODIR/add/12_left-AMD', None)
    """
    uid, sep, round_no = sample_id.rpartition("#")
    return (uid, int(round_no)) if sep and round_no.isdigit() else (sample_id, None)


def open_reviews(folders: Sequence[Path]) -> list[ReviewFolder]:
    """The review folders, opened to read and checked before the build writes anything."""
    stores = []
    for folder in folders:
        try:
            stores.append(ReviewFolder.open(folder))
        except FileNotFoundError as exc:
            raise BuildError(f"--reviews: {exc}") from None
    names = [s.folder.resolve().name for s in stores]
    if len(set(names)) < len(names):
        raise BuildError("--reviews: two review folders share a name; rows name their review by its folder")
    return stores


def review_rows(stores: Iterable[ReviewFolder], built_uids: set[str], info: dict,
                reasons: str = "keep") -> Iterable[tuple[str, dict]]:
    """(source id, row) for every answer whose task is built; `info[review] = {mode, answers, rows, left_out}`.
    `reasons`: keep the raters' free-text reasons, or drop them (None: free text may hold names)."""
    if reasons not in REASONS:
        raise BuildError(f"--review-reasons is one of {', '.join(REASONS)}, not {reasons!r}")
    pseudonyms: dict[str, str] = {}
    for store in stores:
        settings, name = store.settings, store.folder.resolve().name
        items = {item.item_id: item for item in store.items()}
        answers = store.answers()
        counts = info[name] = {"mode": settings.mode, "answers": len(answers), "rows": 0, "left_out": 0}
        if not any(split_sample_id(item.sample_id)[0] in built_uids for item in items.values()):
            raise BuildError(f"--reviews {store.folder}: none of its items is a task of the runs built (it was "
                             f"sampled from {settings.source})")
        for stored in answers:
            item = items[stored.item_id]
            uid, round_no = split_sample_id(item.sample_id)
            if uid not in built_uids:
                counts["left_out"] += 1
                continue
            counts["rows"] += 1
            rater = pseudonyms.setdefault(stored.rater.casefold(), f"rater-{len(pseudonyms) + 1}")
            source_id = _source_id(uid, item.dataset, item.direction, item.disease)
            answer = stored.answer
            yield source_id, {
                "uid": uid, "source_id": source_id, "dataset": item.dataset, "modality": item.modality,
                "disease": item.disease, "task": item.direction, "source_path": None, "round": round_no,
                "review": name, "mode": settings.mode, "item_id": item.item_id, "shown": item.shown,
                "rater": rater, "answered_at": stored.answered_at, "seconds": answer.seconds,
                **{key: getattr(answer, key) for key in ("has_disease", "structure_reasonable", "looks_realistic",
                                                         "fidelity_preserved", "qualified")},
                "reason": (answer.reason or None) if reasons == "keep" else None, "guess": answer.guess,
                "confidence": answer.confidence,
            }


def reviewed_uids(stores: Iterable[ReviewFolder]) -> frozenset[str]:
    """The tasks the reviews' items are about: the build notes which of them it builds (`PartitionSpec`)."""
    return frozenset(split_sample_id(item.sample_id)[0] for store in stores for item in store.items())


def write_reviews(stores: Sequence[ReviewFolder], folder: Path, built_uids: set[str], stats: BuildStats,
                  test_fraction: float, max_shard_bytes: int, hasher=None,
                  reasons: str = "keep") -> tuple[dict[str, str], dict]:
    """Write the human_review shards into the staging `folder` (split by source, like every config); returns
    their digests by path and what each review gave."""
    writers = ShardWriters(folder, 0, {REVIEW_CONFIG: ConfigSchema.of(CONFIG_FEATURES[REVIEW_CONFIG])},
                           max_shard_bytes, hasher, stats)
    info: dict[str, dict] = {}
    for source_id, row in review_rows(stores, built_uids, info, reasons):
        writers.write(REVIEW_CONFIG, split_of(source_id, test_fraction), row)
    return writers.close(), info


def _source_id(uid: str, dataset: str, direction: str, disease: str) -> str:
    """The source id inside a task uid `{dataset}/{direction}/{source_id}-{disease}`."""
    prefix, suffix = f"{dataset}/{direction}/", f"-{disease}"
    if uid.startswith(prefix) and uid.endswith(suffix):
        return uid[len(prefix):-len(suffix)]
    return uid
