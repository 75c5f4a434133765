"""`medbanana upload` against a local stub of the Hub's HTTP API that records what it receives."""

import argparse
import base64
import json
import threading
from http.server import ThreadingHTTPServer

import pytest
import yaml
from stub_http import JSONHandler

from medbanana.builder import commands
from medbanana.builder.build import build

TOKEN = "hf_stubtoken_never_printed"


class StubHub(JSONHandler):
    """The endpoints `HfApi.upload_folder` needs; validate-yaml really parses the README's YAML."""

    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        hub = self.server.hub
        hub["requests"].append((self.path, self.headers.get("Authorization")))
        port = self.server.server_port
        if self.path == "/api/repos/create":
            hub["create"] = json.loads(body)
            repo = f"{hub['create'].get('organization')}/{hub['create']['name']}"
            return self._json({"url": f"http://127.0.0.1:{port}/datasets/{repo}"})
        if self.path == "/api/validate-yaml":
            return self._json(self._validate(json.loads(body)["content"]))
        if "/branch/" in self.path:
            hub["branches"].append(self.path.rsplit("/", 1)[1])
            return self._json({})
        if "/preupload/" in self.path:
            files = json.loads(body)["files"]
            return self._json({"files": [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False}
                                         for f in files]})
        if "/commit/" in self.path:
            for line in body.splitlines():
                item = json.loads(line)
                if item["key"] == "file":
                    hub["files"][item["value"]["path"]] = base64.b64decode(item["value"]["content"])
            repo = self.path.split("/api/datasets/")[1].split("/commit/")[0]
            oid = "0" * 40
            return self._json({"commitUrl": f"http://127.0.0.1:{port}/datasets/{repo}/commit/{oid}",
                               "commitOid": oid, "success": True})
        self._json({"error": f"stub does not know {self.path}"}, 404)

    def do_GET(self):
        hub = self.server.hub
        hub["requests"].append((self.path, self.headers.get("Authorization")))
        create = hub["create"]
        if create and self.path.split("?")[0] == f"/api/datasets/{create.get('organization')}/{create['name']}":
            return self._json({"id": f"{create.get('organization')}/{create['name']}", "sha": "0" * 40,
                               "private": create.get("visibility") == "private", "siblings": []})
        self._json({"error": "not found"}, 404)  # the repository's tree: no commit yet

    def _validate(self, content: str) -> dict:
        errors = []
        try:
            meta = yaml.safe_load(content.split("---\n", 2)[1])
            for config in meta["configs"]:
                if not config["config_name"] or not all({"split", "path"} <= set(f) for f in config["data_files"]):
                    errors.append(f"bad config {config}")
        except Exception as exc:  # any parse or shape problem is a validation error
            errors.append(repr(exc))
        self.server.hub["yaml_errors"] = errors
        return {"errors": [{"message": e} for e in errors], "warnings": []}



@pytest.fixture
def stub_hub(monkeypatch):
    server = ThreadingHTTPServer(("127.0.0.1", 0), StubHub)
    server.hub = {"requests": [], "files": {}, "branches": [], "create": None, "yaml_errors": None}
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{server.server_port}")
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    yield server.hub
    server.shutdown()


def test_upload_sends_every_file_and_a_valid_readme(stub_hub, builder_original_run, tmp_path, capsys):
    out = tmp_path / "medbanana-50k"
    build([builder_original_run], out, quiet=True)
    parser = argparse.ArgumentParser()
    commands.register(parser.add_subparsers())
    args = parser.parse_args(["upload", str(out), "my-org/medbanana-50k", "--private", "--revision", "v1"])
    assert args.func(args) == 0
    printed = capsys.readouterr()
    assert "my-org/medbanana-50k" in printed.out and TOKEN not in printed.out + printed.err
    local = {p.relative_to(out).as_posix(): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    assert stub_hub["files"] == local
    assert stub_hub["yaml_errors"] == []  # the stub parsed the README's front matter and found it sound
    assert stub_hub["create"]["visibility"] == "private" and stub_hub["create"]["type"] == "dataset"
    assert stub_hub["branches"] == ["v1"]
    assert all(auth == f"Bearer {TOKEN}" for _path, auth in stub_hub["requests"])


def test_upload_refuses_a_folder_that_does_not_match_its_manifest(stub_hub, builder_original_run, tmp_path,
                                                                   capsys):
    out = tmp_path / "ds"
    build([builder_original_run], out, configs=["conversations"], quiet=True)
    (out / "README.md").write_text("edited by hand\n")
    parser = argparse.ArgumentParser()
    commands.register(parser.add_subparsers())
    args = parser.parse_args(["upload", str(out), "org/ds"])
    assert args.func(args) == 1
    assert "does not match its manifest" in capsys.readouterr().err
    assert stub_hub["requests"] == []  # nothing was sent
