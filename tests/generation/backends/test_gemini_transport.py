"""Pieces of the Gemini transport and the fake server that need no network: limiter, back-off, Retry-After,
error classification, the request cache, fault schedules, prompts and answer parsing."""

from __future__ import annotations

import json
import random
import re
from email.utils import format_datetime
from datetime import datetime, timedelta, timezone
from pathlib import Path

import aiohttp
import pytest
from google.auth import exceptions as auth_errors
from google.genai import errors as genai_errors
from google.genai import types

from medbanana.generation.testing.faults import Fault
from medbanana.generation.backends.gemini import read_answer
from medbanana.generation.prompts import (PROMPT_NAMES, clean_instruction, editor_prompt, history_json, judge_prompt,
                                          parse_prompt, parse_verdict, prompt_versions, writer_prompt)
from medbanana.generation.records import Attempt, Instruction, Task, Verdict
from medbanana.generation.taxonomy import load_taxonomy
from medbanana.generation.backends.gemini_transport import RequestCache, classify
from medbanana.generation.backends.http import RateLimiter, RetryPolicy, parse_retry_after


def test_rate_limiter_spaces_request_starts():
    now = [100.0]
    limiter = RateLimiter(rpm=30, clock=lambda: now[0])  # one start per 2 s
    assert [limiter.reserve() for _ in range(3)] == [0.0, 2.0, 4.0]
    now[0] = 110.0  # idle long enough: no wait, and no burst credit saved up
    assert [limiter.reserve() for _ in range(2)] == [0.0, 2.0]
    with pytest.raises(ValueError):
        RateLimiter(rpm=0)


def test_backoff_grows_with_jitter_and_respects_retry_after():
    policy, rng = RetryPolicy(base_delay=1.0, max_delay=8.0, max_retry_after=30.0), random.Random(0)
    for n, cap in enumerate([1, 2, 4, 8, 8]):
        delays = [policy.delay(n, None, rng) for _ in range(50)]
        assert all(cap / 2 <= d <= cap for d in delays) and len(set(delays)) > 1
    assert policy.delay(0, 20.0, rng) == 20.0
    assert policy.delay(0, 3600.0, rng) == 30.0  # capped
    assert policy.delay(4, 0.1, rng) >= 4.0  # a tiny Retry-After does not shorten the back-off


def test_retry_after_parsing():
    assert parse_retry_after("7") == 7.0
    assert parse_retry_after(" 1.5 ") == 1.5
    later = datetime.now(timezone.utc) + timedelta(seconds=90)
    assert 80 < parse_retry_after(format_datetime(later, usegmt=True)) <= 90
    assert parse_retry_after("soon") is None and parse_retry_after(None) is None


def test_classification_of_errors():
    retry_info = {"error": {"code": 429, "status": "RESOURCE_EXHAUSTED", "message": "quota",
                            "details": [{"@type": "type.googleapis.com/google.rpc.RetryInfo", "retryDelay": "37s"}]}}
    failure = classify(genai_errors.ClientError(429, retry_info))
    assert (failure.kind, failure.retryable, failure.retry_after) == ("rate_limited", True, 37.0)
    assert classify(genai_errors.ServerError(503, {"error": {"message": "x"}})).kind == "server_error"
    assert classify(genai_errors.ClientError(408, {})).retryable
    permanent = [(400, "invalid_argument"), (403, "permission_denied"), (404, "not_found"), (418, "client_error")]
    for code, kind in permanent:
        failure = classify(genai_errors.ClientError(code, {"error": {"message": "no"}}))
        assert (failure.kind, failure.retryable) == (kind, False)
    assert classify(TimeoutError()).kind == "timeout"
    assert classify(ConnectionResetError("reset")).kind == "transport"
    assert classify(json.JSONDecodeError("torn", "{", 1)).kind == "bad_response"
    with pytest.raises(KeyError):  # a programming error is not dressed up as an API failure
        classify(KeyError("bug"))


def test_classification_of_the_sdk_transports_and_credentials_errors():
    """aiohttp's (the SDK's transport with google-genai[aiohttp]) and google.auth's (Vertex AI tokens)."""
    refused = aiohttp.ClientConnectorError(aiohttp.client_reqrep.ConnectionKey(
        "127.0.0.1", 9, False, True, None, None, None), ConnectionRefusedError(111, "Connection refused"))
    expected = [(refused, "transport", True), (aiohttp.ServerDisconnectedError(), "transport", True),
                (aiohttp.ClientPayloadError("torn"), "transport", True),
                (aiohttp.ConnectionTimeoutError(), "timeout", True), (aiohttp.SocketTimeoutError(), "timeout", True),
                (aiohttp.InvalidURL("htp:/x"), "client_error", False),
                (auth_errors.TransportError("token endpoint unreachable"), "transport", True),
                (auth_errors.DefaultCredentialsError("no ADC"), "unauthenticated", False),
                (auth_errors.RefreshError("revoked"), "unauthenticated", False)]
    for exc, kind, retryable in expected:
        failure = classify(exc)
        assert (type(exc).__name__, failure.kind, failure.retryable) == (type(exc).__name__, kind, retryable)


def _request(text: str, image: bytes = b"\xff\xd8\xff-jpeg") -> list[types.Content]:
    return [types.Content(role="user", parts=[types.Part.from_bytes(data=image, mime_type="image/jpeg"),
                                              types.Part(text=text)])]


def test_cache_key_covers_model_contents_and_config(tmp_path):
    config = types.GenerateContentConfig(seed=1, response_modalities=["TEXT", "IMAGE"])
    key = RequestCache.key("m", _request("a"), config)
    assert key == RequestCache.key("m", _request("a"), config)
    others = {RequestCache.key("m2", _request("a"), config), RequestCache.key("m", _request("b"), config),
              RequestCache.key("m", _request("a", b"\xff\xd8\xff-other"), config),
              RequestCache.key("m", _request("a"), config.model_copy(update={"seed": 2}))}
    assert key not in others and len(others) == 4


def test_cache_round_trips_responses_and_ignores_torn_answers(tmp_path):
    cache = RequestCache(tmp_path)
    parts = [types.Part(text="plan", thought=True),
             types.Part.from_bytes(data=b"\xff\xd8\xff\x00\x01", mime_type="image/jpeg")]
    response = types.GenerateContentResponse(
        candidates=[types.Candidate(content=types.Content(role="model", parts=parts), finish_reason="STOP")],
        usage_metadata=types.GenerateContentResponseUsageMetadata(prompt_token_count=9))
    assert cache.get("ab" * 32) is None
    cache.put("ab" * 32, response)
    answer = read_answer(cache.get("ab" * 32))
    assert answer.images[0].data == b"\xff\xd8\xff\x00\x01" and answer.thoughts == "plan"
    assert answer.finish_reason == "STOP" and answer.usage.input_tokens == 9
    cache.put_json("ab" * 32, '{"candidates": [')  # an answer cut short: asked again
    assert cache.get("ab" * 32) is None and RequestCache(tmp_path).get("ab" * 32) is None


def test_fault_schedules_are_deterministic():
    fault = Fault.parse("429:first=2,retry_after=3")
    assert (fault.kind, fault.first, fault.retry_after) == ("429", 2, 3.0)
    assert [fault.strike() for _ in range(4)] == [True, True, False, False]
    quarter = Fault("500", rate=0.25)
    hits = [quarter.strike() for _ in range(20)]
    assert sum(hits) == 5 and hits[:4].count(True) == 1
    assert Fault("text_only").applies("editor") and not Fault("text_only").applies("judge")
    assert Fault("safety", role="writer").applies("writer") and not Fault("safety", role="writer").applies("editor")
    for bad in ["nonsense", "429:often=1", "safety:role=painter"]:
        with pytest.raises(ValueError):
            Fault.parse(bad)


# ---------------------------------------------------------------- prompts and answers

def _task(label, direction: str) -> Task:
    return Task("ds", label.modality, label.folder, direction, Path("s.jpeg"))


def test_every_prompt_is_versioned_and_renders_for_every_target():
    assert set(prompt_versions()) == set(PROMPT_NAMES)
    assert all(re.fullmatch(r"\w+", v) for v in prompt_versions().values())
    history = [Attempt(1, Instruction("Make it visible."), edit_error="no_image: nothing came back")]
    for label in load_taxonomy().targets:
        for direction in ("add", "remove"):
            task = _task(label, direction)
            texts = [writer_prompt(task, [])[1], writer_prompt(task, history)[1],
                     editor_prompt(task, "Do it."), judge_prompt(task, "Do it.")]
            for text in texts:
                assert f"- Finding: {label.name}\n" in text and f"- Direction: {direction}\n" in text
                assert "$" not in text  # every placeholder filled


def test_the_writer_picks_its_prompt_from_direction_and_history():
    label = load_taxonomy().target("Pleural_Effusion")
    assert writer_prompt(_task(label, "add"), [])[0].name == "writer_add"
    assert writer_prompt(_task(label, "remove"), [])[0].name == "writer_remove"
    verdict = Verdict(False, True, True, True, False, "no fluid seen")
    prompt, text = writer_prompt(_task(label, "add"), [Attempt(2, Instruction("Second try."), verdict),
                                                       Attempt(1, Instruction("First try."), verdict)])
    assert prompt.name == "writer_refine" and text.index("First try.") < text.index("Second try.")
    assert "no fluid seen" in text


def test_history_json_keeps_every_round():
    verdict = Verdict(True, False, True, True, False, "the heart border is distorted")
    rounds = json.loads(history_json([Attempt(1, Instruction("A"), verdict),
                                      Attempt(2, Instruction("B"), edit_error="safety: blocked")]))
    assert rounds[0] == {"round": 1, "instruction": "A", "verdict": {
        "has_disease": True, "structure_reasonable": False, "looks_realistic": True, "fidelity_preserved": True,
        "qualified": False, "reason": "the heart border is distorted"}}
    assert rounds[1] == {"round": 2, "instruction": "B", "edit_error": "safety: blocked"}


def test_prompt_files_need_a_version_line():
    prompt = parse_prompt("mine", "version: 3\nHello $who.")
    assert (prompt.tag, prompt.render(who="you")) == ("mine/3", "Hello you.")
    with pytest.raises(ValueError, match="version: N"):
        parse_prompt("mine", "Hello $who.\nversion: 3")
    with pytest.raises(KeyError):  # a placeholder left unfilled is an error, not a '$who' sent to the model
        prompt.render()


def test_parse_verdict():
    raw = {"has_disease": False, "structure_reasonable": True, "looks_realistic": True, "fidelity_preserved": True,
           "qualified": True, "reason": "clean removal"}
    assert parse_verdict(json.dumps(raw)).reason == "clean removal"
    assert parse_verdict(f"```json\n{json.dumps(raw)}\n```").qualified is True
    assert parse_verdict(json.dumps([raw])).has_disease is False
    for bad in [json.dumps(raw)[:40], "The edit is fine.", json.dumps({**raw, "qualified": None}),
                json.dumps({k: v for k, v in raw.items() if k != "reason"})]:
        with pytest.raises(ValueError):
            parse_verdict(bad)


def test_clean_instruction():
    assert clean_instruction('Instruction: "Add a small effusion."') == "Add a small effusion."
    assert clean_instruction("  New instruction:\nBlur nothing.  ") == "Blur nothing."
    with pytest.raises(ValueError):
        clean_instruction('  ""  ')


def test_token_limiter_keeps_a_minute_of_usage_under_tpm():
    from medbanana.generation.backends.http import TokenLimiter

    now = [0.0]
    limiter = TokenLimiter(1000, clock=lambda: now[0])
    assert limiter.wait_time() == 0.0
    limiter.record(600)
    now[0] = 10.0
    assert limiter.wait_time() == 0.0  # 600 < 1000
    limiter.record(500)
    now[0] = 20.0
    assert limiter.wait_time() == pytest.approx(40.0)  # the 600 at t=0 must expire (t=60) to get under 1000
    now[0] = 60.0
    assert limiter.wait_time() == 0.0
    limiter.record(2000)  # one call over the whole budget: wait until it has left the window
    now[0] = 61.0
    assert limiter.wait_time() == pytest.approx(59.0)


def test_fields_the_sdk_does_not_know_are_dropped_and_nothing_else():
    import json as _json

    from pydantic import ValidationError

    from medbanana.generation.backends.gemini_transport import parse_response
    from medbanana.generation.testing.gemini_format import response, with_new_fields

    answer = with_new_fields(response([{"text": "Add a small nodule."}], "STOP", ["x" * 40], []))
    for body in (_json.dumps(answer), answer):
        parsed = parse_response(body)
        assert parsed.candidates[0].content.parts[0].text == "Add a small nodule."
        assert parsed.usage_metadata.prompt_token_count == 10
    with pytest.raises(ValidationError):  # a known field of the wrong shape is still an error, also beside new ones
        parse_response(_json.dumps({**answer, "candidates": "not a list"}))
