"""The run directory's JSON, as msgspec Structs: decoded straight into typed objects, unknown fields skipped.

The one parser of a round and a task record, wherever they are read: the builder reads `all_conversations.json`
(the original scripts' entries and ours, which add fields; see ARCHITECTURE.md, "Records") and the paper's §5.2
records through it, a resumed run turns its journal's rounds into `Attempt`s through it (`attempt_from_round`), and
every journal line a resume, `--retry-failed` or `merge` reads is parsed by it (`ROUND_LINE`, `TASK_LINE`; checked
by journal.py), as is the run's medbanana-run.json (`RunConfig`, `read_run_config(strict=True)`). Booleans and
scores are any JSON scalar (`Scalar`) because judges have been seen to answer "yes"/"no" or numbers as strings;
`records.as_bool` normalises them. An object or a list there, or an integer past its parquet column's range, is a
malformed entry that msgspec names by its `$...` path (`malformed`: one line naming the field and its value).
`gc=False`: these objects hold no cycles, and keeping a million of them out of the cyclic collector's sight halves
the read time.
"""

from __future__ import annotations

import json
import os
import re
import reprlib
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec

from ..files import MISSING, not_regular, open_owned
from ..records import VERDICT_COLUMNS, Attempt, Instruction, Usage, Verdict, as_bool, verdict_values
from ..taxonomy import DIRECTIONS
from . import layout
from ..failures import UsageError

Scalar = bool | int | float | str | None
Int32 = Annotated[int, msgspec.Meta(ge=-(2**31), le=2**31 - 1)]  # rounds: int32 columns
Int64 = Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1)]  # seed: an int64 column
Count = Annotated[int, msgspec.Meta(ge=1, le=2**31 - 1)]  # max_rounds, limit


# Thinking summaries are most of the text and only the conversations and judge rows use them: they stay raw JSON
# (a view into the file's bytes) until `text()` decodes them, which nearly halves the decoding time.
NULL = msgspec.Raw(b"null")


def text(raw: msgspec.Raw | None) -> str | None:
    """Decode a raw JSON string field; None for a missing or null field, or one that is not a string."""
    value = msgspec.json.decode(raw) if raw else None
    return value if isinstance(value, str) else None


class GeneratePrompt(msgspec.Struct, gc=False):
    thinking_summary: msgspec.Raw = NULL
    prompt: str | None = None


class EditResult(msgspec.Struct, gc=False):
    success: Scalar = True  # read strictly (`records.json_bool`): "false" is false, "no" is refused
    error: str | None = None
    details: msgspec.Raw = NULL  # ours: the editor's facts, decoded only when a run resumes


# A round's `verification`: the verdict's columns as `records.VERDICT_COLUMNS` declares them (booleans and the score
# as any scalar, normalised by `records.verdict_values`), then the judge's thinking (raw) and model (ours).
Verification = msgspec.defstruct(
    "Verification",
    [*((name, str | None if kind is str else Scalar, None) for name, kind in VERDICT_COLUMNS.items()),
     ("thinking_summary", msgspec.Raw, NULL), ("model", str | None, None), ("details", msgspec.Raw, NULL),
     ("unjudged", list[str] | None, None)],
    module=__name__, gc=False)


class RoundEntry(msgspec.Struct, gc=False):
    """An attempt as a run directory stores it: a `rounds` item of `all_conversations.json` (and of a journal line),
    read leniently; `records.Attempt` is the attempt the loop makes, `task_records.AttemptRecord` the one read back."""

    round: Int32 | None = None
    generate_prompt: GeneratePrompt | None = None
    edit_result: EditResult | None = None
    verification: Verification | None = None
    instruction: str | None = None  # ours, equal to generate_prompt.prompt
    seconds: int | float | str | None = None  # ours
    accepted: Scalar = None  # ours
    image: str | None = None  # ours: the attempt's image, relative to the run directory
    usage: msgspec.Raw = NULL  # ours: tokens per role
    geometry: msgspec.Raw = NULL  # ours: the geometry guard's record (generation/geometry.py), read by `geometry_of`


class Models(msgspec.Struct, gc=False):
    """The models of a task (ours); a Struct so that a malformed one is named by field (`$.models.writer`)."""

    writer: str | None = None
    editor: str | None = None
    judge: str | None = None


class Conversation(msgspec.Struct, gc=False):
    """An `all_conversations.json` value."""

    image: str | None = None
    disease: str | None = None
    status: str | None = None
    rounds: list[RoundEntry] = []
    final_prompt: str | None = None
    # ours
    uid: str | None = None
    dataset: str | None = None
    modality: str | None = None
    task: str | None = None
    source_id: str | None = None
    source_path: str | None = None
    source_sha256: str | None = None
    success_round: Int32 | None = None
    final_image: str | None = None
    models: Models | None = None
    seed: Int64 | None = None


class ApiFailureEntry(msgspec.Struct, gc=False):
    """An `api_failures.json` item (and a journal task line's `api_failure`): the task it names, then the fields of
    its `outcomes.ApiFailure` as the original scripts wrote them, read leniently."""

    task: str
    step: str | None = None
    round: int | str | None = None  # read leniently by `readers`, within int32
    error: str | None = None
    disease: str | None = None
    kind: str | None = None  # ours



class JournalRecord(Conversation, gc=False):
    """A journal `task` line's record: an `all_conversations.json` value plus what only the journal keeps."""

    key: str | None = None
    final_image_path: str | None = None
    api_failure: ApiFailureEntry | None = None
    error: dict[str, str | None] | None = None  # an api_failed task's step, kind and message


class TaskLine(msgspec.Struct, gc=False):
    """A `task` line of medbanana-journal.jsonl (store.py writes them; merge reads other machines' through it)."""

    type: str
    uid: str
    record: JournalRecord


class PaperRound(msgspec.Struct, gc=False):
    round: Int32
    instruction: str | None = None
    verdict: Verification | None = None


class PaperRecord(msgspec.Struct, gc=False):
    """One line of a §5.2 `records.jsonl`."""

    image_id: str
    dataset: str
    disease: str
    task: str
    rounds: list[PaperRound] = []
    modality: str | None = None
    outcome: str | None = None
    success_round: Int32 | None = None
    output_path: str | None = None


CONVERSATION = msgspec.json.Decoder(Conversation)  # one entry: files are split into entries by `run_json`
API_FAILURES = msgspec.json.Decoder(list[ApiFailureEntry])
PAPER_RECORD = msgspec.json.Decoder(PaperRecord)
TASK_LINE = msgspec.json.Decoder(TaskLine)


ROUND = msgspec.json.Decoder(RoundEntry)


class RoundLine(msgspec.Struct, gc=False):
    """A `round` line of medbanana-journal.jsonl (store.py writes them)."""

    type: str
    uid: str
    round: RoundEntry


ROUND_LINE = msgspec.json.Decoder(RoundLine)


def attempt_from_round(raw: dict | bytes) -> Attempt:
    """A journalled round (its JSON text, or as `json.loads` made it) back as the Attempt that wrote it."""
    round_ = ROUND.decode(raw if isinstance(raw, bytes) else msgspec.json.encode(raw))
    prompt = round_.generate_prompt or GeneratePrompt()
    usage = _decoded(round_.usage) or {}
    edit = round_.edit_result or EditResult()
    instruction = Instruction(text=prompt.prompt if prompt.prompt is not None else round_.instruction or "",
                              thinking_summary=text(prompt.thinking_summary) or "",
                              usage=Usage(**(usage.get("writer") or {})))
    return Attempt(round=int(round_.round), instruction=instruction,
                   verdict=_verdict(round_.verification, usage.get("judge") or {}),
                   accepted=bool(as_bool(round_.accepted)), edit_error=edit.error or "",
                   image_relpath=round_.image or "", seconds=float(round_.seconds or 0.0),
                   edit_details=_decoded(edit.details) or {}, edit_usage=Usage(**(usage.get("editor") or {})),
                   geometry=_decoded(round_.geometry) or {})


def _verdict(raw: Verification | None, usage: dict) -> Verdict | None:
    if raw is None:
        return None
    return Verdict.from_values(verdict_values(raw), thinking_summary=text(raw.thinking_summary) or "",
                               model=raw.model or "", details=_decoded(raw.details) or {}, usage=Usage(**usage),
                               unjudged=tuple(raw.unjudged or ()))


class GeometryRecord(msgspec.Struct, gc=False):
    """What the builder reads of a round's `geometry` (the guard's record): the measurement's columns and the
    action; null where not measured."""

    aligned: bool | None = None
    shift_px: float | None = None
    scale: float | None = None
    rotation_deg: float | None = None
    action: str | None = None


_GEOMETRY = msgspec.json.Decoder(GeometryRecord)


def geometry_of(raw: msgspec.Raw | None) -> GeometryRecord | None:
    """A round's `geometry` as a GeometryRecord; None when the round has none, or one that does not read as one (a
    derived record: the build measures again where it can)."""
    if not raw or bytes(raw) == b"null":
        return None
    try:
        return _GEOMETRY.decode(raw)
    except msgspec.ValidationError:
        return None


def _decoded(raw: msgspec.Raw):
    return msgspec.json.decode(raw) if raw else None


def read_run_config(run_dir: Path, *, strict: bool = False) -> dict | None:
    """RUN_DIR/medbanana-run.json as a dict, or None when the run has none: read only from inside the run
    (`layout.inside`: a link out is UnsafePath) and checked by stat before it is opened; a ValueError naming the
    file when it is no regular file, not JSON or not a JSON object. Every reader of a run's configuration goes
    through here; those that write the run (reopening it, `--retry-failed`, `merge`) read it `strict`ly: parsed as
    a `RunConfig` (`check_run_config`), a field of the wrong type is a ValueError naming the file and the field."""
    path = layout.inside(Path(run_dir), layout.RUN_CONFIG, named_by=f"the run directory {run_dir}")
    if (problem := not_regular(path)) is not None:
        if problem == MISSING:
            return None
        raise UsageError(f"{path}: {problem}")
    with os.fdopen(open_owned(path), "rb") as fh:  # never blocks, should it become a FIFO since the stat
        data = fh.read()
    try:
        config = json.loads(data)
    except ValueError as exc:
        raise UsageError(f"{path}: not a run configuration, not JSON ({exc})") from None
    if not isinstance(config, dict):
        raise UsageError(f"{path}: not a run configuration, not a JSON object")
    if strict:
        check_run_config(path, config)
    return config


# ---------------------------------------------------------------- a run reopened or merged: its config and journal

Name = Annotated[str, msgspec.Meta(min_length=1, pattern=r"^[^/\x00-\x1f]+$")]  # a folder name: no "/", no control


class RecordedSelection(msgspec.Struct, gc=False):
    """medbanana-run.json's `selection` (what `--retry-failed` selects again)."""

    modalities: list[Name] = []
    diseases: list[Name] = []
    directions: list[Literal["add", "remove"]] = msgspec.field(default_factory=lambda: list(DIRECTIONS))
    modality: Name | None = None
    shard: tuple[Annotated[int, msgspec.Meta(ge=0)], Count] | None = None
    limit: Count | None = None


class RunConfig(msgspec.Struct, gc=False):
    """medbanana-run.json as a run that is written again reads it (store.py, `--retry-failed`, `merge`): the fields
    they use, typed; any other is kept as it is. `backends` and `c2pa` are compared whole (store.IDENTITY_KEYS)."""

    format_version: int | None = None
    max_rounds: Count | None = None
    seed: Int64 | None = None
    accept: str | None = None
    backends: dict[str, Any] | None = None
    models: dict[str, str | None] | None = None
    c2pa: dict[str, Any] | None = None
    digital_source_type: str | None = None
    sources_root: Annotated[str, msgspec.Meta(min_length=1)] | None = None
    selection: RecordedSelection | None = None
    run_id: Annotated[str, msgspec.Meta(min_length=1)] | None = None
    created: float | None = None
    merged_from: list[str] | None = None


def check_run_config(path: Path, config: dict) -> RunConfig:
    """`config` (medbanana-run.json at `path`, as json decodes it) parsed as a RunConfig; ValueError naming the file
    and the field otherwise."""
    try:
        parsed = msgspec.convert(config, RunConfig)
    except msgspec.ValidationError as exc:
        raise malformed(str(path), exc, config) from None
    shard = parsed.selection.shard if parsed.selection is not None else None
    if shard is not None and shard[0] >= shard[1]:
        raise refusal(str(path), "selection.shard", f"is {list(shard)}, not [i, N] with i < N")
    if parsed.sources_root is not None and not os.path.isabs(parsed.sources_root):
        raise refusal(str(path), "sources_root", f"is {shown(parsed.sources_root)}, not an absolute path")
    return parsed


_REPR = reprlib.Repr()  # a value from the data in a refusal: quoted and escaped (repr), cut short
_REPR.maxstring = 200
shown = _REPR.repr
_STEP = re.compile(r"\.([^.\[]+)|\[(\d+)\]")


def refusal(where: str, field: str, problem: str) -> UsageError:
    return UsageError(f"{where}: field '{field}' {problem}")


def malformed(where: str, exc: msgspec.ValidationError, data) -> UsageError:
    """A msgspec refusal ("Expected `int` >= 1 - at `$.max_rounds`") as one line naming the field and its value."""
    problem, _, field = str(exc).partition(" - at `$")
    field = field.rstrip("`").lstrip(".")
    value, found = data, True
    for key, index in _STEP.findall("." + field if field and not field.startswith("[") else field):
        try:
            value = value[key] if key else value[int(index)]
        except (KeyError, IndexError, TypeError):
            found = False
            break
    what = f"is {shown(value)}" if found and field else "is malformed"
    return refusal(where, field or "record", f"{what}: {problem[:1].lower()}{problem[1:]}")
