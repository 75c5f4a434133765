"""How a task ended: its `TaskStatus`, and for an api_failed one the `ApiFailure` (of a `FailureKind`, or of the kind
a backend's APIError names), with its attempts in a `TaskOutcome`."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from .records import Attempt, Task
from .secrets import scrub


class TaskStatus(StrEnum):
    """How a task ended: a record's `status` (a str, so that JSON and parquet hold the word itself)."""

    SUCCESS = "success"  # an attempt was accepted
    FAILED = "failed"  # every round up to the limit was judged and rejected
    API_FAILED = "api_failed"  # ended by a failure (`ApiFailure`, of a `FailureKind` or a backend's), rounds kept


# the statuses, to test a word read from a file against (`word in TaskStatus` raises TypeError before Python 3.12)
STATUSES = tuple(TaskStatus)
ENDED = (TaskStatus.SUCCESS, TaskStatus.FAILED)  # judged to the end: no resume or --retry-failed runs it again


class FailureKind(StrEnum):
    """The kinds of an api_failed task's failure that the code names itself; a backend's APIError names its own
    (`timeout`, `server_error`, ...)."""

    API_ERROR = "api_error"  # `ApiFailure`'s default
    UNEXPECTED = "unexpected"  # a backend's (or the store's) exception: the task ends, the run goes on
    SOURCE_ERROR = "source_error"  # the source image could not be read
    # `--retry-failed --drop-missing-sources`: the source is gone, so no retry can run the task; not retried again,
    # not counted by the exit code
    SOURCE_MISSING = "source_missing"


@dataclass
class ApiFailure:
    step: str  # generate_prompt | update_prompt | edit_image | verify_image
    round: int
    error: str
    kind: str = FailureKind.API_ERROR  # a FailureKind, or the kind a backend's APIError names

    def __post_init__(self):
        # the one place every failure message passes, also an unexpected exception's, which may quote an answer
        self.error = scrub(self.error)


@dataclass
class TaskOutcome:
    task: Task
    status: TaskStatus
    attempts: list[Attempt]
    failure: ApiFailure | None = None

    @property
    def success_round(self) -> int | None:
        return self.attempts[-1].round if self.status == TaskStatus.SUCCESS else None
