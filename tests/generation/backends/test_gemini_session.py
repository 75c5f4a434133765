"""The Gemini API client's HTTP session (gemini_client.py): in a plain environment the transport's own aiohttp
session, which looks neither proxy nor netrc up per request; with a proxy (or a netrc file) in the environment the
SDK's own, which honours it. Checked with a real forwarding proxy on 127.0.0.1 in front of the fake Gemini server."""

from __future__ import annotations

import asyncio
import gc
import logging
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from threading import Thread

import pytest

from fake_runs import chest_source
from medbanana.generation.backends.gemini import GeminiWriter
from medbanana.generation.backends.gemini_client import environment_routes_requests
from medbanana.generation.records import Task
from medbanana.generation.testing.fake_gemini import FakeGemini

PROXY_VARIABLES = ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "NO_PROXY")


@pytest.fixture
def plain_environment(monkeypatch, tmp_path):
    for name in PROXY_VARIABLES:
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(name.lower(), raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    return monkeypatch


class ForwardingProxy(BaseHTTPRequestHandler):
    """An HTTP proxy: each request (absolute-form) sent on to its URL, the answer back; every one counted."""

    seen: list[str] = []

    def do_POST(self):  # noqa: N802 - the http.server name
        self.seen.append(self.path)
        body = self.rfile.read(int(self.headers["Content-Length"]))
        headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "proxy-connection", "connection")}
        request = urllib.request.Request(self.path, data=body, headers=headers, method="POST")
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # straight to the server
        try:
            with opener.open(request, timeout=10) as answer:
                status, data = answer.status, answer.read()
        except urllib.error.HTTPError as exc:
            status, data = exc.code, exc.read()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture
def proxy():
    ForwardingProxy.seen = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), ForwardingProxy)
    Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}", ForwardingProxy.seen
    server.shutdown()
    server.server_close()


def _write_twice(base_url: str, folder, close: bool = True) -> list[str]:
    """An instruction asked in two event loops one after the other (a transport outlives a run's loop); the
    transport closed at the end of the second, or never."""
    source = chest_source(folder, size=64)
    task = Task("cxr_demo", "chest_xray", "Pleural_Effusion", "add", source.path)
    writer = GeminiWriter(api_key="test-key-session-3e1f", base_url=base_url, timeout=5.0, max_attempts=1)

    async def once(close: bool) -> str:
        text = (await writer.write(task, source, [])).text
        if close:
            await writer.transport.aclose()
        return text

    return [asyncio.run(once(close=False)), asyncio.run(once(close=close))]


def test_a_proxy_in_the_environment_carries_every_call(plain_environment, proxy, tmp_path):
    url, seen = proxy
    plain_environment.setenv("HTTP_PROXY", url)
    assert environment_routes_requests()
    with FakeGemini() as fake:
        texts = _write_twice(fake.base_url, tmp_path)
        calls = len(fake.calls)
    assert all(texts) and calls == 2 and len(seen) == 2 and all(p.startswith(fake.base_url) for p in seen)


def test_in_a_plain_environment_calls_go_straight_to_the_endpoint(plain_environment, proxy, tmp_path):
    _, seen = proxy
    assert not environment_routes_requests()
    with FakeGemini() as fake:
        texts = _write_twice(fake.base_url, tmp_path)
        calls = len(fake.calls)
    assert all(texts) and calls == 2 and seen == []


def test_what_counts_as_an_environment_that_routes_requests(plain_environment, tmp_path):
    assert not environment_routes_requests()
    plain_environment.setenv("NO_PROXY", "localhost")  # exceptions to no proxy: nothing to route through
    assert not environment_routes_requests()
    plain_environment.setenv("HTTPS_PROXY", "http://proxy.example:3128")
    assert environment_routes_requests()
    plain_environment.delenv("HTTPS_PROXY")
    netrc = tmp_path / "netrc"
    netrc.write_text("machine generativelanguage.googleapis.com login me password pw\n")
    plain_environment.setenv("NETRC", str(netrc))  # aiohttp's trust_env would send these credentials
    assert environment_routes_requests()


def test_a_client_never_closed_is_closed_with_its_event_loop(plain_environment, tmp_path, caplog):
    caplog.set_level(logging.ERROR)
    with FakeGemini() as fake:
        texts = _write_twice(fake.base_url, tmp_path, close=False)
    gc.collect()  # an aiohttp session or connector collected open says so (asyncio's logger)
    assert all(texts) and not [r.getMessage() for r in caplog.records if "nclosed" in r.getMessage()]
