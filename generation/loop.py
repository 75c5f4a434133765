"""The per-task refinement loop: instruction -> edit the ORIGINAL -> judge -> refine from the full history.

It is written once, as a plain generator, `refinement`: it yields each step it needs answered (`WriteInstruction`,
`EditImage`, `CheckGeometry`, `JudgeEdit`, then `StoreAttempt` for the store), is sent each step's answer or has
the step's exception thrown into it, and returns the TaskOutcome. `CheckGeometry` (the geometry guard,
generation/geometry.py) is answered by the driver itself, off its event loop (the runners' process pool,
runners/image_work.py, else a worker thread): an edit whose frame moved is
rejected before the judge, warped back onto the source's grid, or judged as it came, by the run's `geometry` mode. It alone names the steps, builds the attempts, applies the
acceptance policy and decides when to stop. Drivers only answer steps: `refine_task` awaits a backend method per
step for one task (the local and the worker-process runners); runners/batch.py answers one step kind for every
live task at once through batch jobs. So the two runners cannot disagree about what a round is.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from dataclasses import dataclass, fields
from typing import Any, Awaitable, Callable, ClassVar, Generator, Union

from .backends import APIError, EditRefused, Editor, InstructionWriter, Judge
from .acceptance import AcceptanceRule
from .geometry import GeometryCheck, check_edit, frame_verdict
from .records import (DEFAULT_GEOMETRY, DEFAULT_MAX_ROUNDS, VERDICT_FIELDS, Attempt, EditedImage, SourceImage, Task,
                      Verdict)
from .outcomes import ApiFailure, FailureKind, TaskOutcome, TaskStatus

Acceptance = Callable[[Verdict, Task], bool]
OnRound = Callable[[Task, Attempt, "EditedImage | None"], Awaitable[None] | None]
Checker = Callable[["CheckGeometry"], Awaitable[GeometryCheck]]  # answers a CheckGeometry step off the event loop


def accept_qualified(verdict: Verdict, task: Task) -> bool:
    """Default policy: the judge's `qualified`, and the disease present after add / absent after remove."""
    return verdict.qualified and verdict.compliance(task.direction)


def acceptance_policy(spec: str) -> Acceptance:
    """'qualified' (default), 'score>=X' (the weighted rubric score), or any rule of generation/acceptance.py;
    compliance is always required."""
    if spec == "qualified":
        return accept_qualified
    rule = AcceptanceRule.parse(spec)

    def accept_rule(verdict: Verdict, task: Task) -> bool:
        return rule.accepts({name: getattr(verdict, name) for name in VERDICT_FIELDS}, task.direction,
                            getattr(task, "modality", None))

    accept_rule.__name__ = rule.text
    return accept_rule


def attempt_seed(run_seed: int, task: Task, round_no: int) -> int:
    """A stable per-attempt seed: the same run, task and round always give the same seed."""
    digest = hashlib.sha256(f"{run_seed}:{task.uid}:{round_no}".encode()).digest()
    return int.from_bytes(digest[:4], "little")


# ---------------------------------------------------------------- the steps a refinement asks for

@dataclass(frozen=True)
class BackendStep:
    """A step one backend answers, about `task` and its original `source`: the method `method` of the `role`'s
    backend, called with the step's fields in order. `ask` gives that call's awaitable, `exchange` the same call as
    `<method>_exchange` (the requests the Batch runner answers). A step names both in its class line."""

    role: ClassVar[str]
    method: ClassVar[str]
    task: Task
    source: SourceImage

    def __init_subclass__(cls, *, role: str, method: str, **kwargs):
        super().__init_subclass__(**kwargs)
        cls.role, cls.method = role, method

    def ask(self, backend) -> Awaitable:
        return getattr(backend, self.method)(*self._arguments())

    def exchange(self, backend):
        return getattr(backend, self.method + "_exchange")(*self._arguments())

    def _arguments(self) -> tuple:
        return tuple(getattr(self, f.name) for f in fields(self))


@dataclass(frozen=True)
class WriteInstruction(BackendStep, role="writer", method="write"):
    """Answer with the writer's Instruction for the next round, written from the full `history`."""

    history: list[Attempt]


@dataclass(frozen=True)
class EditImage(BackendStep, role="editor", method="edit"):
    """Answer with the editor's EditedImage of the ORIGINAL source (EditRefused: a round without an image)."""

    instruction: str
    seed: int


@dataclass(frozen=True)
class JudgeEdit(BackendStep, role="judge", method="judge"):
    """Answer with the judge's Verdict on the edit."""

    edited: EditedImage
    instruction: str


@dataclass(frozen=True)
class CheckGeometry:
    """Answer with the geometry guard's GeometryCheck of the edit under `mode` (`answer()` computes it: CPU work,
    milliseconds, a registration more, so drivers run it off their event loop)."""

    task: Task
    source: SourceImage
    edited: EditedImage
    mode: str

    def answer(self) -> GeometryCheck:
        return check_edit(self.mode, self.source, self.edited)


@dataclass(frozen=True)
class StoreAttempt:
    """A finished attempt (and its image, None after a refused edit), to be stored. The driver sets
    `attempt.seconds` (its measure of the round's wall time), writes it, and answers None: only then does the
    attempt count, so a round that was never stored is never part of the outcome."""

    task: Task
    attempt: Attempt
    image: EditedImage | None


BACKEND_STEPS = (WriteInstruction, EditImage, JudgeEdit)  # in the order of a round (CheckGeometry between the last two)
Step = Union[WriteInstruction, EditImage, CheckGeometry, JudgeEdit, StoreAttempt]
# what is sent back depends on the step (an Instruction, an EditedImage, a Verdict, None): no one type says it
Refinement = Generator[Step, Any, TaskOutcome]


def refinement(task: Task, source: SourceImage, *, max_rounds: int = DEFAULT_MAX_ROUNDS,
               accept: Acceptance = accept_qualified, seed: int = 0, history: list[Attempt] | None = None,
               geometry: str = DEFAULT_GEOMETRY) -> Refinement:
    """One task, to success, to `max_rounds` rejected attempts, or to a failure, as the steps it needs answered.

    Every round edits the original source image, and every edit's frame is checked under `geometry` (reject |
    register | record) before the judge sees it. `history` resumes a task after its journalled rounds. An
    APIError thrown into a backend step ends the task api_failed at that step; EditRefused at the edit step is a
    recorded round without an image; any other exception (a backend's bug, the store's failure) ends it
    api_failed with kind `unexpected`, so one task's problem never takes the whole run down.
    """
    attempts = list(history or [])
    try:
        return (yield from _rounds(task, source, attempts, max_rounds, accept, seed, geometry))
    except Exception as exc:
        return TaskOutcome(task, TaskStatus.API_FAILED, attempts, ApiFailure(
            "unexpected", len(attempts) + 1, f"{type(exc).__name__}: {exc}", FailureKind.UNEXPECTED))


def _rounds(task: Task, source: SourceImage, attempts: list[Attempt], max_rounds: int, accept: Acceptance,
            seed: int, geometry: str) -> Refinement:
    if attempts and attempts[-1].accepted:
        return TaskOutcome(task, TaskStatus.SUCCESS, attempts)
    for round_no in range(len(attempts) + 1, max_rounds + 1):
        step = "generate_prompt" if round_no == 1 else "update_prompt"
        edited = None
        try:
            instruction = yield WriteInstruction(task, source, attempts)
            step = "edit_image"
            try:
                edited = yield EditImage(task, source, instruction.text, attempt_seed(seed, task, round_no))
            except EditRefused as refused:  # no image this round: recorded, and the writer sees why
                attempt = Attempt(round_no, instruction, edit_error=str(refused), edit_usage=refused.usage)
            else:
                check = yield CheckGeometry(task, source, edited, geometry)
                edited = check.edited  # warped back onto the source's grid when registered
                if check.action == "rejected":  # the frame moved: no judge call, and the writer is told why
                    attempt = Attempt(round_no, instruction, frame_verdict(check), edit_details=edited.details,
                                      edit_usage=edited.usage, geometry=check.record())
                else:
                    step = "verify_image"
                    verdict = yield JudgeEdit(task, source, edited, instruction.text)
                    attempt = Attempt(round_no, instruction, verdict, accepted=accept(verdict, task),
                                      edit_details=edited.details, edit_usage=edited.usage, geometry=check.record())
        except APIError as error:
            return TaskOutcome(task, TaskStatus.API_FAILED, attempts, ApiFailure(step, round_no, str(error), error.kind))
        yield StoreAttempt(task, attempt, edited)
        attempts.append(attempt)
        if attempt.accepted:
            return TaskOutcome(task, TaskStatus.SUCCESS, attempts)
    return TaskOutcome(task, TaskStatus.FAILED, attempts)


def advance(steps: Refinement, answer: object = None) -> Step | TaskOutcome:
    """Send a step's answer into a refinement (thrown, when it is the exception the step ended with); the next
    step, or the outcome once the refinement has returned."""
    try:
        return steps.throw(answer) if isinstance(answer, BaseException) else steps.send(answer)
    except StopIteration as done:
        return done.value


# ---------------------------------------------------------------- the driver for one task

async def refine_task(task: Task, source: SourceImage, writer: InstructionWriter, editor: Editor, judge: Judge, *,
                      max_rounds: int = DEFAULT_MAX_ROUNDS, accept: Acceptance = accept_qualified, seed: int = 0,
                      history: list[Attempt] | None = None, on_round: OnRound | None = None,
                      geometry: str = DEFAULT_GEOMETRY, check: Checker | None = None) -> TaskOutcome:
    """`refinement` answered by awaiting the backends' methods, one step after the other; the geometry check by
    `check` (the runners' process pool), else in a worker thread.

    `on_round` stores each finished attempt (the store writes its image and journal line there); an attempt's
    `seconds` is its round's wall time."""
    backends = {"writer": writer, "editor": editor, "judge": judge}
    steps = refinement(task, source, max_rounds=max_rounds, accept=accept, seed=seed, history=history,
                       geometry=geometry)
    started = time.perf_counter()
    step = advance(steps)
    while not isinstance(step, TaskOutcome):
        answer: object = None
        try:
            if isinstance(step, StoreAttempt):
                step.attempt.seconds = time.perf_counter() - started
                if on_round is not None and (maybe := on_round(task, step.attempt, step.image)) is not None:
                    await maybe
                started = time.perf_counter()
            elif isinstance(step, CheckGeometry):
                answer = await (check(step) if check is not None else asyncio.to_thread(step.answer))
            else:
                answer = await step.ask(backends[step.role])
        except Exception as exc:  # the refinement decides what it means
            answer = exc
        step = advance(steps, answer)
    return step
