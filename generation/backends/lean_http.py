"""A small HTTP/1.1 client for the one request an API call makes: POST an encoded JSON body, read the whole answer.

Why: behind google-genai's async client sit httpx, httpcore, anyio and h11, which cost about 2 ms of CPU per call
(a pool scan per request, a task group and cancel scopes per read and write, 64 KB reads); sending the same bytes
over asyncio streams costs a fraction of that. What it does not do it leaves to the library's client: proxies
(`LeanHTTP.usable()` is False when a proxy variable is set), HTTP/2, compression (no Accept-Encoding is sent, so
answers come as they are) and redirects (a 3xx is returned as an error status).

Connections are kept alive per (scheme, host, port) and per event loop; one the server closed while idle is not
reused. Failures are raised as OSError (a connection closed before the answer's end is ConnectionResetError) for
the transport's retries, and a call cancelled midway closes its connection rather than return it half read.
"""

from __future__ import annotations

import asyncio
import os
import ssl
from urllib.parse import urlsplit

PROXY_VARIABLES = ("https_proxy", "http_proxy", "all_proxy")
MAX_HEADER_BYTES = 64 * 1024


class LeanHTTP:
    """POST over kept-alive HTTP/1.1 connections (one pool per event loop)."""

    def __init__(self):
        self._idle: dict[tuple, list[tuple[asyncio.StreamReader, asyncio.StreamWriter]]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ssl: ssl.SSLContext | None = None
        # read once, as the library's client reads its proxies when it is made
        self.proxied = any(os.environ.get(name) or os.environ.get(name.upper()) for name in PROXY_VARIABLES)

    def usable(self, url: str) -> bool:
        """Whether this client can send to `url`: http or https, and no proxy configured in the environment."""
        return not self.proxied and url.startswith(("http://", "https://"))

    async def post(self, url: str, headers: dict[str, str], body: bytes) -> tuple[int, dict[str, str], bytes]:
        """(status, headers with lower-case names, body) of one POST."""
        parts = urlsplit(url)
        https = parts.scheme == "https"
        where = (parts.scheme, parts.hostname or "", parts.port or (443 if https else 80))
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        host = parts.netloc.rpartition("@")[2]  # no user:password@ in a Host header
        head = [f"POST {target} HTTP/1.1", f"Host: {host}", f"Content-Length: {len(body)}"]
        head += [f"{name}: {value}" for name, value in headers.items()
                 if name.lower() not in ("host", "content-length", "connection", "transfer-encoding")]
        head = ("\r\n".join(head) + "\r\n\r\n").encode("latin-1")
        reader, writer = await self._connection(where)
        try:
            writer.write(head)  # two writes rather than a copy of the body (asyncio sets TCP_NODELAY)
            writer.write(body)
            await writer.drain()
            status, answer_headers, data, keep = await _read_answer(reader)
        except asyncio.IncompleteReadError as exc:  # an OSError, so that it is retried as network trouble
            writer.close()
            raise ConnectionResetError(f"the server closed the connection after {len(exc.partial)} bytes of "
                                       f"{'an answer' if exc.partial else 'no answer'}") from None
        except BaseException:  # cancelled (the per-call timeout) or anything else: never reused half read
            writer.close()
            raise
        if keep:
            self._idle.setdefault(where, []).append((reader, writer))
        else:
            writer.close()
        return status, answer_headers, data

    async def _connection(self, where: tuple):
        loop = asyncio.get_running_loop()
        if loop is not self._loop:  # connections belong to the loop that opened them
            self._idle, self._loop = {}, loop
        idle = self._idle.get(where, [])
        while idle:
            reader, writer = idle.pop()
            if not writer.is_closing() and not reader.at_eof():  # a server that closed it has said so by now
                return reader, writer
            writer.close()
        scheme, host, port = where
        context = self._ssl_context() if scheme == "https" else None
        return await asyncio.open_connection(host, port, ssl=context, limit=MAX_HEADER_BYTES)

    def _ssl_context(self) -> ssl.SSLContext:
        if self._ssl is None:  # the CA bundle the library's client uses: SSL_CERT_FILE, else certifi's
            cafile = os.environ.get("SSL_CERT_FILE")
            if not cafile:
                try:
                    import certifi
                    cafile = certifi.where()
                except ImportError:
                    cafile = None
            self._ssl = ssl.create_default_context(cafile=cafile)
            self._ssl.set_alpn_protocols(["http/1.1"])
        return self._ssl

    def close(self) -> None:
        for connections in self._idle.values():
            for _, writer in connections:
                writer.close()
        self._idle = {}


async def _read_answer(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes, bool]:
    """(status, headers, body, whether the connection may be reused) of one HTTP/1.1 answer."""
    while True:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except asyncio.LimitOverrunError as exc:
            raise ConnectionError(f"answer headers over {MAX_HEADER_BYTES} bytes") from exc
        lines = head.decode("latin-1").split("\r\n")
        version, _, rest = lines[0].partition(" ")
        if not version.startswith("HTTP/1.") or not rest[:3].isdigit():
            raise ConnectionError(f"not an HTTP/1.x answer: {lines[0][:80]!r}")
        status = int(rest[:3])
        if status >= 200 or status == 101:
            break  # 1xx (100 Continue, 103 Early Hints) come before the answer
    headers: dict[str, str] = {}
    for line in lines[1:]:
        if line:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
    keep = version != "HTTP/1.0" and "close" not in headers.get("connection", "").lower()
    if "chunked" in headers.get("transfer-encoding", "").lower():
        chunks = []
        while size := _chunk_size(await reader.readline()):
            chunks.append(await reader.readexactly(size))
            await reader.readexactly(2)
        while (await reader.readline()) not in (b"\r\n", b"\n", b""):  # trailers
            pass
        body = b"".join(chunks)
    elif "content-length" in headers:
        body = await reader.readexactly(int(headers["content-length"]))
    elif status in (204, 304):
        body = b""
    else:  # delimited by the end of the connection
        body, keep = await reader.read(), False
    return status, headers, body, keep


def _chunk_size(line: bytes) -> int:
    try:
        return int(line.split(b";")[0].strip(), 16)
    except ValueError:
        raise ConnectionError(f"not a chunk size: {line[:40]!r}") from None
