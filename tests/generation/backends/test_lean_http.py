"""lean_http.py, the HTTP/1.1 client of the Gemini calls: the answer forms servers use, kept-alive connections, TLS
with a verified certificate, and the SDK's client where a proxy is configured."""

from __future__ import annotations

import asyncio
import datetime
import hashlib
import ipaddress
import json
import socket
import ssl
import subprocess
import sys
import threading
import time

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from fake_runs import chest_source
from medbanana.generation.backends import APIError
from medbanana.generation.backends.gemini import GeminiEditor
from medbanana.generation.backends.lean_http import LeanHTTP
from medbanana.generation.records import Task
from medbanana.generation.testing.fake_gemini import FakeGemini

KEY = "AIza-test-lean-0123456789"


class ScriptedServer:
    """A raw socket server on 127.0.0.1: reads each request whole (headers, Content-Length body) and answers with
    the next scripted bytes; None closes the connection instead, (bytes, "close") closes it after answering.
    Counts connections and keeps the requests."""

    def __init__(self, answers: list):
        self.answers, self.requests, self.connections = list(answers), [], 0
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=_accept_forever, args=(self.sock, self._connection), daemon=True).start()

    def _connection(self, conn: socket.socket):
        self.connections += 1
        with conn, conn.makefile("rb") as reader:
            while self.answers:
                head = b""
                while not head.endswith(b"\r\n\r\n"):
                    line = reader.readline()
                    if not line:
                        return
                    head += line
                length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                                  if line.lower().startswith(b"content-length")))
                self.requests.append((head, reader.read(length)))
                answer = self.answers.pop(0)
                if answer is None:
                    return
                conn.sendall(answer[0] if isinstance(answer, tuple) else answer)
                if isinstance(answer, tuple):
                    return

    def close(self):
        self.sock.close()


def _accept_forever(sock: socket.socket, handle) -> None:
    """Each connection to `sock` handled by `handle(conn)` on a thread of its own, until `sock` is closed."""
    while True:
        try:
            conn, _ = sock.accept()
        except OSError:
            return
        threading.Thread(target=handle, args=(conn,), daemon=True).start()


def post(client: LeanHTTP, port: int, body: bytes = b'{"q": 1}'):
    return client.post(f"http://127.0.0.1:{port}/v1beta/models/m:generateContent?alt=json",
                       {"Content-Type": "application/json", "x-goog-api-key": KEY}, body)


def test_answers_by_length_by_chunks_and_to_the_end_of_the_connection_are_read_whole():
    async def scenario():
        client = LeanHTTP()
        server = ScriptedServer([
            b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 5\r\nX-A: 1\r\n\r\nhello",
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n4;ext=1\r\nwiki\r\n6\r\npedia \r\n0\r\nT: x\r\n\r\n",
            b"HTTP/1.1 429 Too Many\r\nRetry-After: 7\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}",
            (b"HTTP/1.0 200 OK\r\n\r\nto the end", "close")])
        first = await post(client, server.port, b"x" * 300_000)
        second = await post(client, server.port)
        third = await post(client, server.port)  # closes: the next call opens a new connection
        fourth = await post(client, server.port)
        client.close()
        server.close()
        return server, [first, second, third, fourth]

    server, answers = asyncio.run(scenario())
    assert answers[0] == (200, {"content-length": "5", "x-a": "1"}, b"hello")
    assert answers[1][0] == 200 and answers[1][2] == b"wikipedia "
    assert answers[2] == (429, {"retry-after": "7", "content-length": "2", "connection": "close"}, b"{}")
    assert answers[3][2] == b"to the end"
    assert server.connections == 2  # kept alive through the first three answers
    head, body = server.requests[0]
    assert body == b"x" * 300_000 and head.startswith(b"POST /v1beta/models/m:generateContent?alt=json HTTP/1.1\r\n")
    assert b"Host: 127.0.0.1:%d\r\n" % server.port in head and b"x-goog-api-key: " + KEY.encode() in head


def test_a_connection_the_server_closed_while_idle_is_not_reused_and_a_torn_answer_is_a_connection_error():
    ok = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"

    async def scenario():
        client = LeanHTTP()
        server = ScriptedServer([(ok, "close"), ok, None,
                                 (b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\ntorn", "close")])
        assert (await post(client, server.port))[2] == b"ok"  # then the server closes it (its keep-alive timeout)
        (reader, _), = client._idle[("http", "127.0.0.1", server.port)]
        for _ in range(500):  # until the close has reached this loop, however busy the machine
            if reader.at_eof():
                break
            await asyncio.sleep(0.01)
        assert (await post(client, server.port))[2] == b"ok" and server.connections == 2
        with pytest.raises(ConnectionResetError, match="after 0 bytes of no answer"):  # the transport retries it
            await post(client, server.port)
        with pytest.raises(ConnectionResetError, match="after 4 bytes of an answer"):
            await post(client, server.port)
        client.close()
        server.close()
        return server

    assert asyncio.run(scenario()).connections == 3  # the no-answer call reused the kept one


def _certificate(tmp_path):
    """A self-signed certificate for 127.0.0.1: (certificate file, key file)."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), True)
            .sign(key, hashes.SHA256()))
    cert_file, key_file = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_file, key_file


class TLSRelay:
    """TLS on 127.0.0.1 in front of a plain HTTP server, as a load balancer terminates it."""

    def __init__(self, target_port: int, cert_file, key_file):
        self.context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.context.load_cert_chain(cert_file, key_file)
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port, self.target = self.sock.getsockname()[1], target_port
        threading.Thread(target=_accept_forever, args=(self.sock, self._relay), daemon=True).start()

    def _relay(self, conn):
        try:
            tls = self.context.wrap_socket(conn, server_side=True)
        except (ssl.SSLError, OSError):
            conn.close()
            return
        plain = socket.create_connection(("127.0.0.1", self.target))
        threading.Thread(target=_pump, args=(plain, tls), daemon=True).start()
        _pump(tls, plain)

    def close(self):
        self.sock.close()


def _pump(src, dst):
    try:
        while data := src.recv(1 << 16):
            dst.sendall(data)
    except OSError:
        pass
    finally:
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return chest_source(tmp_path_factory.mktemp("src"), size=128)


def _edit(editor: GeminiEditor, source):
    task = Task("cxr_demo", "chest_xray", "Pleural_Effusion", "add", source.path)
    return asyncio.run(editor.edit(task, source, "Add a small effusion.", seed=1))


def test_gemini_calls_go_over_tls_with_the_certificate_verified(tmp_path, monkeypatch, source):
    cert_file, key_file = _certificate(tmp_path)
    with FakeGemini() as fake:
        relay = TLSRelay(fake.port, cert_file, key_file)
        options = {"api_key": KEY, "base_url": f"https://127.0.0.1:{relay.port}", "timeout": 10.0,
                   "max_attempts": 1}
        monkeypatch.setenv("SSL_CERT_FILE", str(cert_file))  # the CA bundle a user points at, as for the SDK
        editor = GeminiEditor(**options)
        edited = _edit(editor, source)
        assert edited.data[:2] == b"\xff\xd8" and fake.count("editor") == 1
        assert ("https", "127.0.0.1", relay.port) in editor.transport.direct.lean._idle  # it went the lean way
        monkeypatch.delenv("SSL_CERT_FILE")  # certifi's bundle does not know this certificate: refused
        with pytest.raises(APIError) as refused:
            _edit(GeminiEditor(**options), source)
        assert refused.value.kind == "transport" and "CERTIFICATE_VERIFY_FAILED" in str(refused.value)
        assert fake.count("editor") == 1
        relay.close()


def test_with_a_proxy_configured_calls_take_the_sdks_client(monkeypatch, source):
    monkeypatch.setenv("HTTPS_PROXY", "http://127.0.0.1:9")  # nothing listens there: only NO_PROXY lets it through
    monkeypatch.setenv("NO_PROXY", "127.0.0.1")
    with FakeGemini() as fake:
        editor = GeminiEditor(api_key=KEY, base_url=fake.base_url, timeout=10.0, max_attempts=1)
        assert not editor.transport.direct.lean_can_send(f"{fake.base_url}/v1beta/models/m:generateContent")
        assert _edit(editor, source).data[:2] == b"\xff\xd8" and fake.count("editor") == 1
        assert editor.transport.direct.lean._idle == {}


_UVICORN_APP = """
import hashlib, sys
import uvicorn
from starlette.applications import Starlette
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

async def by_length(request):
    body = await request.body()
    return JSONResponse({"bytes": len(body), "sha256": hashlib.sha256(body).hexdigest()})

async def by_chunks(request):
    body = await request.body()
    async def pieces():
        for piece in (b'{"pieces": [', b'"' + hashlib.sha256(body).hexdigest().encode() + b'"', b", 1" * 50000, b"]}"):
            yield piece
    return StreamingResponse(pieces(), media_type="application/json")

app = Starlette(routes=[Route("/length", by_length, methods=["POST"]), Route("/chunks", by_chunks, methods=["POST"])])
uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
"""


def test_a_server_of_another_make_is_read_right_over_kept_alive_connections(tmp_path):
    """uvicorn (h11) frames answers its own way: by length, and chunked for a streamed body."""
    pytest.importorskip("uvicorn")  # gradio's server, in the [dev] extra
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-c", _UVICORN_APP, str(port)])
    try:
        for _ in range(200):
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.1).close()
                break
            except OSError:
                time.sleep(0.05)
        body = bytes(range(256)) * 4000

        async def scenario():
            client = LeanHTTP()
            answers = []
            for path in ("/length", "/chunks", "/length", "/chunks"):
                answers.append(await client.post(f"http://127.0.0.1:{port}{path}",
                                                 {"Content-Type": "application/json"}, body))
            idle = sum(len(c) for c in client._idle.values())
            client.close()
            return answers, idle

        answers, idle = asyncio.run(scenario())
        digest = hashlib.sha256(body).hexdigest()
        assert all(status == 200 for status, _, _ in answers)
        assert json.loads(answers[0][2]) == {"bytes": len(body), "sha256": digest} == json.loads(answers[2][2])
        assert answers[1][1].get("transfer-encoding") == "chunked" and "content-length" not in answers[1][1]
        pieces = json.loads(answers[3][2])["pieces"]
        assert pieces[0] == digest and pieces[1:] == [1] * 50000
        assert idle == 1  # all four over one kept-alive connection
    finally:
        server.terminate()
        server.wait(10)
