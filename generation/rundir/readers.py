"""The readers of task records: the three of `runs.read_tasks` (one output folder's JSON, a §5.2 records file, an
image-only folder) and that of a built dataset's `conversations` rows.

Each entry is checked before it becomes a `TaskRecord`, so that nothing malformed reaches the rows: `task` is add
or remove, a status is known, round numbers are distinct, a success names one of its rounds, `edit_result.success`
is a boolean (or "true"/"false"), numbers fit their columns, and every image path the entry implies (from
`dataset`, `source_id`, the task key, the disease) or records (`final_image`) stays inside the folder the user
named. Entries whose files disagree are refused too: a `success_round` whose edit failed (no image to accept), a
success in progress.json with no entry in all_conversations.json. A bad entry is a `confined.Refused` naming the
file, the entry and the field; the caller's policy raises it or records it.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import msgspec

from ..records import json_bool, task_uid
from ..outcomes import STATUSES, TaskStatus
from ..taxonomy import DIRECTIONS, load_taxonomy
from . import layout, run_json, schema
from .confined import INCONSISTENT, MALFORMED, Confined, Refused, handle
from .task_records import AttemptRecord, TaskRecord, Unit, block_of, image_files, infer_modality

_NO_ROUND = object()  # equal to no round number: a task that is not a success accepts none
_INT32 = 2**31


def read_json_unit(unit: Unit, part: int, parts: int, confined: Confined, refused) -> list[TaskRecord]:
    folder = unit.path.relative_to(unit.run_dir).as_posix()
    named_by = f"the run directory {unit.run_dir}"
    files = {name: (unit.path / name, run_json.load(unit.run_dir, f"{folder}/{name}", named_by, unit.scope))
             for name in (layout.ALL_CONVERSATIONS, layout.PROGRESS, layout.API_FAILURES)}
    conv_path, data = files[layout.ALL_CONVERSATIONS]
    # a whole file read by one partition is decoded in one pass; a block of it (or a file with a malformed
    # entry) entry by entry
    decoded = run_json.conversations(data, conv_path) if data is not None and parts == 1 else None
    conversations = decoded if decoded is not None else run_json.entries(data, conv_path) if data is not None else {}
    prog_path, data = files[layout.PROGRESS]
    progress = run_json.statuses(data, prog_path) if data is not None else {}
    fail_path, data = files[layout.API_FAILURES]
    failures = {f.task: f for f in run_json.decode(data, schema.API_FAILURES, fail_path)} if data is not None else {}
    # api_failed tasks (and any task the JSON was not rewritten for) exist only in progress.json
    keys = list(conversations) + [key for key in progress if key not in conversations]
    tasks = []
    for key in block_of(keys, part, parts):
        try:
            status = progress.get(key)
            raw = conversations.get(key)
            if raw is None:
                failure = failures.get(key)
                origin = (prog_path, key)
                if status == TaskStatus.SUCCESS:  # its rounds and accepted image are unknown: not a success to publish
                    raise Refused(f"{_where(origin)}: status 'success' but {layout.ALL_CONVERSATIONS} has no entry "
                                  "for it (no rounds, no accepted edit)", INCONSISTENT)
                disease = (failure.disease if failure else None) or _disease_from_key(key, origin)
                tasks.append(_new_task(unit, key, disease, status, schema.Conversation(), failure, origin,
                                       fail_path))
            else:
                entry = raw if decoded is not None else run_json.decode_entry(schema.CONVERSATION, raw, conv_path,
                                                                               key)
                tasks.append(_task_from_entry(unit, key, entry, status, failures.get(key), confined,
                                              (conv_path, key), fail_path))
        except Refused as exc:
            handle(exc, refused)
    return tasks


def _task_from_entry(unit: Unit, key: str, entry: schema.Conversation, progress_status: str | None,
                     failure: schema.ApiFailureEntry | None, confined: Confined, origin: tuple,
                     fail_path: Path) -> TaskRecord:
    disease = entry.disease or _disease_from_key(key, origin)
    status = entry.status or progress_status or TaskStatus.FAILED
    task = _new_task(unit, key, disease, status, entry, failure, origin, fail_path)
    rounds = entry.rounds
    numbers = [r.round or i + 1 for i, r in enumerate(rounds)]
    if entry.success_round is not None:
        task.success_round = entry.success_round
    elif status == TaskStatus.SUCCESS and numbers:
        task.success_round = numbers[-1]
    _check_rounds(task, numbers)
    # Run for every attempt of a release (~280,000): the common case of each check is tested inline, and the
    # helpers (which name the round in a refusal) are called only otherwise.
    run_dir, scope = unit.run_dir, unit.scope
    dataset, direction, source_id = task.dataset, task.direction, task.source_id
    accepted_round = task.success_round if status == TaskStatus.SUCCESS else _NO_ROUND
    for number, raw in zip(numbers, rounds):
        def where(number=number) -> str:  # formatted only for a refusal: most attempts never need it
            return f"{task.origin}, round {number}"

        accepted = number == accepted_round
        prompt, edit, verification = raw.generate_prompt, raw.edit_result, raw.verification
        edited = True if edit is None or edit.success is True or edit.success is None else \
            _edit_succeeded(edit, where)
        if verification is not None and verification.score.__class__ is int:
            _check_score(verification, where)
        image = None
        if edited:
            image = layout.attempt_image_relpath(dataset, direction, source_id, disease, number, accepted)
            confined.check(run_dir, image, where, scope)
        elif accepted:
            raise Refused(f"{task.origin}: field 'success_round' is {number}, but round {number}'s edit failed "
                          "(edit_result.success is false): there is no image to accept", INCONSISTENT)
        seconds = raw.seconds
        if seconds is not None and seconds.__class__ is not float:
            seconds = _seconds(seconds, where)
        task.add_attempt(AttemptRecord(
            round=number, instruction=raw.instruction or (prompt.prompt if prompt else None),
            writer_thinking_json=prompt.thinking_summary if prompt else None,
            edit_error=None if edited else (edit.error or "the editor produced no image"),
            verdict=verification,
            judge_thinking_json=verification.thinking_summary if verification else None,
            judge_model=verification.model if verification else None, accepted=accepted, image=image,
            seconds=seconds, usage_json=raw.usage,
            geometry=schema.geometry_of(raw.geometry) if image else None))
    task.final_prompt = entry.final_prompt
    if entry.final_image:  # recorded in the conversations rows, so held to the same rule as the images read
        confined.check(unit.run_dir, entry.final_image, lambda: f"{task.origin}, field 'final_image'", scope)
    task.final_image = entry.final_image or _final_image(task)
    return task


def _new_task(unit: Unit, key: str, disease: str, status: str | None, entry: schema.Conversation,
              failure: schema.ApiFailureEntry | None, origin: tuple, fail_path: Path | None = None) -> TaskRecord:
    dataset = entry.dataset or unit.dataset
    direction = entry.task or unit.direction
    if direction not in DIRECTIONS:
        raise Refused(f"{_where(origin)}: field 'task' is {_show(direction)}, not 'add' or 'remove'", MALFORMED)
    if status not in STATUSES:
        raise Refused(f"{_where(origin)}: status {_show(status)} is not one of {', '.join(STATUSES)}", MALFORMED)
    if entry.source_id:
        source_id = entry.source_id
    elif entry.image:
        source_id = entry.image.rsplit("/", 1)[-1].rsplit(".", 1)[0]
    else:
        source_id = layout.split_task_key(key, disease) if key.endswith(f"-{disease}") else key
    api_failure = None
    if failure is not None:
        api_failure = {"step": failure.step, "round": _failure_round(failure, fail_path), "error": failure.error,
                       "kind": failure.kind}
    return TaskRecord(
        uid=entry.uid or task_uid(dataset, direction, source_id, disease), run_dir=unit.run_dir,
        dataset=dataset, modality=entry.modality or infer_modality(dataset, disease), disease=disease,
        direction=direction, source_id=source_id, status=TaskStatus(status), source_path=entry.source_path,
        source_sha256=entry.source_sha256, models=msgspec.structs.asdict(entry.models) if entry.models else None,
        seed=entry.seed, api_failure=api_failure,
        origin_file=origin[0], origin_entry=origin[1], scope=unit.scope)


def _final_image(task: TaskRecord) -> str | None:
    accepted = task.accepted
    if accepted is not None:
        return accepted.image
    with_image = [a for a in task.attempts if a.image]
    return with_image[-1].image if with_image else None


# --- the paper's §5.2 records -------------------------------------------------------------------------------

def read_records_unit(unit: Unit, part: int, parts: int, confined: Confined, refused) -> list[TaskRecord]:
    named_by = f"the run directory {unit.run_dir}"
    data = run_json.load(unit.run_dir, unit.path.relative_to(unit.run_dir).as_posix(), named_by, unit.scope)
    lines = [(n, line) for n, line in enumerate(iter(data.readline, b""), 1) if line.strip()] if data else []
    tasks = []
    for line_no, line in block_of(lines, part, parts):
        try:
            tasks.append(_task_from_record(unit, line_no, line, confined))
        except Refused as exc:
            handle(exc, refused)
    return tasks


def _task_from_record(unit: Unit, line_no: int, line: bytes, confined: Confined) -> TaskRecord:
    where = f"{unit.path}, line {line_no}"
    try:
        rec = schema.PAPER_RECORD.decode(line)
    except (msgspec.DecodeError, UnicodeDecodeError) as exc:  # also ValidationError: a missing or mistyped field
        raise Refused(f"{where}: not a §5.2 record: {exc}", MALFORMED) from None
    source_id = Path(rec.image_id).stem
    disease, dataset, direction = rec.disease, rec.dataset, rec.task
    status = rec.outcome or TaskStatus.FAILED
    if direction not in DIRECTIONS:
        raise Refused(f"{where}: field 'task' is {_show(direction)}, not 'add' or 'remove'", MALFORMED)
    if status not in STATUSES:
        raise Refused(f"{where}: field 'outcome' is {_show(status)}, not one of {', '.join(STATUSES)}", MALFORMED)
    task = TaskRecord(uid=task_uid(dataset, direction, source_id, disease), run_dir=unit.run_dir, dataset=dataset,
                      modality=rec.modality or infer_modality(dataset, disease), disease=disease,
                      direction=direction, source_id=source_id, status=TaskStatus(status), success_round=rec.success_round,
                      origin_file=unit.path, origin_entry=line_no, scope=unit.scope)
    _check_rounds(task, [raw.round for raw in rec.rounds])
    for raw in rec.rounds:
        accepted = status == TaskStatus.SUCCESS and raw.round == task.success_round
        def at_round(number=raw.round) -> str:
            return f"{where}, round {number}"

        _check_score(raw.verdict, at_round)
        image = layout.attempt_image_relpath(dataset, direction, source_id, disease, raw.round, accepted)
        confined.check(unit.run_dir, image, at_round, unit.scope)
        task.add_attempt(AttemptRecord(
            round=raw.round, instruction=raw.instruction, verdict=raw.verdict, accepted=accepted,
            judge_thinking_json=raw.verdict.thinking_summary if raw.verdict else None, image=image))
    task.final_image = _final_image(task)
    return task


# --- image-only release folders ----------------------------------------------------------------------------

def read_image_unit(unit: Unit, part: int, parts: int, confined: Confined, refused) -> list[TaskRecord]:
    word = layout.direction_word(unit.direction)
    tasks = []
    for relative in block_of(list(image_files(unit)), part, parts):
        name = relative.rsplit("/", 1)[1].rsplit(".", 1)[0]
        if not name.endswith(f"-{word}"):
            continue  # not an accepted edit of this direction (e.g. a stray file)
        key = name[: -len(word) - 1]
        origin = (unit.path, None)
        try:
            disease = relative.split("/")[-2] if unit.direction == "add" else _disease_from_key(key, origin)
            task = _new_task(unit, key, disease, TaskStatus.SUCCESS, schema.Conversation(), None, origin)
        except Refused as exc:
            handle(exc, refused)
            continue
        # the file itself is checked when read: its folder passed the rule when the unit was found
        task.add_attempt(AttemptRecord(round=None, instruction=None, accepted=True, image=relative))
        task.final_image = relative
        tasks.append(task)
    return tasks


# --- checks ----------------------------------------------------------------------------------------------

def _where(origin: tuple) -> str:
    file, entry = origin
    return str(file) if entry is None else f"{file}, entry {entry!r}"


def _show(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:57]}..."


def _check_rounds(task: TaskRecord, numbers: list[int]) -> None:
    """Round numbers are distinct, and a success names one of them (else its sft row would vanish)."""
    if len(set(numbers)) != len(numbers):
        twice = next(n for n in numbers if numbers.count(n) > 1)
        raise Refused(f"{task.origin}: round {twice} appears more than once in 'rounds'", MALFORMED)
    if task.status == TaskStatus.SUCCESS and task.success_round not in numbers:
        if not numbers:
            raise Refused(f"{task.origin}: status 'success' but no rounds", MALFORMED)
        raise Refused(f"{task.origin}: field 'success_round' is {task.success_round}, not one of its rounds "
                      f"{numbers[:10]}", MALFORMED)


def _edit_succeeded(edit: schema.EditResult | None, where) -> bool:
    """A JSON boolean, or the strings "true"/"false" (`records.json_bool`); anything else is refused rather than
    guessed: whether the round has an image decides which files are read."""
    value = True if edit is None or edit.success is None else edit.success
    succeeded = json_bool(value)
    if succeeded is None:
        raise Refused(f"{where()}: field 'edit_result.success' is {_show(value)}; it must be true or false",
                      MALFORMED)
    return succeeded


def _check_score(verdict: schema.Verification | None, where) -> None:
    """A score is written as a float: an integer too large for one is refused here, not by pyarrow later."""
    if verdict is not None and verdict.score.__class__ is int:
        try:
            float(verdict.score)
        except OverflowError:
            raise Refused(f"{where()}: field 'verification.score' is too large a number", MALFORMED) from None


def _seconds(value, where) -> float | None:
    if value is None:
        return None
    if not isinstance(value, bool):  # float(True) would pass
        try:
            return float(value)
        except (ValueError, OverflowError):
            pass
    raise Refused(f"{where()}: field 'seconds' is {_show(value)}, not a number", MALFORMED)


def _failure_round(failure: schema.ApiFailureEntry, path: Path | None) -> int | None:
    """The round of an API failure, read leniently as the original scripts wrote it, within its int32 column."""
    try:
        value = int(failure.round) if failure.round is not None else None
    except (TypeError, ValueError):
        return None
    if value is not None and not -_INT32 <= value < _INT32:
        raise Refused(f"{path}, task {failure.task!r}: field 'round' is out of range", MALFORMED)
    return value


def _disease_from_key(key: str, origin: tuple) -> str:
    """The disease of a task key `{stem}-{Disease}`: the longest known folder name it ends with."""
    for folder in _disease_folders():
        if key.endswith(f"-{folder}") and len(key) > len(folder) + 1:
            return folder
    if "-" not in key:
        raise Refused(f"{_where(origin)}: task key {_show(key)} has no -Disease suffix", MALFORMED)
    return key.rsplit("-", 1)[1]



@lru_cache(maxsize=1)
def _disease_folders() -> list[str]:
    return sorted({label.folder for label in load_taxonomy().labels}, key=len, reverse=True)
