"""A stand-in of the Hugging Face Hub's model download API on 127.0.0.1, serving local folders as model repos, so
that `from_pretrained("org/name")` with HF_ENDPOINT pointing here downloads as it does from the Hub.

Endpoints (what huggingface_hub 2.x asks for): HEAD/GET `/{repo}/resolve/{revision}/{path}` with the commit, ETag
and size headers; `/api/models/{repo}[/revision/{revision}]` (siblings); `/api/models/{repo}/tree/{revision}[/path]`.
A missing file or repo answers 404 with the Hub's `X-Error-Code`, which the clients turn into their usual errors.
"""

from __future__ import annotations

import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit


class ModelHub:
    """`with ModelHub({"org/name": folder}) as hub:` serves the folders at `hub.endpoint`; `hub.downloads` lists
    (repo, path) of every file body sent."""

    def __init__(self, repos: dict[str, Path]):
        self.repos = {repo: Path(folder) for repo, folder in repos.items()}
        self.downloads: list[tuple[str, str]] = []
        self.requests: list[str] = []
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        self._server.hub = self
        self.endpoint = f"http://127.0.0.1:{self._server.server_port}"

    def __enter__(self) -> ModelHub:
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()

    def files(self, repo: str) -> list[str]:
        folder = self.repos[repo]
        return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())

    def commit(self, repo: str) -> str:
        return hashlib.sha1(repo.encode()).hexdigest()  # 40 hex digits, fixed per repo


class _Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):  # quiet
        pass

    def do_HEAD(self):
        self._route(body=False)

    def do_GET(self):
        self._route(body=True)

    def _route(self, body: bool) -> None:
        hub: ModelHub = self.server.hub
        path = unquote(urlsplit(self.path).path)
        hub.requests.append(f"{self.command} {path}")
        if path.startswith("/api/models/"):
            return self._api(hub, path[len("/api/models/"):])
        repo, sep, rest = path.lstrip("/").partition("/resolve/")
        if not sep or repo not in hub.repos:
            return self._error(404, "RepoNotFound", f"no repo {repo}")
        _, _, name = rest.partition("/")  # drop the revision
        file = hub.repos[repo] / name
        if not name or not file.is_file():
            return self._error(404, "EntryNotFound", f"{name} not in {repo}")
        data = file.read_bytes()
        self.send_response(200)
        self.send_header("X-Repo-Commit", hub.commit(repo))
        self.send_header("ETag", f'"{hashlib.sha256(data).hexdigest()}"')
        self.send_header("Content-Length", str(len(data)))
        self.send_header("Content-Type", "application/octet-stream")
        self.end_headers()
        if body:
            hub.downloads.append((repo, name))
            self.wfile.write(data)

    def _api(self, hub: ModelHub, rest: str) -> None:
        for repo in hub.repos:
            if rest == repo or rest.startswith(repo + "/"):
                break
        else:
            return self._error(404, "RepoNotFound", "no such repo")
        tail = rest[len(repo):].lstrip("/")
        if tail.startswith("tree/"):
            prefix = tail.split("/", 2)[2] if tail.count("/") >= 2 else ""
            entries = [{"type": "file", "path": name, "size": (hub.repos[repo] / name).stat().st_size,
                        "oid": hashlib.sha1(name.encode()).hexdigest()}
                       for name in hub.files(repo) if not prefix or name.startswith(prefix.rstrip("/") + "/")]
            if prefix and not entries:
                return self._error(404, "EntryNotFound", f"{prefix} not in {repo}")
            return self._json(entries)
        return self._json({"id": repo, "modelId": repo, "sha": hub.commit(repo), "private": False,
                           "siblings": [{"rfilename": name} for name in hub.files(repo)]})

    def _json(self, value) -> None:
        data = json.dumps(value).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def _error(self, status: int, code: str, message: str) -> None:
        data = json.dumps({"error": message}).encode()
        self.send_response(status)
        self.send_header("X-Error-Code", code)
        self.send_header("X-Error-Message", message)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)
