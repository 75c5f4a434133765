"""A review folder's read contract: `review.sqlite`'s tables, the records they hold, and the read-only queries
`build --reviews` runs on them. `medbanana review` (review/store.py) writes the folder through a `ReviewStore`, a
`ReviewFolder` that also creates, assigns and answers; the builder opens it as a `ReviewFolder` and only reads, so it
never imports the review stage.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sqlite3
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from ..records import VERDICT_BOOLEANS
from ..failures import NotFound, UsageError

DB_NAME = "review.sqlite"
IMAGES = "images"  # the folder of the items' images, the only files the page serves
MODES = ("rubric", "realism")  # settings.mode
# settings.design: how the items were drawn. A calibration sample is seeded random over the judged attempts,
# stratified by modality and direction, each item's inclusion probability recorded; an escalation review holds the
# edits `medbanana calibrate` could not decide; "stratified in turns" (the default, and "" in older folders) draws
# across modality, direction, disease and outcome in turn, a coverage sample with no known probabilities.
CALIBRATION, ESCALATION, IN_TURNS = "calibration", "escalation", "stratified in turns"
# an item's image, as the store names it: content-derived (the first 20 hex digits of its PNG's sha256)
IMAGE_NAME = re.compile(rf"{IMAGES}/(?P<digest>[0-9a-f]{{20}})\.png")
MAX_IMAGE_BYTES = 256 * 2**20  # a review image is a PNG of a source or an edit: a few MB at most
MAX_REASON = 2000  # characters of a rater's optional reason

SCHEMA = f"""
CREATE TABLE IF NOT EXISTS settings (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS items (
    item_id TEXT PRIMARY KEY, position INTEGER NOT NULL UNIQUE, pair_id TEXT NOT NULL, shown TEXT NOT NULL,
    sample_id TEXT NOT NULL, record TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS claims (
    item_id TEXT NOT NULL REFERENCES items, rater TEXT NOT NULL, claimed_at REAL NOT NULL,
    PRIMARY KEY (item_id, rater));
CREATE TABLE IF NOT EXISTS answers (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, item_id TEXT NOT NULL REFERENCES items, rater TEXT NOT NULL,
    answered_at TEXT NOT NULL, seconds REAL,
    {", ".join(f"{name} INTEGER" for name in VERDICT_BOOLEANS)},
    reason TEXT, guess TEXT, confidence INTEGER,
    UNIQUE (item_id, rater));
CREATE TRIGGER IF NOT EXISTS answers_no_update BEFORE UPDATE ON answers
    BEGIN SELECT RAISE(ABORT, 'review answers are append-only'); END;
CREATE TRIGGER IF NOT EXISTS answers_no_delete BEFORE DELETE ON answers
    BEGIN SELECT RAISE(ABORT, 'review answers are append-only'); END;
"""


@dataclass(frozen=True)
class ReviewSettings:
    mode: str  # rubric | realism
    raters_per_item: int
    seed: int
    source: str  # the dataset or run the items were sampled from
    requested_items: int
    edits: int  # edits sampled (realism: each gives an edited item; its source a real one)
    created_at: str = ""
    round_auroc: float | None = None  # how well the shown instructions tell round 1 from later rounds (blinding.py)
    round_auroc_note: str = ""  # why there is no round_auroc, or how it was measured
    design: str = ""  # how the items were drawn: calibration | escalation | stratified in turns ("": the latter)


@dataclass(frozen=True)
class ReviewItem:
    """One thing a rater answers. Everything but `images` and `instruction` is hidden from raters."""

    item_id: str  # opaque: says nothing of the edit, its round or its outcome
    pair_id: str  # realism: the source, shared by its real and edited items; rubric: the edit
    shown: str  # "pair" (rubric: source and edit) | "real" | "edited" (realism: one image)
    sample_id: str  # the edit's id in datasets and judge-agreement: <uid>#<round>
    dataset: str
    modality: str | None
    disease: str
    direction: str
    instruction: str
    images: tuple[str, ...]  # files relative to the review folder: (source, edited) or (the one image)
    judge: dict | None = None  # the recorded verdict (VERDICT_FIELDS), when there is one
    accepted: bool | None = None  # whether the run accepted the edit
    stratum: str = ""  # modality/direction/disease/outcome, the sampling stratum
    # a calibration sample (`review --calibration`): the item's chance of being drawn, and how many judged attempts
    # its stratum (modality and direction) held; None otherwise
    inclusion_probability: float | None = None
    stratum_size: int | None = None


@dataclass(frozen=True)
class Answer:
    """A rater's answer: the rubric's booleans (VERDICT_BOOLEANS) and a reason, or a realism guess and confidence."""

    has_disease: bool | None = None
    structure_reasonable: bool | None = None
    looks_realistic: bool | None = None
    fidelity_preserved: bool | None = None
    qualified: bool | None = None
    reason: str = ""
    guess: str | None = None  # real | edited
    confidence: int | None = None  # CONFIDENCE
    seconds: float | None = None  # time from showing the item to the answer


@dataclass(frozen=True)
class StoredAnswer:
    seq: int
    item_id: str
    rater: str
    answered_at: str
    answer: Answer = field(default_factory=Answer)


class ReviewFolder:
    """A review folder opened for reading (each query on its own connection: a server may be answering meanwhile)."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        self.path = self.folder / DB_NAME

    @classmethod
    def open(cls, folder: Path) -> ReviewFolder:
        store = cls(folder)  # a ReviewStore when review/store.py opens it
        if store.path.is_symlink():
            raise UsageError(f"{store.path} is a symlink: a review's store is opened only as a file of its folder")
        if not store.path.is_file():
            raise NotFound(f"{folder}: not a review folder (no {DB_NAME}); create one with "
                                    "`medbanana review DATASET_OR_RUN --out DIR`")
        return store

    @contextmanager
    def _connect(self, create: bool = False) -> Iterator[sqlite3.Connection]:
        uri = f"file:{self.path}{'' if create else '?mode=rw'}"
        db = sqlite3.connect(uri, uri=True, timeout=30, isolation_level=None, check_same_thread=False)
        try:
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=FULL")  # an answer acknowledged is an answer on disk
            db.execute("PRAGMA foreign_keys=ON")
            yield db
        finally:
            db.close()

    @property
    def settings(self) -> ReviewSettings:
        with self._connect() as db:
            values = {k: json.loads(v) for k, v in db.execute("SELECT key, value FROM settings")}
        return ReviewSettings(**{f.name: values[f.name] for f in fields(ReviewSettings) if f.name in values})

    def items(self) -> list[ReviewItem]:
        with self._connect() as db:
            return [item_from_record(json.loads(r)) for (r,) in db.execute("SELECT record FROM items ORDER BY position")]

    def item(self, item_id: str) -> ReviewItem:
        with self._connect() as db:
            row = db.execute("SELECT record FROM items WHERE item_id = ?", (item_id,)).fetchone()
        if row is None:
            raise KeyError(f"no item {item_id!r} in this review")
        return item_from_record(json.loads(row[0]))

    def check_image_names(self) -> None:
        """ValueError naming the first item whose images are not named as the store names them (IMAGE_NAME): a
        review.sqlite altered to name another file (`../x`, an absolute path) is refused as a whole."""
        for item in self.items():
            for name in item.images:
                if not isinstance(name, str) or not IMAGE_NAME.fullmatch(name):
                    raise UsageError(f"{self.path}: item {item.item_id} names the image {str(name)[:200]!r}, not one "
                                     f"of the review's {IMAGES}/<digest>.png: this review folder was altered")

    def read_image(self, name: str) -> bytes:
        """The bytes of one of the review's images, checked on open: `name` a content-derived name (IMAGE_NAME), the
        file a regular file (never a link) directly in the review's own `images/` folder (never a link either), at
        most MAX_IMAGE_BYTES, whose content still hashes to its name. ValueError naming it otherwise."""
        match = IMAGE_NAME.fullmatch(name) if isinstance(name, str) else None
        if match is None:
            raise UsageError(f"{str(name)[:200]!r} is not one of the review's {IMAGES}/<digest>.png names")
        folder = self.folder / IMAGES
        if folder.is_symlink() or not folder.is_dir():
            raise UsageError(f"{folder} is not the review's own folder of images (a link, or missing)")
        flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
        path = self.folder / name
        try:
            fd = os.open(path, flags)
        except OSError as exc:
            raise UsageError(f"{path} cannot be opened ({exc.strerror}; a link is never followed)") from None
        info = os.fstat(fd)  # the descriptor's own checks (no race with a swap), before open() wraps it
        if not stat.S_ISREG(info.st_mode) or info.st_size > MAX_IMAGE_BYTES:
            os.close(fd)
            raise UsageError(f"{path} is not a regular file of at most {MAX_IMAGE_BYTES:,} bytes")
        with open(fd, "rb") as fh:
            data = fh.read(MAX_IMAGE_BYTES + 1)
        if hashlib.sha256(data).hexdigest()[:20] != match["digest"]:
            raise UsageError(f"{path}: its content is not the image the review stored under that name")
        return data

    def answers(self) -> list[StoredAnswer]:
        names = [*VERDICT_BOOLEANS, "reason", "guess", "confidence", "seconds"]
        with self._connect() as db:
            rows = db.execute(f"SELECT seq, item_id, rater, answered_at, {', '.join(names)} FROM answers "
                              "ORDER BY seq").fetchall()
        out = []
        for seq, item_id, rater, at, *values in rows:
            record = dict(zip(names, values))
            for name in VERDICT_BOOLEANS:
                record[name] = None if record[name] is None else bool(record[name])
            record["reason"] = record["reason"] or ""
            out.append(StoredAnswer(seq, item_id, rater, at, Answer(**record)))
        return out


def image_name(png: bytes) -> str:
    """The name the store gives an image: content-derived, relative to the review folder (IMAGE_NAME)."""
    return f"{IMAGES}/{hashlib.sha256(png).hexdigest()[:20]}.png"


def item_record(item: ReviewItem) -> dict:
    return {**asdict(item), "images": list(item.images)}


def item_from_record(record: dict) -> ReviewItem:
    return ReviewItem(**{**record, "images": tuple(record["images"])})
