"""Separability probe: can a simple classifier tell edited images from real scans?

For each modality and direction (and, when the input holds them, accepted and rejected edits separately) the
real side is the set of source images those edits started from and the other side the edits. Features come from
`probe_features` (weight-free forensics statistics, raw and controlled). `probe_statistics` fits a linear probe in
grouped k-fold cross-validation (a source image and every edit made from it share one group, so no source is seen in
training and testing): the out-of-fold scores give the AUROC, a group bootstrap that refits every fold its 95 %
interval, and a grouped permutation test its p-value. 0.5 means indistinguishable, 1.0 perfectly separable. A
real-vs-real row per modality (the real images split in two at random, by group) shows what chance looks like on
the same data.
"""

from __future__ import annotations

import hashlib
import itertools
import os
from collections.abc import Iterable, Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..generation.interrupts import ignore_sigint
from .inputs import ImageRef, Sample, image_bytes
from .probe_cache import FeatureCache, content_digest, feature_key
from .probe_embeddings import BATCH as EMBED_BATCH
from .probe_embeddings import EMBEDDING_VERSION
from .probe_features import FEATURE_VERSION, FeatureSettings, image_features
from .probe_statistics import BOOTSTRAP, FOLDS, PERMUTATIONS, probe

CHUNK = 1024  # images whose bytes may be in memory at once


# ---------------------------------------------------------------- images from samples

@dataclass
class ProbeImage:
    key: str  # a source's identity (its path or content hash) or an edit's sample id
    ref: ImageRef | None  # dropped once the image's features are computed
    role: str  # real | accepted | rejected
    group: str  # the source image's key: an edit and its source share it
    modality: str
    direction: str
    sample_id: str | None = None


def _ref_key(ref: ImageRef) -> str:
    if isinstance(ref, bytes):
        return "sha1:" + hashlib.sha1(ref).hexdigest()
    return str(Path(ref).resolve())


def collect_images(samples: Iterable[Sample]) -> Iterator[ProbeImage]:
    """Edits (accepted or rejected) and each distinct source once per modality and direction."""
    seen_sources: set[tuple] = set()
    for sample in samples:
        if sample.problem or sample.source is None or sample.edited is None:
            continue
        modality = sample.modality or "unknown"
        group = _ref_key(sample.source)
        if (group, modality, sample.direction) not in seen_sources:
            seen_sources.add((group, modality, sample.direction))
            yield ProbeImage(group, sample.source, "real", group, modality, sample.direction)
        role = "rejected" if sample.accepted is False else "accepted"
        yield ProbeImage(sample.id, sample.edited, role, group, modality, sample.direction, sample.id)


_known_keys: frozenset[str] = frozenset()  # the cache's keys when extraction began, in each worker process


def _know(keys: frozenset[str]) -> None:
    global _known_keys
    _known_keys = keys


def _worker_knows(keys: frozenset[str]) -> None:  # the pool's initializer: Ctrl-C is the parent's to handle
    ignore_sigint()
    _know(keys)


def _features_of(job: tuple[ImageRef, FeatureSettings]) -> tuple[str | None, str | None, tuple | str | None]:
    """(content digest, cache key, result): the (raw, controlled) vectors, None when the key is already cached,
    or the error's text. The worker reads and hashes the image, so the main process never reads it."""
    ref, settings = job
    digest = key = None
    try:
        data = image_bytes(ref)
        digest = content_digest(data)
        key = feature_key(digest, "weight-free", FEATURE_VERSION, settings.size, settings.quality, settings.detail)
        return digest, key, None if key in _known_keys else image_features(data, settings)
    except Exception as exc:  # noqa: BLE001 — an unreadable image is left out and counted, the probe goes on
        return digest, key, f"{type(exc).__name__}: {exc}"


def _batched(items: Iterable, n: int) -> Iterator[list]:
    iterator = iter(items)
    while chunk := list(itertools.islice(iterator, n)):
        yield chunk


def extract_features(images: Iterable[ProbeImage], settings: FeatureSettings, workers: int | None = None,
                     embedder=None, progress=None,
                     cache: FeatureCache | None = None) -> tuple[list[ProbeImage], list[list]]:
    """The images and, per feature set (weight-free, then the embedder's), each image's (raw, controlled) vectors
    or its error's text. Worker processes when `workers` > 1; images go through in chunks and each chunk's refs
    are dropped once done, so a dataset's embedded image bytes are never all in memory. With `cache`, vectors
    stored there are reused and each one computed is appended to it as it arrives (what a resumed run skips)."""
    workers = workers or os.cpu_count() or 1
    known = cache.keys() if cache is not None else frozenset()
    _know(known)
    kept: list[ProbeImage] = []
    feature_sets: list[list] = [[]] + ([[]] if embedder is not None else [])
    pool = (ProcessPoolExecutor(max_workers=workers, initializer=_worker_knows, initargs=(known,)) if workers > 1
            else None)
    try:
        for chunk in _batched(images, CHUNK):
            jobs = [(image.ref, settings) for image in chunk]
            digests = []
            for digest, key, result in pool.map(_features_of, jobs, chunksize=16) if pool else map(_features_of, jobs):
                if result is None:
                    result = cache.get(key)
                elif cache is not None and key is not None and not isinstance(result, str) and key not in cache:
                    cache.put(key, *result)
                feature_sets[0].append(result)
                digests.append(digest)
                if progress is not None:
                    progress()
            if embedder is not None:
                feature_sets[1] += _embedded([image.ref for image in chunk], digests, settings, embedder, cache)
            for image in chunk:
                image.ref = None
            kept += chunk
    finally:
        if pool is not None:
            pool.shutdown()
        _know(frozenset())
    return kept, feature_sets


def _embedded(refs: list[ImageRef], digests: list[str | None], settings: FeatureSettings, embedder,
              cache: FeatureCache | None) -> list:
    """The embedder's (raw, controlled) vectors or error per image: cached ones reused, the others embedded batch
    by batch, each batch stored when done."""
    keys = [feature_key(d, embedder.cache_name, EMBEDDING_VERSION, settings.size, settings.quality)
            if d is not None and cache is not None else None for d in digests]
    results = [cache.get(key) if key is not None else None for key in keys]
    missing = [i for i, result in enumerate(results) if result is None]
    for start in range(0, len(missing), EMBED_BATCH):
        batch = missing[start:start + EMBED_BATCH]
        for i, result in zip(batch, embedder.embed([refs[i] for i in batch], settings)):
            results[i] = result
            if keys[i] is not None and not isinstance(result, str) and keys[i] not in cache:
                cache.put(keys[i], *result)
    return results


# ---------------------------------------------------------------- the probe over an input

def _halves(groups: list[str], seed: int = 0) -> np.ndarray:
    """The real-vs-real split: 0/1 per image, whole groups on one side, half of the groups each side. A seeded
    permutation of the groups in their order of appearance, so the split is the same on every machine (a hash of
    the group key would change with the folder the images sit in)."""
    order = list(dict.fromkeys(groups))
    side = np.zeros(len(order), int)
    side[np.random.default_rng(seed).permutation(len(order))[:len(order) // 2]] = 1
    index = {group: i for i, group in enumerate(order)}
    return np.array([side[index[group]] for group in groups], int)


def run_separability(samples: Iterable[Sample], *, settings: FeatureSettings | None = None,
                     workers: int | None = None, bootstrap: int = BOOTSTRAP, permutations: int = PERMUTATIONS,
                     progress=None, embedder=None, cache: FeatureCache | None = None) -> dict:
    """Rows per feature set, modality, direction and kind of edit (plus real vs real per modality), and per-image
    scores. `embedder` (probe_embeddings.Embedder) adds rows on pretrained features; `cache` (probe_cache) keeps
    every image's features, so that a rerun computes only the missing ones. `bootstrap` refit draws give each
    AUROC's interval, `permutations` its p-value (probe_statistics)."""
    settings = settings or FeatureSettings()
    images, results = extract_features(collect_images(samples), settings, workers, embedder, progress, cache)
    feature_sets = list(zip(["weight-free"] + ([embedder.name] if embedder is not None else []), results))
    rows, per_image, unreadable = [], {}, {}
    for name, results in feature_sets:
        unreadable.update({image.key: r for image, r in zip(images, results) if isinstance(r, str)})
        kept = [(image, r) for image, r in zip(images, results) if not isinstance(r, str)]
        suffix = "" if name == "weight-free" else "_pretrained"
        for row, members, labels in _comparisons(kept):
            row = {"features": name, **row}
            scores = _probe_row(members, labels, row, bootstrap, permutations)
            rows.append(row)
            if row["comparison"] == "real vs real":
                continue
            for (image, _), (raw, controlled) in zip(members, zip(*scores)):
                entry = per_image.setdefault(image.key, {"id": image.key, "role": image.role,
                                                         "modality": image.modality, "direction": image.direction})
                entry.update({f"p_edit_raw{suffix}": raw, f"p_edit_controlled{suffix}": controlled})
    return {"settings": {"size": settings.size, "detail": settings.detail, "quality": settings.quality, "folds": FOLDS, "bootstrap": bootstrap,
                         "permutations": permutations, "features": [name for name, _ in feature_sets]},
            "rows": rows, "images": list(per_image.values()),
            "unreadable": [{"id": key, "error": error} for key, error in unreadable.items()]}


def _probe_row(members: list, labels: np.ndarray, row: dict, bootstrap: int,
               permutations: int) -> tuple[np.ndarray, np.ndarray]:
    """Fill `row` with the raw and controlled AUROC, intervals and p-values; the out-of-fold scores of both."""
    groups = np.array([image.group for image, _ in members])
    scores = []
    for which, index in (("raw", 0), ("controlled", 1)):
        result = probe(np.stack([r[index] for _, r in members]), labels, groups, bootstrap=bootstrap,
                       permutations=permutations)
        row.update({f"auroc_{which}": result.auroc, f"low_{which}": result.low, f"high_{which}": result.high,
                    f"p_{which}": result.p_value})
        scores.append(result.scores)
    return scores[0], scores[1]


def _comparisons(kept: list[tuple[ProbeImage, tuple]]):
    """(row, members, labels) for real vs accepted / rejected per modality and direction, then real vs real."""
    keys = sorted({(image.modality, image.direction) for image, _ in kept})
    for modality, direction in keys:
        here = [(image, r) for image, r in kept if (image.modality, image.direction) == (modality, direction)]
        real = [m for m in here if m[0].role == "real"]
        for role in ("accepted", "rejected"):
            edits = [m for m in here if m[0].role == role]
            if edits:
                yield (_row(modality, direction, f"real vs {role}", real, edits), real + edits,
                       np.array([0] * len(real) + [1] * len(edits)))
    for modality in sorted({m for m, _ in keys}):
        real = [(image, r) for image, r in kept if image.modality == modality and image.role == "real"]
        halves = _halves([image.group for image, _ in real])
        if len(real) >= 4 and 0 < halves.sum() < len(real):
            yield (_row(modality, "all", "real vs real", [m for m, h in zip(real, halves) if not h],
                        [m for m, h in zip(real, halves) if h]), real, halves)


def _row(modality: str, direction: str, comparison: str, real: list, other: list) -> dict:
    groups = {image.group for image, _ in real + other}
    # `real` = images of class 0, `compared` = class 1 (edits, or the other half of the real images)
    return {"modality": modality, "direction": direction, "comparison": comparison, "real": len(real),
            "compared": len(other), "sources": len(groups)}
