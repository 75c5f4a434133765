"""A fake Gemini API on 127.0.0.1 for tests and benchmarks, spoken to by the REAL google-genai client.

It answers `POST /{v1,v1beta}/models/{model}:generateContent`, Vertex AI's
`POST /{v1,v1beta1}/projects/{project}/locations/{location}/publishers/google/models/{model}:generateContent` (and
`/{v1,v1beta1}/publishers/google/models/{model}:generateContent`, express mode), and the Batch and Files API
endpoints that `--batch` uses (fake_batches.py). The role of a request is read from its generation config (image output ->
editor, JSON output -> judge, otherwise writer; a JSON request carrying the 0-10 scoring prompt,
prompts/eval_score.txt, is the judge model as `scorer`, hit by the judge's faults); the task is read from the
"Finding:" and "Direction:" lines of medbanana's prompts, the instruction from <instruction>, earlier rounds from
<history>. The work is done by the simulator backends (writer, editor, judge), so answers are real images, verdicts
and scores.

Faults are injected by flags and hit the first N matching calls or an evenly spread fraction of them:

    python -m medbanana.generation.testing.fake_gemini --port 8089 --latency 0.2 \\
        --fault 429:first=2,retry_after=1 --fault text_only:rate=0.1

In tests: `with FakeGemini(faults=["503:first=1"]) as fake: ... base_url=fake.base_url ...`;
`fake.calls` lists every request seen (role, model, path, fault, credential); `POST /token` hands out OAuth access
tokens (for Application Default Credentials pointed at it). The request and response JSON is gemini_format.py;
reading medbanana's prompts back (shared with fake_openai.py) is wire.py.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import re
import signal
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import parse_qsl

import msgspec
from PIL import Image

from .. import backends
from ..records import EditedImage, SourceImage
from . import gemini_format as rest
from .echo import EchoEditor, EchoJudge, EchoWriter
from .fake_batches import FakeBatches
from .faults import FAULT_KINDS, parse_faults
from .wire import (LocalServer, WireHandler, blank_jpeg, connection_loop, history_from, run_coroutine, spoiled_json,
                   tagged, task_from, verdict_json)


@dataclass(frozen=True)
class Call:
    role: str
    model: str
    path: str  # models/{model}:generateContent (Vertex AI: projects/.../models/...), or the answering batch job
    fault: str  # "" when answered normally
    images: int  # inline images in the request
    credential: str = ""  # the x-goog-api-key header, else the Authorization header, as sent


class FakeGemini(LocalServer):
    """The server plus its state: faults, latency, the log of calls, and the simulator backends doing the work."""

    def __init__(self, *, faults=(), latency: float = 0.0, host: str = "127.0.0.1", port: int = 0,
                 engine: str = "simulator", accept_rate: float = 0.6, writer=None, editor=None, judge=None,
                 scorer=None, batch_seconds: float = 0.0):
        """engine: "simulator" (real edits and verdicts) or "echo" (no image work; echo.py, for benchmarks);
        writer/editor/judge replace the engine's backend for that role; scorer (any object with the judges'
        `score`) answers scoring requests, by default the judge when it scores, else the simulator's pixel judge; a
        batch job reports RUNNING for at least batch_seconds."""
        super().__init__(host, port, _Handler)
        self.faults = parse_faults(faults)
        self.latency = latency
        if engine not in ("simulator", "echo"):
            raise ValueError(f"engine must be 'simulator' or 'echo', not {engine!r}")
        echo = {"writer": EchoWriter, "editor": EchoEditor, "judge": lambda: EchoJudge(accept_rate)}
        for role, given in (("writer", writer), ("editor", editor), ("judge", judge)):
            setattr(self, role, given or (echo[role]() if engine == "echo" else backends.create(role, "simulator")))
        self.scorer = scorer or (self.judge if hasattr(self.judge, "score") else backends.create("judge", "simulator"))
        self.calls: list[Call] = []
        self.last_request: dict | None = None  # the last generateContent body, as JSON
        self.tokens: list[str] = []  # access tokens handed out by /token
        self.batches = FakeBatches(self, batch_seconds)
        self._lock = threading.Lock()
        self._stopping = threading.Event()

    def start(self) -> FakeGemini:
        self._stopping.clear()
        return super().start()

    def stop(self) -> None:
        self._stopping.set()  # releases hanging and slow calls
        super().stop()

    def reset(self, faults=()) -> None:
        """New faults (counted from zero), an empty call log, and no batch jobs or files."""
        with self._lock:
            self.faults, self.calls = parse_faults(faults), []
            self.batches = FakeBatches(self, self.batches.seconds)

    def count(self, role: str | None = None) -> int:
        with self._lock:
            return sum(1 for c in self.calls if role in (None, c.role))

    def wait(self, seconds: float) -> None:
        if seconds > 0:
            self._stopping.wait(seconds)

    def role_of(self, request: dict) -> str:
        return rest.role_of(rest.get(request, "generationConfig", "generation_config") or {})

    def strike(self, kind: str, role: str) -> bool:
        """Whether a fault of `kind` hits this job (for faults that strike whole batch jobs)."""
        with self._lock:
            return any(f.kind == kind and f.applies(role) and f.strike() for f in self.faults)

    @staticmethod
    def error(code: int, message: str) -> tuple[int, dict, dict]:
        return rest.error(code, message) + ({},)

    def token(self, request: bytes, **_) -> tuple[int, dict, dict]:
        """An OAuth token endpoint (google.auth's refresh of Application Default Credentials whose token_uri is
        {base_url}/token): a new access token per refresh, counted in `tokens`."""
        with self._lock:
            self.tokens.append(f"fake-access-token-{len(self.tokens) + 1}")
            token = self.tokens[-1]
        return 200, {"access_token": token, "expires_in": 3600, "token_type": "Bearer"}, {}

    # ------------------------------------------------------------ generateContent

    def generate_content(self, model: str, request: dict, api_key: str, in_batch: str = "",
                         arrived: float | None = None, headers=None, vertex: str = "", **_) -> tuple[int, dict, dict]:
        """(HTTP status, JSON body, extra headers) for one generateContent request; `in_batch` names the batch
        job answering it (then there is no latency, and a hang is a DEADLINE_EXCEEDED error); `vertex` is the
        Vertex AI path's prefix up to the model's name (e.g. "projects/P/locations/L/publishers/google/").

        With a latency the answer leaves `latency` seconds after the request `arrived` (time.monotonic()), the
        server's own work included, as a real service's latency includes its own."""
        started = time.monotonic() if arrived is None else arrived
        credential = api_key or (headers.get("authorization", "") if headers is not None else "")
        where = in_batch or f"{vertex}models/{model}:generateContent"
        answer = self._generate_content(model, request, api_key, where, credential, in_batch)
        if self.latency and not in_batch:
            self.wait(started + self.latency - time.monotonic())
        return answer

    def _generate_content(self, model: str, request: dict, api_key: str, where: str, credential: str,
                          in_batch: str) -> tuple[int, dict, dict]:
        config = rest.get(request, "generationConfig", "generation_config") or {}
        role = rest.role_of(config)
        fault_role, role = role, "scorer" if role == "judge" and rest.is_score_request(request) else role
        with self._lock:
            fault = next((f for f in self.faults if f.kind != "batch_failed" and f.applies(fault_role)
                          and f.strike()), None)
            self.calls.append(Call(role, model, where, fault.kind if fault else "", rest.count_images(request),
                                   credential))
            self.last_request = request  # only the last one: keeping every body would hold every image
        kind = fault.kind if fault else ""
        if kind == "hang":
            if in_batch:
                return rest.error(504, "deadline exceeded (injected hang)") + ({},)
            self.wait(fault.hang)
            return 0, {}, {}  # the handler drops the connection
        if kind in ("429", "500", "503"):
            headers = {"Retry-After": f"{fault.retry_after:g}"} if kind == "429" else {}
            return rest.error(int(kind), f"fake {kind} (injected)") + (headers,)
        if kind == "invalid_argument":  # echoes the key, as a hostile server might: callers must redact it
            return rest.error(400, f"invalid argument (injected) for key {api_key}") + ({},)
        try:
            texts, images = rest.read_contents(request)
            if kind in ("safety", "image_safety"):
                return 200, rest.response([], kind.upper(), texts, images), {}
            task = task_from(texts)
            parts, finish = getattr(self, f"_{role}")(task, texts, images, rest.get(config, "seed") or 0, kind)
        except ValueError as exc:
            return rest.error(400, str(exc)) + ({},)
        if kind == "torn_body":
            body = json.dumps(rest.response(parts, finish, texts, images)).encode()
            return 200, body[: len(body) // 2], {"Content-Type": "application/json; charset=UTF-8"}
        include_thoughts = bool(rest.get(rest.get(config, "thinkingConfig", "thinking_config") or {},
                                         "includeThoughts", "include_thoughts"))
        if not include_thoughts:
            parts = [p for p in parts if not p.get("thought")]
        answer = rest.response(parts, finish, texts, images)
        return 200, rest.with_new_fields(answer) if kind == "new_fields" else answer, {}

    def _writer(self, task, texts, images, seed, kind):
        if isinstance(self.writer, EchoWriter):  # it reads no image: no decode, and no event loop to run it on
            instruction = self.writer.instruction(task, history_from(texts))
        else:
            source = _RequestImage(images[0]) if images else SourceImage(Path("source.jpeg"), data=blank_jpeg())
            instruction = run_coroutine(self.writer.write(task, source, history_from(texts)))
        return [{"text": instruction.thinking_summary or f"Planning the {task.direction} edit.", "thought": True},
                {"text": instruction.text}], "STOP"

    def _editor(self, task, texts, images, seed, kind):
        if not images:
            raise ValueError("the editor request carries no image")
        if kind in ("text_only", "no_image"):
            finish = "NO_IMAGE" if kind == "no_image" else "STOP"
            return [{"text": "I cannot produce the image for this request."}], finish
        if isinstance(self.editor, EchoEditor) and kind not in ("truncated_image", "png_image"):
            # the source unchanged, as EchoEditor.edit returns it: its base64 goes back without a decode and encode
            return [{"text": "Here is the edited image."},
                    {"inlineData": {"mimeType": images[0].mime_type, "data": images[0].standard_base64()}}], "STOP"
        try:
            edited = run_coroutine(self.editor.edit(task, _RequestImage(images[0]), tagged(texts, "instruction"),
                                                    int(seed)))
        except backends.EditRefused as refused:  # a simulated refusal, answered the way Gemini answers one
            finish = {"safety": "SAFETY", "image_safety": "IMAGE_SAFETY", "no_image": "NO_IMAGE"}
            return [{"text": f"I can't make this edit ({refused})."}], finish.get(refused.kind, "STOP")
        data, mime = edited.data, "image/jpeg"
        if kind == "truncated_image":
            data = data[: len(data) // 2]
        elif kind == "png_image":
            data, mime = _png(edited), "image/png"
        return [{"text": "Here is the edited image."},
                {"inlineData": {"mimeType": mime, "data": base64.b64encode(data).decode()}}], "STOP"

    def _judge(self, task, texts, images, seed, kind):
        if len(images) < 2:
            raise ValueError(f"the judge request carries {len(images)} image(s), not 2 (original, edited)")
        if isinstance(self.judge, EchoJudge):  # its draw needs only the original's base64: neither image is decoded
            verdict = self.judge.verdict(task, images[0].base64, tagged(texts, "instruction"))
        else:
            verdict = run_coroutine(self.judge.judge(task, _RequestImage(images[0]), EditedImage(data=images[1].data),
                                                     tagged(texts, "instruction")))
        body = spoiled_json(verdict_json(verdict), kind, "The edit looks fine to me. ")
        return [{"text": verdict.thinking_summary or f"Compared both images: {verdict.reason}", "thought": True},
                {"text": body}], "STOP"

    def _scorer(self, task, texts, images, seed, kind):
        """Images: original, [ground truth,] edited. The scores are the scorer's, rounded to the schema's
        integers."""
        if len(images) not in (2, 3):
            raise ValueError(f"the scoring request carries {len(images)} image(s), not 2 or 3")
        truth = _RequestImage(images[1], "truth.jpeg") if len(images) == 3 else None
        scores = run_coroutine(self.scorer.score(task, _RequestImage(images[0]), EditedImage(data=images[-1].data),
                                                 tagged(texts, "instruction"), truth))
        body = spoiled_json(json.dumps({"editing_accuracy": int(round(scores.editing_accuracy)),
                                        "visual_quality": int(round(scores.visual_quality)),
                                        "reason": scores.reason}), kind, "Scores: ")
        return [{"text": f"Graded the edit: {scores.reason}", "thought": True}, {"text": body}], "STOP"


class _RequestImage(SourceImage):
    """A request's inline image as a SourceImage, decoded the first time a backend reads `data` (the echo writer
    never does; a decode costs about a millisecond for a 1024^2 JPEG)."""

    def __init__(self, image: rest.InlineImage, name: str = "source.jpeg"):
        super().__init__(Path(name), data=b"")
        del self.data  # read through __getattr__ until decoded
        self._image = image

    def __getattr__(self, name: str):
        if name != "data":
            raise AttributeError(name)
        self.data = self._image.data
        return self.data


class _Handler(WireHandler):
    disable_nagle_algorithm = True  # an answer larger than the socket's buffer goes in pieces: none held ~40 ms
    json_type = "application/json; charset=UTF-8"
    # (method, path pattern, handler as an attribute path on FakeGemini, body: JSON or raw bytes)
    ROUTES = (
        ("POST", re.compile(r"^/(?:v1|v1beta)/models/(?P<model>[^/:]+):generateContent$"), "generate_content", "json"),
        ("POST", re.compile(r"^/(?:v1|v1beta1)/(?P<vertex>(?:projects/[^/:]+/locations/[^/:]+/)?publishers/google/)"
                            r"models/(?P<model>[^/:]+):generateContent$"), "generate_content", "json"),
        ("POST", re.compile(r"^/(?:v1|v1beta)/models/(?P<model>[^/:]+):batchGenerateContent$"), "batches.create",
         "json"),
        ("GET", re.compile(r"^/(?:v1|v1beta)/batches/(?P<batch_id>[^/:]+)$"), "batches.get", "json"),
        ("POST", re.compile(r"^/upload/(?:v1|v1beta)/files$"), "batches.upload", "raw"),
        ("POST", re.compile(r"^/token$"), "token", "raw"),
        ("GET", re.compile(r"^/(?:v1|v1beta)/files/(?P<file_id>[^/:]+):download$"), "batches.download", "raw"),
    )

    def handle(self):
        with connection_loop():  # the simulator's coroutines of this connection's calls run on one loop
            super().handle()

    def do_POST(self):
        self._dispatch("POST")

    def do_GET(self):
        self._dispatch("GET")

    def _dispatch(self, method: str) -> None:
        arrived = time.monotonic()  # headers read; the latency runs from here
        fake: FakeGemini = self.server.fake
        body = self.read_body()
        path, _, query = self.path.partition("?")
        for route_method, pattern, name, kind in self.ROUTES:
            match = pattern.match(path)
            if match and route_method == method:
                try:
                    request = msgspec.json.decode(body or b"{}") if kind == "json" else body
                except ValueError:  # msgspec.DecodeError is one
                    return self.send_payload(*rest.error(400, "request body is not JSON"))
                handler = fake
                for attribute in name.split("."):
                    handler = getattr(handler, attribute)
                try:
                    status, payload, headers = handler(**match.groupdict(), request=request,
                                                       api_key=self.headers.get("x-goog-api-key", ""),
                                                       headers=self.headers, query=dict(parse_qsl(query)),
                                                       arrived=arrived)
                except Exception as exc:  # a simulator bug: a 500 the client can report, and the trace here
                    traceback.print_exc()
                    return self.send_payload(*rest.error(500, f"fake Gemini failed: {type(exc).__name__}: {exc}"))
                if status == 0:
                    self.close_connection = True
                    return
                return self.send_payload(status, payload, headers)
        self.send_payload(*rest.error(404, f"fake Gemini has no {method} {path}"))


def _png(edited: EditedImage) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(edited.array).save(buf, format="PNG")
    return buf.getvalue()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m medbanana.generation.testing.fake_gemini", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port (printed)")
    parser.add_argument("--latency", type=float, default=0.0,
                        help="seconds from a request's arrival to its answer, the server's own work included")
    parser.add_argument("--engine", choices=("simulator", "echo"), default="simulator",
                        help="simulator: real edits and verdicts; echo: no image work, for throughput benchmarks")
    parser.add_argument("--accept-rate", type=float, default=0.6, help="echo engine: share of edits accepted")
    parser.add_argument("--batch-seconds", type=float, default=0.0, help="least time a batch job reports RUNNING")
    parser.add_argument("--fault", action="append", default=[], metavar="KIND[:first=N|rate=F,role=R,...]",
                        help=f"repeatable; kinds: {', '.join(FAULT_KINDS)}")
    args = parser.parse_args(argv)
    fake = FakeGemini(faults=args.fault, latency=args.latency, host=args.host, port=args.port, engine=args.engine,
                      accept_rate=args.accept_rate, batch_seconds=args.batch_seconds).start()
    print(f"fake Gemini listening on {fake.base_url}", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    fake.stop()


if __name__ == "__main__":
    main()
