"""Patient data goes only where the user said, through the real CLI against real servers on this machine.

Sources are prepared with `medbanana prepare folders --data-use CLASS` (their manifest records the class). The
Gemini Developer API is `cloud` whatever its base URL, so the fake Gemini server on 127.0.0.1 stands for it
honestly; a remote OpenAI-compatible endpoint is a TCP server on this machine's non-loopback address (192.0.2.x
here), which counts the connections it is offered: zero means nothing was sent. A redirecting endpoint sends every
request on to a second port (another origin, as another host would be), which records what reaches it.
"""

from __future__ import annotations

import ipaddress
import json
import socket
import threading
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from fake_runs import mimic_sources
from service_account import service_account_file
from medbanana.cli import main
from medbanana.generation.destinations import sources_data_use
from medbanana.generation.rundir import layout
from medbanana.generation.testing.fake_gemini import FakeGemini
from medbanana.generation.testing.fake_openai import FakeOpenAI

ONE_TASK = ["--diseases", "Pneumothorax", "--directions", "add", "--limit", "1", "--max-rounds", "1",
            "--max-attempts", "1", "--timeout", "20", "--concurrency", "1", "-q"]


@pytest.fixture(autouse=True)
def no_endpoint_variables(monkeypatch):
    for name in ("GEMINI_API_KEY", "GOOGLE_API_KEY", "GOOGLE_GEMINI_BASE_URL", "GOOGLE_VERTEX_BASE_URL",
                 "GOOGLE_GENAI_USE_VERTEXAI", "GOOGLE_CLOUD_PROJECT", "GOOGLE_CLOUD_LOCATION", "OPENAI_BASE_URL",
                 "OPENAI_API_KEY", "GOOGLE_APPLICATION_CREDENTIALS"):
        monkeypatch.delenv(name, raising=False)


def prepared(tmp_path: Path, *data_use: str, name: str = "MIMIC_dest") -> Path:
    """Sources made by `prepare folders` (one normal and one Pneumothorax image), with `--data-use` as given."""
    raw = mimic_sources(tmp_path / "raw", name, per_class=1)
    out = tmp_path / "sources"
    assert main(["prepare", "folders", str(raw), "--out", str(out), "--size", "128", "-q", *data_use]) == 0
    return out


class Counting:
    """A TCP server that accepts connections, counts them and closes them (nothing is answered)."""

    def __init__(self, host: str):
        self.sock = socket.create_server((host, 0))
        self.sock.settimeout(0.2)
        self.port, self.accepted, self._stop = self.sock.getsockname()[1], 0, threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self):
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            self.accepted += 1
            conn.close()

    def close(self):
        self._stop.set()
        self._thread.join()
        self.sock.close()


def non_loopback_address() -> str | None:
    """An address of this machine that is not loopback (a UDP connect sends nothing), or None."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.1", 9))
        except OSError:
            return None
        address = probe.getsockname()[0]
    return None if ipaddress.ip_address(address).is_loopback else address


def _err_lines(capsys) -> list[str]:
    return capsys.readouterr().err.strip().splitlines()


# ---------------------------------------------------------------- data-use classes in the manifest

def test_prepare_records_each_images_data_use_class(tmp_path, capsys):
    credentialed = prepared(tmp_path / "a", "--data-use", "credentialed")
    assert "data use: credentialed" in capsys.readouterr().out
    rows = [json.loads(line) for line in (credentialed / "prepare_manifest.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and {(r["data_use"], r["licence"]) for r in rows} == {("credentialed", None)}
    assert sources_data_use(credentialed)["MIMIC_dest"].kind == "credentialed"
    assert sources_data_use(credentialed / "MIMIC_dest")["MIMIC_dest"].kind == "credentialed"  # one dataset folder

    unknown = prepared(tmp_path / "b")
    assert sources_data_use(unknown)["MIMIC_dest"].kind == "unknown"
    raw = tmp_path / "b" / "raw"
    # a different class for images already prepared, open without a licence, a class for a kind that has its own
    for argv in (["folders", str(raw), "--out", str(unknown), "--data-use", "open", "--licence", "CC BY 4.0"],
                 ["folders", str(raw), "--out", str(tmp_path / "c"), "--data-use", "open"],
                 ["mimic-cxr", str(raw), "--out", str(tmp_path / "d"), "--data-use", "open"]):
        capsys.readouterr()
        assert main(["prepare", *argv, "--size", "128", "-q"]) == 2
        err = _err_lines(capsys)
        assert len(err) == 1 and ("--data-use" in err[0] or "--licence" in err[0]), err
    assert not (tmp_path / "c").exists() and not (tmp_path / "d").exists()
    opened = prepared(tmp_path / "e", "--data-use", "open", "--licence", "CC BY 4.0")
    assert sources_data_use(opened)["MIMIC_dest"].licences == ("CC BY 4.0",)


# ---------------------------------------------------------------- the gate

def test_credentialed_sources_to_the_gemini_developer_api_are_refused_before_any_request(tmp_path, monkeypatch,
                                                                                          capsys):
    sources = prepared(tmp_path, "--data-use", "credentialed")
    capsys.readouterr()
    with FakeGemini(engine="echo") as fake:
        monkeypatch.setenv("GEMINI_API_KEY", "dest-key-0123456789")
        monkeypatch.setenv("GOOGLE_GEMINI_BASE_URL", fake.base_url)  # on loopback, yet the Gemini API: cloud
        code = main(["generate", "--sources", str(sources), "--out", str(tmp_path / "run"), "--backend", "gemini",
                     *ONE_TASK])
        calls = list(fake.calls)
    err = _err_lines(capsys)
    assert code == 2 and calls == [] and not (tmp_path / "run").exists()
    assert len(err) == 1, err
    assert "credentialed images (MIMIC_dest)" in err[0] and f"127.0.0.1:{fake.port}" in err[0]
    assert "(gemini, cloud)" in err[0] and "local or cloud-no-retention" in err[0] and "Nothing was sent" in err[0]


def test_credentialed_sources_to_a_remote_url_are_refused_unless_attested(tmp_path, capsys):
    address = non_loopback_address()
    if address is None:
        pytest.skip("this machine has no non-loopback address to stand for a remote endpoint")
    sources = prepared(tmp_path, "--data-use", "credentialed")
    remote = Counting(address)
    argv = ["generate", "--sources", str(sources), "--out", str(tmp_path / "run"), "--backend", "simulator",
            "--writer", "openai", "--judge", "openai", "--openai-model", "m",
            "--openai-base-url", f"https://{address}:{remote.port}/v1", *ONE_TASK]
    try:
        capsys.readouterr()
        assert main(argv) == 2
        err = _err_lines(capsys)
        assert remote.accepted == 0 and not (tmp_path / "run").exists()
        assert len(err) == 1 and "credentialed images" in err[0] and f"{address}:{remote.port} (openai, cloud)" in err[0]

        # attested zero-retention: the gate lets it through (the endpoint is then reached: it hangs up)
        assert main([*argv, "--attest-endpoint", "zero-retention"]) == 3
        assert remote.accepted >= 1
    finally:
        remote.close()
    recorded = json.loads((tmp_path / "run" / layout.RUN_CONFIG).read_text())["destinations"]
    [openai] = [d for d in recorded if d["backend"] == "openai"]
    assert (openai["class"], openai["attested"], openai["data_use"]) == ("cloud-no-retention", True, ["credentialed"])


@pytest.mark.slow
def test_credentialed_sources_go_to_a_loopback_server_and_are_recorded_in_run_card_and_eval(tmp_path, monkeypatch,
                                                                                           capsys):
    sources = prepared(tmp_path, "--data-use", "credentialed")
    run = tmp_path / "run"
    with FakeOpenAI() as fake:
        capsys.readouterr()
        code = main(["generate", "--sources", str(sources), "--out", str(run), "--backend", "simulator",
                     "--writer", "openai", "--judge", "openai", "--openai-model", "m",
                     "--openai-base-url", fake.base_url, *ONE_TASK])
        assert code in (0, 3) and fake.count() >= 2
    assert "warning" not in capsys.readouterr().err
    recorded = {d["backend"]: d for d in json.loads((run / layout.RUN_CONFIG).read_text())["destinations"]}
    assert recorded["openai"]["class"] == "local" and recorded["openai"]["roles"] == ["writer", "judge"]
    assert recorded["openai"]["where"] == f"127.0.0.1:{fake.port}" and recorded["openai"]["data_use"] == ["credentialed"]
    assert recorded["simulator"]["roles"] == ["editor"] and recorded["simulator"]["data_use"] == ["credentialed"]

    assert main(["build", str(run), "--out", str(tmp_path / "dataset"), "-q"]) == 0
    card = (tmp_path / "dataset" / "README.md").read_text()
    section = card.split("## Where the source images went")[1].split("\n## ")[0]
    assert f"127.0.0.1:{fake.port} (openai) &#124; local &#124; credentialed" not in section  # cells, not escaped pipes
    assert f"| run | writer and judge | 127.0.0.1:{fake.port} (openai) | local | credentialed |" in section
    info = json.loads((tmp_path / "dataset" / "medbanana-build.json").read_text())
    assert info["destinations"]["run"][0]["data_use"] == ["credentialed"]

    # eval with a cloud judge: the run's images are credentialed, refused before anything is read or sent
    with FakeGemini(engine="echo") as gemini:
        monkeypatch.setenv("GEMINI_API_KEY", "dest-key-0123456789")
        capsys.readouterr()
        code = main(["eval", str(run), "--out", str(tmp_path / "eval"), "--source-images", str(sources),
                     "--judge", "gemini", "--base-url", gemini.base_url, "-q"])
        assert code == 2 and gemini.calls == [] and not (tmp_path / "eval").exists()
    err = _err_lines(capsys)
    assert len(err) == 1 and "credentialed images" in err[0] and "(gemini, cloud)" in err[0]


@pytest.mark.slow
def test_unknown_sources_to_the_cloud_get_one_warning_and_go(tmp_path, monkeypatch, capsys):
    sources = mimic_sources(tmp_path / "sources", "MIMIC_plain", per_class=1)  # never prepared: unknown
    with FakeGemini(engine="echo") as fake:
        monkeypatch.setenv("GEMINI_API_KEY", "dest-key-0123456789")
        monkeypatch.setenv("GOOGLE_GEMINI_BASE_URL", fake.base_url)
        assert main(["generate", "--sources", str(sources), "--out", str(tmp_path / "run"), "--backend", "gemini",
                     *ONE_TASK]) in (0, 3)
        assert fake.count() >= 2
    warnings = [line for line in _err_lines(capsys) if "data use" in line]  # (pytest shows the SDK's deprecations)
    assert len(warnings) == 1 and warnings[0].startswith("medbanana: warning: images of unknown data use (MIMIC_plain)")
    assert f"127.0.0.1:{fake.port} (gemini, cloud)" in warnings[0]


def test_malformed_destinations_are_one_line_and_send_nothing(tmp_path, monkeypatch, capsys):
    sources = mimic_sources(tmp_path / "sources", "MIMIC_plain", per_class=1)
    listening = Counting("127.0.0.1")
    password = f"pw-{uuid.uuid4().hex}"
    base = ["generate", "--sources", str(sources), "--out", str(tmp_path / "run"), *ONE_TASK]
    openai = ["--backend", "simulator", "--writer", "openai", "--openai-model", "m"]
    cases = [([*openai, "--openai-base-url", "http://192.0.2.77:8000/v1"], {}, "plain http:// to another machine"),
             ([*openai, "--openai-base-url", f"http://u:{password}@127.0.0.1:{listening.port}/v1"], {},
              "no user name or password"),
             (["--backend", "gemini"], {"GOOGLE_GEMINI_BASE_URL": "http://example.org"}, "GOOGLE_GEMINI_BASE_URL"),
             (["--vertex-project", "proj-r", "--vertex-location", f"127.0.0.1:{listening.port}#"], {},
              "not a Google Cloud location"),
             (["--vertex-project", "proj/../x", "--vertex-location", "us-central1"], {}, "not a Google Cloud project")]
    try:
        for argv, env, said in cases:
            with monkeypatch.context() as patch:
                patch.setenv("GEMINI_API_KEY", "dest-key-0123456789")
                for name, value in env.items():
                    patch.setenv(name, value)
                capsys.readouterr()
                assert main([*base, *argv]) == 2, argv
                err = _err_lines(capsys)
                assert len(err) == 1 and said in err[0] and password not in err[0], err
    finally:
        listening.close()
    assert listening.accepted == 0 and not (tmp_path / "run").exists()


# ---------------------------------------------------------------- a run file never chooses a destination

@pytest.mark.slow
def test_a_crafted_run_naming_another_host_or_model_folder_sends_nothing(tmp_path, monkeypatch, capsys):
    sources = mimic_sources(tmp_path / "sources", "MIMIC_plain", per_class=1)
    run = tmp_path / "run"
    assert main(["generate", "--sources", str(sources), "--out", str(run), "--backend", "simulator", *ONE_TASK]) == 0
    made = json.loads((run / layout.RUN_CONFIG).read_text())
    journal = (run / layout.JOURNAL).read_bytes()
    listening = Counting("127.0.0.1")
    vertex = {"backend": "gemini", "model": "gemini-2.5-pro",
              "vertex": {"project": "proj-r", "location": f"127.0.0.1:{listening.port}#"}}
    crafted = {
        "vertex location": ({"writer": vertex, "editor": {**vertex, "model": "gemini-2.5-flash-image"},
                             "judge": vertex}, [], ["--backend", "gemini"], "--vertex-project, --vertex-location"),
        "base url": ({**made["backends"], "writer": {"backend": "openai", "model": "m"}},
                     [{"backend": "openai", "where": f"127.0.0.1:{listening.port}", "class": "local",
                       "url": f"http://127.0.0.1:{listening.port}/v1", "roles": ["writer"]}],
                     ["--writer", "openai", "--openai-model", "m"], "--openai-base-url"),
        "model folder": ({**made["backends"], "editor": {"backend": "diffusers", "model": "/etc"}}, [],
                         ["--editor", "diffusers"], "--editor-model"),
        "backend by import string": ({**made["backends"], "judge": {"backend": "os.path:join", "model": ""}}, [],
                                     [], "--judge"),
    }
    monkeypatch.setenv("GEMINI_API_KEY", "dest-key-0123456789")
    try:
        for what, (backends, destinations, given, named) in crafted.items():
            (run / layout.RUN_CONFIG).write_text(json.dumps({**made, "backends": backends,
                                                             "destinations": destinations}))
            capsys.readouterr()
            assert main(["generate", "--retry-failed", str(run), "--sources", str(sources), *given, "-q"]) == 2, what
            err = _err_lines(capsys)
            assert len(err) == 1 and "a run file never chooses where requests go" in err[0], (what, err)
            assert f"{named} as the run records" in err[0] and "nothing was sent" in err[0], (what, err)
        # the crafted location given on the command line is refused by its shape
        capsys.readouterr()
        (run / layout.RUN_CONFIG).write_text(json.dumps({**made, "backends": crafted["vertex location"][0]}))
        assert main(["generate", "--retry-failed", str(run), "--sources", str(sources), "--backend", "gemini",
                     "--vertex-project", "proj-r", "--vertex-location", f"127.0.0.1:{listening.port}#", "-q"]) == 2
        assert "not a Google Cloud location" in capsys.readouterr().err
    finally:
        listening.close()
    assert listening.accepted == 0 and (run / layout.JOURNAL).read_bytes() == journal


# ---------------------------------------------------------------- no credential follows a redirect

class Redirector(BaseHTTPRequestHandler):
    """Every request answered 307 to the same path on `server.target` (another port: another origin)."""

    def _redirect(self):
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.send_response(307)
        self.send_header("Location", f"http://127.0.0.1:{self.server.target}{self.path}")
        self.send_header("Content-Length", "0")
        self.end_headers()

    do_GET = do_POST = do_PUT = _redirect

    def log_message(self, *args):
        pass


class Recorder(BaseHTTPRequestHandler):
    """Records each request's path and headers; answers 500."""

    def _record(self):
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.server.seen.append((self.path, dict(self.headers)))
        self.send_response(500)
        self.send_header("Content-Length", "0")
        self.end_headers()

    do_GET = do_POST = do_PUT = _record

    def log_message(self, *args):
        pass


@pytest.fixture
def redirect():
    second = ThreadingHTTPServer(("127.0.0.1", 0), Recorder)
    second.seen = []
    first = ThreadingHTTPServer(("127.0.0.1", 0), Redirector)
    first.target = second.server_port
    for server in (first, second):
        threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{first.server_port}", second.seen
    for server in (first, second):
        server.shutdown()
        server.server_close()


def _records(run: Path) -> list[dict]:
    return [r for _, _, folder in layout.find_output_dirs(run)
            for r in json.loads((folder / layout.ALL_CONVERSATIONS).read_text()).values()]


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["gemini", "vertex", "openai"])
def test_a_redirect_to_another_host_is_not_followed(backend, redirect, tmp_path, monkeypatch, capsys):
    first, seen = redirect
    secret = f"SECRET-{uuid.uuid4().hex}"
    sources = mimic_sources(tmp_path / "sources", "MIMIC_plain", per_class=1)
    argv = ["generate", "--sources", str(sources), "--out", str(tmp_path / "run"), *ONE_TASK]
    with FakeGemini(engine="echo") as token_server:  # Vertex AI: the OAuth token comes from here, the calls go first
        if backend == "gemini":
            monkeypatch.setenv("GEMINI_API_KEY", secret)
            monkeypatch.setenv("GOOGLE_GEMINI_BASE_URL", first)
            argv += ["--backend", "gemini"]
        elif backend == "vertex":
            monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS",
                               str(service_account_file(tmp_path, f"{token_server.base_url}/token")))
            monkeypatch.setenv("GOOGLE_VERTEX_BASE_URL", first)
            argv += ["--vertex-project", "proj-r", "--vertex-location", "us-central1"]
        else:
            monkeypatch.setenv("OPENAI_API_KEY", secret)
            argv += ["--backend", "simulator", "--writer", "openai", "--openai-model", "m",
                     "--openai-base-url", f"{first}/v1"]
        assert main(argv) == 3
    [record] = _records(tmp_path / "run")
    assert record["status"] == "api_failed" and record["error"]["kind"] == "redirect_refused", record["error"]
    assert "not followed" in record["error"]["message"]
    assert seen == []  # the second host never heard of the request: neither its credential nor its body


def test_a_hub_upload_redirected_to_another_host_sends_it_no_token(redirect, builder_original_run, tmp_path,
                                                                   monkeypatch, capsys):
    """huggingface_hub's httpx client follows redirects (the Hub sends downloads to its CDN) and drops the
    Authorization header when the origin changes: the second host gets the request, never the token."""
    first, seen = redirect
    token = f"hf_SECRET{uuid.uuid4().hex}"
    assert main(["build", str(builder_original_run), "--out", str(tmp_path / "ds"), "--configs", "conversations",
                 "-q"]) == 0
    monkeypatch.setenv("HF_ENDPOINT", first)
    monkeypatch.setenv("HF_TOKEN", token)
    assert main(["upload", str(tmp_path / "ds"), "my-org/dest-test"]) == 1
    assert seen, "the redirect was not followed at all: nothing tested"
    assert all(token not in json.dumps(headers) and "authorization" not in {k.lower() for k in headers}
               for _, headers in seen)


# ---------------------------------------------------------------- answer size limits

class Oversize(BaseHTTPRequestHandler):
    """Every generateContent or chat-completions call answered over the limits, as `server.how` says: `text` (a
    valid answer holding 300,000 characters of text), `stream` (65 MiB with no Content-Length, until the client
    hangs up) or `declared` (a Content-Length of 1 GiB, then a trickle)."""

    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.server.calls += 1
        how, text = self.server.how, "x" * 300_000
        chat = self.path.endswith("/chat/completions")
        answer = ({"id": "o", "object": "chat.completion", "created": 0, "model": "m", "choices": [{
            "index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": text}}]} if chat else
            {"candidates": [{"content": {"role": "model", "parts": [{"text": text}]}, "finishReason": "STOP"}]})
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        data = json.dumps(answer).encode()
        if how == "text":
            self.send_header("Content-Length", str(len(data)))
        elif how == "declared":
            self.send_header("Content-Length", str(2 ** 30))
        self.end_headers()
        try:
            if how == "text":
                self.wfile.write(data)
            else:
                chunk = b'{"candidates": [{"content": {"parts": [{"text": "' + b"y" * (1 << 20)
                for _ in range(65 if how == "stream" else 1):
                    self.wfile.write(chunk)
                    chunk = b"y" * (1 << 20)
        except OSError:  # the client hung up, as it should
            pass
        self.close_connection = True

    def log_message(self, *args):
        pass


@pytest.mark.slow
@pytest.mark.parametrize("backend,how", [("gemini", "text"), ("gemini", "stream"), ("openai", "text"),
                                         ("openai", "declared")])
def test_an_oversize_answer_is_a_recorded_failure_not_a_huge_file(backend, how, tmp_path, monkeypatch, capsys):
    server = ThreadingHTTPServer(("127.0.0.1", 0), Oversize)
    server.how, server.calls = how, 0
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_port}"
    sources = mimic_sources(tmp_path / "sources", "MIMIC_plain", per_class=1)
    argv = ["generate", "--sources", str(sources), "--out", str(tmp_path / "run"), *ONE_TASK]
    if backend == "gemini":
        monkeypatch.setenv("GEMINI_API_KEY", "dest-key-0123456789")
        monkeypatch.setenv("GOOGLE_GEMINI_BASE_URL", url)
        argv += ["--backend", "gemini"]
    else:
        argv += ["--backend", "simulator", "--writer", "openai", "--openai-model", "m", "--openai-base-url",
                 f"{url}/v1"]
    try:
        assert main(argv) == 3
    finally:
        server.shutdown()
        server.server_close()
    [record] = _records(tmp_path / "run")
    assert record["error"]["kind"] == "answer_too_large" and server.calls == 1, record["error"]  # never asked again
    assert sum(p.stat().st_size for p in (tmp_path / "run").rglob("*") if p.is_file()) < 1_000_000


@pytest.mark.slow
def test_the_demos_phantoms_are_synthetic_in_manifest_run_and_card(demo_run_root):
    demo = demo_run_root / "demo-run"
    assert {use.kind for use in sources_data_use(demo / "sources").values()} == {"synthetic"}
    [simulator] = json.loads((demo / "run" / layout.RUN_CONFIG).read_text())["destinations"]
    assert (simulator["backend"], simulator["class"], simulator["data_use"]) == ("simulator", "local", ["synthetic"])
    assert "| run | writer and editor and judge | this process (simulator) | local | synthetic |" in (
        demo / "dataset" / "README.md").read_text()


@pytest.mark.slow
def test_a_merged_run_records_what_each_shard_sent(tmp_path):
    runs = []
    for name, use in (("MIMIC_cred", ["--data-use", "credentialed"]), ("MIMIC_open", ["--data-use", "open",
                                                                                       "--licence", "CC BY 4.0"])):
        sources = prepared(tmp_path / name, *use, name=name)
        runs.append(tmp_path / name / "run")
        assert main(["generate", "--sources", str(sources), "--out", str(runs[-1]), "--backend", "simulator",
                     *ONE_TASK]) == 0
    assert main(["merge", *map(str, runs), "--out", str(tmp_path / "merged")]) == 0
    [simulator] = json.loads((tmp_path / "merged" / layout.RUN_CONFIG).read_text())["destinations"]
    assert simulator["data_use"] == ["credentialed", "open"] and simulator["class"] == "local"
