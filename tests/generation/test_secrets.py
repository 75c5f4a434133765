"""No secret is written to disk or printed, even by an endpoint that echoes the request's headers.

A local echo server answers every call with the request's headers (the key with them), as they are and encoded
(base64 and URL-safe base64 with the key at each of the three byte offsets, hex in both cases, percent-encoded), in
its text, thoughts, verdict reason, refusal text, an unknown JSON field and an HTTP 401 or 500 error body. A real
`medbanana generate` runs against it with a unique fake key (Gemini, then the OpenAI-compatible backend), the run is
built into a dataset, and every file under the run (request cache included), every file of the dataset (raw bytes
and the decoded parquet) and everything printed is searched for the key by decoding every base64, hex and
percent-encoded run it holds. `medbanana upload` is run against a Hub stub that echoes the Authorization header in
401/403/500 bodies, and against a closed port. A password in a base URL (`--openai-base-url`, `HF_ENDPOINT`) is in
no file, lock or printed line.
"""

from __future__ import annotations

import base64
import html
import itertools
import json
import re
import textwrap
import socket
import subprocess
import sys
import threading
import time
import uuid
from urllib.parse import quote, unquote, unquote_plus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from conftest import write_jpeg
from service_account import service_account_file
from stub_http import JSONHandler
from medbanana.builder.build import build
from medbanana.cli import main
from medbanana.generation.rundir import layout
from medbanana.generation import secrets
from medbanana.generation.backends.response_cache import ResponseCache
from medbanana.generation.secrets import LONG_RUN, MARK, scrub


# ---------------------------------------------------------------- the scrubber itself

def test_scrub_removes_held_values_and_header_forms(monkeypatch):
    key = f"AIza-unit-{uuid.uuid4().hex}"
    monkeypatch.setenv("GEMINI_API_KEY", key)
    secrets.hold(option := f"opt-{uuid.uuid4().hex}")  # handed over as an option, in no variable
    text = (f"key {key} and {option}; Authorization: Bearer other-token-1; {{'x-goog-api-key': 'other-2'}} "
            f"GET /v1?alt=sse&key=other-3 hf_{'A' * 34} sk-{'b' * 40}")
    clean = scrub(text)
    for secret in (key, option, "other-token-1", "other-2", "other-3", "hf_AAAA", "sk-bbbb"):
        assert secret not in clean
    assert clean.count(MARK) == 7 and "Authorization: " in clean and "alt=sse" in clean
    assert scrub(clean) == clean  # idempotent: scrubbing twice changes nothing


def test_all_clean_says_whether_scrub_would_change_any_text(monkeypatch):
    key = f"AIza-unit-{uuid.uuid4().hex}"
    monkeypatch.setenv("GEMINI_API_KEY", key)
    clean = ["Add a small pneumothorax at the right apex.", "gemini-2.5-pro", ""]
    assert secrets.all_clean(clean)
    for dirty in (f"echo {key}", "Authorization: Bearer tok-123", base64.b64encode(key.encode()).decode()):
        assert scrub(dirty) is not dirty and not secrets.all_clean([*clean, dirty])
    assert not secrets.all_clean(clean, secrets=["gemini-2.5-pro"])  # an extra secret, as scrub takes one


def test_scrub_keeps_json_valid_images_untouched_and_clean_text_identical(monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", "abc")  # too short to be a key: ordinary words must survive
    answer = json.dumps({"reason": "echo: " + json.dumps({"Authorization": "Bearer tok-123", "n": "abc"})})
    assert json.loads(scrub(answer))["reason"] == 'echo: {"Authorization": "[redacted]", "n": "abc"}'
    # base64 of image bytes may hold any token shape by chance; it is a run the token patterns stay off
    image = base64.b64encode(b"\xff\xd8" * 10).decode() + "AIza" + "x" * 35 + "hf_" + "y" * 30
    assert scrub(image) is image
    text = "Add a small pneumothorax at the right apex."
    assert scrub(text) is text


def test_scrub_removes_every_encoding_of_a_held_value(monkeypatch):
    key = f"AIza-unit/SECRET+{uuid.uuid4()}="  # characters percent-encoding changes, and a base64 alphabet's own
    monkeypatch.setenv("GEMINI_API_KEY", key)
    text = f"key {key} " + encoded(f"x-goog-api-key: {key}") + " " + encoded(f"{{'Authorization': 'Bearer {key}'}}")
    assert {"as it is", "percent-encoded", "hex", "base64"} == set(leaks(key, text))  # the detector sees them all
    clean = scrub(text)
    assert leaks(key, clean) == [] and clean.count(MARK) == 1 + 2 * 10  # each form once
    assert scrub(clean) == clean and secrets.holds_secret(text) and not secrets.holds_secret(clean)


def test_scrub_removes_a_urls_user_info_and_a_held_urls_password(monkeypatch):
    password = f"pa55:{uuid.uuid4().hex[:12]}/x"
    url = f"http://medbanana:{quote(password, safe='')}@127.0.0.1:8000/v1"
    assert scrub(f"cannot reach {url}; retry") == "cannot reach http://[redacted]@127.0.0.1:8000/v1; retry"
    assert scrub(json.dumps({"u": "https://tok@hf.example/x"})) == json.dumps({"u": "https://[redacted]@hf.example/x"})
    monkeypatch.setenv("HF_ENDPOINT", url)  # its password is a secret wherever it shows, encoded or not
    basic = base64.b64encode(f"medbanana:{password}".encode()).decode()
    clean = scrub(f"password {password}, Basic auth header echoed as {basic}, {encoded(password)}")
    assert leaks(password, clean) == [] and basic not in clean


def test_scrub_removes_wrapped_base32_and_html_entity_forms(monkeypatch):
    key = f"AIza-unit/SECRET+{uuid.uuid4()}="
    monkeypatch.setenv("GEMINI_API_KEY", key)
    wrapped_json = json.dumps("\r\n".join(textwrap.wrap(base64.b64encode(f"k={key}".encode()).decode(), 20)))
    text = f"echo {encoded_more(f'x-goog-api-key: {key}')} and, JSON-escaped, {wrapped_json}"
    assert {"base64, line-wrapped", "base32", "as it is, HTML entities"} <= set(leaks(key, text))
    clean = scrub(text)
    assert leaks(key, clean) == [] and scrub(clean) == clean
    plain = "Tom &amp; Jerry &#x263A;\nline two\nABCDEF\nGHIJ \\n QUJD"  # entities and wrapped runs without a key
    assert scrub(plain) is plain


# ---------------------------------------------------------------- the echo server

class Echo(JSONHandler):
    """Gemini generateContent and OpenAI chat completions, each answer quoting the request's headers.

    Calls are counted per role (runs use --concurrency 1, so the order is fixed): the writer's k-th instruction says
    `variant k % 3`, which the Gemini editor reads back: 0 refuses (SAFETY, text quoting the headers), 1 answers
    text only (EditRefused text_only quotes it), 2 returns the source image. The judge's n-th verdict qualifies
    when n % 3 == 1; the writer's `fail_writer`-th call (the judge's `fail_judge`-th) is an HTTP 401 whose body quotes
    the headers."""

    def do_POST(self):
        state = self.server.state
        body = self.rfile.read(int(self.headers["Content-Length"]))
        if self.path == "/token":  # an OAuth token endpoint (a service account's key file points ADC here)
            return self._json({"access_token": state["token"], "expires_in": 3600, "token_type": "Bearer"})
        body, headers = json.loads(body), self.headers
        state["signed"].add((self.path.partition("/models/")[0], headers["Authorization"]))
        bare = (headers["Authorization"] or "").rpartition(" ")[2]  # the credential alone, no header name before it
        # the credentials first: refusal messages quote only the start of an answer
        credentials = f"x-goog-api-key: {headers['x-goog-api-key']} Authorization: {headers['Authorization']} {bare}"
        echo = f"{credentials} {encoded(credentials)} {encoded_more(credentials)} request headers: " \
               f"{dict(headers)} raw: {str(headers)!r} path: {self.path}"
        openai = self.path.endswith("/chat/completions")
        role = _openai_role(body) if openai else _gemini_role(body)
        n = state["calls"][role] = state["calls"].get(role, -1) + 1
        if n == state.get(f"fail_{role}"):  # 401, or 500 with every header encoded first
            status, text = state["fail_status"], f"{encoded(str(headers))} {echo}"
            return self._json({"error": {"code": status, "message": f"bad key; {text}", "status": "UNAUTHENTICATED"
                                         if status == 401 else "INTERNAL"}}, status)
        if role == "editor":
            return self._gemini(*_edit(body, echo), echo)
        if role == "writer":
            text, thought = f"Add a small pneumothorax, variant {n % 3}. {echo}", f"Thinking. {echo}"
        else:
            text, thought = json.dumps({"has_disease": True, "structure_reasonable": True, "looks_realistic": True,
                                        "fidelity_preserved": True, "qualified": n % 3 == 1,
                                        "reason": f"Checked. {echo}"}), f"Compared. {echo}"
        if openai:
            return self._json({"id": f"echo-{n}", "object": "chat.completion", "created": 0, "model": body["model"],
                               "choices": [{"index": 0, "finish_reason": "stop", "message": {
                                   "role": "assistant", "content": text, "reasoning_content": thought}}],
                               "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
                               "echo": echo})
        self._gemini([{"text": thought, "thought": True}, {"text": text}], "STOP", echo)

    def _gemini(self, parts: list[dict], finish: str, echo: str):
        long_echo = "." * LONG_RUN + echo  # past the length up to which the body's search looks for encoded forms
        self._json({"candidates": [{"content": {"role": "model", "parts": parts}, "finishReason": finish,
                                    "finishMessage": long_echo, "index": 0}],
                    "usageMetadata": {"promptTokenCount": 1}, "modelVersion": long_echo})



def encoded(text: str) -> str:
    """`text` in each encoding an echo may use: base64 (standard and URL-safe) after 0, 1 and 2 bytes of something
    else (so that every secret in it lies at each byte offset of a base64 stream), hex (lower, upper),
    percent-encoded (`quote`, every byte as %XX)."""
    data = text.encode()
    forms = []
    for pad in range(3):
        forms += [base64.b64encode(b"#" * pad + data).decode(), base64.urlsafe_b64encode(b"#" * pad + data).decode()]
    forms += [data.hex(), data.hex().upper(), quote(text, safe=""), "".join(f"%{b:02X}" for b in data)]
    return " ".join(forms)


def encoded_more(text: str) -> str:
    """`text` in the encodings `encoded` leaves out: base64 wrapped at 76 characters with CR LF (MIME) after 0, 1
    and 2 bytes of something else, base32 (upper and lower case) after 0 to 4 bytes, HTML character references
    (decimal for every character; hexadecimal for every other one, the rest as it is)."""
    data = text.encode()
    forms = ["\r\n".join(textwrap.wrap(base64.b64encode(b"#" * pad + data).decode(), 76)) for pad in range(3)]
    for pad in range(5):
        b32 = base64.b32encode(b"#" * pad + data).decode()
        forms += [b32, b32.lower()]
    forms.append("".join(f"&#{ord(c)};" for c in text))
    forms.append("".join(f"&#x{ord(c):x};" if i % 2 else html.escape(c) for i, c in enumerate(text)))
    return " ".join(forms)


def leaks(secret: str, text: str) -> list[str]:
    """The encodings in which `text` still holds `secret`, found by decoding (not by encoding the secret the way
    the scrubber does): the text, its percent-decoding, every hex run at both nibble offsets, every base64 run
    (either alphabet) at each of its four character offsets, every base32 run at each of its eight, each of these
    also with line breaks (CR LF, LF, or their JSON escapes) removed and with HTML character references decoded."""
    joined = re.sub(r"\r?\n|\\r\\n|\\n", "", text)
    unescaped = html.unescape(text)
    found = _leaks(secret, text)
    for variant, name in ((joined, "line-wrapped"), (unescaped, "HTML entities")):
        found += [f"{form}, {name}" for form in _leaks(secret, variant) if form not in found]
    return found


def _leaks(secret: str, text: str) -> list[str]:
    data, found = secret.encode(), []
    if secret in text:
        found.append("as it is")
    if secret in unquote(text) or secret in unquote_plus(text):
        found.append("percent-encoded")
    for run in re.findall(r"[0-9A-Fa-f]{16,}", text):
        if any(data in bytes.fromhex(run[i:][:(len(run) - i) // 2 * 2]) for i in (0, 1)):
            found.append("hex")
    for run in re.findall(r"[A-Za-z0-9+/_-]{12,}", text):
        run = run.replace("-", "+").replace("_", "/")
        if any(data in base64.b64decode(run[i:][:(len(run) - i) // 4 * 4]) for i in range(4)):
            found.append("base64")
    for run in re.findall(r"[A-Z2-7]{16,}|[a-z2-7]{16,}", text):
        run = run.upper()
        if any(data in base64.b32decode(run[i:][:(len(run) - i) // 8 * 8]) for i in range(8)):
            found.append("base32")
    return found


def _edit(body: dict, echo: str) -> tuple[list[dict], str]:
    """The editor's parts and finish reason for the variant its instruction names."""
    parts = body["contents"][0]["parts"]
    variant = int(re.search(r"variant (\d)", " ".join(p.get("text", "") for p in parts))[1])
    answer = [{"text": f"I will not. {echo}"}]
    if variant == 2:  # the source image back, as the edit
        source = next(p["inlineData"] for p in parts if "inlineData" in p)
        answer.append({"inlineData": {"mimeType": "image/jpeg", "data": source["data"]}})
    return answer, "SAFETY" if variant == 0 else "STOP"


def _gemini_role(body: dict) -> str:
    config = body.get("generationConfig") or {}
    if "IMAGE" in config.get("responseModalities", []):
        return "editor"
    return "judge" if config.get("responseMimeType") == "application/json" else "writer"


def _openai_role(body: dict) -> str:
    content = body["messages"][0]["content"]
    return "judge" if sum(part["type"] == "image_url" for part in content) == 2 else "writer"


@pytest.fixture
def echo():
    server = ThreadingHTTPServer(("127.0.0.1", 0), Echo)
    server.state = {"calls": {}, "fail_writer": -1, "fail_judge": -1, "fail_status": 401, "token": "", "signed": set()}
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server
    server.shutdown()
    server.server_close()


@pytest.fixture
def sources(tmp_path) -> Path:
    for i in range(3):
        write_jpeg(tmp_path / "sources" / "MIMIC_secret" / "normal" / f"n{i}.jpeg", i, size=64)
    return tmp_path / "sources"


def _generate_and_build(argv: list[str], run_dir: Path, dataset: Path, capfd) -> tuple[str, dict]:
    """`medbanana generate` then `medbanana build`; returns what both printed and the run's records by source."""
    assert main(["generate", *argv, "--out", str(run_dir), "--diseases", "Pneumothorax", "--directions", "add",
                 "--concurrency", "1", "--max-attempts", "1", "--timeout", "20", "-q"]) == 3  # one task api_failed
    assert main(["build", str(run_dir), "--out", str(dataset), "-q"]) == 0
    captured = capfd.readouterr()
    records = {}
    for _, _, folder in layout.find_output_dirs(run_dir):
        for record in json.loads((folder / layout.ALL_CONVERSATIONS).read_text()).values():
            records[record["image"]] = record
    return captured.out + captured.err, records


def _parquet_text(dataset: Path) -> str:
    """Every row of every parquet file, decoded: strings as they are, bytes as latin-1 (image metadata too)."""
    rows = [row for path in sorted(dataset.rglob("*.parquet")) for row in pq.read_table(path).to_pylist()]
    assert rows
    return json.dumps(rows, default=lambda v: v.decode("latin-1") if isinstance(v, bytes) else str(v))


def _assert_nowhere(secret: str, printed: str, *folders: Path) -> None:
    """Not in what was printed, nor in any file under `folders` (read as bytes, each byte a character), nor in a
    decoded parquet row: neither as it is nor encoded."""
    assert leaks(secret, printed) == []
    files = [p for folder in folders for p in folder.rglob("*") if p.is_file()]
    assert len(files) > 10
    assert {p: found for p in files if (found := leaks(secret, p.read_bytes().decode("latin-1")))} == {}
    for dataset in folders:
        if any(dataset.rglob("*.parquet")):
            assert leaks(secret, _parquet_text(dataset)) == []


@pytest.mark.slow
@pytest.mark.parametrize("status", [401, 500])
def test_gemini_run_and_dataset_hold_no_key_from_an_echoing_endpoint(echo, sources, tmp_path, monkeypatch, capfd,
                                                                      status):
    key = f"AIza-test/SECRET+{uuid.uuid4()}="  # characters that percent-encoding changes
    monkeypatch.delenv("GOOGLE_API_KEY", raising=False)
    monkeypatch.setenv("GEMINI_API_KEY", key)
    monkeypatch.setenv("GOOGLE_GEMINI_BASE_URL", f"http://127.0.0.1:{echo.server_port}")
    # the third task's second call: its two predecessors took three writer calls each, and its own first round was
    # refused; the answers of that round stay cached (an api_failed task's, for --retry-failed)
    echo.state["fail_writer"] = 7
    echo.state["fail_status"] = status
    run_dir, dataset = tmp_path / "run", tmp_path / "dataset"
    printed, records = _generate_and_build(["--sources", str(sources), "--backend", "gemini", "--max-rounds", "3"],
                                           run_dir, dataset, capfd)
    assert [records[f"n{i}.jpeg"]["status"] for i in range(3)] == ["failed", "success", "api_failed"]
    rounds = records["n0.jpeg"]["rounds"]  # the endpoint's text reached every field it could, scrubbed
    assert rounds[0]["edit_result"]["error"].startswith("safety: ") and MARK in rounds[0]["edit_result"]["error"]
    assert rounds[1]["edit_result"]["error"].startswith("text_only: ") and MARK in rounds[1]["edit_result"]["error"]
    assert MARK in rounds[2]["verification"]["reason"] and MARK in rounds[2]["generate_prompt"]["thinking_summary"]
    assert records["n2.jpeg"]["error"]["kind"] == {401: "unauthenticated", 500: "server_error"}[status]
    assert MARK in records["n2.jpeg"]["error"]["message"]
    cached = list(ResponseCache(run_dir / "medbanana-cache" / "gemini").answers().values())
    assert cached and all(MARK in text for text in cached)  # each answer echoed the headers: each was scrubbed
    parquet = _parquet_text(dataset)
    assert "request headers" in parquet and MARK in parquet and key not in parquet
    _assert_nowhere(key, printed, run_dir, dataset)


@pytest.mark.slow
@pytest.mark.parametrize("status", [401, 500])
def test_openai_run_and_dataset_hold_no_key_from_an_echoing_endpoint(echo, sources, tmp_path, monkeypatch, capfd,
                                                                      status):
    key = f"sk-test/SECRET+{uuid.uuid4()}="
    monkeypatch.setenv("OPENAI_API_KEY", key)
    # the third task's judge: the first succeeds in round 2, the second fails after 2 rounds; the third task's
    # writer answer stays cached (an api_failed task's, for --retry-failed)
    echo.state["fail_judge"] = 4
    echo.state["fail_status"] = status
    run_dir, dataset = tmp_path / "run", tmp_path / "dataset"
    argv = ["--sources", str(sources), "--backend", "simulator", "--writer", "openai", "--judge", "openai",
            "--openai-base-url", f"http://127.0.0.1:{echo.server_port}/v1", "--openai-model", "echo",
            "--max-rounds", "2"]
    printed, records = _generate_and_build(argv, run_dir, dataset, capfd)
    assert [records[f"n{i}.jpeg"]["status"] for i in range(3)] == ["success", "failed", "api_failed"]
    last = records["n0.jpeg"]["rounds"][-1]
    assert MARK in last["instruction"] and MARK in last["verification"]["reason"]
    assert MARK in last["generate_prompt"]["thinking_summary"] and MARK in records["n2.jpeg"]["error"]["message"]
    cached = [json.loads(t) for t in ResponseCache(run_dir / "medbanana-cache" / "openai").answers().values()]
    assert cached and all(MARK in c["echo"] and MARK in c["choices"][0]["message"]["content"] for c in cached)
    parquet = _parquet_text(dataset)
    assert "request headers" in parquet and MARK in parquet and key not in parquet
    _assert_nowhere(key, printed, run_dir, dataset)


@pytest.mark.slow
def test_vertex_run_and_dataset_hold_no_access_token_it_fetched_from_an_echoing_endpoint(echo, sources, tmp_path,
                                                                                          monkeypatch, capfd):
    """Vertex AI on Application Default Credentials: the SDK signs calls with an OAuth access token google.auth
    fetches from the key file's token endpoint; the endpoint echoes it with no `Authorization:` before it, in its
    answers and in an HTTP 500's body, as it is and encoded."""
    token = f"ya29.test/SECRET+{uuid.uuid4()}="
    base_url = f"http://127.0.0.1:{echo.server_port}"
    for name in ("GEMINI_API_KEY", "GOOGLE_API_KEY", "GOOGLE_CLOUD_PROJECT", "GOOGLE_CLOUD_LOCATION"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(service_account_file(tmp_path, f"{base_url}/token")))
    monkeypatch.setenv("GOOGLE_VERTEX_BASE_URL", base_url)
    echo.state.update(token=token, fail_writer=6, fail_status=500)  # the third task's first call, as above
    run_dir, dataset = tmp_path / "run", tmp_path / "dataset"
    printed, records = _generate_and_build(["--sources", str(sources), "--vertex-project", "proj-echo",
                                            "--vertex-location", "us-central1", "--max-rounds", "3"],
                                           run_dir, dataset, capfd)
    assert echo.state["signed"] == {("/v1beta1/projects/proj-echo/locations/us-central1/publishers/google",
                                     f"Bearer {token}")}
    assert [records[f"n{i}.jpeg"]["status"] for i in range(3)] == ["failed", "success", "api_failed"]
    assert records["n2.jpeg"]["error"]["kind"] == "server_error" and MARK in records["n2.jpeg"]["error"]["message"]
    _assert_nowhere(token, printed, run_dir, dataset)


class QuietEcho(JSONHandler):
    """A Gemini writer and judge whose text is clean: the key comes back only deep inside a finishMessage and a
    modelVersion over LONG_RUN characters long, base64 at byte offset 1, base32, MIME-wrapped and as entities."""

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        key = self.headers["x-goog-api-key"]
        hidden = "." * LONG_RUN + " " + base64.b64encode(b"#" + key.encode()).decode() + " " + encoded_more(key)
        judge = (body.get("generationConfig") or {}).get("responseMimeType") == "application/json"
        if judge and next(self.server.judged) >= 2:  # the third task ends api_failed: its writer's answer stays cached
            return self._json({"error": {"code": 500, "message": "down", "status": "INTERNAL"}}, 500)
        text = json.dumps({"has_disease": True, "structure_reasonable": True, "looks_realistic": True,
                           "fidelity_preserved": True, "qualified": True, "reason": "Checked."}) if judge else \
            "Add a small right apical pneumothorax."
        self._json({"candidates": [{"content": {"role": "model", "parts": [{"text": text}]}, "finishReason": "STOP",
                                    "finishMessage": hidden, "index": 0}],
                    "usageMetadata": {"promptTokenCount": 1}, "modelVersion": hidden})


@pytest.mark.slow
def test_a_key_only_in_long_answer_fields_reaches_no_file(sources, tmp_path, monkeypatch, capfd):
    key = f"AIza-test/SECRET+{uuid.uuid4()}="
    server = ThreadingHTTPServer(("127.0.0.1", 0), QuietEcho)
    server.judged = itertools.count()
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.delenv("GOOGLE_API_KEY", raising=False)
    monkeypatch.setenv("GEMINI_API_KEY", key)
    monkeypatch.setenv("GOOGLE_GEMINI_BASE_URL", f"http://127.0.0.1:{server.server_port}")
    run_dir, dataset = tmp_path / "run", tmp_path / "dataset"
    try:
        assert main(["generate", "--sources", str(sources), "--out", str(run_dir), "--backend", "gemini", "--editor",
                     "simulator", "--diseases", "Pneumothorax", "--directions", "add", "--max-rounds", "1",
                     "--concurrency", "1", "--max-attempts", "1", "--timeout", "20", "-q"]) == 3
    finally:
        server.shutdown()
        server.server_close()
    assert main(["build", str(run_dir), "--out", str(dataset), "-q"]) == 0
    cached = list(ResponseCache(run_dir / "medbanana-cache" / "gemini").answers().values())
    assert cached and all(MARK in text for text in cached)  # each answer held the key: each was scrubbed
    captured = capfd.readouterr()
    _assert_nowhere(key, captured.out + captured.err, run_dir, dataset)


# ---------------------------------------------------------------- medbanana upload

class RefusingHub(BaseHTTPRequestHandler):
    """Every request refused with `code`, the request's headers (the token with them) in the body and a header."""

    def _refuse(self):
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        echo = f"refused; you sent Authorization: {self.headers['Authorization']}, all: {dict(self.headers)}"
        data = json.dumps({"error": echo}).encode()
        self.send_response(self.server.code)
        self.send_header("Content-Type", "application/json")
        self.send_header("X-Error-Message", echo)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_POST = do_PUT = _refuse

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def dataset(builder_original_run, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("upload") / "ds"
    build([builder_original_run], out, configs=["conversations"], quiet=True)
    return out


def _upload(dataset: Path, capsys) -> tuple[int, str, str]:
    code = main(["upload", str(dataset), "my-org/medbanana-50k"])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.parametrize("status", [401, 403, 500])
def test_upload_prints_one_line_without_the_token_when_the_hub_echoes_it(dataset, status, monkeypatch, capsys):
    token = f"hf_test_SECRET_{uuid.uuid4().hex}"
    server = ThreadingHTTPServer(("127.0.0.1", 0), RefusingHub)
    server.code = status
    threading.Thread(target=server.serve_forever, daemon=True).start()
    endpoint = f"http://127.0.0.1:{server.server_port}"
    monkeypatch.setenv("HF_ENDPOINT", endpoint)
    monkeypatch.setenv("HF_TOKEN", token)
    try:
        code, out, err = _upload(dataset, capsys)
    finally:
        server.shutdown()
        server.server_close()
    assert code == 1 and out == ""
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert f"answered HTTP {status}" in err and endpoint in err and "my-org/medbanana-50k" in err
    assert MARK in err and token not in err  # the echo is quoted, the token is not


def test_upload_scrubs_a_token_stored_by_hf_auth_login(dataset, monkeypatch, capsys, tmp_path):
    """A token from the token file is in no variable and has no known shape: scrub learns it from upload."""
    import huggingface_hub.constants

    token = f"stored-SECRET-{uuid.uuid4()}"
    (tmp_path / "token").write_text(token)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_TOKEN_PATH", str(tmp_path / "token"))
    server = ThreadingHTTPServer(("127.0.0.1", 0), RefusingHub)
    server.code = 403
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{server.server_port}")
    try:
        code, out, err = _upload(dataset, capsys)
    finally:
        server.shutdown()
        server.server_close()
    assert code == 1 and "HTTP 403" in err and token not in out + err


def test_upload_to_a_closed_port_is_one_clear_line(dataset, monkeypatch, capsys):
    with socket.socket() as probe:  # a port that was free a moment ago: nothing listens on it
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    endpoint = f"http://127.0.0.1:{port}"
    monkeypatch.setenv("HF_ENDPOINT", endpoint)
    monkeypatch.setenv("HF_TOKEN", f"hf_test_SECRET_{uuid.uuid4().hex}")
    code, out, err = _upload(dataset, capsys)
    assert code == 1 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err
    assert lines[0].startswith("medbanana upload: error: creating the dataset repository my-org/medbanana-50k failed")
    assert f"could not reach {endpoint}" in lines[0] and "check HF_ENDPOINT" in lines[0]


def test_an_unexpected_error_prints_its_traceback_scrubbed(monkeypatch, capsys):
    """A failure nobody foresaw still prints a traceback to debug from, with the secrets the process holds removed."""
    from medbanana import cli
    from medbanana.generation.commands import taxonomy

    key = "AIza-test-SECRET-traceback-0123456789"
    monkeypatch.setenv("GEMINI_API_KEY", key)

    def explode(args):
        raise KeyError(f"the endpoint answered: x-goog-api-key: {key}")

    monkeypatch.setattr(taxonomy, "cmd_taxonomy", explode)  # the parser binds the command when main() builds it
    assert cli.main(["taxonomy"]) == 1
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and "KeyError" in err
    assert key not in err and "[redacted]" in err


# ---------------------------------------------------------------- a password in a base URL

def _closed_port() -> int:
    with socket.socket() as probe:  # a port that was free a moment ago: nothing listens on it
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_a_password_in_the_openai_base_url_is_refused_without_printing_it(sources, tmp_path, capsys):
    """A base URL holds no user-info (generation/destinations.py): refused in one line, before any connection."""
    password = f"pw-SECRET-{uuid.uuid4().hex}"
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen(8)
        listening.setblocking(False)
        url = f"http://medbanana:{password}@127.0.0.1:{listening.getsockname()[1]}/v1"
        assert main(["generate", "--sources", str(sources), "--out", str(tmp_path / "run"), "--backend", "simulator",
                     "--writer", "openai", "--openai-base-url", url, "--openai-model", "echo", "--limit", "1"]) == 2
        with pytest.raises(BlockingIOError):  # no connection waits
            listening.accept()
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "no user name or password" in err
    assert leaks(password, err) == [] and not (tmp_path / "run").exists()


@pytest.mark.slow
def test_a_key_in_the_openai_base_urls_query_is_in_no_file_lock_or_printed_line(sources, tmp_path):
    """A real `medbanana generate` process (the lock records its command line while it runs) against a port that
    takes connections and never answers: the lock file is read while the run waits, and is gone after it."""
    password = f"pw-SECRET-{uuid.uuid4().hex}"
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)  # connections wait in the backlog, unanswered, until the call's --timeout
        url = f"http://127.0.0.1:{silent.getsockname()[1]}/v1?key={password}"
        run_dir = tmp_path / "run"
        running = subprocess.Popen([sys.executable, "-m", "medbanana", "generate", "--sources", str(sources), "--out",
                                    str(run_dir), "--diseases", "Pneumothorax", "--directions", "add", "--backend",
                                    "simulator", "--writer", "openai", "--openai-base-url", url, "--openai-model",
                                    "echo", "--max-attempts", "1", "--timeout", "5", "--limit", "1"],
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        lock = None
        while lock is None and running.poll() is None:  # the holder's line, once it is written
            try:
                lock = json.loads((run_dir / "medbanana.lock").read_text())
            except (OSError, ValueError):
                time.sleep(0.02)
        stdout, stderr = running.communicate(timeout=120)
    assert running.returncode == 3, stderr  # the one task api_failed: nothing answers there
    assert lock is not None, "the run ended before its lock file could be read"
    assert "--openai-base-url 'http://127.0.0.1:" in lock["command"] and "?key=[redacted]" in lock["command"]
    assert not (run_dir / "medbanana.lock").exists()  # removed when the run ended
    [record] = [r for _, _, folder in layout.find_output_dirs(run_dir)
                for r in json.loads((folder / layout.ALL_CONVERSATIONS).read_text()).values()]
    assert record["status"] == "api_failed" and record["error"]["message"]
    assert leaks(password, stdout + stderr) == []
    assert {p: f for p in run_dir.rglob("*") if p.is_file() and (f := leaks(password, p.read_text("latin-1")))} == {}


def test_a_password_in_hf_endpoint_is_not_printed(dataset, monkeypatch, capsys):
    password = f"pw-SECRET-{uuid.uuid4().hex}"
    monkeypatch.setenv("HF_ENDPOINT", f"http://medbanana:{password}@127.0.0.1:{_closed_port()}")
    monkeypatch.setenv("HF_TOKEN", f"hf_test_SECRET_{uuid.uuid4().hex}")
    code, out, err = _upload(dataset, capsys)
    assert code == 1 and "could not reach http://[redacted]@127.0.0.1:" in err
    assert leaks(password, out + err) == []
