"""One refinement loop, two drivers: `loop.refine_task` (local and worker runners) awaits a backend method per
step; `runners.batch.refine_in_passes` answers one step kind for every live task at once through exchanges.

Both drive `loop.refinement`, so scripted backends that accept, refuse, fail and crash at chosen rounds must give
the same outcomes, the same attempts and the same calls in the same order, whichever driver runs them.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict, namedtuple

import pytest

from medbanana.generation.backends import APIError, EditRefused
from medbanana.generation.loop import acceptance_policy, advance, attempt_seed, refine_task, refinement
from medbanana.generation.records import Attempt, EditedImage, Instruction, SourceImage, Verdict, rubric_score
from medbanana.generation.runners import batch
from medbanana.generation.sources.scan import scan_sources

MAX_ROUNDS = 3
Request = namedtuple("Request", "model contents config")

# task key -> what happens to it: the round its edit is accepted, and faults as (role, round) -> exception
SCRIPT = {
    "n0-Pneumothorax": {"accept": 2},
    "n1-Pneumothorax": {"accept": 99},  # never: failed after MAX_ROUNDS
    "p0-Pneumothorax": {"accept": 2, ("editor", 1): EditRefused("no_image", "text only")},
    "n0-Pleural_Effusion": {"accept": 3, ("editor", 2): APIError("http_503", "unavailable")},
    "n1-Pleural_Effusion": {"accept": 3, ("writer", 2): ValueError("a bug in a backend")},
    "e0-Pleural_Effusion": {"accept": 3, ("judge", 1): APIError("unparseable_verdict", "no JSON")},
}


class Script:
    """Writer, editor and judge in one: each answer is a pure function of the task and the round, and every call
    is logged, so two drivers can be compared call by call."""

    def __init__(self):
        self.calls = defaultdict(list)  # task key -> [(role, round)]

    def answer(self, role: str, task, round_no: int, seed: int | None = None):
        self.calls[task.key].append((role, round_no))
        plan = SCRIPT[task.key]
        if (role, round_no) in plan:
            raise plan[role, round_no]
        if role == "writer":
            return Instruction(f"{task.key} instruction {round_no}")
        if role == "editor":
            return EditedImage(data=b"jpeg %d" % seed, details={"round": round_no})
        ok = round_no >= plan["accept"]
        present = ok if task.direction == "add" else not ok
        return Verdict(has_disease=present, structure_reasonable=True, looks_realistic=True, fidelity_preserved=ok,
                       qualified=ok, reason="ok" if ok else "too subtle", score=rubric_score(ok, True, True, ok))

    @staticmethod
    def _round(instruction: str) -> int:
        return int(instruction.rsplit(" ", 1)[1])

    # the async face, for refine_task
    async def write(self, task, source, history):
        return self.answer("writer", task, len(history) + 1)

    async def edit(self, task, source, instruction, seed):
        return self.answer("editor", task, self._round(instruction), seed)

    async def judge(self, task, source, edited, instruction):
        return self.answer("judge", task, self._round(instruction))

    # the exchange face, for the batch driver: one request each, answered by FakeCalls
    def write_exchange(self, task, source, history):
        yield Request("scripted", task.uid, "writer")
        return self.answer("writer", task, len(history) + 1)

    def edit_exchange(self, task, source, instruction, seed):
        yield Request("scripted", task.uid, "editor")
        return self.answer("editor", task, self._round(instruction), seed)

    def judge_exchange(self, task, source, edited, instruction):
        yield Request("scripted", task.uid, "judge")
        return self.answer("judge", task, self._round(instruction))


class FakeCalls:
    """Stands in for BatchCalls: answers every request of a step at once, and remembers the steps."""

    def __init__(self):
        self.steps = []
        self.transport = self

    async def answer(self, requests, step):
        self.steps.append((step, len(requests)))
        return [object() for _ in requests]

    def forget(self, model, contents, config):
        pass


def _tasks(tiny_sources):
    tasks = {t.key: t for t in scan_sources(tiny_sources)}
    return [tasks[key] for key in SCRIPT]


def _history(task):
    """A resumed task: round 1 was journalled before a restart."""
    if task.key != "n1-Pneumothorax":
        return []
    return [Attempt(1, Instruction(f"{task.key} instruction 1"), edit_error="no_image: resumed")]


def _plain(outcome, stored):
    attempts = [(a.round, a.instruction.text, a.verdict, a.accepted, a.edit_error, a.edit_details)
                for a in outcome.attempts]
    return outcome.status, outcome.failure, attempts, stored


def _run_locally(tasks, seed):
    script, stored, outcomes = Script(), defaultdict(list), {}
    accept = acceptance_policy("qualified")

    def on_round(task, attempt, image):
        stored[task.key].append((attempt.round, image.data if image else None))

    for task in tasks:
        outcome = asyncio.run(refine_task(task, SourceImage(task.source_path), script, script, script,
                                          max_rounds=MAX_ROUNDS, accept=accept, seed=seed, history=_history(task),
                                          on_round=on_round))
        outcomes[task.key] = _plain(outcome, stored[task.key])
    return outcomes, script.calls


def _run_in_passes(tasks, seed):
    script, calls, stored, ended = Script(), FakeCalls(), defaultdict(list), []
    live = []
    for task in tasks:
        steps = refinement(task, SourceImage(task.source_path), max_rounds=MAX_ROUNDS,
                           accept=acceptance_policy("qualified"), seed=seed, history=_history(task))
        live.append(batch._Live(task, steps, advance(steps)))

    def on_round(task, attempt, image, masks):
        assert masks is None  # no image pool given: the store makes them
        stored[task.key].append((attempt.round, image.data if image else None))

    backends = dict.fromkeys(("writer", "editor", "judge"), script)
    asyncio.run(batch.refine_in_passes(live, backends, calls, on_round, ended.extend))
    outcomes = {o.task.key: _plain(o, stored[o.task.key]) for o in ended}
    return outcomes, script.calls, calls.steps


@pytest.mark.parametrize("seed", [0, 7])
def test_the_batch_driver_and_the_local_driver_run_the_same_loop(tiny_sources, seed):
    tasks = _tasks(tiny_sources)
    local, local_calls = _run_locally(tasks, seed)
    passes, pass_calls, steps = _run_in_passes(tasks, seed)

    assert passes == local
    assert pass_calls == local_calls
    # the loop's decisions, spelled out: success, stop after max_rounds, refusals, failures at their step
    failures = {key: (o[1].step, o[1].round, o[1].kind) for key, o in local.items() if o[1] is not None}
    assert {key: o[0] for key, o in local.items()} == {
        "n0-Pneumothorax": "success", "n1-Pneumothorax": "failed", "p0-Pneumothorax": "success",
        "n0-Pleural_Effusion": "api_failed", "n1-Pleural_Effusion": "api_failed", "e0-Pleural_Effusion": "api_failed"}
    assert failures == {"n0-Pleural_Effusion": ("edit_image", 2, "http_503"),
                        "n1-Pleural_Effusion": ("unexpected", 2, "unexpected"),
                        "e0-Pleural_Effusion": ("verify_image", 1, "unparseable_verdict")}
    refused = local["p0-Pneumothorax"][2][0]
    assert refused[4] == "no_image: text only" and refused[2] is None
    assert local["n1-Pneumothorax"][3] == [(2, b"jpeg %d" % attempt_seed(seed, tasks[1], 2)),
                                           (3, b"jpeg %d" % attempt_seed(seed, tasks[1], 3))]
    # the batch driver answered each step kind for all its tasks at once, a round per pass
    assert steps[:3] == [("r1-writer", 6), ("r1-editor", 6), ("r1-judge", 5)]
