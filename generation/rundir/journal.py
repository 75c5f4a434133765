"""A run's journal read back before the run is written again: by a resume, `--retry-failed` (with or without
`--drop-missing-sources`) and `merge`. Every `round` and `task` line is parsed by the run's one schema (schema.py:
ROUND_LINE, TASK_LINE) and checked as the store writes it, before anything is done with any: the names that
become folders and files (dataset, disease, source id) are plain names, the uid and key follow from them, rounds
are numbered 1, 2, ..., and each image is the path the layout gives for its task and round, so that no record
steers a write outside the run. A refusal is a UsageError naming the file, the line and the field.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import msgspec

from ..files import open_owned
from ..records import json_bool, task_uid
from ..outcomes import STATUSES, TaskStatus
from ..taxonomy import DIRECTIONS
from . import layout
from .schema import ROUND_LINE, TASK_LINE, RoundEntry, RoundLine, TaskLine, malformed, refusal, shown
from ..failures import UsageError

NAME_MAX = 255  # bytes in one file or folder name (ext4, XFS, Btrfs, NFS): a longer dataset folder cannot be made


@dataclass(frozen=True)
class JournalLine:
    """One line of a journal, parsed and checked: `where` names it (file and line), `entry` as json decodes it
    (what a run replays and merge copies), `task` the parsed `task` line (None for a round)."""

    where: str
    entry: dict
    task: TaskLine | None = None


def journal_lines(path: Path, who: str) -> list[JournalLine]:
    """The journal at `path`, parsed and checked (`parse_journal`); [] when there is none. Opened without following
    a link or blocking (files.open_owned: a FIFO, a folder or a link there is UnsafeFile)."""
    try:
        with os.fdopen(open_owned(path), "rb") as fh:
            data = fh.read()
    except FileNotFoundError:
        return []
    return parse_journal(data, who)


def parse_journal(data: bytes, who: str) -> list[JournalLine]:
    """Every `round` and `task` line of a journal's bytes, each parsed (ROUND_LINE, TASK_LINE) and checked as the
    store writes it (`check_round_line`, `check_task_line`) before anything is done with any: ValueError naming
    `who`, the line and the field. A line that is not JSON (the last, torn by a kill) is skipped, and so is one of
    another type (none of ours writes one)."""
    lines = []
    for line_no, raw in enumerate(data.splitlines(), 1):
        where = f"{who}, {layout.JOURNAL} line {line_no}"
        try:
            entry = json.loads(raw)
        except UnicodeDecodeError:
            raise UsageError(f"{where}: not UTF-8 text") from None
        except json.JSONDecodeError:
            continue
        kind = entry.get("type") if isinstance(entry, dict) else None
        if kind == "task":
            task = _decoded_line(TASK_LINE, raw, where, entry)
            check_task_line(where, task)
            lines.append(JournalLine(where, entry, task))
        elif kind == "round":
            check_round_line(where, _decoded_line(ROUND_LINE, raw, where, entry))
            lines.append(JournalLine(where, entry))
    return lines


def _decoded_line(decoder: msgspec.json.Decoder, raw: bytes, where: str, entry: dict):
    try:
        return decoder.decode(raw)
    except msgspec.ValidationError as exc:  # "Expected `str | null`, got `int` - at `$.record.disease`"
        raise malformed(where, exc, entry) from None
    except msgspec.DecodeError as exc:
        raise UsageError(f"{where}: not valid JSON text ({exc})") from None


def _plain_name(where: str, field: str, value: str | None) -> str:
    """A name that becomes one path component of the layout (a dataset, disease or source id)."""
    if not value:
        raise refusal(where, field, "is missing or empty")
    if "/" in value or "\x00" in value or value in (".", ".."):
        raise refusal(where, field, f"is {shown(value)}, not a plain file name")
    return value


def _dataset_name(where: str, field: str, dataset: str | None, direction: str) -> str:
    """A plain name the builder reads back from its folders' names ({D}-edit / {D}-remove), within NAME_MAX."""
    dataset = _plain_name(where, field, dataset)
    if layout.parse_output_dir(layout.output_dir(Path(), dataset, direction).name) != (dataset, direction):
        raise refusal(where, field, f"is {shown(dataset)}, which no run folder name can carry")
    if len(os.fsencode(layout.failed_dir(Path(), dataset, direction).name)) > NAME_MAX:
        raise refusal(where, field, f"is {len(dataset)} characters: its folders' names would be longer than "
                                     f"{NAME_MAX} bytes")
    return dataset


def _edited(where: str, at: str, rnd: RoundEntry) -> bool:
    """Whether a round's edit gave an image (`edit_result.success`; None: edited, as the builder reads it)."""
    success = rnd.edit_result.success if rnd.edit_result is not None else None
    edited = True if success is None else json_bool(success)
    if edited is None:
        raise refusal(where, f"{at}.edit_result.success", "is neither true nor false")
    return edited


def check_round_line(where: str, line: RoundLine) -> None:
    """A `round` line as the store writes it (`RunStore.journal_attempt`), or ValueError naming the field: its uid is
    a task's (`{dataset}/{direction}/{key}`, plain names), its round a number from 1, `accepted` true or false, and
    its image the path the layout gives for its task and round (empty when the edit gave none)."""
    parts = line.uid.split("/")
    if len(parts) != 3 or parts[1] not in DIRECTIONS:
        raise refusal(where, "uid", f"is {shown(line.uid)}, not a task's {{dataset}}/{{direction}}/{{key}}")
    dataset, direction, key = parts
    _dataset_name(where, "uid", dataset, direction)
    _plain_name(where, "uid", key)
    rnd = line.round
    if rnd.round is None or rnd.round < 1:
        raise refusal(where, "round.round", f"is {rnd.round!r}, not a round number (1, 2, ...)")
    if rnd.accepted.__class__ is not bool:
        raise refusal(where, "round.accepted", f"is {shown(rnd.accepted)}, not true or false")
    image = rnd.image or ""
    if not _edited(where, "round", rnd):
        expected = ""
    else:  # the disease ends the key; an add edit's class folder is the disease, a remove edit's `normal`
        disease = (image.split("/") + ["", ""])[1] if direction == "add" else key.rpartition("-")[2]
        stem = key[: -len(disease) - 1] if disease and key.endswith(f"-{disease}") else ""
        expected = (layout.attempt_image_relpath(dataset, direction, stem, disease, rnd.round, rnd.accepted)
                    if stem and disease not in (".", "..") else None)
    if image != expected:
        should = "empty (the edit gave no image)" if expected == "" else "the layout's path for its task and round"
        raise refusal(where, "round.image", f"is {shown(image)}, not {should}")


def check_task_line(where: str, line: TaskLine) -> None:
    """A task record as the store writes it (`store.conversation_record`), or ValueError naming the field: its
    names are plain names the builder reads back from the folders, its uid and key follow from them, its rounds are
    1..n with `accepted` only on a success's last, and each image is the path the layout gives for its round."""
    rec = line.record
    _plain_name(where, "record.dataset", rec.dataset)
    disease = _plain_name(where, "record.disease", rec.disease)
    source_id = _plain_name(where, "record.source_id", rec.source_id)
    if rec.task not in DIRECTIONS:
        raise refusal(where, "record.task", f"is {shown(rec.task)}, not one of {', '.join(DIRECTIONS)}")
    if rec.status not in STATUSES:
        raise refusal(where, "record.status", f"is {shown(rec.status)}, not one of {', '.join(STATUSES)}")
    dataset = _dataset_name(where, "record.dataset", rec.dataset, rec.task)
    uid = task_uid(dataset, rec.task, source_id, disease)
    if rec.uid != uid or line.uid != uid:
        raise refusal(where, "uid", f"is {shown(line.uid)} (record: {shown(rec.uid)}), not "
                                     f"{shown(uid)} as its dataset, task, source_id and disease give")
    if rec.key != f"{source_id}-{disease}":
        raise refusal(where, "record.key", f"is {'missing' if rec.key is None else shown(rec.key)}, not "
                                            f"{shown(f'{source_id}-{disease}')}")
    success = rec.status == TaskStatus.SUCCESS
    last = len(rec.rounds)
    for n, rnd in enumerate(rec.rounds, 1):
        at = f"record.rounds[{n - 1}]"
        if rnd.round != n:
            raise refusal(where, f"{at}.round", f"is {rnd.round!r}, not {n}: rounds are numbered 1, 2, ...")
        if rnd.accepted is not (success and n == last):
            raise refusal(where, f"{at}.accepted", f"is {rnd.accepted!r}, which a {rec.status} task's round "
                                                    f"{n} of {last} cannot be")
        edited = _edited(where, at, rnd)
        expected = layout.attempt_image_relpath(dataset, rec.task, source_id, disease, n, rnd.accepted)
        if (rnd.image or "") != (expected if edited else ""):
            should = f"the layout's {expected}" if edited else "empty (the edit gave no image)"
            raise refusal(where, f"{at}.image", f"is {shown(rnd.image)}, not {should}")
    if success and rec.success_round not in (None, last):  # None: the builder takes the last round
        raise refusal(where, "record.success_round", f"is {rec.success_round!r}, not its last round {last}")
    if not success and rec.success_round is not None:
        raise refusal(where, "record.success_round", f"is {rec.success_round!r} in a {rec.status} task")
    final = (rec.rounds[-1].image or "") if rec.rounds else ""
    if (rec.final_image or "") != final:
        raise refusal(where, "record.final_image", f"is {shown(rec.final_image)}, not its last round's "
                                                    f"image {final!r}")
    if (rec.api_failure is not None) != (rec.status == TaskStatus.API_FAILED):
        raise refusal(where, "record.api_failure", f"is {'missing' if rec.api_failure is None else 'present'} "
                                                    f"in a {rec.status} task")
    if rec.api_failure is not None and rec.api_failure.task != rec.key:
        raise refusal(where, "record.api_failure.task", f"is {shown(rec.api_failure.task)}, not the "
                                                         f"record's key {rec.key}")


def open_journal(path: Path):
    """(the journal opened to append, its bytes) of a run that has one, (None, b"") of one that has none. Opened
    as a file of ours (files.open_owned: a symbolic link, a hard link, a FIFO or a folder there is refused in one
    line) and read through that descriptor."""
    try:
        fd = open_owned(path, os.O_RDWR | os.O_APPEND)
    except FileNotFoundError:
        return None, b""
    try:
        data = b"".join(iter(lambda: os.read(fd, 1 << 24), b""))
        return os.fdopen(fd, "ab"), data
    except BaseException:
        os.close(fd)
        raise
