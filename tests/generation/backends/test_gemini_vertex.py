"""Gemini on Vertex AI through the same google-genai client, against the fake server's Vertex AI paths.

What the fake can show: the request path the SDK sends (project, location, publisher, model), how calls are signed
(an OAuth bearer token from the credentials, or the API key in express mode), that Application Default Credentials
are used and refreshed through their token endpoint, and that the answers are read as on the Gemini API.
"""

from __future__ import annotations

import asyncio
import json

import pytest
from google.oauth2.credentials import Credentials

from fake_runs import chest_source, mimic_sources
from service_account import service_account_file
from medbanana.cli import main
from medbanana.generation.backends import APIError
from medbanana.generation.backends.gemini import GeminiEditor, GeminiJudge, GeminiWriter
from medbanana.generation.backends.gemini_client import VertexTarget
from medbanana.generation.records import Task
from medbanana.generation.rundir import layout
from medbanana.generation.rundir.store import read_journal

KEY = "vertex-express-key-4b8e2d1a"
SDK_VARIABLES = ("GEMINI_API_KEY", "GOOGLE_API_KEY", "GOOGLE_GENAI_USE_VERTEXAI", "GOOGLE_CLOUD_PROJECT",
                 "GOOGLE_CLOUD_LOCATION", "GOOGLE_GEMINI_BASE_URL", "GOOGLE_VERTEX_BASE_URL",
                 "GOOGLE_APPLICATION_CREDENTIALS")


@pytest.fixture
def fake(echo_gemini, monkeypatch):
    for name in SDK_VARIABLES:  # only what each test sets
        monkeypatch.delenv(name, raising=False)
    echo_gemini.reset()
    echo_gemini.tokens.clear()
    return echo_gemini


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return chest_source(tmp_path_factory.mktemp("src"), size=96)


def a_round(options: dict, source) -> None:
    """Write, edit and judge one task through one transport."""
    task = Task("cxr_demo", "chest_xray", "Pleural_Effusion", "add", source.path)
    writer = GeminiWriter(timeout=10, max_attempts=1, **options)
    editor, judge = GeminiEditor(transport=writer.transport), GeminiJudge(transport=writer.transport)

    async def go():
        instruction = await writer.write(task, source, [])
        edited = await editor.edit(task, source, instruction.text, seed=1)
        await judge.judge(task, source, edited, instruction.text)

    asyncio.run(go())


def test_a_project_and_location_with_credentials_sign_calls_with_their_token(fake, source):
    target = VertexTarget("my-project", "europe-west4", Credentials(token="vertex-token-1c9e"))
    a_round({"base_url": fake.base_url, "vertex": target}, source)
    assert [(c.role, c.path, c.credential) for c in fake.calls] == [
        (role, f"projects/my-project/locations/europe-west4/publishers/google/models/{model}:generateContent",
         "Bearer vertex-token-1c9e")
        for role, model in (("writer", "gemini-2.5-pro"), ("editor", "gemini-2.5-flash-image"),
                            ("judge", "gemini-2.5-pro"))]


def test_express_mode_signs_with_the_api_key(fake, source):
    a_round({"base_url": fake.base_url, "vertex": VertexTarget(), "api_key": KEY}, source)
    assert {(c.path.split("/models/")[0], c.credential) for c in fake.calls} == {("publishers/google", KEY)}
    assert fake.count() == 3


def test_the_sdk_variables_choose_vertex_ai(fake, source, monkeypatch):
    monkeypatch.setenv("GOOGLE_GENAI_USE_VERTEXAI", "true")
    monkeypatch.setenv("GOOGLE_CLOUD_PROJECT", "env-project")
    monkeypatch.setenv("GOOGLE_CLOUD_LOCATION", "us-east5")
    monkeypatch.setenv("GOOGLE_VERTEX_BASE_URL", fake.base_url)
    monkeypatch.setenv("GEMINI_API_KEY", KEY)  # a project wins over a key from the environment, as in the SDK
    a_round({"vertex": VertexTarget(credentials=Credentials(token="env-token"))}, source)
    assert {(c.path.split("/publishers/")[0], c.credential) for c in fake.calls} == {
        ("projects/env-project/locations/us-east5", "Bearer env-token")}


def test_vertex_without_project_or_key_is_a_clear_error(fake):
    with pytest.raises(ValueError, match="Vertex AI needs a project .* or, in express mode, an API key"):
        GeminiWriter(base_url=fake.base_url, vertex=VertexTarget())


def test_refused_credentials_are_a_permanent_unauthenticated_failure(fake, source, tmp_path):
    expired = Credentials(token=None, refresh_token="r", client_id="c", client_secret="s",
                          token_uri=f"{fake.base_url}/no-such-endpoint")
    with pytest.raises(APIError) as caught:
        a_round({"base_url": fake.base_url, "vertex": VertexTarget("p", "us-central1", expired)}, source)
    assert caught.value.kind == "unauthenticated" and fake.count() == 0


def test_generate_vertex_runs_on_application_default_credentials(fake, tmp_path, monkeypatch, capfd):
    sources = mimic_sources(tmp_path / "sources", "MIMIC_vertex", per_class=1, size=64)
    adc = service_account_file(tmp_path, f"{fake.base_url}/token")
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(adc))
    monkeypatch.setenv("GOOGLE_VERTEX_BASE_URL", fake.base_url)
    out = tmp_path / "run"
    code = main(["generate", "--sources", str(sources), "--out", str(out), "--vertex", "--vertex-project", "proj-7",
                 "--vertex-location", "us-central1", "--diseases", "Pneumothorax", "--directions", "add",
                 "--max-rounds", "1", "--timeout", "10", "--max-attempts", "1", "-q"])
    assert code == 0, capfd.readouterr()
    records = [e["record"] for e in read_journal(out / layout.JOURNAL) if e["type"] == "task"]
    assert records and all(r["status"] in ("accepted", "failed") for r in records)
    assert fake.count() >= 3 and fake.tokens == ["fake-access-token-1"]  # one refresh serves the run
    assert {(c.path.split("/publishers/")[0], c.credential) for c in fake.calls} == {
        ("projects/proj-7/locations/us-central1", "Bearer fake-access-token-1")}
    written = b"".join(p.read_bytes() for p in out.rglob("*") if p.is_file())
    assert b"PRIVATE KEY" not in written and b"fake-access-token" not in written
    recorded = json.loads((out / layout.RUN_CONFIG).read_text())["backends"]  # what --retry-failed reads back
    assert {role: made.get("vertex") for role, made in recorded.items()} == dict.fromkeys(
        ("writer", "editor", "judge"), {"project": "proj-7", "location": "us-central1"})


def test_vertex_without_application_default_credentials_is_one_clear_line(fake, tmp_path, monkeypatch, capfd):
    sources = mimic_sources(tmp_path / "sources", "MIMIC_vertex", per_class=1, size=64)
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(tmp_path / "no-such-key.json"))
    code = main(["generate", "--sources", str(sources), "--out", str(tmp_path / "run"), "--vertex",
                 "--vertex-project", "proj-p", "-q"])
    err = capfd.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert "Application Default Credentials" in err and "no-such-key.json" in err and fake.count() == 0


def test_batch_on_vertex_is_refused_in_one_line(fake, tmp_path, capfd):
    sources = mimic_sources(tmp_path / "sources", "MIMIC_vertex", per_class=1, size=64)
    code = main(["generate", "--sources", str(sources), "--out", str(tmp_path / "run"), "--vertex",
                 "--vertex-project", "p", "--batch", "-q"])
    err = capfd.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "--batch" in err and "Vertex AI" in err
    assert fake.count() == 0
