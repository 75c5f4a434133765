"""`medbanana upload` publishes atomically: a stateful stub of the Hub on 127.0.0.1 that keeps the repository's files
and every commit, as huggingface_hub 2.x sends them (NDJSON commits with `file` and `deletedFile` lines)."""

import base64
import fnmatch
import hashlib
import json
import os
import subprocess
import sys
import threading
from http.server import ThreadingHTTPServer
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from stub_http import JSONHandler

from medbanana.builder.build import build
from medbanana.cli import main

TOKEN = "hf_stubtoken_publishing"
REPO = "my-org/medbanana-50k"
CARD = {"README.md", "medbanana-build.json", "SHA256SUMS"}
# what a user keeps in the repository beside the dataset: never deleted
USER_FILES = {".gitattributes": b"*.parquet filter=lfs diff=lfs merge=lfs -text\n", "NOTES.md": b"our notes\n",
              "sft/how-we-filtered.txt": b"by hand\n", "extra/other.parquet": b"not this dataset's\n"}


def _blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


class Hub(JSONHandler):
    """One dataset repository: create, preupload, commit (added and deleted files), tree listing, repo info.
    `fail_after` N: every commit after the first N is refused, as if the upload were cut off there."""

    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        hub, path = self.server.hub, urlsplit(self.path).path
        if path == "/api/repos/create":
            hub["creates"].append(json.loads(body))
            hub["private"] = hub["private"] if hub["exists"] else json.loads(body).get("visibility") == "private"
            url = {"url": f"{self._base()}/datasets/{REPO}"}
            if hub["exists"]:  # what the Hub answers for an existing repo; create_repo(exist_ok=True) accepts it
                return self._json({"error": "You already created this dataset repo", **url}, 409)
            hub["exists"] = True
            return self._json(url)
        if path == "/api/validate-yaml":
            return self._json({"errors": [], "warnings": []})
        if path.endswith("/preupload/main"):
            return self._json({"files": [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False,
                                          **({"oid": _blob_id(hub["files"][f["path"]])}
                                             if f["path"] in hub["files"] else {})}
                                         for f in json.loads(body)["files"]]})
        if path.endswith("/commit/main"):
            return self._commit(body)
        self._json({"error": f"stub does not know POST {path}"}, 404)

    def do_GET(self):
        hub, path = self.server.hub, urlsplit(self.path).path
        if path.startswith(f"/api/datasets/{REPO}/tree/main") and hub["tree_answer"] is not None:
            return self._json(hub["tree_answer"])  # a 200 whose JSON is not what the client expects
        if path.startswith(f"/api/datasets/{REPO}/tree/main"):
            folders = {"/".join(p.split("/")[:i]) for p in hub["files"] for i in range(1, p.count("/") + 1)}
            return self._json([{"type": "directory", "oid": "1" * 40, "path": f} for f in sorted(folders)] +
                              [self._entry(p, data) for p, data in sorted(hub["files"].items())])
        if path in (f"/api/datasets/{REPO}", f"/api/datasets/{REPO}/revision/main"):
            return self._json({"id": REPO, "sha": self._head(), "private": hub["private"],
                               "siblings": [{"rfilename": p} for p in hub["files"]]})
        self._json({"error": f"stub does not know GET {path}"}, 404)

    def _commit(self, body: bytes):
        hub = self.server.hub
        if hub["on_commit"]:  # the uploading process is killed as its commit arrives: the commit never lands,
            hub["on_commit"]()  # as when a process dies between its pre-upload and its commit
            self.close_connection = True
            return None
        if hub["fail_after"] is not None and len(hub["commits"]) >= hub["fail_after"]:
            return self._json({"error": "stub: the connection was cut here"}, 422)  # 422: not retried, fast
        lines = [json.loads(line) for line in body.splitlines()]
        commit = {"summary": lines[0]["value"]["summary"], "added": [], "deleted": []}
        files = dict(hub["files"])
        for item in lines[1:]:
            value = item["value"]
            if item["key"] == "file":
                files[value["path"]] = base64.b64decode(value["content"])
                commit["added"].append(value["path"])
            elif item["key"] == "deletedFile":
                if files.pop(value["path"], None) is None:  # the Hub refuses to delete what is not there
                    return self._json({"error": f"A file with this name doesn't exist: {value['path']}"}, 404)
                commit["deleted"].append(value["path"])
            else:
                return self._json({"error": f"stub does not take {item['key']} lines"}, 422)
        hub["files"] = files  # a commit lands whole or not at all
        hub["commits"].append(commit)
        return self._json({"commitUrl": f"{self._base()}/datasets/{REPO}/commit/{self._head()}",
                           "commitOid": self._head(), "success": True})

    def _entry(self, path: str, data: bytes) -> dict:
        if path.endswith((".parquet", ".png")):  # stored as LFS on the Hub: the listing gives their sha256
            pointer = f"version https://git-lfs.github.com/spec/v1\noid sha256:{hashlib.sha256(data).hexdigest()}\n"
            return {"type": "file", "path": path, "size": len(data), "oid": _blob_id(pointer.encode()),
                    "lfs": {"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": len(pointer)}}
        return {"type": "file", "path": path, "size": len(data), "oid": _blob_id(data)}

    def _head(self) -> str:
        return hashlib.sha1(str(len(self.server.hub["commits"])).encode()).hexdigest()

    def _base(self) -> str:
        return f"http://127.0.0.1:{self.server.server_port}"



@pytest.fixture
def hub(monkeypatch):
    server = ThreadingHTTPServer(("127.0.0.1", 0), Hub)
    server.hub = {"files": {}, "commits": [], "creates": [], "exists": False, "fail_after": None, "private": False,
                  "on_commit": None, "tree_answer": None}
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{server.server_port}")
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    yield server.hub
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def builds(builder_original_run, tmp_path_factory) -> dict[str, Path]:
    """The same run built twice: `many` shards (20KB each) and, rebuilt, `few` (one shard per config)."""
    root = tmp_path_factory.mktemp("publishing")
    build([builder_original_run], root / "many", max_shard_size="20KB", quiet=True)
    build([builder_original_run], root / "few", quiet=True)
    return {"many": root / "many", "few": root / "few"}


def _files(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def _upload(folder: Path, capsys, *options: str) -> tuple[int, str, str]:
    code = main(["upload", str(folder), REPO, *options])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _assert_card_names_existing_files(files: dict[str, bytes]) -> None:
    """The published manifest names only files the repository holds, with those contents."""
    for line in files["SHA256SUMS"].decode().splitlines():
        digest, name = line.split("  ", 1)
        assert name in files and hashlib.sha256(files[name]).hexdigest() == digest, name


@pytest.mark.slow
def test_reupload_of_a_rebuild_with_fewer_shards_deletes_the_stale_ones_and_keeps_the_users(hub, builds, capsys):
    assert _upload(builds["many"], capsys)[0] == 0
    hub["files"].update(USER_FILES)
    old_sft = {p for p in hub["files"] if fnmatch.fnmatch(p, "sft/train-*.parquet")}
    assert len(old_sft) > 1  # the first build really had several sft shards

    code, out, err = _upload(builds["few"], capsys)
    assert code == 0, err
    assert hub["files"] == {**_files(builds["few"]), **USER_FILES}  # stale shards gone, the user's files kept
    # the card's data_files glob matches exactly the new build's shards again (it matched both before the fix)
    assert sorted(p for p in hub["files"] if fnmatch.fnmatch(p, "sft/train-*.parquet")) == \
        ["sft/train-00000-of-00001.parquet"]
    deleted = set(hub["commits"][-1]["deleted"])
    assert old_sft <= deleted and not deleted & set(USER_FILES)
    assert f"deleted {len(deleted)} stale file(s)" in out
    # the rule that decides what may be deleted covers every file a build writes, and none of the user's
    from medbanana.builder.upload import built_by_medbanana

    assert all(built_by_medbanana(p) for p in {**_files(builds["many"]), **_files(builds["few"])})
    assert not any(built_by_medbanana(p) for p in USER_FILES)


def test_an_upload_is_one_commit_of_data_card_and_deletions(hub, builds, capsys):
    code, _out, err = _upload(builds["many"], capsys)
    assert code == 0, err
    (first,) = hub["commits"]  # data and card together: no revision holds one without the other
    assert set(first["added"]) == set(_files(builds["many"])) and first["deleted"] == []

    hub["files"].update(USER_FILES)
    assert _upload(builds["few"], capsys)[0] == 0
    first, second = hub["commits"]
    assert CARD <= set(second["added"]) and second["deleted"]  # the new card and the stale files' removal, at once
    assert {p for p in hub["files"] if p not in USER_FILES} == set(_files(builds["few"]))
    _assert_card_names_existing_files(hub["files"])


def test_an_upload_killed_before_its_commit_leaves_the_previous_dataset_and_resumes(hub, builds, capsys):
    """The real CLI in its own process, killed (SIGKILL) by the Hub stand-in when its one commit arrives: the data
    was uploaded ahead, but the repository still holds exactly the previous dataset; the same command then finishes."""
    assert _upload(builds["few"], capsys)[0] == 0
    before = dict(hub["files"])
    proc = None

    def kill_it():
        proc.kill()
        proc.wait()

    hub["on_commit"] = kill_it
    proc = subprocess.Popen([sys.executable, "-m", "medbanana", "upload", str(builds["many"]), REPO],
                            env=os.environ.copy(), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.communicate(timeout=300)
    assert proc.returncode == -9
    assert hub["files"] == before and len(hub["commits"]) == 1  # nothing of the killed upload is published

    hub["on_commit"] = None
    code, _out, err = _upload(builds["many"], capsys)
    assert code == 0, err
    assert hub["files"] == _files(builds["many"]) and len(hub["commits"]) == 2
    _assert_card_names_existing_files(hub["files"])


def test_an_upload_cut_off_at_its_commit_leaves_the_previous_card_and_says_how_to_resume(hub, builds, capsys):
    assert _upload(builds["few"], capsys)[0] == 0
    before = dict(hub["files"])
    hub["fail_after"] = len(hub["commits"])  # the next commit is refused, as if the line were cut there
    code, out, err = _upload(builds["many"], capsys)
    assert code == 1 and out == ""
    assert hub["files"] == before
    assert len(err.strip().splitlines()) == 1 and "run the same command again to resume" in err


def test_an_answer_the_client_cannot_read_is_one_scrubbed_line(hub, builds, capsys):
    """A 200 with JSON huggingface_hub does not expect (here: the file listing) ends the upload with one line naming
    the step and the endpoint, never a traceback and never the token."""
    hub["tree_answer"] = {"unexpected": True, "echo": f"Bearer {TOKEN}"}
    code, out, err = _upload(builds["few"], capsys)
    assert code == 1 and out == ""
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert "listing the files" in err and "cannot read" in err and TOKEN not in err


def test_visibility_is_sent_only_when_asked_for(hub, builds, capsys):
    for options, expected in (((), None), (("--private",), "private"), (("--public",), "public")):
        hub["exists"] = False
        code, _out, err = _upload(builds["few"], capsys, *options)
        assert code == 0, err
        create = hub["creates"][-1]
        assert create.get("visibility") == expected and "private" not in create, options
    with pytest.raises(SystemExit):  # one or the other
        main(["upload", str(builds["few"]), REPO, "--private", "--public"])
    assert "not allowed with argument" in capsys.readouterr().err


def test_private_into_an_existing_public_repository_is_refused_before_anything_is_sent(hub, builds, capsys):
    hub["exists"], hub["private"] = True, False
    code, _out, err = _upload(builds["few"], capsys, "--private")
    assert code == 1 and "already exists and is public" in err and "nothing was uploaded" in err
    assert hub["files"] == {} and hub["commits"] == []
    hub["private"] = True  # made private on the Hub: the same command now publishes
    code, _out, err = _upload(builds["few"], capsys, "--private")
    assert code == 0, err
    assert hub["files"] == _files(builds["few"])


@pytest.mark.slow
def test_a_second_upload_of_the_same_folder_sends_nothing(hub, builds, tmp_path):
    """Run as the installed command, in a fresh process that reads HF_ENDPOINT at import like any user's."""
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf_home"), "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
    command = [str(Path(sys.executable).with_name("medbanana")), "upload", str(builds["few"]), REPO]
    first = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120, check=False)
    assert first.returncode == 0 and first.stdout.startswith("uploaded "), first.stderr
    commits, files = len(hub["commits"]), dict(hub["files"])

    second = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120, check=False)
    assert second.returncode == 0, second.stderr
    assert second.stdout.startswith(f"nothing to upload: {REPO} is up to date") and "uploaded" not in second.stdout
    assert len(hub["commits"]) == commits and hub["files"] == files


def test_upload_help_tells_the_upload_as_it_happens_one_commit(hub, builds, capsys):
    """`upload --help` says one commit; an upload of a build of many shards is exactly one commit."""
    with pytest.raises(SystemExit):
        main(["upload", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "in ONE commit" in text and "several commits" not in text and "never a mix" in text
    assert _upload(builds["many"], capsys)[0] == 0
    assert len(hub["commits"]) == 1 and len(hub["commits"][0]["added"]) == len(_files(builds["many"]))
