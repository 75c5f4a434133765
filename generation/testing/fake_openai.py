"""A fake OpenAI chat-completions server on 127.0.0.1 for tests, spoken to by the REAL openai client.

It answers `POST /v1/chat/completions` with images as data URLs. A request with two images is the judge, any
other the writer; the task is read from medbanana's prompts (wire.py, as in fake_gemini.py) and the work is done by
the simulator's writer and judge, so instructions and verdicts are real. Faults reuse faults.py's kinds
("429", "500", "503", "invalid_argument", "safety", "malformed_json", "truncated_json"); `structured_output=False`
makes it reject `response_format` with a 400, as servers without JSON mode do; `think=True` wraps answers in
<think> blocks, as reasoning models served without a reasoning parser do. `latency` holds every answer that many
seconds, so that concurrent requests are in flight together.

    with FakeOpenAI(faults=["429:first=1,retry_after=0.5"]) as fake: ... base_url=fake.base_url ...
"""

from __future__ import annotations

import base64
import json
import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from .. import backends
from ..records import EditedImage, SourceImage
from .faults import parse_faults
from .wire import (LocalServer, WireHandler, blank_jpeg, history_from, run_coroutine, spoiled_json, tagged, task_from,
                   verdict_json)

DATA_URL = re.compile(r"^data:(?P<mime>[\w/+.-]+);base64,(?P<data>.*)$", re.DOTALL)


@dataclass(frozen=True)
class Call:
    role: str
    model: str
    fault: str
    authorization: str  # the Authorization header as received, to check what the client sends
    response_format: str  # its "type", or ""


class FakeOpenAI(LocalServer):
    """The server plus its state: faults, the call log, and the simulator backends doing the work."""

    url_path = "/v1"

    def __init__(self, *, faults=(), structured_output: bool = True, think: bool = False, latency: float = 0.0,
                 host: str = "127.0.0.1", port: int = 0):
        super().__init__(host, port, _Handler)
        self.faults = parse_faults(faults)
        self.structured_output = structured_output
        self.think = think
        self.latency = latency
        self.writer = backends.create("writer", "simulator")
        self.judge = backends.create("judge", "simulator")
        self.calls: list[Call] = []
        self.judged: list[tuple[bytes, bytes]] = []  # (source, edit) of every judge request, as received
        self._lock = threading.Lock()

    def reset(self, faults=(), *, structured_output: bool = True, think: bool = False, latency: float = 0.0) -> None:
        with self._lock:
            self.faults, self.calls, self.judged = parse_faults(faults), [], []
            self.structured_output, self.think, self.latency = structured_output, think, latency

    def count(self, role: str | None = None) -> int:
        with self._lock:
            return sum(1 for c in self.calls if role in (None, c.role))

    def chat_completions(self, request: dict, authorization: str) -> tuple[int, dict, dict]:
        """(HTTP status, JSON body, extra headers) for one chat-completions request."""
        texts, images = _read_messages(request.get("messages") or [])
        role = "judge" if len(images) >= 2 else "writer"
        response_format = (request.get("response_format") or {}).get("type", "")
        with self._lock:
            fault = next((f for f in self.faults if f.applies(role) and f.strike()), None)
            self.calls.append(Call(role, request.get("model", ""), fault.kind if fault else "", authorization,
                                   response_format))
        if self.latency:  # each request has its own thread: the held answers overlap
            time.sleep(self.latency)
        kind = fault.kind if fault else ""
        if kind in ("429", "500", "503"):
            headers = {"Retry-After": f"{fault.retry_after:g}"} if kind == "429" else {}
            return _error(int(kind), f"fake {kind} (injected)") + (headers,)
        if kind == "invalid_argument":  # echoes the key, as a hostile server might: callers must redact it
            return _error(400, f"invalid argument (injected) for {authorization}") + ({},)
        if response_format and not self.structured_output:
            return _error(400, f"response_format {response_format!r} is not supported by this server") + ({},)
        if kind == "safety":
            return 200, _completion(request, "I can't help with that.", "content_filter"), {}
        try:
            task = task_from(texts)
        except ValueError as exc:
            return _error(400, str(exc)) + ({},)
        if role == "writer":
            source = SourceImage(Path("source.jpeg"), data=images[0] if images else blank_jpeg())  # text-only round 1
            instruction = run_coroutine(self.writer.write(task, source, history_from(texts)))
            text = f"Instruction: {instruction.text}"
        else:
            with self._lock:
                self.judged.append((images[0], images[1]))
            verdict = run_coroutine(self.judge.judge(task, SourceImage(Path("source.jpeg"), data=images[0]),
                                                     EditedImage(data=images[1]), tagged(texts, "instruction")))
            body = verdict_json(verdict)
            if kind in ("malformed_json", "truncated_json"):
                body = spoiled_json(body, kind, "The edit looks fine to me. ")
            elif not response_format:  # servers without JSON mode wrap the JSON in prose
                body = f"Here is my assessment:\n```json\n{body}\n```\nI hope this helps."
            text = body
        if self.think:
            text = f"<think>Looking at the {task.direction} task first.</think>\n{text}"
        return 200, _completion(request, text, "stop"), {}


class _Handler(WireHandler):
    def do_POST(self):
        length = int(self.headers.get("content-length") or 0)
        body = self.rfile.read(length) if length else b""
        if self.path.rstrip("/") != "/v1/chat/completions":
            return self.send_payload(*_error(404, f"fake OpenAI has no POST {self.path}"))
        try:
            request = json.loads(body or b"{}")
        except ValueError:
            return self.send_payload(*_error(400, "request body is not JSON"))
        self.send_payload(*self.server.fake.chat_completions(request, self.headers.get("authorization", "")))


def _read_messages(messages: list[dict]) -> tuple[list[str], list[bytes]]:
    texts, images = [], []
    for message in messages:
        content = message.get("content")
        for part in [{"type": "text", "text": content}] if isinstance(content, str) else content or []:
            if part.get("type") == "text":
                texts.append(part.get("text", ""))
            elif part.get("type") == "image_url":
                match = DATA_URL.match((part.get("image_url") or {}).get("url", ""))
                if match:
                    images.append(base64.b64decode(match.group("data")))
    return texts, images


def _completion(request: dict, text: str, finish: str) -> dict:
    prompt_tokens = sum(len(json.dumps(m)) for m in request.get("messages") or []) // 4
    return {"id": f"chatcmpl-fake-{time.monotonic_ns()}", "object": "chat.completion", "created": int(time.time()),
            "model": request.get("model", ""),
            "choices": [{"index": 0, "finish_reason": finish,
                         "message": {"role": "assistant", "content": text}}],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": len(text) // 4,
                      "total_tokens": prompt_tokens + len(text) // 4}}


def _error(code: int, message: str) -> tuple[int, dict]:
    return code, {"error": {"message": message, "type": "fake_error", "code": code}}
