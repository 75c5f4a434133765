"""gemini_wire's REST JSON (batch files) and cache keys: the same body and the same cache key as pydantic makes them,
each image's base64 and sha256 made once, and heavy answers read off the event loop."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import threading

import pytest
from google.genai import types

from fake_runs import chest_source
from medbanana.generation.backends.gemini import GeminiEditor, GeminiJudge, GeminiWriter
from medbanana.generation.backends.gemini_transport import RequestCache, rest_request
from medbanana.generation.backends.gemini_wire import InlineData, encode
from medbanana.generation.backends.http import drive
from medbanana.generation.records import EditedImage, SourceImage, Task
from medbanana.generation.testing.fake_gemini import FakeGemini

KEY = "test-key-5e1d7a3c9b2f"


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> SourceImage:
    return chest_source(tmp_path_factory.mktemp("src"), size=128)


@pytest.fixture
def requests(source):
    """The first request of each backend's exchange, as they make them (score with a ground truth too)."""
    task = Task("cxr_demo", "chest_xray", "Pleural_Effusion", "add", source.path)
    options = {"api_key": KEY, "base_url": "http://127.0.0.1:9"}
    writer, editor, judge = GeminiWriter(**options), GeminiEditor(**options), GeminiJudge(**options)
    edited = EditedImage(data=source.data[:-100] + b"\xff\xd9")
    return [next(writer.write_exchange(task, source, [])), next(editor.edit_exchange(task, source, "Add.", 3)),
            next(judge.judge_exchange(task, source, edited, "Add.")),
            next(judge.score_exchange(task, source, edited, "Add.", ground_truth=source))]


def pydantic_body(request) -> list[dict]:
    return [c.model_dump(mode="json", by_alias=True, exclude_none=True) for c in request.contents]


def pydantic_key(request) -> str:
    """The cache key as earlier versions computed it (pydantic dumps, hashlib per call): caches they wrote must
    still answer."""
    contents = []
    for content in request.contents:
        parts = []
        for part in content.parts:
            if part.inline_data is not None:
                rest = part.model_dump(mode="json", exclude_none=True, exclude={"inline_data": {"data"}})
                parts.append({**rest, "inline_data_sha256": hashlib.sha256(part.inline_data.data).hexdigest()})
            else:
                parts.append(part.model_dump(mode="json", exclude_none=True))
        contents.append({"role": content.role, "parts": parts})
    payload = {"model": request.model, "contents": contents,
               "config": request.config.model_dump(mode="json", exclude_none=True)}
    return hashlib.sha256(json.dumps(payload, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def test_the_body_and_the_cache_key_are_those_pydantic_makes(requests):
    inline = InlineData()
    for request in requests:
        body = rest_request(request, inline)
        assert body["contents"] == pydantic_body(request)
        assert json.loads(encode(body)) == body
        assert RequestCache.key(request.model, request.contents, request.config, inline) == pydantic_key(request)


def test_parts_of_other_shapes_go_through_pydantic(source):
    parts = [types.Part(text="thinking", thought=True), types.Part(text="plain"),
             types.Part.from_bytes(data=source.data, mime_type="image/jpeg"),
             types.Part(inline_data=types.Blob(data=b"\x00\x01", mime_type="image/png", display_name="x.png")),
             types.Part(file_data=types.FileData(file_uri="files/abc", mime_type="image/jpeg"))]
    request = type("Request", (), {"model": "m", "contents": [types.Content(role="user", parts=parts)],
                                   "config": types.GenerateContentConfig(temperature=0.5)})()
    assert rest_request(request, InlineData())["contents"] == pydantic_body(request)
    assert RequestCache.key("m", request.contents, request.config, InlineData()) == pydantic_key(request)


def test_base64_is_made_once_per_bytes_object_and_old_entries_go():
    inline = InlineData(max_bytes=3 * (1000 + 1336))  # room for three 1,000-byte images and their base64
    first = bytes(range(256)) * 4
    text = inline.base64(first)
    assert text == base64.urlsafe_b64encode(first).decode() and inline.base64(first) is text
    assert inline.sha256(first) == hashlib.sha256(first).hexdigest()
    equal_copy = bytearray(first)
    assert inline.base64(bytes(equal_copy)) == text  # another object, same content: same text
    others = [bytes([i]) * 1000 for i in range(4)]
    for data in others:
        assert base64.urlsafe_b64decode(inline.base64(data)) == data
    assert len(inline._items) == 3 and inline.base64(first) is not text  # evicted, made again
    assert inline._held <= inline.max_bytes


def test_a_task_hashes_its_source_once_for_the_cache_and_the_server_reads_it(source, tmp_path):
    task = Task("cxr_demo", "chest_xray", "Pleural_Effusion", "add", source.path)
    with FakeGemini() as fake:
        options = {"api_key": KEY, "base_url": fake.base_url, "timeout": 10.0, "cache_dir": tmp_path / "cache"}
        writer = GeminiWriter(**options)
        editor = GeminiEditor(transport=writer.transport)
        instruction = asyncio.run(writer.write(task, source, []))
        digest = writer.transport.inline.sha256(source.data)
        edited = asyncio.run(editor.edit(task, source, instruction.text, seed=1))
        assert writer.transport.inline.sha256(source.data) is digest  # not hashed again for the editor's key
        sent = fake.last_request["contents"][0]["parts"][0]["inlineData"]["data"]
        assert base64.urlsafe_b64decode(sent) == source.data and edited.data[:3] == b"\xff\xd8\xff"


def test_heavy_answers_are_sent_into_the_exchange_on_a_worker_thread():
    def exchange():
        first = yield "one"
        second = yield "two"
        return first, second, threading.get_ident()

    async def call(request):
        return (request, threading.get_ident())

    async def main():
        loop_thread = threading.get_ident()
        light = await drive(exchange(), call, lambda r: None)
        heavy = await drive(exchange(), call, lambda r: None, heavy=lambda answer: answer[0] == "two")
        return loop_thread, light, heavy

    loop_thread, light, heavy = asyncio.run(main())
    assert light[2] == loop_thread and light[:2] == (("one", loop_thread), ("two", loop_thread))
    assert heavy[2] != loop_thread and heavy[:2] == light[:2]  # same answers, the last one read on a thread
