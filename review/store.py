"""A review folder's one store: `review.sqlite` (WAL) holds the review's settings, its items and every answer.

Answers are append-only (SQLite triggers refuse UPDATE and DELETE on them) and unique per (item, rater): a second
submit of the same item by the same rater is reported, never stored twice. Several server threads and processes may
use one folder at once: each operation opens its own connection, and choosing the next item for a rater runs in an
IMMEDIATE transaction, so two raters never both claim the last open slot of an item.

The store decides what is stored: an answer is accepted only for an item it handed that rater (their claim), never
for the other form of a source they answered (realism), and never past K answers, whatever a client sends.

Assignment: a rater is shown the item they claimed and have not answered (a reload resumes there), else the open
item with the fewest answers (then the review's seeded order) that they have not answered, that has fewer than K
answers and live claims by others, and, in realism mode, whose source they have not seen in any form.
"""

from __future__ import annotations

import json
import sqlite3
import time
import unicodedata
from dataclasses import asdict
from pathlib import Path

from ..generation.dataset.review_folder import (DB_NAME, IMAGES, MAX_REASON, SCHEMA, Answer, ReviewFolder, ReviewItem,
                                                ReviewSettings, item_record)
from ..generation.records import VERDICT_BOOLEANS
from ..generation.failures import UsageError

GUESSES = ("real", "edited")
CONFIDENCE = range(1, 6)  # 1 = a guess, 5 = certain
CLAIM_SECONDS = 15 * 60  # an item shown to a rater is held for them this long
MAX_RATER_NAME = 40
_NAME_PUNCTUATION = set(" .-_'")

class NotGiven(KeyError):
    """An answer the store refuses: the item is unknown, was not handed to this rater, or is full."""

    def __str__(self) -> str:
        return str(self.args[0])


def check_rater_name(name: str) -> str:
    """The rater's name as stored: NFC, blanks trimmed; letters, digits, spaces and . - _ ' only, 1-40 long.

    >>> check_rater_name("  Dr. Ana Núñez ")
    'Dr. Ana Núñez'
    >>> check_rater_name("<script>")
    Traceback (most recent call last):
    ...
    ValueError: a rater name may hold letters, digits, spaces and . - _ ' only, not '<', '>'
    """
    name = unicodedata.normalize("NFC", str(name or "")).strip()
    if not name:
        raise UsageError("enter your name (or initials) to start")
    odd = sorted({c for c in name if not (c.isalnum() or c in _NAME_PUNCTUATION)})
    if odd:
        raise UsageError("a rater name may hold letters, digits, spaces and . - _ ' only, not "
                         + ", ".join(repr(c) for c in odd))
    if len(name) > MAX_RATER_NAME:
        raise UsageError(f"a rater name is at most {MAX_RATER_NAME} characters")
    return name


def refuse_existing(folder: Path) -> None:
    """ValueError when `folder` already holds a review (a review is created once, then served again), or a
    symlink where the review's own files go (they are never written through a link)."""
    folder = Path(folder)
    linked = [name for name in (DB_NAME, f"{DB_NAME}-wal", f"{DB_NAME}-shm", f"{DB_NAME}-journal", IMAGES)
              if (folder / name).is_symlink()]
    if linked:
        raise UsageError(f"{folder}/{linked[0]} is a symlink: a review folder's files are never written through one; "
                         "choose another --out")
    if (folder / DB_NAME).exists():
        raise UsageError(f"{folder} already holds a review ({DB_NAME}); serve it with `medbanana review "
                         f"{folder}`, or choose another --out")


def check_answer(mode: str, answer: Answer) -> None:
    """ValueError naming what is missing or wrong in an answer for this mode (a reason is at most MAX_REASON
    characters)."""
    if len(answer.reason or "") > MAX_REASON:
        raise UsageError(f"a reason is at most {MAX_REASON:,} characters (this one has {len(answer.reason):,}): "
                         "shorten it; nothing stored")
    if mode == "rubric":
        missing = [name for name in VERDICT_BOOLEANS if getattr(answer, name) is None]
        if missing:
            raise UsageError(f"answer every question before submitting: {', '.join(missing)}")
    elif answer.guess not in GUESSES or answer.confidence not in CONFIDENCE:
        raise UsageError("answer real or edited, and how sure you are (1-5), before submitting")


class ReviewStore(ReviewFolder):
    """The review folder as `medbanana review` uses it: created once, then items assigned and answers stored (its
    reading, and the tables, are the folder's contract in generation/dataset/review_folder.py)."""

    # ------------------------------------------------------------ creating and opening

    @classmethod
    def create(cls, folder: Path, settings: ReviewSettings, items: list[ReviewItem]) -> ReviewStore:
        """A new review in `folder` (its images already written there); refuses a folder that holds one."""
        store = cls(folder)
        refuse_existing(folder)
        if not items:
            raise UsageError("the sample is empty: no item to review")
        store.folder.mkdir(parents=True, exist_ok=True)
        with store._connect(create=True) as db:
            db.executescript(SCHEMA)
            db.execute("BEGIN IMMEDIATE")
            db.executemany("INSERT INTO settings VALUES (?, ?)",
                           [(k, json.dumps(v)) for k, v in asdict(settings).items()])
            db.executemany("INSERT INTO items VALUES (?, ?, ?, ?, ?, ?)",
                           [(it.item_id, pos, it.pair_id, it.shown, it.sample_id, json.dumps(item_record(it)))
                            for pos, it in enumerate(items)])
            db.execute("COMMIT")
        return store

    # ------------------------------------------------------------ reading

    def answered(self, rater: str, item_id: str) -> bool:
        """Whether this rater has an answer to this item."""
        with self._connect() as db:
            return db.execute("SELECT 1 FROM answers WHERE item_id = ? AND rater = ?",
                              (item_id, check_rater_name(rater))).fetchone() is not None

    def progress(self, rater: str) -> tuple[int, int]:
        """(items this rater answered, items this rater may still be given or has answered); in realism mode one
        item per source, the most a rater is given."""
        rater = check_rater_name(rater)
        with self._connect() as db:
            done = db.execute("SELECT COUNT(*) FROM answers WHERE rater = ?", (rater,)).fetchone()[0]
            pairs = {pair for _item, pair, _n in self._open_items(db, rater, time.time(), limit=None)}
        return done, done + len(pairs)

    # ------------------------------------------------------------ assigning and answering

    def next_item(self, rater: str) -> ReviewItem | None:
        """The item to show this rater now (claimed for them), or None when nothing is left for them."""
        rater = check_rater_name(rater)
        now = time.time()
        with self._connect() as db:
            db.execute("BEGIN IMMEDIATE")
            try:
                held = db.execute(
                    "SELECT c.item_id FROM claims c JOIN items i USING (item_id) WHERE c.rater = ? AND NOT EXISTS "
                    "(SELECT 1 FROM answers a WHERE a.item_id = c.item_id AND a.rater = c.rater) "
                    "ORDER BY i.position LIMIT 1", (rater,)).fetchone()
                if held is None:
                    found = self._open_items(db, rater, now, limit=1)
                    held = found[0] if found else None
                if held is not None:
                    db.execute("INSERT OR REPLACE INTO claims VALUES (?, ?, ?)", (held[0], rater, now))
                db.execute("COMMIT")
            except BaseException:
                db.execute("ROLLBACK")
                raise
        return None if held is None else self.item(held[0])

    def _open_items(self, db: sqlite3.Connection, rater: str, now: float, limit: int | None) -> list[tuple]:
        """(item id, pair id, answers) of the items `rater` may be given now, the first to give first."""
        k = self.settings_value(db, "raters_per_item")
        query = (
            "SELECT i.item_id, i.pair_id, (SELECT COUNT(*) FROM answers a WHERE a.item_id = i.item_id) AS n "
            "FROM items i "
            "WHERE NOT EXISTS (SELECT 1 FROM answers a WHERE a.item_id = i.item_id AND a.rater = :rater) "
            "AND NOT EXISTS (SELECT 1 FROM items j WHERE j.pair_id = i.pair_id AND j.item_id != i.item_id AND ("
            "  EXISTS (SELECT 1 FROM answers a WHERE a.item_id = j.item_id AND a.rater = :rater) OR"
            "  EXISTS (SELECT 1 FROM claims c WHERE c.item_id = j.item_id AND c.rater = :rater"
            "          AND c.claimed_at > :expired))) "
            "AND n + (SELECT COUNT(*) FROM claims c WHERE c.item_id = i.item_id AND c.rater != :rater "
            "         AND c.claimed_at > :expired AND NOT EXISTS (SELECT 1 FROM answers a "
            "         WHERE a.item_id = c.item_id AND a.rater = c.rater)) < :k "
            "ORDER BY n, i.position" + (" LIMIT :limit" if limit else ""))
        return db.execute(query, {"rater": rater, "expired": now - CLAIM_SECONDS, "k": k,
                                  "limit": limit}).fetchall()

    @staticmethod
    def settings_value(db: sqlite3.Connection, key: str):
        return json.loads(db.execute("SELECT value FROM settings WHERE key = ?", (key,)).fetchone()[0])

    def submit(self, rater: str, item_id: str, answer: Answer) -> bool:
        """Store the answer: True; False when this rater already answered this item (the first answer is kept).
        ValueError for an incomplete answer; NotGiven (a KeyError) for an unknown item, an item the store did not
        hand this rater, the other form of a source they answered (realism), or an item that has its K answers."""
        rater = check_rater_name(rater)
        with self._connect() as db:
            mode, k = self.settings_value(db, "mode"), self.settings_value(db, "raters_per_item")
            check_answer(mode, answer)
            values = {name: getattr(answer, name) for name in (*VERDICT_BOOLEANS, "reason", "guess", "confidence",
                                                                "seconds")}
            values["reason"] = (answer.reason or "").strip() or None
            db.execute("BEGIN IMMEDIATE")  # the checks and the insert see one state: K is never exceeded
            try:
                stored = self._check_given(db, rater, item_id, k)
                if stored:
                    db.execute(f"INSERT INTO answers (item_id, rater, answered_at, {', '.join(values)}) "
                               f"VALUES (?, ?, ?, {', '.join('?' * len(values))})",
                               (item_id, rater, time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                                *values.values()))
                db.execute("COMMIT")
            except BaseException:
                db.execute("ROLLBACK")
                raise
        return stored

    @staticmethod
    def _check_given(db: sqlite3.Connection, rater: str, item_id: str, k: int) -> bool:
        """False when `rater` already answered the item; NotGiven unless the store handed it to them (their claim),
        no other form of its source has their answer, and it has fewer than K answers."""
        row = db.execute("SELECT pair_id FROM items WHERE item_id = ?", (item_id,)).fetchone()
        if row is None:
            raise NotGiven(f"no item {item_id!r} in this review")
        if db.execute("SELECT 1 FROM answers WHERE item_id = ? AND rater = ?", (item_id, rater)).fetchone():
            return False
        if db.execute("SELECT 1 FROM claims WHERE item_id = ? AND rater = ?", (item_id, rater)).fetchone() is None:
            raise NotGiven(f"{item_id} was not given to {rater}: nothing stored")
        if db.execute("SELECT 1 FROM answers a JOIN items j USING (item_id) WHERE j.pair_id = ? AND a.rater = ?",
                      (row[0], rater)).fetchone():
            raise NotGiven(f"{rater} already answered another form of {item_id}'s image: nothing stored")
        if db.execute("SELECT COUNT(*) FROM answers WHERE item_id = ?", (item_id,)).fetchone()[0] >= k:
            raise NotGiven(f"{item_id} has its {k} answers already (your claim on it had expired): nothing stored")
        return True
