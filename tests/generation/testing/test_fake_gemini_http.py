"""The fake Gemini server read over plain sockets and urllib: inline images in either base64 alphabet, inline data
that is not base64 answered 400, the echo engine's answers (the editor's image is the source's bytes, the judge wants
two images and answers alike requests alike), and the HTTP framing the server does itself (a body sent in pieces,
pipelined requests, header names in any case, HTTP/1.0 closing, a malformed request line)."""

from __future__ import annotations

import base64
import json
import socket
import time
import urllib.error
import urllib.request

import pytest

from fake_runs import chest_source
from medbanana.generation.prompts import editor_prompt, judge_prompt
from medbanana.generation.records import SourceImage, Task
from medbanana.generation.testing.fake_gemini import FakeGemini

EDITOR = {"responseModalities": ["TEXT", "IMAGE"], "seed": 1}
JUDGE = {"responseMimeType": "application/json"}


@pytest.fixture(scope="module")
def echo():
    with FakeGemini(engine="echo") as server:
        yield server


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> SourceImage:
    return chest_source(tmp_path_factory.mktemp("src"), size=256)


def _task(source: SourceImage) -> Task:
    return Task("cxr_demo", "chest_xray", "Pleural_Effusion", "add", source.path)


def _request(prompt: str, config: dict, *images: str) -> dict:
    parts = [{"inlineData": {"mimeType": "image/jpeg", "data": data}} for data in images] + [{"text": prompt}]
    return {"contents": [{"role": "user", "parts": parts}], "generationConfig": config}


def _post(fake: FakeGemini, request: dict) -> tuple[int, dict]:
    http_request = urllib.request.Request(f"{fake.base_url}/v1beta/models/gemini-x:generateContent",
                                          data=json.dumps(request).encode(), method="POST",
                                          headers={"Content-Type": "application/json", "x-goog-api-key": "k"})
    try:
        with urllib.request.urlopen(http_request, timeout=10) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def _wire(path: str, body: bytes, *headers: str, version: str = "HTTP/1.1") -> bytes:
    lines = [f"POST {path} {version}", "Host: 127.0.0.1", "Content-Type: application/json",
             f"Content-Length: {len(body)}", *headers]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


def _read_answer(reader) -> tuple[int, bytes]:
    status = int(reader.readline().split()[1])
    length = 0
    while (line := reader.readline()) not in (b"\r\n", b""):
        name, _, value = line.decode("latin-1").partition(":")
        length = int(value) if name.strip().lower() == "content-length" else length
    return status, reader.read(length)


def _image_of(answer: dict) -> str:
    return answer["candidates"][0]["content"]["parts"][-1]["inlineData"]["data"]


@pytest.mark.parametrize("encode", [base64.b64encode, base64.urlsafe_b64encode])
def test_the_echo_editor_answers_the_source_in_the_standard_alphabet(echo, source, encode):
    sent = encode(source.data).decode()
    assert {"-", "_"} & set(base64.urlsafe_b64encode(source.data).decode())  # the alphabets differ for this image
    status, answer = _post(echo, _request(editor_prompt(_task(source), "Add."), EDITOR, sent))
    assert status == 200 and _image_of(answer) == base64.b64encode(source.data).decode()


@pytest.mark.parametrize("data", ["abc", "ab!d" * 8, "Zm9v====", "é" * 4, "Zm9v=YmE="])
def test_inline_data_that_is_not_base64_is_a_400(echo, source, data):
    status, answer = _post(echo, _request(editor_prompt(_task(source), "Add."), EDITOR, data))
    assert status == 400 and answer["error"]["status"] == "INVALID_ARGUMENT"
    assert "not base64" in answer["error"]["message"]


def test_the_simulator_decodes_every_image_it_reads_and_refuses_bad_letters(source):
    good = base64.urlsafe_b64encode(source.data).decode()
    with FakeGemini() as simulator:
        status, _ = _post(simulator, _request(judge_prompt(_task(source), "Add."), JUDGE, good, good))
        assert status == 200
        status, answer = _post(simulator, _request(judge_prompt(_task(source), "Add."), JUDGE, good, "ab!d" * 8))
        assert status == 400 and "not base64" in answer["error"]["message"]


def test_the_echo_judge_wants_two_images_and_answers_alike_requests_alike(echo, source):
    image = base64.urlsafe_b64encode(source.data).decode()
    status, answer = _post(echo, _request(judge_prompt(_task(source), "Add."), JUDGE, image))
    assert status == 400 and "1 image(s), not 2" in answer["error"]["message"]

    def verdict(instruction: str) -> dict:
        status, answer = _post(echo, _request(judge_prompt(_task(source), instruction), JUDGE, image, image))
        assert status == 200
        return json.loads(answer["candidates"][0]["content"]["parts"][-1]["text"])

    verdicts = [verdict(f"Add a small effusion, try {i}.") for i in range(40)]
    assert verdict("Add a small effusion, try 7.") == verdicts[7]
    assert 0 < sum(v["qualified"] for v in verdicts) < 40  # accept_rate 0.6: some of each


def test_a_body_sent_in_pieces_and_pipelined_requests_are_read_whole(echo, source):
    body = json.dumps(_request(editor_prompt(_task(source), "Add."), EDITOR,
                               base64.urlsafe_b64encode(source.data).decode())).encode()
    request = _wire("/v1/models/gemini-x:generateContent", body, "X-GOOG-API-KEY: k")
    with socket.create_connection(("127.0.0.1", echo.port), timeout=10) as sock, sock.makefile("rb") as reader:
        for start in range(0, len(request), len(request) // 5 + 1):  # headers and body in five pieces
            sock.sendall(request[start:start + len(request) // 5 + 1])
            time.sleep(0.02)
        status, answer = _read_answer(reader)
        assert status == 200 and _image_of(json.loads(answer)) == base64.b64encode(source.data).decode()
        sock.sendall(request + request)  # two requests in one write, on the same connection
        assert [_read_answer(reader)[0] for _ in range(2)] == [200, 200]
    assert echo.count("editor") >= 3


def test_header_names_in_any_case_reach_the_handler(echo, source):
    echo.reset(["invalid_argument:first=1"])  # its message names the key the request carried
    body = json.dumps(_request(editor_prompt(_task(source), "Add."), EDITOR, "Zm9v")).encode()
    try:
        with socket.create_connection(("127.0.0.1", echo.port), timeout=10) as sock, sock.makefile("rb") as reader:
            sock.sendall(_wire("/v1/models/x:generateContent", body, "X-GOOG-API-KEY: key-in-upper-case"))
            status, answer = _read_answer(reader)
        assert status == 400 and json.loads(answer)["error"]["message"].endswith("for key key-in-upper-case")
    finally:
        echo.reset()


def test_http_1_0_closes_and_a_malformed_request_line_is_a_400(echo, source):
    body = json.dumps({"contents": [{"parts": [{"text": "hello"}]}]}).encode()
    with socket.create_connection(("127.0.0.1", echo.port), timeout=10) as sock, sock.makefile("rb") as reader:
        sock.sendall(_wire("/v1/models/x:generateContent", body, version="HTTP/1.0"))
        assert _read_answer(reader)[0] == 400  # not a medbanana prompt
        assert reader.read() == b""  # and the server closed the connection
    with socket.create_connection(("127.0.0.1", echo.port), timeout=10) as sock, sock.makefile("rb") as reader:
        sock.sendall(b"NONSENSE\r\n\r\n")
        assert b" 400 " in reader.readline()
