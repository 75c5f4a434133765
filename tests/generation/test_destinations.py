"""generation/destinations.py's pure functions: each backend's destination class, the checks of what names a
destination, the gate's matrix, what a run records, and the data-use classes read from a sources manifest."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest

from medbanana.generation.destinations import (CLOUD, LOCAL, NO_RETENTION, DestinationRefused, check_base_url,
                                               check_vertex, classes_of, destinations, gate, record_destinations,
                                               sources_data_use)

ALL = {"writer": "gemini", "editor": "gemini", "judge": "gemini"}


def _one(roles, env=None, **settings):
    return [(d.roles, d.backend, d.where, d.kind) for d in destinations(roles, environ=env or {}, **settings)]


def test_each_backend_has_its_class_and_host():
    assert _one(ALL) == [(("writer", "editor", "judge"), "gemini", "generativelanguage.googleapis.com", CLOUD)]
    # the Gemini Developer API stays cloud wherever its base URL points
    assert _one(ALL, {"GOOGLE_GEMINI_BASE_URL": "http://127.0.0.1:9"})[0][2:] == ("127.0.0.1:9", CLOUD)
    vertex = SimpleNamespace(vertex=True, vertex_project="proj-a", vertex_location="europe-west4")
    assert _one(ALL, gemini=vertex)[0][2:] == ("europe-west4-aiplatform.googleapis.com", NO_RETENTION)
    assert _one(ALL, {"GOOGLE_GENAI_USE_VERTEXAI": "true"})[0][2:] == ("aiplatform.googleapis.com", NO_RETENTION)
    roles = {"writer": "openai", "editor": "diffusers", "judge": "simulator"}
    found = _one(roles, openai=SimpleNamespace(base_url="http://localhost:8000/v1"),
                 diffusers=SimpleNamespace(model="/models/ip2p"))
    assert found == [(("writer",), "openai", "localhost:8000", LOCAL), (("editor",), "diffusers", "/models/ip2p", LOCAL),
                     (("judge",), "simulator", "this process", LOCAL)]
    assert _one({"judge": "openai"}, {"OPENAI_BASE_URL": "https://[::1]:8443/v1"})[0][2:] == ("[::1]:8443", LOCAL)
    assert _one({"judge": "openai"})[0][2:] == ("api.openai.com", CLOUD)
    attested = destinations({"judge": "openai"}, environ={},
                            openai=SimpleNamespace(base_url="https://llm.example:8443/v1", zero_retention=True))
    assert [(d.where, d.kind, d.attested) for d in attested] == [("llm.example:8443", NO_RETENTION, True)]
    assert _one({"judge": "my.module:Judge"})[0][3] == CLOUD  # a backend medbanana does not know


@pytest.mark.parametrize("url,fine", [
    ("https://api.example.org/v1", True), ("http://127.0.0.1:8000/v1", True), ("http://localhost/v1", True),
    ("http://[::1]:1/v1", True), ("http://127.9.9.9/v1", True), ("http://10.0.0.5:8000/v1", False),
    ("http://example.org", False), ("https://user:pw@example.org/v1", False), ("https://@example.org", False),
    ("ftp://example.org", False), ("https:///v1", False), ("https://example.org:port/v1", False),
    ("http://127.0.0.1.evil.org/v1", False)])
def test_base_urls_are_https_or_loopback_without_user_info(url, fine):
    if fine:
        check_base_url(url, "the base URL")
    else:
        with pytest.raises(DestinationRefused):
            check_base_url(url, "the base URL")


@pytest.mark.parametrize("project,location,fine", [
    ("my-project-7", "us-central1", True), ("123456789012", "global", True), ("example.com:my-proj", "eu", True),
    ("proj-r", "northamerica-northeast2", True), ("proj-r", "127.0.0.1:8443#", False), ("p", "us-central1", False),
    ("proj-r", "us-central1.evil.org", False), ("Proj-R", "us", False), ("proj-r-", "us", False),
    ("proj/../x", "us", False), ("proj-r", "us-central1/x", False)])
def test_vertex_projects_and_locations_have_googles_shapes(project, location, fine):
    if fine:
        check_vertex(project, location)
    else:
        with pytest.raises(DestinationRefused):
            check_vertex(project, location)


def test_the_gate_refuses_credentialed_to_cloud_and_warns_for_unknown():
    local, kept, cloud = (destinations({"judge": "simulator"}, environ={}),
                          destinations(ALL, environ={"GOOGLE_GENAI_USE_VERTEXAI": "1"}), destinations(ALL, environ={}))
    for places in (local, kept):
        assert gate(places, {"credentialed": {"MIMIC"}, "open": {"brain"}}) == []
    with pytest.raises(DestinationRefused, match=r"credentialed images \(MIMIC\) would go to the writer, editor "
                                                r"and judge at generativelanguage.googleapis.com \(gemini, cloud\)"):
        gate(cloud, {"credentialed": {"MIMIC"}, "unknown": {"mine"}})
    [warning] = gate(cloud, {"unknown": {"mine"}, "open": {"brain"}, "synthetic": {"demo"}})
    assert warning.startswith("images of unknown data use (mine) go to")
    assert gate(cloud, {"open": {"brain"}, "synthetic": {"demo"}}) == []
    assert gate(local, {"unknown": {"mine"}}) == []


def test_a_run_records_every_destination_it_ever_sent_to():
    first = record_destinations(destinations(ALL, environ={}), {"unknown"})
    again = record_destinations(destinations({"writer": "gemini", "editor": "simulator", "judge": "gemini"},
                                             environ={}), {"credentialed"}, first)
    by_backend = {(e["backend"], e["where"]): e for e in again}
    gemini = by_backend[("gemini", "generativelanguage.googleapis.com")]
    assert gemini["roles"] == ["writer", "editor", "judge"] and gemini["data_use"] == ["credentialed", "unknown"]
    assert by_backend[("simulator", "this process")]["data_use"] == ["credentialed"]
    assert record_destinations([], set(), "not a list") == []


def test_data_use_classes_come_from_the_manifest(tmp_path):
    folder = tmp_path / "sources"
    (folder / "MIMIC_a").mkdir(parents=True)
    rows = [{"dataset": "MIMIC_a", "data_use": "credentialed"}, {"dataset": "MIMIC_a", "data_use": "open"},
            {"dataset": "brain_b", "data_use": "open", "licence": "CC0"}, {"dataset": "odir_c"},
            {"dataset": "odir_d", "data_use": "made-up"}, ["not", "a", "row"]]
    (folder / "prepare_manifest.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"torn')
    use = sources_data_use(folder)
    assert {name: u.kind for name, u in use.items()} == {"MIMIC_a": "credentialed", "brain_b": "open",
                                                          "odir_c": "unknown", "odir_d": "unknown"}
    assert use["brain_b"].licences == ("CC0",)
    assert sources_data_use(folder / "MIMIC_a")["MIMIC_a"].kind == "credentialed"  # the parent's manifest
    assert classes_of(["MIMIC_a", "brain_b", "never_prepared"], use) == {
        "credentialed": {"MIMIC_a"}, "open": {"brain_b"}, "unknown": {"never_prepared"}}
    (folder / "prepare_manifest.jsonl").unlink()
    os.mkfifo(folder / "prepare_manifest.jsonl")  # a FIFO is not read (opening it would block)
    assert sources_data_use(folder) == {}
