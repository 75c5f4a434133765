"""What a review shows: a seeded sample of edits, stratified by modality, direction, disease and the judge's outcome,
turned into blind items whose images are copied into the review folder under opaque names.

Images are decoded and written again as PNG without metadata, so neither a file name, a format nor an embedded
mark (the run's XMP provenance, a C2PA manifest) tells a rater which image is an edit or how it was judged.
"""

from __future__ import annotations

import io
import math
import os
import random
import sys
import time
from collections.abc import Iterator, Sequence
from itertools import islice
from pathlib import Path

from ..generation.taxonomy import canonical_prompt
from ..evaluation.inputs import Sample, image_bytes, open_samples, recorded_sources
from ..generation.dataset.inputs import input_kind
from ..generation.records import decode_rgb
from ..generation.rundir import layout
from ..generation.dataset.review_folder import (CALIBRATION, ESCALATION, IMAGES, IN_TURNS, MODES, ReviewItem, ReviewSettings,
                                                image_name)
from .blinding import blind_instruction, leakage_warning, round_leakage, round_of
from .store import ReviewStore, refuse_existing
from ..generation.failures import NotFound, UsageError

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
    source and edited images are both there and inside the folder the user named: an edited image that leads out
    of the run (a symlink) is left out, and said so in one line."""
    path = Path(path)
    if not path.exists():
        raise NotFound(f"{path}: no such dataset or run directory")
    kind = input_kind(path)
    if kind == "manifest":
        samples = open_samples(path)
    elif kind == "dataset":
        samples = open_samples(path, config="judge", source_images=source_images)
    else:
        samples = open_samples(path, source_images=source_images or _confirmed_sources(path), attempts="all")
    root = path if path.is_dir() else path.parent  # a run's edits, a samples file's images: inside the folder named
    named = {"run": ("edited",), "manifest": ("source", "edited")}.get(kind, ())
    usable, outside = [], []
    for sample in samples:
        if sample.outside:  # refused by the containment rule, never read
            outside.append(sample.id)
            continue
        if sample.problem is not None or sample.source is None or sample.edited is None:
            continue
        if any(isinstance(getattr(sample, ref), Path) and not _inside(root, getattr(sample, ref)) for ref in named):
            outside.append(sample.id)
            continue
        usable.append(sample)
    if outside:
        print(f"skipped {len(outside)} edit(s) whose image leads outside {path} (a symlink), e.g. {outside[0]}",
              file=sys.stderr)
    if not usable:
        raise UsageError(f"{path}: no edit with both its source and edited image to review"
                         + ("" if source_images else " (a dataset built without sources needs --source-images)"))
    return usable


def _confirmed_sources(run: Path) -> Path | None:
    """The sources folder of a run when the run holds it; a folder elsewhere that the run's medbanana-run.json
    names is only a hint: the user confirms it with --source-images."""
    recorded = recorded_sources(run)
    if not recorded:
        return None  # open_samples says that --source-images is needed
    if _inside(run, Path(recorded)):
        return Path(recorded)
    raise UsageError(f"{run}: its {layout.RUN_CONFIG} names the sources folder {recorded}, outside the run; "
                     f"review reads no folder you did not name: confirm it with --source-images {recorded}")


def _inside(root: Path, file: Path) -> bool:
    """Whether `file` (symlinks resolved) lies inside `root` (layout.inside, the one containment rule)."""
    try:
        layout.inside(root, os.path.relpath(os.path.abspath(file), os.path.abspath(root)))
    except ValueError:
        return False
    return True


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
        raise UsageError("--items must be at least 1")
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


def calibration_sample(samples: list[Sample], n: int, seed: int) -> tuple[list[Sample], dict[str, tuple]]:
    """A seeded random sample of `n` judged attempts (accepted and rejected), stratified by modality and direction
    with proportional allocation, and each one's (inclusion probability, its stratum's size). A stratum's share
    n * N_h / N is rounded systematically (one seeded uniform offset over the strata in a seeded order), so every
    judged attempt is drawn with the same probability n / N: estimates need no weights, and are unbiased.

    >>> from types import SimpleNamespace as S
    >>> pool = [S(id=f"a{i}", modality="xray", direction="add", disease="d", accepted=i % 2 == 0) for i in range(6)]
    >>> pool += [S(id=f"m{i}", modality="mri", direction="add", disease="d", accepted=True) for i in range(3)]
    >>> picked, design = calibration_sample(pool, 3, seed=0)
    >>> sorted(s.id[0] for s in picked), sorted(set(design.values()))
    (['a', 'a', 'm'], [(0.3333333333333333, 3), (0.3333333333333333, 6)])
    """
    if n < 1:
        raise UsageError("--items must be at least 1")
    judged = sorted((s for s in samples if outcome(s) != "unjudged"), key=lambda s: s.id)
    if not judged:
        raise UsageError("no judged attempt to draw a calibration sample from (no recorded verdict)")
    strata: dict[tuple[str, str], list[Sample]] = {}
    for sample in judged:
        strata.setdefault((sample.modality or "unknown", sample.direction), []).append(sample)
    total, n = len(judged), min(n, len(judged))
    rng = random.Random(seed)
    keys = sorted(strata)
    rng.shuffle(keys)
    offset, cumulative, picked, design = rng.random(), 0.0, [], {}
    for key in keys:
        share = n * len(strata[key]) / total
        count = math.floor(cumulative + share + offset) - math.floor(cumulative + offset)
        cumulative += share
        for sample in rng.sample(strata[key], count):
            picked.append(sample)
            design[sample.id] = (n / total, len(strata[key]))
    return picked, design


def listed_edits(samples: list[Sample], ids: set[str]) -> list[Sample]:
    """The edits `--only` names (calibrate's undecided edits), all of them; ValueError naming one not found."""
    found = [s for s in samples if s.id in ids]
    missing = sorted(ids - {s.id for s in found})
    if missing:
        raise UsageError(f"--only names {len(missing)} edit(s) that are not in the source with both images, e.g. "
                         f"{missing[0]!r}")
    return found


def make_items(samples: Sequence[Sample], mode: str, folder: Path, seed: int, *,
               quiet: bool = False, design: dict[str, tuple] | None = None) -> list[ReviewItem]:
    """Blind items for `mode`, their images written to `folder/images/`, in a seeded shuffled order.

    rubric: one item per edit (source and edit side by side). realism: one `edited` item per edit and one `real`
    item per distinct source; all items of one source share a pair id, so one rater sees a source in one form only.
    `design`: sample id -> (inclusion probability, stratum size) of a calibration sample.
    """
    from tqdm.auto import tqdm

    if mode not in MODES:
        raise UsageError(f"--mode is one of {', '.join(MODES)}, not {mode!r}")
    images = folder / IMAGES
    images.mkdir(parents=True, exist_ok=True)
    if images.is_symlink() or not images.is_dir():
        raise UsageError(f"{images} is not a folder of the review: its images are never written through a link")
    items: list[ReviewItem] = []
    real_sources: set[str] = set()
    bar = tqdm(samples, desc="preparing review images", unit="edit", dynamic_ncols=True,
               disable=True if quiet else None)  # None: shown on a terminal only
    for sample in bar:
        source = _write_png(folder, image_bytes(sample.source))
        edited = _write_png(folder, image_bytes(sample.edited))
        common = dict(sample_id=sample.id, dataset=sample.dataset, modality=sample.modality, disease=sample.disease,
                      direction=sample.direction, judge=sample.recorded_verdict, accepted=sample.accepted,
                      stratum=stratum(sample), **dict(zip(("inclusion_probability", "stratum_size"),
                                                          (design or {}).get(sample.id, (None, None)))))
        if mode == "rubric":
            items.append(ReviewItem(item_id="", pair_id=sample.id, shown="pair",
                                    instruction=blind_instruction(sample.instruction, canonical_prompt(sample)),
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
    """The image as a metadata-free PNG under an opaque content-derived name; its path relative to `folder`.
    Written to a new temp file (O_EXCL | O_NOFOLLOW: never through a link placed there), then renamed."""
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(decode_rgb(data)).save(buffer, format="PNG")
    png = buffer.getvalue()
    name = image_name(png)
    target = folder / name
    if target.is_file() and not target.is_symlink():
        return name
    tmp = target.with_name(f".{target.name}.tmp{os.getpid()}")
    tmp.unlink(missing_ok=True)  # left by a killed run (a link there is removed, not followed)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o644)
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(png)
        os.replace(tmp, target)  # replaces a link placed at the name, never writes through it
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return name


def create_review(source: Path, out: Path, *, mode: str, items: int, raters_per_item: int, seed: int,
                  source_images: Path | None = None, quiet: bool = False, calibration: bool = False,
                  only: set[str] | None = None) -> ReviewStore:
    """Sample `items` edits of a dataset or run into a new review folder `out` and return its store; how well the
    shown instructions still tell the round is measured and kept in its settings (a warning above 0.65).
    `calibration`: a calibration sample (`calibration_sample`); `only`: exactly these edits (escalation)."""
    if raters_per_item < 1:
        raise UsageError("--raters-per-item must be at least 1")
    if calibration and mode != "rubric" or only is not None and mode != "rubric":
        raise UsageError("--calibration and --only draw edits for rubric answers (qualified or not): not with "
                         "--mode realism")
    refuse_existing(out)  # before sampling: the images would be written into another review's folder
    edits, design = read_edits(source, source_images=source_images), None
    if only is not None:
        picked, kind = listed_edits(edits, only), ESCALATION
    elif calibration:
        (picked, design), kind = calibration_sample(edits, items, seed), CALIBRATION
    else:
        picked, kind = stratified_sample(edits, items, seed), IN_TURNS
    review_items = make_items(picked, mode, Path(out), seed, quiet=quiet, design=design)
    auroc, note = None, "not measured: realism items show no instruction"
    if mode == "rubric":
        auroc, note = round_leakage([i.instruction for i in review_items],
                                    [round_of(i.sample_id) for i in review_items], [i.images[0] for i in review_items])
    settings = ReviewSettings(mode=mode, raters_per_item=raters_per_item, seed=seed, source=str(Path(source).resolve()),
                              requested_items=items, edits=len(picked),
                              created_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                              round_auroc=auroc, round_auroc_note=note, design=kind)
    warning = leakage_warning(auroc)
    if warning:
        print(warning, file=sys.stderr)
    return ReviewStore.create(out, settings, review_items)
