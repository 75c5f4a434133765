"""Statistics of one build, gathered per partition while writing and merged at the end.

They feed the dataset card and `medbanana-build.json`; every number comes from the rows actually written.
"""

from __future__ import annotations

import heapq
import zlib
from collections import Counter
from dataclasses import dataclass, field

import msgspec

from ..generation.costs import ROLES, tokens_of
from ..generation.records import FALSE_WORDS, TRUE_WORDS, VERDICT_BOOLEANS, as_bool, as_score
from ..generation.outcomes import TaskStatus
from ..generation.rundir.provenance import read_mark
from .reasons import count_phrases
from ..generation.rundir.task_records import TaskRecord
from ..generation.rundir.source_index import looked_for

DIMENSIONS = ("compliance", "structure_reasonable", "looks_realistic", "fidelity_preserved", "qualified")
# a `verdicts` key: its is-add flag, then the judge's booleans in the order of records.VERDICT_BOOLEANS
COERCED_EXAMPLES = 5
MISSING_EXAMPLES = 20
TOP_REASONS_JSON = 50
UNMARKED = "none"  # image_marks key of an image without a DigitalSourceType mark


@dataclass
class BuildStats:
    rows: Counter = field(default_factory=Counter)  # (config, split) -> rows
    row_bytes: Counter = field(default_factory=Counter)  # (config, split) -> uncompressed size estimate
    shard_bytes: Counter = field(default_factory=Counter)  # (config, split) -> bytes on disk
    tasks: Counter = field(default_factory=Counter)  # (modality, direction, disease, status) -> tasks
    datasets: Counter = field(default_factory=Counter)  # (run, dataset, modality) -> tasks
    success_rounds: Counter = field(default_factory=Counter)  # (modality, direction, round) -> accepted tasks
    attempts: Counter = field(default_factory=Counter)  # (modality, direction) -> attempts
    verdicts: Counter = field(default_factory=Counter)  # (is add, raw judge values...) -> attempts; see below
    odd_scores: Counter = field(default_factory=Counter)  # a score written as no number ("high", "0.8") -> attempts
    no_pair: Counter = field(default_factory=Counter)  # why a task gives no DPO pair -> tasks
    # verdict text -> rejected attempts with it, not yet split into clauses: counting whole texts is a C-speed
    # hash, and each distinct text is split once, by `count_reasons`, at the end of its partition (in parallel)
    rejection_texts: Counter = field(default_factory=Counter)
    reason_counts: Counter = field(default_factory=Counter)  # verdict clause -> rejected attempts naming it
    reviewed_tasks: set = field(default_factory=set)  # uids built that a `--reviews` folder reviewed
    # with expert labels (acceptance.note_judged): judged attempts per (modality, direction); accepted edits per
    # (modality, direction, judge's qualified); each labelled attempt's (id, modality, direction, accepted, qualified)
    judged: Counter = field(default_factory=Counter)
    approval: Counter = field(default_factory=Counter)
    labelled: Counter = field(default_factory=Counter)
    image_marks: Counter = field(default_factory=Counter)  # IPTC DigitalSourceType (or UNMARKED) -> images read
    edit_errors: int = 0
    image_files_read: int = 0
    image_bytes_read: int = 0
    missing_images: int = 0
    missing_image_examples: list = field(default_factory=list)
    sources_attached: int = 0  # tasks whose source image --source-images had (only counted when given)
    sources_missing: int = 0
    source_missing_examples: list = field(default_factory=list)  # what was looked for, in words
    mask_origins: Counter = field(default_factory=Counter)  # stored_masks.STORED/COMPUTED/MISSING -> attempt images
    # and REJECTED / REGION_REJECTED: stored masks refused on read (then computed or missing), by kind and listed
    mask_rejections: Counter = field(default_factory=Counter)
    mask_rejection_examples: list = field(default_factory=list)
    alignment: Counter = field(default_factory=Counter)  # (alignment origin, what was found) -> attempt images
    # inputs refused and left out under `--unsafe skip` (under `error` the first one stops the build)
    refused: Counter = field(default_factory=Counter)  # kind (confined.OUTSIDE, ...) -> refusals
    refusals: list = field(default_factory=list)  # every refusal's message: the file, who named it, why
    refused_tasks: int = 0  # tasks left out (a refused folder or JSON file leaves out what it held, uncounted)
    tokens: Counter = field(default_factory=Counter)  # (role, model, "steps" | "input" | "output") -> count

    def add_refusal(self, exc, task_left_out: bool = True) -> None:
        """Record a `confined.Refused` whose input is left out."""
        self.refused[exc.kind] += 1
        self.refusals.append(str(exc))
        self.refused_tasks += task_left_out

    def add_mask_origins(self, origins: Counter, rejections) -> None:
        """A task's mask counts (stored_masks.row_masks) and its rejected stored masks (a stored_masks.Rejections)."""
        self.mask_origins.update(origins)
        if rejections is not None and rejections.items:
            self.mask_rejections.update(rejections.kinds)
            self.mask_rejection_examples.extend(rejections.items[: max(0, MISSING_EXAMPLES -
                                                                         len(self.mask_rejection_examples))])

    def add_task(self, task: TaskRecord, images: dict, source_found: bool | None) -> None:
        modality = task.modality or "unknown"
        self.tasks[(modality, task.direction, task.disease, task.status)] += 1
        self.datasets[(task.run_dir.name, task.dataset, modality)] += 1
        accepted = task.accepted
        if accepted is not None:
            self.success_rounds[(modality, task.direction, task.success_round)] += 1
            if task.success_round == 1:
                self.no_pair["accepted at round 1"] += 1
        elif task.status == TaskStatus.API_FAILED:
            self.no_pair["stopped by an API failure"] += 1
        else:
            self.no_pair["never accepted"] += 1
        if accepted is not None and task.success_round is None:
            self.no_pair["round unknown (image-only release)"] += 1
        self.attempts[(modality, task.direction)] += len(task.attempts)
        self._count_tokens(task)
        add = task.direction == "add"
        verdicts, rejection_texts, edit_errors = self.verdicts, self.rejection_texts, 0
        for attempt in task.attempts:  # ~280,000 attempts in a release: locals, and as_bool only for a non-bool
            if attempt.edit_error is not None:
                edit_errors += 1
            v = attempt.verdict
            if v is not None:  # raw values, normalised once per distinct pattern in dimension_counts()
                qualified, score = v.qualified, v.score
                verdicts[(add, v.has_disease, v.structure_reasonable, v.looks_realistic, v.fidelity_preserved,
                          qualified)] += 1
                if score is not None and score.__class__ is not float and score.__class__ is not int:
                    self.odd_scores[score] += 1
                if qualified is False or (qualified.__class__ is not bool and as_bool(qualified) is False):
                    rejection_texts[v.reason or ""] += 1  # each clause once per attempt
        self.edit_errors += edit_errors
        for path, value in images.items():
            if value is None:
                self.missing_images += 1
                if len(self.missing_image_examples) < MISSING_EXAMPLES:
                    self.missing_image_examples.append(f"{task.run_dir.name}/{path}")
            else:
                self.image_files_read += 1
                self.image_bytes_read += len(value["bytes"])
                self.image_marks[_source_type(value["bytes"])] += 1
        if source_found is not None:
            self.sources_attached += source_found
            self.sources_missing += not source_found
            if not source_found and len(self.source_missing_examples) < MISSING_EXAMPLES:
                example = looked_for(task.dataset, task.direction, task.disease, task.source_id, task.source_path)
                if example not in self.source_missing_examples:  # one source serves several tasks
                    self.source_missing_examples.append(example)

    def _count_tokens(self, task: TaskRecord) -> None:
        """The tokens each attempt's writer, editor and judge calls used, per role and model, where recorded."""
        models = task.models if isinstance(task.models, dict) else {}
        for attempt in task.attempts:
            if attempt.usage_json is None:
                continue
            try:
                usage = msgspec.json.decode(attempt.usage_json)
            except msgspec.DecodeError:
                continue
            for role in ROLES:
                tokens = tokens_of(usage.get(role)) if isinstance(usage, dict) else None
                if tokens is not None:
                    model = str(models.get(role) or "unknown")
                    self.tokens[(role, model, "steps")] += 1
                    self.tokens[(role, model, "input")] += tokens[0]
                    self.tokens[(role, model, "output")] += tokens[1]

    def dimension_counts(self) -> dict[str, tuple[int, int]]:
        """dimension -> (attempts passing it, judged attempts reporting it)."""
        passes, judged = Counter(), Counter()
        for (add, has, *others), n in self.verdicts.items():
            has = as_bool(has)
            values = (has if has is None or add else not has, *map(as_bool, others))
            for name, value in zip(DIMENSIONS, values):
                if value is not None:
                    judged[name] += n
                    passes[name] += n * value
        return {name: (passes[name], judged[name]) for name in DIMENSIONS}

    def coerced(self) -> dict[str, dict]:
        """Judge fields whose values were not of their column's type and were read as it anyway: booleans that were
        neither a boolean nor a yes/no word (e.g. "maybe", 7, "high"; `records.as_bool`), scores that were no number
        (e.g. "high", read as null, or "0.8"; `records.as_score`): field -> {count: attempts, examples: {value as
        written: read as}}. From the patterns already counted: nothing is added to the per-attempt loop but a
        class check of the score."""
        found: dict[str, dict] = {}

        def add(name: str, value, n: int, read_as) -> None:
            entry = found.setdefault(name, {"count": 0, "examples": {}})
            entry["count"] += n
            if len(entry["examples"]) < COERCED_EXAMPLES:
                entry["examples"][repr(value)[:60]] = read_as

        for (_add, *values), n in sorted(self.verdicts.items(), key=lambda kv: tuple(map(repr, kv[0]))):
            for name, value in zip(VERDICT_BOOLEANS, values):
                if _coerced(value):
                    add(name, value, n, as_bool(value))
        for value, n in sorted(self.odd_scores.items(), key=lambda kv: repr(kv[0])):
            add("score", value, n, as_score(value))
        return dict(sorted(found.items()))

    def merge(self, other: "BuildStats") -> None:
        for name, value in vars(other).items():
            mine = getattr(self, name)
            if isinstance(mine, Counter):
                mine.update(value)
            elif isinstance(mine, set):
                mine |= value
            elif name == "refusals":  # listed in full: a left-out input is never silent
                mine.extend(value)
            elif isinstance(mine, list):
                mine.extend(value[: max(0, MISSING_EXAMPLES - len(mine))])
            else:
                setattr(self, name, mine + value)

    # --- summaries ---

    def count_reasons(self) -> None:
        """Split the verdict texts counted so far into clauses, added to `reason_counts` (each clause once per
        attempt). Clause counts add up across partitions, so each partition splits its own texts."""
        count_phrases(self.rejection_texts, self.reason_counts)
        self.rejection_texts.clear()

    @property
    def failure_reasons(self) -> Counter:
        """Verdict clause -> rejected attempts naming it."""
        self.count_reasons()
        return self.reason_counts

    def top_failure_reasons(self, top: int) -> list[tuple[str, int]]:
        """The `top` most frequent reasons; ties in alphabetical order, so the card does not depend on which
        partition finished first."""
        return heapq.nsmallest(top, self.failure_reasons.items(), key=lambda kv: (-kv[1], kv[0]))

    def source_counts(self) -> dict:
        """What --source-images gave, as the card, medbanana-build.json and the summary report it."""
        return {"matched": self.sources_attached, "total": self.sources_attached + self.sources_missing,
                "missing_examples": self.source_missing_examples}

    def total_tasks(self, status: str | None = None) -> int:
        return sum(n for (_m, _t, _d, s), n in self.tasks.items() if status is None or s == status)

    def to_json(self) -> dict:
        def table(counter, names):
            return [{**dict(zip(names, key if isinstance(key, tuple) else (key,))), "count": n}
                    for key, n in sorted(counter.items(), key=lambda kv: tuple(map(str, kv[0])))]

        return {
            "rows": table(self.rows, ("config", "split")),
            "row_bytes": table(self.row_bytes, ("config", "split")),
            "shard_bytes": table(self.shard_bytes, ("config", "split")),
            "tasks": table(self.tasks, ("modality", "task", "disease", "status")),
            "datasets": table(self.datasets, ("run", "dataset", "modality")),
            "success_rounds": table(self.success_rounds, ("modality", "task", "round")),
            "attempts": table(self.attempts, ("modality", "task")),
            "dimension_pass_rates": {name: passes / judged
                                     for name, (passes, judged) in self.dimension_counts().items() if judged},
            "no_pair": dict(self.no_pair), "edit_errors": self.edit_errors,
            "failure_reasons": dict(self.top_failure_reasons(TOP_REASONS_JSON)),
            "image_marks": dict(sorted(self.image_marks.items())),
            "image_files_read": self.image_files_read, "image_bytes_read": self.image_bytes_read,
            "missing_images": self.missing_images, "missing_image_examples": self.missing_image_examples,
            "sources_attached": self.sources_attached, "sources_missing": self.sources_missing,
            "source_missing_examples": self.source_missing_examples,
            "edit_masks": dict(sorted(self.mask_origins.items())),
            "rejected_masks": {"count": sum(self.mask_rejections.values()),
                               "by_reason": dict(sorted(self.mask_rejections.items())),
                               "examples": self.mask_rejection_examples},
            "alignment": {f"{origin}:{found}" if found else origin: n
                          for (origin, found), n in sorted(self.alignment.items())},
            "refused": {"count": len(self.refusals), "tasks_left_out": self.refused_tasks,
                        "by_reason": dict(sorted(self.refused.items())), "items": sorted(self.refusals)},
            "coerced": self.coerced(),
        }


def _coerced(value) -> bool:
    """Whether a judge's boolean field was written as something `as_bool` can only guess at: not None, a boolean,
    a yes/no word (TRUE_WORDS, FALSE_WORDS) or the number 0 or 1."""
    if value is None or value.__class__ is bool:
        return False
    if isinstance(value, str):
        return value.strip().lower() not in TRUE_WORDS | FALSE_WORDS
    return value not in (0, 1)


def _source_type(data: bytes) -> str:
    """The DigitalSourceType of an image's XMP mark; UNMARKED when it has none or its header cannot be read."""
    try:
        mark = read_mark(data)
    except (ValueError, IndexError, zlib.error):  # a corrupt header: the row keeps the bytes all the same
        return UNMARKED
    return mark.digital_source_type if mark is not None else UNMARKED
