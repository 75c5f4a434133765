"""The Gemini backend against the fake Gemini server, through the real google-genai client.

Every fault kind maps to the right exception and kind with a bounded number of calls, counted at the server.
Back-off sleeps are recorded instead of slept, so Retry-After is checked without waiting for it.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import urllib.error
import urllib.request

import numpy as np
import pytest

from fake_runs import chest_source
from medbanana.generation import backends
from medbanana.generation.backends import APIError, EditRefused
from medbanana.generation.testing.echo import EchoJudge
from medbanana.generation.testing.fake_gemini import FakeGemini
from medbanana.generation.backends.gemini import GeminiEditor, GeminiJudge, GeminiWriter
from medbanana.generation.backends.gemini_transport import rest_request
from medbanana.generation.backends.response_cache import ResponseCache
from medbanana.generation.prompts import editor_prompt
from medbanana.generation.records import (Attempt, EditedImage, Instruction, SourceImage, Task, Verdict,
                                          decode_rgb, encode_jpeg, rubric_score)

KEY = "test-key-7f3a9c1e5b2d"  # distinctive, so that a leak is found by grep
MAX_ATTEMPTS, MAX_REASKS, MAX_IMAGE_RETRIES = 3, 2, 2


@pytest.fixture(scope="module")
def fake():
    with FakeGemini() as server:
        yield server


@pytest.fixture
def options(fake, sleeps):
    fake.reset()
    return {"api_key": KEY, "base_url": fake.base_url, "timeout": 5.0, "max_attempts": MAX_ATTEMPTS,
            "retry_base_delay": 0.01, "retry_max_delay": 0.05, "sleep": sleeps}


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> SourceImage:
    return chest_source(tmp_path_factory.mktemp("src"), size=256)


def make_task(source: SourceImage, direction: str = "add", disease: str = "Pleural_Effusion") -> Task:
    return Task("cxr_demo", "chest_xray", disease, direction, source.path)


def run(coro):
    return asyncio.run(coro)


def edited_from(source: SourceImage) -> EditedImage:
    return EditedImage(data=encode_jpeg(np.clip(source.array.astype(int) + 10, 0, 255)))


class Recorder:
    """Wraps a simulator backend inside the fake server and keeps what it was given and what it returned."""

    def __init__(self, inner):
        self.inner, self.seen, self.returned = inner, [], []

    async def edit(self, task, source, instruction, seed):
        self.seen.append((task, source.data, instruction, seed))
        result = await self.inner.edit(task, source, instruction, seed)
        self.returned.append(result.data)
        return result


class FixedJudge:
    """A judge inside the fake server that always answers with the same verdict."""

    def __init__(self, **fields):
        self.fields = fields

    async def judge(self, task, source, edited, instruction):
        return Verdict(**self.fields)


# ---------------------------------------------------------------- the happy path

def test_registry_builds_gemini_backends(options):
    writer = backends.create("writer", "gemini", **options)
    editor = backends.create("editor", "gemini", model="gemini-2.5-flash-image-preview", **options)
    judge = backends.create("judge", "gemini", model="my-judge", **options)
    assert isinstance(writer, GeminiWriter) and writer.model == "gemini-2.5-pro"
    assert isinstance(editor, GeminiEditor) and editor.model == "gemini-2.5-flash-image-preview"
    assert isinstance(judge, GeminiJudge) and judge.model == "my-judge"


def test_a_full_round_and_a_refinement(fake, options, source):
    task = make_task(source)
    writer, editor, judge = GeminiWriter(**options), GeminiEditor(**options), GeminiJudge(**options)

    async def rounds():
        first = await writer.write(task, source, [])
        edited = await editor.edit(task, source, first.text, seed=11)
        verdict = await judge.judge(task, source, edited, first.text)
        second = await writer.write(task, source, [Attempt(1, first, verdict)])
        return first, edited, verdict, second

    first, edited, verdict, second = run(rounds())
    assert first.text and second.text and first.model == "gemini-2.5-pro"
    assert first.thinking_summary and verdict.thinking_summary  # thought parts kept
    assert first.usage.input_tokens > 0 and edited.usage.output_tokens > 0 and verdict.usage.thinking_tokens > 0
    assert edited.data[:3] == b"\xff\xd8\xff" and edited.details["reencoded"] is False
    assert decode_rgb(edited.data).shape == source.array.shape
    assert verdict.score == pytest.approx(rubric_score(verdict.compliance("add"), verdict.structure_reasonable,
                                                       verdict.looks_realistic, verdict.fidelity_preserved))
    assert [(c.role, c.images) for c in fake.calls] == [("writer", 1), ("editor", 1), ("judge", 2), ("writer", 1)]
    assert [c.model for c in fake.calls] == ["gemini-2.5-pro", "gemini-2.5-flash-image", "gemini-2.5-pro",
                                             "gemini-2.5-pro"]


def test_source_bytes_go_out_and_jpeg_bytes_come_back_as_they_are(options, source):
    recorder = Recorder(backends.create("editor", "simulator"))
    with FakeGemini(editor=recorder) as server:
        editor = GeminiEditor(**{**options, "base_url": server.base_url})
        edited = run(editor.edit(make_task(source), source, "Add a small effusion at the right base.", seed=5))
    (task, sent, instruction, seed), = recorder.seen
    assert sent == source.data and seed == 5 and instruction == "Add a small effusion at the right base."
    assert (task.disease, task.direction) == ("Pleural_Effusion", "add")
    assert edited.data == recorder.returned[0]


def test_png_answers_are_encoded_once_to_jpeg(fake, options, source):
    fake.reset(["png_image"])
    edited = run(GeminiEditor(**options).edit(make_task(source), source, "Add an effusion.", seed=1))
    assert edited.data[:3] == b"\xff\xd8\xff" and edited.details["reencoded"] is True
    assert edited.details["returned_mime_type"] == "image/png"


def test_the_writer_sends_the_original_image_when_image_aware_and_always_when_refining(fake, options, source):
    history = [Attempt(1, Instruction("Add a small effusion."), edit_error="no_image: nothing came back")]
    for image_aware in (False, True):
        writer = GeminiWriter(image_aware=image_aware, **options)
        run(writer.write(make_task(source), source, []))
        run(writer.write(make_task(source), source, history))
    assert [(c.role, c.images) for c in fake.calls] == [("writer", 0), ("writer", 1), ("writer", 1), ("writer", 1)]


@pytest.mark.parametrize("direction, has_disease, qualified", [
    ("remove", True, False),  # the model said qualified, but the disease is still there: not accepted
    ("remove", False, True),
    ("add", False, False),
    ("add", True, True),
])
def test_judge_enforces_compliance(options, source, direction, has_disease, qualified):
    answer = dict(has_disease=has_disease, structure_reasonable=True, looks_realistic=True,
                  fidelity_preserved=False, qualified=True, reason="looks fine")
    with FakeGemini(judge=FixedJudge(**answer)) as server:
        judge = GeminiJudge(**{**options, "base_url": server.base_url})
        verdict = run(judge.judge(make_task(source, direction), source, edited_from(source), "Edit it."))
    assert verdict.has_disease is has_disease and verdict.qualified is qualified
    assert verdict.details["model_qualified"] is True
    assert ("qualified_overridden" in verdict.details) is (not qualified)
    compliant = has_disease if direction == "add" else not has_disease
    assert verdict.score == pytest.approx(rubric_score(compliant, True, True, False))
    assert verdict.reason == "looks fine"


# ---------------------------------------------------------------- faults

def test_retry_after_is_honoured_then_the_call_succeeds(fake, options, sleeps, source):
    fake.reset(["429:first=2,retry_after=7"])
    instruction = run(GeminiWriter(**options).write(make_task(source), source, []))
    assert instruction.text
    assert fake.count() == 3 and [c.fault for c in fake.calls] == ["429", "429", ""]
    assert len(sleeps) == 2 and all(s >= 7 for s in sleeps)


@pytest.mark.parametrize("fault, kind", [("500", "server_error"), ("503", "server_error"), ("429", "rate_limited")])
def test_retries_are_bounded_then_api_error(fake, options, sleeps, source, fault, kind):
    fake.reset([fault])
    with pytest.raises(APIError) as caught:
        run(GeminiJudge(**options).judge(make_task(source), source, edited_from(source), "Edit it."))
    assert caught.value.kind == kind
    assert fake.count() == MAX_ATTEMPTS and len(sleeps) == MAX_ATTEMPTS - 1


def test_a_transient_503_is_retried(fake, options, source):
    fake.reset(["503:first=1"])
    verdict = run(GeminiJudge(**options).judge(make_task(source), source, edited_from(source), "Edit it."))
    assert isinstance(verdict, Verdict) and fake.count() == 2


def test_a_hanging_call_times_out_and_is_retried_boundedly(fake, options, source):
    fake.reset(["hang:hang=10"])
    editor = GeminiEditor(**{**options, "timeout": 0.3, "max_attempts": 2})
    with pytest.raises(APIError) as caught:
        run(editor.edit(make_task(source), source, "Add an effusion.", seed=1))
    assert caught.value.kind == "timeout" and fake.count() == 2


def test_connection_refused_is_a_transport_error(options, sleeps, source):
    with FakeGemini(writer=object(), editor=object(), judge=object()) as server:
        closed_url = server.base_url
    writer = GeminiWriter(**{**options, "base_url": closed_url})
    with pytest.raises(APIError) as caught:
        run(writer.write(make_task(source), source, []))
    assert caught.value.kind == "transport" and "gave up after 3 attempts" in str(caught.value)
    assert len(sleeps) == MAX_ATTEMPTS - 1 and writer.transport.network_calls == MAX_ATTEMPTS


def test_a_dropped_connection_is_retried_by_us_alone(options, sleeps, source):
    """A server that closes every connection unanswered: one connection per attempt of ours, so the SDK's client
    did not retry on its own (it would, after sleeping 1 to 10 s, without retry options of its own)."""
    accepted = []
    with socket.create_server(("127.0.0.1", 0)) as listener:
        def drop():
            while True:
                try:
                    conn, _ = listener.accept()
                except OSError:  # the listener closed: the test is over
                    return
                accepted.append(conn.recv(1 << 16)[:4])
                conn.close()

        threading.Thread(target=drop, daemon=True).start()
        writer = GeminiWriter(**{**options, "base_url": f"http://127.0.0.1:{listener.getsockname()[1]}"})
        with pytest.raises(APIError) as caught:
            run(writer.write(make_task(source), source, []))
    assert caught.value.kind == "transport" and accepted == [b"POST"] * MAX_ATTEMPTS
    assert len(sleeps) == MAX_ATTEMPTS - 1


@pytest.mark.parametrize("fault, kind", [("safety", "safety"), ("image_safety", "image_safety"),
                                         ("truncated_image", "truncated_image"),
                                         ("invalid_argument", "invalid_argument")])
def test_permanent_editor_failures_are_refusals_without_retry(fake, options, source, fault, kind):
    fake.reset([fault])
    with pytest.raises(EditRefused) as caught:
        run(GeminiEditor(**options).edit(make_task(source), source, "Add an effusion.", seed=1))
    assert caught.value.kind == kind and fake.count() == 1
    assert KEY not in str(caught.value)


@pytest.mark.parametrize("fault, kind", [("text_only", "text_only"), ("no_image", "no_image")])
def test_missing_images_are_retried_with_new_seeds_then_refused(fake, options, source, fault, kind):
    fake.reset([fault])
    with pytest.raises(EditRefused) as caught:
        run(GeminiEditor(max_image_retries=MAX_IMAGE_RETRIES, **options).edit(
            make_task(source), source, "Add an effusion.", seed=1))
    assert caught.value.kind == kind and fake.count() == 1 + MAX_IMAGE_RETRIES


def test_a_missing_image_once_is_recovered_with_the_next_seed(fake, options, source):
    fake.reset(["text_only:first=1"])
    edited = run(GeminiEditor(**options).edit(make_task(source), source, "Add an effusion.", seed=41))
    assert edited.details["tries"] == 2 and edited.details["seed"] == 42 and fake.count() == 2


@pytest.mark.parametrize("fault", ["malformed_json", "truncated_json"])
def test_unparseable_verdicts_are_re_asked_boundedly(fake, options, source, fault):
    fake.reset([fault])
    judge = GeminiJudge(max_reasks=MAX_REASKS, **options)
    with pytest.raises(APIError) as caught:
        run(judge.judge(make_task(source), source, edited_from(source), "Edit it."))
    assert caught.value.kind == "unparseable_verdict" and fake.count() == 1 + MAX_REASKS


def test_an_unparseable_verdict_once_is_recovered(fake, options, source):
    fake.reset(["truncated_json:first=1"])
    verdict = run(GeminiJudge(**options).judge(make_task(source), source, edited_from(source), "Edit it."))
    assert verdict.details["tries"] == 2 and fake.count() == 2


@pytest.mark.parametrize("backend", ["writer", "judge"])
def test_writer_and_judge_permanent_failures_are_api_errors(fake, options, source, backend):
    fake.reset([f"safety:role={backend}"])
    with pytest.raises(APIError) as caught:
        if backend == "writer":
            run(GeminiWriter(**options).write(make_task(source), source, []))
        else:
            run(GeminiJudge(**options).judge(make_task(source), source, edited_from(source), "Edit it."))
    assert caught.value.kind == "safety" and fake.count() == 1


# ---------------------------------------------------------------- cache, rate limit, secrets

def test_the_cache_answers_a_repeated_call_even_after_a_restart(fake, options, source, tmp_path):
    task, cache = make_task(source), tmp_path / "cache"
    first = GeminiEditor(cache_dir=cache, **options)
    a = run(first.edit(task, source, "Add an effusion.", seed=3))
    b = run(first.edit(task, source, "Add an effusion.", seed=3))
    resumed = GeminiEditor(cache_dir=cache, **options)  # a new process resuming the run
    c = run(resumed.edit(task, source, "Add an effusion.", seed=3))
    assert fake.count() == 1 and first.transport.cache_hits == 1 and resumed.transport.cache_hits == 1
    assert a.data == b.data == c.data
    run(first.edit(task, source, "Add an effusion.", seed=4))  # a different payload is a new call
    assert fake.count() == 2


def test_a_torn_response_body_is_retried_and_the_cache_keeps_the_body_as_sent(fake, options, source, tmp_path):
    fake.reset(["torn_body:first=1"])
    editor = GeminiEditor(cache_dir=tmp_path / "cache", **options)
    edited = run(editor.edit(make_task(source), source, "Add an effusion.", seed=1))
    assert fake.count() == 2 and editor.transport.network_calls == 2
    assert decode_rgb(edited.data).shape == source.array.shape
    (cached,) = ResponseCache(tmp_path / "cache").answers().values()
    body = json.loads(cached)  # the server's JSON, camelCase keys and all, not a re-serialisation
    assert base64.b64decode(body["candidates"][0]["content"]["parts"][-1]["inlineData"]["data"]) == edited.data


def _wire_form(value):
    """A request body with key spelling (camelCase or snake_case) and base64 alphabet made irrelevant."""
    if isinstance(value, dict):
        out = {}
        for key, item in value.items():
            key = re.sub(r"_([a-z])", lambda m: m.group(1).upper(), key)
            out[key] = base64.urlsafe_b64decode(item.replace("+", "-").replace("/", "_")) if key == "data" \
                else _wire_form(item)
        return out
    return [_wire_form(v) for v in value] if isinstance(value, list) else value


def test_batch_request_lines_are_the_bodies_the_sdk_puts_on_the_wire(fake, options, source):
    """A batch file's request (rest_request, written by hand) against what generate_content sent to the server."""
    task, edited = make_task(source), edited_from(source)
    writer, editor, judge = GeminiWriter(**options), GeminiEditor(**options), GeminiJudge(**options)
    requests = [next(writer.write_exchange(task, source, [])), next(editor.edit_exchange(task, source, "Add.", 5)),
                next(judge.judge_exchange(task, source, edited, "Add.")),
                next(judge.score_exchange(task, source, edited, "Add.", ground_truth=source))]
    for request, transport in zip(requests, (writer.transport, editor.transport, judge.transport, judge.transport)):
        run(transport.generate(request.model, request.contents, request.config))
        assert _wire_form(rest_request(request)) == _wire_form(fake.last_request)
        assert fake.calls[-1].path == f"models/{request.model}:generateContent"


def test_failed_calls_are_not_cached(fake, options, source, tmp_path):
    fake.reset(["500:first=3"])
    writer = GeminiWriter(cache_dir=tmp_path, **options)
    with pytest.raises(APIError):
        run(writer.write(make_task(source), source, []))
    assert run(writer.write(make_task(source), source, [])).text and fake.count() == MAX_ATTEMPTS + 1


def test_rpm_spaces_calls_per_model(fake, options, sleeps, source):
    writer = GeminiWriter(rpm=6, **{**options, "model": "rpm-test-model"})  # one call per 10 s
    run(writer.write(make_task(source), source, []))
    run(writer.write(make_task(source, "remove"), source, []))
    assert fake.count() == 2 and len(sleeps) == 1 and 0 < sleeps[0] <= 10


def test_tpm_waits_once_a_minute_of_reported_usage_reaches_the_limit(fake, options, sleeps, source):
    writer = GeminiWriter(tpm=1, **{**options, "model": "tpm-test-model"})  # any answer uses up the minute
    run(writer.write(make_task(source), source, []))
    assert sleeps == []
    run(writer.write(make_task(source, "remove"), source, []))
    assert fake.count() == 2 and len(sleeps) == 1 and 0 < sleeps[0] <= 60


def test_the_api_key_is_never_written_or_reported(fake, options, source, tmp_path, monkeypatch):
    monkeypatch.setenv("GEMINI_API_KEY", KEY)
    env_options = {k: v for k, v in options.items() if k != "api_key"}
    cache, task = tmp_path / "cache", make_task(source)
    writer = GeminiWriter(cache_dir=cache, **env_options)
    editor = GeminiEditor(cache_dir=cache, **env_options)
    judge = GeminiJudge(cache_dir=cache, **env_options)
    messages = []
    instruction = run(writer.write(task, source, []))
    edited = run(editor.edit(task, source, instruction.text, seed=2))
    run(judge.judge(task, source, edited, instruction.text))
    for fault in ["invalid_argument:role=writer", "500", "safety:role=writer"]:
        fake.reset([fault])
        with pytest.raises(APIError) as caught:
            run(writer.write(task, source, [Attempt(1, instruction)]))
        messages.append(str(caught.value))
    written = [p for p in cache.rglob("*") if p.is_file()]
    # the three answers; errors are not cached, nor the refusal (an answer that ended in an APIError)
    assert len(written) == 3
    assert not [p for p in written if KEY.encode() in p.read_bytes()]
    assert not [m for m in messages if KEY in m] and "[redacted]" in messages[0]


def test_key_and_base_url_can_come_from_the_environment(fake, source, monkeypatch):
    monkeypatch.setenv("GEMINI_API_KEY", KEY)
    monkeypatch.setenv("GOOGLE_GEMINI_BASE_URL", fake.base_url)  # how a `medbanana generate` subprocess finds it
    fake.reset()
    assert run(GeminiWriter().write(make_task(source), source, [])).text and fake.count("writer") == 1


def test_a_missing_api_key_is_a_clear_error(monkeypatch):
    monkeypatch.delenv("GEMINI_API_KEY", raising=False)
    monkeypatch.delenv("GOOGLE_API_KEY", raising=False)
    with pytest.raises(ValueError, match="GEMINI_API_KEY or GOOGLE_API_KEY"):
        GeminiWriter(base_url="http://127.0.0.1:9")


def test_v1beta_and_plain_rest_clients_are_served(fake, source):
    body = {"contents": [{"role": "user", "parts": [
        {"inlineData": {"mimeType": "image/jpeg", "data": base64.b64encode(source.data).decode()}},
        {"text": editor_prompt(make_task(source), "Add a small effusion.")}]}],
        "generationConfig": {"responseModalities": ["TEXT", "IMAGE"], "seed": 3}}

    def post(path: str, payload: dict) -> tuple[int, dict]:
        request = urllib.request.Request(fake.base_url + path, data=json.dumps(payload).encode(), method="POST",
                                         headers={"Content-Type": "application/json", "x-goog-api-key": KEY})
        try:
            with urllib.request.urlopen(request, timeout=10) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as error:
            return error.code, json.loads(error.read())

    status, answer = post("/v1beta/models/gemini-2.5-flash-image:generateContent", body)
    parts = answer["candidates"][0]["content"]["parts"]
    assert status == 200 and base64.b64decode(parts[-1]["inlineData"]["data"])[:3] == b"\xff\xd8\xff"
    assert answer["usageMetadata"]["promptTokenCount"] > 0
    status, answer = post("/v1/models/x:generateContent", {"contents": [{"parts": [{"text": "hello"}]}]})
    assert status == 400 and answer["error"]["status"] == "INVALID_ARGUMENT"  # not a medbanana prompt
    status, answer = post("/v2/models/x:generateContent", body)
    assert status == 404 and answer["error"]["code"] == 404


# ---------------------------------------------------------------- the command-line server

def test_the_server_runs_as_a_module_with_faults_and_the_echo_engine(options, sleeps, source):
    proc = subprocess.Popen([sys.executable, "-m", "medbanana.generation.testing.fake_gemini", "--port", "0", "--engine",
                             "echo", "--fault", "503:first=1", "--latency", "0.01"],
                            stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        line = proc.stdout.readline()
        assert line.startswith("fake Gemini listening on http://127.0.0.1:")
        url = line.rsplit(" ", 1)[1].strip()
        edited = run(GeminiEditor(**{**options, "base_url": url}).edit(make_task(source), source, "Add.", seed=1))
        assert edited.data == source.data  # the echo engine edits nothing
        assert len(sleeps) == 1  # the injected 503 was retried once
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0


def test_the_echo_judge_is_deterministic_and_accepts_about_its_rate(source):
    judge, task = EchoJudge(accept_rate=0.6), make_task(source, "remove")
    verdicts = [run(judge.judge(task, source, edited_from(source), f"Remove it, try {i}.")) for i in range(200)]
    again = run(judge.judge(task, source, edited_from(source), "Remove it, try 7."))
    assert again == verdicts[7]
    assert 0.5 < sum(v.qualified for v in verdicts) / 200 < 0.7
    for v in verdicts:  # a rejected verdict names one failed criterion, and remove means has_disease is false
        failed = [not v.compliance("remove"), not v.structure_reasonable, not v.looks_realistic,
                  not v.fidelity_preserved]
        assert v.qualified == (sum(failed) == 0) and sum(failed) <= 1
