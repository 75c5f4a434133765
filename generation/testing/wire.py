"""What the fake servers share (fake_gemini.py, fake_openai.py): reading medbanana's prompts back into a task, an
instruction and the history, running the simulator's coroutines in a handler thread, and the judge's JSON answer.

The task is read from the "- Finding:" and "- Direction:" lines of medbanana's prompts, the instruction from
<instruction>, earlier rounds from <history>; so the fakes understand medbanana's requests only.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path

import numpy as np

from ..records import Attempt, Instruction, Task, Verdict, encode_jpeg
from ..taxonomy import load_taxonomy

VERDICT_FIELDS = ("has_disease", "structure_reasonable", "looks_realistic", "fidelity_preserved", "qualified",
                  "reason")


def task_from(texts: list[str]) -> Task:
    """The task a request's prompts are about; ValueError when they are not medbanana's."""
    joined = "\n".join(texts)
    finding = re.search(r"^- Finding: (.+)$", joined, re.MULTILINE)
    direction = re.search(r"^- Direction: (add|remove)\s*$", joined, re.MULTILINE)
    if not finding or not direction:
        raise ValueError("fake Gemini understands medbanana prompts only: no '- Finding:' / '- Direction:' lines")
    label = load_taxonomy().find(finding.group(1).strip())
    if label is None:
        raise ValueError(f"unknown finding {finding.group(1)!r}")
    return Task(dataset="fake", modality=label.modality, disease=label.folder, direction=direction.group(1),
                source_path=Path("source.jpeg"))


def tagged(texts: list[str], tag: str) -> str:
    """The text between <tag> and </tag> in the prompts, or ""."""
    match = re.search(rf"<{tag}>\n?(.*?)\n?</{tag}>", "\n".join(texts), re.DOTALL)
    return match.group(1).strip() if match else ""


def history_from(texts: list[str]) -> list[Attempt]:
    """The earlier rounds the writer's prompt carries in <history>."""
    raw = tagged(texts, "history")
    history = []
    for entry in json.loads(raw) if raw else []:
        verdict = Verdict(**entry["verdict"]) if entry.get("verdict") else None
        history.append(Attempt(round=entry["round"], instruction=Instruction(entry["instruction"]),
                               verdict=verdict, edit_error=entry.get("edit_error", "")))
    return history


def verdict_json(verdict: Verdict) -> str:
    """The judge's answer as the prompt asks for it: the verdict's fields as one JSON object."""
    return json.dumps({k: getattr(verdict, k) for k in VERDICT_FIELDS})


def spoiled_json(body: str, kind: str, prose: str) -> str:
    """`body` as the faults malformed_json (the braces dropped, after `prose`) and truncated_json (cut in half) leave
    it; unchanged for any other kind."""
    if kind == "malformed_json":
        return f"{prose}{body.replace('{', '')}"
    if kind == "truncated_json":
        return body[: len(body) // 2]
    return body


_connection = threading.local()  # .loop: the event loop of the connection this thread serves


@contextmanager
def connection_loop():
    """One event loop for the calls of the connection this thread serves (a new loop per call costs about a
    millisecond, a fifth of an echo call's CPU); `run_coroutine` uses it while the block runs."""
    _connection.loop = asyncio.new_event_loop()
    try:
        yield
    finally:
        _connection.loop.close()
        _connection.loop = None


def run_coroutine(coro):
    """Run a backend's coroutine in this thread: on the connection's loop inside `connection_loop()`, else on a
    fresh loop."""
    loop = getattr(_connection, "loop", None)
    return loop.run_until_complete(coro) if loop is not None else asyncio.run(coro)


@lru_cache(maxsize=1)
def blank_jpeg() -> bytes:
    """A black 64x64 JPEG: the source the writer sees when a request carries no image (text-only round 1)."""
    return encode_jpeg(np.zeros((64, 64, 3), dtype=np.uint8))
