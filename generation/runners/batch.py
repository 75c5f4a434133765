"""`medbanana generate --batch`: the refinement loop over the Gemini Batch API (half price, hours of latency).

Round-synchronous: every live task's refinement (loop.py, the same loop the local runner drives) is advanced in
lockstep; in each round, the writer calls of every pending task go out as one batch job, then their editor calls,
then their judge calls; a re-ask (unparseable verdict, image-less answer) is one more job of just those calls.
Backends keep their logic in exchanges (gemini.py), so a task's calls are the ones the concurrent runner would
make, and its records go through the same RunStore: the run directory has the same format, and a batch run can be
resumed concurrently or the other way round. A pass's geometry checks, and its images' masks, run together in a
process pool sized to the machine (image_work.py): a job's thousands of images never wait on one core.

Results land in the request cache, and job names are persisted in RUN_DIR/medbanana-batches.json before they are
polled. A restarted run rebuilds the same requests from the journal: answered ones come from the cache, ones in
a submitted job are polled there, and only the rest are submitted. (A kill between a job's creation and the
write of its name can still lose that one job; it is then submitted again.) Request and results files under
RUN_DIR/medbanana-cache/batches/ last no longer than the run that made them: one killed outright leaves them to
the next run, which removes them when it opens the run directory (session.open_run). Memory grows with the run:
every live task's source, and a step's requests, are held at once; split large runs with --shard.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter, defaultdict
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path

from ..backends import APIError
from ..backends.gemini import Answer, GeminiEditor, GeminiJudge, GeminiWriter, read_answer
from ..backends.gemini_transport import INLINE_LIMIT, GeminiTransport, Request
from ..backends.http import CallFailure
from ..backends.settings import batch_files_dir, remove_batch_files
from ..files import atomic_write_json
from ..loop import (BACKEND_STEPS, CheckGeometry, Refinement, StoreAttempt, Step, WriteInstruction,
                    acceptance_policy, advance, refinement)
from ..outcomes import TaskOutcome
from ..pools import pool_size
from ..records import SourceImage, Task
from .budget import Ledger, answer_usage
from .image_work import ImageWork
from .local import read_source, source_error
from .session import RunOptions, RunSession, RunSummary
from ..failures import UsageError

JOBS_FILE = "medbanana-batches.json"
DONE_STATES = {"JOB_STATE_SUCCEEDED", "JOB_STATE_FAILED", "JOB_STATE_CANCELLED", "JOB_STATE_EXPIRED",
               "JOB_STATE_PARTIALLY_SUCCEEDED"}
# states of a job on its way to one of DONE_STATES; a state in neither set is a malformed answer, not progress
LIVE_STATES = {"JOB_STATE_UNSPECIFIED", "JOB_STATE_QUEUED", "JOB_STATE_PENDING", "JOB_STATE_RUNNING",
               "JOB_STATE_PAUSED", "JOB_STATE_UPDATING", "JOB_STATE_CANCELLING"}


class BatchCalls:
    """Answers many requests at once: from the request cache, from jobs already submitted, or through one new
    batch job per model. Per-request errors worth retrying go out again in a later job, at most the transport's
    max_attempts times; the rest become APIErrors, as in the sync path."""

    def __init__(self, transport: GeminiTransport, run_dir: Path, *, poll_interval: float = 30.0,
                 inline_limit: int = INLINE_LIMIT, label: str = "medbanana", sleep=asyncio.sleep):
        if transport.cache is None:
            raise ValueError("batch mode needs the transport's request cache (cache_dir): results are kept there")
        self.transport, self.cache = transport, transport.cache
        self.path = Path(run_dir) / JOBS_FILE
        self.work_dir = batch_files_dir(run_dir)
        self.poll_interval, self.inline_limit, self.label = poll_interval, inline_limit, label
        self._sleep = sleep
        self.jobs: dict[str, dict] = json.loads(self.path.read_text())["jobs"] if self.path.exists() else {}

    def _save(self) -> None:
        atomic_write_json(self.path, {"jobs": self.jobs})

    async def answer(self, requests: list[Request], step: str) -> list[Answer | APIError]:
        """The answer (or error) to each request, in order."""
        keys = [self.cache.key(r.model, r.contents, r.config) for r in requests]
        by_key = dict(zip(keys, requests))
        outcome: dict[str, Answer | APIError] = {}
        tries: Counter = Counter()
        while todo := [k for k in by_key if k not in outcome]:
            for key in todo:
                if (cached := self.cache.get(key)) is not None:
                    outcome[key] = read_answer(cached)
            todo = [k for k in todo if k not in outcome]
            if not todo:
                break
            open_jobs = {name: job for name, job in self.jobs.items() if job["state"] == "submitted"}
            in_jobs = {key: name for name, job in open_jobs.items() for key in job["keys"]}
            polled = {in_jobs[k] for k in todo if k in in_jobs}
            new = defaultdict(list)
            for key in todo:
                if key not in in_jobs:
                    new[by_key[key].model].append((key, by_key[key]))
            for model, items in new.items():
                polled.add(await self._submit(model, items, step))
            failures = await self._collect(polled)
            for key in todo:
                if key in self.cache:
                    continue  # answered: read from the cache on the next pass
                failure = failures.get(key) or CallFailure("batch_missing", "the job returned no result for it", True)
                tries[key] += 1
                if not failure.retryable or tries[key] >= self.transport.retry.max_attempts:
                    outcome[key] = self.transport.error(failure, f"{by_key[key].model} (batch)")
        return [outcome[k] for k in keys]

    async def _submit(self, model: str, items: list[tuple[str, Request]], step: str) -> str:
        display_name = f"{self.label}-{step}-{len(self.jobs) + 1}"
        name = await self.transport.create_batch(model, items, display_name=display_name, work_dir=self.work_dir,
                                                 inline_limit=self.inline_limit)
        self.jobs[name] = {"model": model, "display_name": display_name, "state": "submitted",
                           "requests": len(items), "submitted_at": time.time(), "keys": [k for k, _ in items]}
        self._save()
        return name

    async def _poll(self, name: str) -> tuple[object, str, str]:
        """(job, state, what is malformed about the answer or "") for one status poll."""
        try:
            job = await self.transport.get_batch(name)
        except APIError as exc:
            if exc.kind == "not_found":  # gone (deleted, or another server): resubmitted
                return None, "JOB_STATE_NOT_FOUND", ""
            if exc.kind == "bad_response":  # a body that does not parse, even after the transport's retries
                return None, "", _detail(exc, name)
            raise
        state = str(getattr(job.state, "value", job.state) or "")
        if not state:
            return job, "", "no state in the answer"
        if state not in DONE_STATES | LIVE_STATES:
            return job, state, f"unknown state {state!r}"
        return job, state, ""

    async def _collect(self, names: set[str]) -> dict[str, CallFailure]:
        """Poll the jobs until each is done; put every returned response into the cache; the failures by key.

        A job may run for hours, but a malformed status answer is not progress: after max_attempts of them in a
        row the job is given up and its requests fail with bad_response (not retried: another job would be
        polled at the same endpoint), so the run ends with them recorded instead of polling forever."""
        failures: dict[str, CallFailure] = {}
        malformed: Counter = Counter()
        waiting = set(names)
        while waiting:
            for name in sorted(waiting):
                job, state, problem = await self._poll(name)
                answered = False
                if not problem and state in ("JOB_STATE_SUCCEEDED", "JOB_STATE_PARTIALLY_SUCCEEDED"):
                    try:
                        self._store_results(await self.transport.batch_results(job, self.work_dir), failures)
                        answered = True
                    except APIError as exc:
                        if exc.kind != "bad_response":
                            raise
                        problem = _detail(exc, name)  # "... succeeded without results"
                    except ValueError as exc:  # a torn or garbled results file (JSON, pydantic): fetched again
                        problem = f"its results do not parse ({type(exc).__name__}: {str(exc)[:200]})"
                if problem:
                    malformed[name] += 1
                    if malformed[name] < self.transport.retry.max_attempts:
                        continue
                elif job is not None and state not in DONE_STATES:
                    malformed.pop(name, None)  # in a row: a well-formed answer in between starts the count anew
                    continue
                entry = self.jobs[name]
                if problem:
                    message = (f"{name}: malformed answer {malformed[name]} times in a row, gave up on the job; "
                               f"last: {problem}")
                    failures.update({key: CallFailure("bad_response", message, False) for key in entry["keys"]
                                     if key not in self.cache})  # a torn file's whole lines were answers
                    state = "MALFORMED_STATUS"
                    entry["error"] = problem[:300]
                elif not answered:
                    kind = "batch_" + state.removeprefix("JOB_STATE_").lower()
                    detail = f": {job.error.message}" if job is not None and job.error else ""
                    failures.update(dict.fromkeys(entry["keys"], CallFailure(kind, f"{name} ended {state}{detail}",
                                                                             True)))
                entry.update(state=state, finished_at=time.time())
                entry.pop("keys")  # answers are in the cache now; a restart needs no more than that
                self._save()
                waiting.discard(name)
            if waiting:
                await self._sleep(self.poll_interval)
        return failures

    def _store_results(self, results, failures: dict[str, CallFailure]) -> None:
        """Each answer of a job into the cache, each failed request into `failures`. A results file goes when
        reading ends, even by an exception (a line that does not parse: ValueError)."""
        with closing(results):
            for key, item in results:
                if isinstance(item, CallFailure):
                    failures[key] = item
                else:
                    self.cache.put(key, item)


def _detail(exc: APIError, name: str) -> str:
    """An APIError's message without the kind and job name that the recorded error states already."""
    return str(exc).removeprefix(f"{exc.kind}: ").removeprefix(f"{name}: ")


async def drive_exchanges(calls: BatchCalls, exchanges: dict, step: str) -> dict:
    """Run many exchanges in lockstep, each of their requests of a pass going out together. Returns each
    exchange's result, or the exception it ended with (an APIError's answers are dropped from the cache, as in
    gemini.run_exchange)."""
    results, pending, answered = {}, {}, defaultdict(list)

    def resume(key, send, value) -> None:
        try:
            pending[key] = send(value)
        except StopIteration as done:
            results[key] = done.value
        except Exception as exc:  # a backend's verdict on this task (or a bug): recorded by the caller
            if isinstance(exc, APIError):
                for request in answered[key]:
                    calls.transport.forget(request.model, request.contents, request.config)
            results[key] = exc

    for key, exchange in exchanges.items():
        resume(key, exchange.send, None)
    while pending:
        batch, pending = list(pending.items()), {}
        answers = await calls.answer([request for _, request in batch], step)
        for (key, request), answer in zip(batch, answers):
            if isinstance(answer, APIError):
                resume(key, exchanges[key].throw, answer)
            else:
                answered[key].append(request)
                resume(key, exchanges[key].send, answer)
    return results


@dataclass
class _Live:
    """A task in flight: its refinement, and the step that refinement waits on."""
    task: Task
    steps: Refinement
    step: Step


async def _start(session: RunSession, options: RunOptions, accept) -> list[_Live]:
    """Each task's refinement, from its journalled rounds, up to its first step; tasks already done (a source
    that cannot be read, a resumed task with nothing left to do) are finished here."""
    sources: dict[Path, SourceImage | Exception] = {}
    live = []
    for task in session.todo:
        if task.source_path not in sources:
            try:
                sources[task.source_path] = await asyncio.to_thread(read_source, task.source_path, options.max_pixels)
            except (OSError, ValueError) as exc:
                sources[task.source_path] = exc
        source = sources[task.source_path]
        if isinstance(source, Exception):
            session.finish(source_error(task, source))
            continue
        steps = refinement(task, source, max_rounds=options.max_rounds, accept=accept, seed=options.seed,
                           history=session.store.history(task), geometry=options.geometry)
        step = advance(steps)
        if isinstance(step, TaskOutcome):
            session.finish(step)
        else:
            live.append(_Live(task, steps, step))
    return live


async def refine_in_passes(live: list[_Live], backends: dict, calls: BatchCalls, on_round, on_finished,
                           ledger: Ledger | None = None, on_budget=None, work: ImageWork | None = None) -> None:
    """Drive the refinements of all live tasks in lockstep, a round per pass: every writer step of the pass as
    one exchange run (one batch job per model), then every editor step, the edits' geometry checks (all at once in
    `work`'s pool, else in worker threads), then every judge step, then the finished rounds are stored with
    `on_round(task, attempt, image, masks)` (their `seconds` is the whole pass's wall time: the calls share batch
    jobs; `masks` made in `work`'s pool, None without one: the store makes them). `on_finished(outcomes)`
    gets the tasks that ended, after each pass. With a `ledger`, a task's round goes into the pass only if it fits
    the budget; the first that does not stops the run from starting any (`on_budget()`), those left stay
    unfinished."""
    n = 0
    while live:
        n += 1
        started = time.perf_counter()
        waiting: list[_Live] = []
        if ledger is not None:  # each round of the pass held first; one that does not fit waits for the next pass
            for s in live:
                ledger.release(s.task.uid)
            verdicts = {s.task.uid: ledger.try_open(s.task.uid) if isinstance(s.step, WriteInstruction) else "open"
                        for s in live}
            if "stop" in verdicts.values():
                on_budget()  # no round starts any more: the tasks not in this pass stay unfinished
            waiting = [s for s in live if verdicts[s.task.uid] == "wait"]
            live = [s for s in live if verdicts[s.task.uid] == "open"]
            if not live:
                break
        for kind in BACKEND_STEPS:
            asking = [s for s in live if isinstance(s.step, kind)]
            answers = await drive_exchanges(calls, {s.task.uid: s.step.exchange(backends[kind.role])
                                                    for s in asking}, f"r{n}-{kind.role}")
            for s in asking:
                if ledger is not None:
                    ledger.settle(s.task.uid, kind.role, *answer_usage(answers[s.task.uid]))
                s.step = advance(s.steps, answers[s.task.uid])
            while checking := [s for s in asking if isinstance(s.step, CheckGeometry)]:
                checks = await asyncio.gather(*(_checked(s.step, work) for s in checking))
                for s, check in zip(checking, checks):
                    s.step = advance(s.steps, check)
        finished = [s for s in live if isinstance(s.step, StoreAttempt)]
        made = await asyncio.gather(*(_masks(s.step, work) for s in finished))
        for s, masks in zip(finished, made):
            s.step.attempt.seconds = time.perf_counter() - started
            on_round(s.task, s.step.attempt, s.step.image, masks)
            s.step = advance(s.steps)
        ended = [s for s in live if isinstance(s.step, TaskOutcome)]
        for s in ended:
            if ledger is not None:
                ledger.release(s.task.uid)
            if work is not None:
                work.forget(s.task)
        on_finished([s.step for s in ended])
        live = [s for s in live if not isinstance(s.step, TaskOutcome)] + waiting


async def _checked(step: CheckGeometry, work: ImageWork | None):
    """The geometry check's answer, or the exception it raised (thrown into the refinement, which records it)."""
    try:
        return await (work.check(step) if work is not None else asyncio.to_thread(step.answer))
    except Exception as exc:  # noqa: BLE001 - the refinement decides what it means
        return exc


async def _masks(step: StoreAttempt, work: ImageWork | None):
    """The masks of a finished round's image from `work`'s pool; None (the store makes them) without a pool."""
    if work is None or step.image is None:
        return None
    return await work.masks(step.task, step.image, step.attempt.frame_rejected)


async def run_batch_tasks(tasks: list[Task], run_dir: Path, writer: GeminiWriter, editor: GeminiEditor,
                          judge: GeminiJudge, options: RunOptions | None = None, config: dict | None = None, *,
                          poll_interval: float = 30.0, inline_limit: int = INLINE_LIMIT, on_open=None) -> RunSummary:
    options = options or RunOptions()
    if not all(isinstance(b, cls) for b, cls in ((writer, GeminiWriter), (editor, GeminiEditor),
                                                  (judge, GeminiJudge))):
        raise UsageError("--batch needs the gemini backend for the writer, the editor and the judge")
    if not (writer.transport is editor.transport is judge.transport):
        raise UsageError("--batch needs one transport shared by the writer, the editor and the judge")
    accept = acceptance_policy(options.accept)
    with RunSession(tasks, run_dir, options, config, on_open) as session:
        try:
            calls = BatchCalls(writer.transport, run_dir, poll_interval=poll_interval, inline_limit=inline_limit,
                               label=f"medbanana-{session.store.config['run_id'][:8]}")
            live = await _start(session, options, accept)
            work = ImageWork(pool_size())
            try:
                await refine_in_passes(live, {"writer": writer, "editor": editor, "judge": judge}, calls,
                                       session.store.write_attempt, lambda ended: session.finish(*ended),
                                       session.ledger, session.budget_reached, work)
            except APIError as exc:  # a job could not be submitted or polled: stop here, resumable
                raise UsageError(f"batch mode stopped ({exc}); finished rounds are kept, and running the same "
                                   f"command again resumes polling the submitted jobs") from None
            finally:
                work.close()
        finally:
            remove_batch_files(run_dir)  # what an error or Ctrl-C left mid-transfer; the next run needs none of it
            await session.close_clients(writer, editor, judge, count_calls=False)
        return session.end()


def run_batch(tasks, run_dir, writer, editor, judge, options=None, config=None, **batch_options) -> RunSummary:
    return asyncio.run(run_batch_tasks(tasks, run_dir, writer, editor, judge, options, config, **batch_options))
