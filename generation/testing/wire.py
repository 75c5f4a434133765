"""What the fake servers share (fake_gemini.py, fake_openai.py): the HTTP server on its own thread, the request read
and the answer sent back (LocalServer, WireHandler; lean on CPU, as benchmarks run a fake on the client's cores),
reading medbanana's prompts back into a task, an instruction and the history, running the simulator's coroutines in
a handler thread, and the judge's JSON answer.

The task is read from the "- Finding:" and "- Direction:" lines of medbanana's prompts, the instruction from
<instruction>, earlier rounds from <history>; so the fakes understand medbanana's requests only.
"""

from __future__ import annotations

import asyncio
import json
import re
import socket
import threading
from contextlib import contextmanager
from functools import lru_cache
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import ClassVar

import msgspec
import numpy as np

from ..records import Attempt, Instruction, Task, Verdict, encode_jpeg
from ..taxonomy import load_taxonomy

VERDICT_FIELDS = ("has_disease", "structure_reasonable", "looks_realistic", "fidelity_preserved", "qualified",
                  "reason")


class LocalServer:
    """A fake's HTTP server on 127.0.0.1 (by default), served from a daemon thread: `start()` binds it (port 0 picks a
    free port, read back into `port`), `stop()` shuts it down, `with` does both. Each request is answered by the
    subclass's `handler` class on a thread of its own; the handler finds the fake as `self.server.fake`."""

    url_path: ClassVar[str] = ""  # what base_url adds after host and port

    def __init__(self, host: str, port: int, handler: type[BaseHTTPRequestHandler]):
        self.host, self.port = host, port
        self._handler = handler
        self._server: _Server | None = None

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}{self.url_path}"

    def start(self):
        self._server = _Server((self.host, self.port), self._handler)
        self._server.fake = self
        self.port = self._server.server_address[1]
        threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05},
                         name=type(self).__name__, daemon=True).start()
        return self

    def stop(self) -> None:
        if self._server:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False
    request_queue_size = 256  # benchmarks open hundreds of connections at once
    fake: LocalServer


class WireHandler(BaseHTTPRequestHandler):
    """What a fake's request handler shares: HTTP/1.1 connections, headers and body read with few system calls
    (`read_body`), answers sent whole in one (`send_payload`), no access log."""

    protocol_version = "HTTP/1.1"
    json_type: ClassVar[str] = "application/json"  # the Content-Type of a JSON answer
    server: _Server

    def parse_request(self) -> bool:
        """The request line and headers, as http.server reads them but with the headers split by a plain loop: its
        email parser costs more CPU than the rest of an echo call's HTTP work. False, after an error answer, when
        malformed."""
        self.command, self.request_version, self.close_connection = None, "HTTP/1.1", True  # errors get a status line
        self.requestline = str(self.raw_requestline, "iso-8859-1").rstrip("\r\n")
        words = self.requestline.split()
        if len(words) != 3 or words[2] not in ("HTTP/1.0", "HTTP/1.1"):
            self.send_error(HTTPStatus.BAD_REQUEST, f"Bad request line ({self.requestline!r})")
            return False
        self.command, self.path, self.request_version = words
        headers = self.MessageClass()
        while True:
            line = self.rfile.readline(65537)
            if len(line) > 65536 or len(headers) >= 100:
                self.send_error(HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE, "Header line too long, or too many")
                return False
            if line in (b"\r\n", b"\n", b""):
                break
            name, colon, value = line.decode("iso-8859-1").partition(":")
            if not colon:
                self.send_error(HTTPStatus.BAD_REQUEST, f"Bad header line ({line[:80]!r})")
                return False
            headers[name.strip()] = value.strip()
        self.headers = headers
        connection = headers.get("Connection", "").lower()
        self.close_connection = connection == "close" or (self.request_version == "HTTP/1.0"
                                                          and connection != "keep-alive")
        if headers.get("Expect", "").lower() == "100-continue" and self.request_version == "HTTP/1.1":
            return self.handle_expect_100()
        return True

    def read_body(self) -> bytes | bytearray:
        """The request body (Content-Length bytes): what reading the headers left buffered, then the rest straight
        from the socket with MSG_WAITALL, one wake-up of this thread rather than one per TCP segment."""
        length = int(self.headers.get("content-length") or 0)
        if length <= 0:
            return b""
        head = self.rfile.read1(length)
        if not head or len(head) == length:
            return head
        body = bytearray(length)
        body[: len(head)] = head
        rest = memoryview(body)[len(head):]
        while rest:
            received = self.connection.recv_into(rest, len(rest), socket.MSG_WAITALL)
            if not received:  # the client went away mid-body
                self.close_connection = True
                break
            rest = rest[received:]
        return body if not rest else body[: length - len(rest)]

    def send_payload(self, status: int, payload: dict | bytes, headers: dict | None = None) -> None:
        """Answer with `payload`, JSON or raw bytes (application/octet-stream unless `headers` name a
        Content-Type), status line, headers and body in one write."""
        raw = isinstance(payload, bytes)
        data = payload if raw else msgspec.json.encode(payload)
        headers = dict(headers or {})
        content_type = headers.pop("Content-Type", None) or ("application/octet-stream" if raw else self.json_type)
        lines = [f"{self.protocol_version} {status} {self.responses.get(status, ('',))[0]}",
                 f"Server: {self.version_string()}", f"Date: {self.date_time_string()}",
                 f"Content-Type: {content_type}", f"Content-Length: {len(data)}"]
        for key, value in headers.items():
            lines.append(f"{key}: {value}")
            if key.lower() == "connection" and value.lower() == "close":
                self.close_connection = True
        try:
            head = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
            sent = self.connection.sendmsg([head, data])  # one call, and no copy of a large body to join them
            if sent < len(head):  # the socket took part: the rest goes after
                self.connection.sendall(head[sent:])
            if sent < len(head) + len(data):
                self.connection.sendall(memoryview(data)[max(0, sent - len(head)):])
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True  # the client gave up (timeout); nothing to answer

    def log_message(self, format, *args):  # quiet: tests and benchmarks read fake.calls instead
        pass


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
