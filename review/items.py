"""What a review shows: a seeded sample of edits, stratified by modality, direction, disease and the judge's outcome,
turned into blind items whose images are copied into the review folder under opaque names.

Images are decoded and written again as PNG without metadata, so neither a file name, a format nor an embedded
mark (the run's XMP provenance, a C2PA manifest) tells a rater which image is an edit or how it was judged.
"""

from __future__ import annotations

import hashlib
import io
import random
import re
import time
from collections.abc import Iterable, Iterator
from itertools import islice
from pathlib import Path

from ..evaluation.inputs import Sample, image_bytes, input_kind, open_samples
from ..generation.files import atomic_write_bytes
from ..generation.records import decode_rgb
from .store import IMAGES, MODES, ReviewItem, ReviewSettings, ReviewStore, refuse_existing

# A sentence of a refined instruction that speaks of earlier attempts tells the rater it is a later round
_HISTORY = re.compile(r"\b(?:previous|earlier|prior|last|former|first)\s+(?:attempts?|rounds?|edits?|tries|"
                      r"instructions?|versions?)\b", re.IGNORECASE)


def blind_instruction(text: str) -> str:
    """The instruction without its sentences about earlier attempts (a refined instruction's feedback), which
    would tell a rater the round.

    >>> blind_instruction("Add an effusion. Unlike the last attempt, keep the ribs. Compared with the previous "
    ...                   "attempts: larger; softer. Keep the rest.")
    'Add an effusion. Keep the rest.'
    """
    sentences = re.split(r"(?<=[.!?])\s+", text.strip())
    return " ".join(sentence for sentence in sentences if not _HISTORY.search(sentence))


def outcome(sample: Sample) -> str:
    """accepted | rejected | unjudged: the judge's outcome, one of the sampling strata."""
    if sample.accepted is not None:
        return "accepted" if sample.accepted else "rejected"
    if sample.recorded_verdict and sample.recorded_verdict.get("qualified") is not None:
        return "accepted" if sample.recorded_verdict["qualified"] else "rejected"
    return "unjudged"


def stratum(sample: Sample) -> str:
    return "/".join((sample.modality or "unknown", sample.direction, sample.disease, outcome(sample)))


def read_edits(path: Path, *, source_images: Path | None = None) -> list[Sample]:
    """Every edit of a dataset (its `judge` config: every judged attempt) or run (every attempt with an image) whose
    source and edited images are both there."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such dataset or run directory")
    kind = input_kind(path)
    if kind == "manifest":
        samples = open_samples(path)
    elif kind == "dataset":
        samples = open_samples(path, config="judge", source_images=source_images)
    else:
        samples = open_samples(path, source_images=source_images, attempts="all")
    usable = [s for s in samples if s.problem is None and s.source is not None and s.edited is not None]
    if not usable:
        raise ValueError(f"{path}: no edit with both its source and edited image to review"
                         + ("" if source_images else " (a dataset built without sources needs --source-images)"))
    return usable


def stratified_sample(samples: list[Sample], n: int, seed: int) -> list[Sample]:
    """`n` samples drawn in turn across modalities, then within each across directions, diseases and the judge's
    outcome (seeded orders at every level), so that small strata are represented; reproducible.

    >>> from types import SimpleNamespace as S
    >>> pool = [S(id=f"x{i}", modality="xray", direction="add", disease="a", accepted=True) for i in range(8)]
    >>> pool += [S(id=f"x{i}", modality="xray", direction="add", disease=f"d{i}", accepted=True) for i in range(8)]
    >>> pool += [S(id="m0", modality="mri", direction="add", disease="a", accepted=False)]
    >>> sorted(s.id[0] for s in stratified_sample(pool, 2, seed=0))
    ['m', 'x']
    """
    if n < 1:
        raise ValueError("--items must be at least 1")
    rng = random.Random(seed)
    tree: dict = {}
    for sample in sorted(samples, key=lambda s: s.id):
        *branches, leaf = stratum(sample).split("/")
        node = tree
        for key in branches:
            node = node.setdefault(key, {})
        node.setdefault(leaf, []).append(sample)
    return list(islice(_in_turn(tree, rng), n))


def _in_turn(node: dict | list, rng: random.Random) -> Iterator:
    """The samples under `node`: a leaf's in seeded random order, a branch's children taking turns."""
    if isinstance(node, list):
        rng.shuffle(node)
        yield from node
        return
    keys = sorted(node)
    rng.shuffle(keys)
    turns = [_in_turn(node[key], rng) for key in keys]
    while turns:
        for turn in list(turns):
            sample = next(turn, None)
            if sample is None:
                turns.remove(turn)
            else:
                yield sample


def make_items(samples: Iterable[Sample], mode: str, folder: Path, seed: int) -> list[ReviewItem]:
    """Blind items for `mode`, their images written to `folder/images/`, in a seeded shuffled order.

    rubric: one item per edit (source and edit side by side). realism: one `edited` item per edit and one `real`
    item per distinct source; all items of one source share a pair id, so one rater sees a source in one form only.
    """
    if mode not in MODES:
        raise ValueError(f"--mode is one of {', '.join(MODES)}, not {mode!r}")
    (folder / IMAGES).mkdir(parents=True, exist_ok=True)
    items: list[ReviewItem] = []
    real_sources: set[str] = set()
    for sample in samples:
        source = _write_png(folder, image_bytes(sample.source))
        edited = _write_png(folder, image_bytes(sample.edited))
        common = dict(sample_id=sample.id, dataset=sample.dataset, modality=sample.modality, disease=sample.disease,
                      direction=sample.direction, judge=sample.recorded_verdict, accepted=sample.accepted,
                      stratum=stratum(sample))
        if mode == "rubric":
            items.append(ReviewItem(item_id="", pair_id=sample.id, shown="pair",
                                    instruction=blind_instruction(sample.instruction),
                                    images=(source, edited), **common))
            continue
        items.append(ReviewItem(item_id="", pair_id=source, shown="edited", instruction="", images=(edited,),
                                **common))
        if source not in real_sources:
            real_sources.add(source)
            items.append(ReviewItem(item_id="", pair_id=source, shown="real", instruction="", images=(source,),
                                    **{**common, "sample_id": sample.id.rsplit("#", 1)[0], "judge": None,
                                       "accepted": None}))  # a source: no edit, no verdict
    random.Random(seed).shuffle(items)
    return [ReviewItem(**{**item.__dict__, "item_id": f"item-{n + 1:04d}"}) for n, item in enumerate(items)]


def _write_png(folder: Path, data: bytes) -> str:
    """The image as a metadata-free PNG under an opaque content-derived name; its path relative to `folder`."""
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(decode_rgb(data)).save(buffer, format="PNG")
    png = buffer.getvalue()
    name = f"{IMAGES}/{hashlib.sha256(png).hexdigest()[:20]}.png"
    if not (folder / name).is_file():
        atomic_write_bytes(folder / name, png)
    return name


def create_review(source: Path, out: Path, *, mode: str, items: int, raters_per_item: int, seed: int,
                  source_images: Path | None = None) -> ReviewStore:
    """Sample `items` edits of a dataset or run into a new review folder `out` and return its store."""
    if raters_per_item < 1:
        raise ValueError("--raters-per-item must be at least 1")
    refuse_existing(out)  # before sampling: the images would be written into another review's folder
    picked = stratified_sample(read_edits(source, source_images=source_images), items, seed)
    review_items = make_items(picked, mode, Path(out), seed)
    settings = ReviewSettings(mode=mode, raters_per_item=raters_per_item, seed=seed, source=str(Path(source).resolve()),
                              requested_items=items, edits=len(picked),
                              created_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    return ReviewStore.create(out, settings, review_items)
