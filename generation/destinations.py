"""Where images go and what kind of data they are: destinations, data-use classes, and the gate between them.

Data-use classes (`prepare` records one per image in the sources folder's `prepare_manifest.jsonl`):

    credentialed  PhysioNet credentialed data (MIMIC-CXR-JPG, DICOM from it): its agreement forbids sharing the data
                  with third parties, online APIs included
    open          a dataset under its own public licence (Kaggle Brain Tumor MRI, ODIR-5K), recorded with it
    unknown       anything else: `prepare folders` unless `--data-use CLASS` says otherwise, folders never prepared
    synthetic     images medbanana made (the demo's phantoms)

Destination classes, from the backend kind (and for an OpenAI-compatible server from its URL's host):

    local               the simulator, the diffusers editor, an OpenAI-compatible server on a loopback address
    cloud-no-retention  Vertex AI, or an OpenAI-compatible endpoint the user attests (--attest-endpoint zero-retention)
    cloud               the Gemini Developer API (whatever its base URL), any other remote URL, a backend not known here

The gate: credentialed images never go to a `cloud` destination (refused before any connection); unknown ones going
there get one warning line. Everything here is a pure function of its arguments (`environ` is read, never changed),
except `sources_data_use`, which reads one manifest.
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Mapping
from urllib.parse import urlsplit

from .files import not_regular, read_jsonl
from .secrets import scrub
from .failures import UsageError

MANIFEST = "prepare_manifest.jsonl"  # what `prepare` writes beside the dataset folders, one JSON line per image
CREDENTIALED, OPEN, UNKNOWN, SYNTHETIC = "credentialed", "open", "unknown", "synthetic"
DATA_USE_CLASSES = (CREDENTIALED, OPEN, UNKNOWN, SYNTHETIC)  # strictest first
LOCAL, NO_RETENTION, CLOUD = "local", "cloud-no-retention", "cloud"
DESTINATION_CLASSES = (LOCAL, NO_RETENTION, CLOUD)
ACCEPTED = {CREDENTIALED: (LOCAL, NO_RETENTION), UNKNOWN: DESTINATION_CLASSES, OPEN: DESTINATION_CLASSES,
            SYNTHETIC: DESTINATION_CLASSES}
ZERO_RETENTION = "zero-retention"  # what --attest-endpoint takes
ROLES = ("writer", "editor", "judge")  # in the order a round calls them

# The SDKs' own variables that move an endpoint (read here so that the destination is the one the call reaches).
GEMINI_BASE_VARIABLE, VERTEX_BASE_VARIABLE = "GOOGLE_GEMINI_BASE_URL", "GOOGLE_VERTEX_BASE_URL"
OPENAI_BASE_VARIABLE = "OPENAI_BASE_URL"
VERTEX_VARIABLE = "GOOGLE_GENAI_USE_VERTEXAI"
PROJECT_VARIABLE, LOCATION_VARIABLE = "GOOGLE_CLOUD_PROJECT", "GOOGLE_CLOUD_LOCATION"
GEMINI_API = "https://generativelanguage.googleapis.com"
OPENAI_API = "https://api.openai.com/v1"
LOCAL_BACKENDS = {"simulator": "this process", "diffusers": None}  # diffusers: where = its model folder or id

# Google's documented shapes: a project id is 6-30 lowercase letters, digits and hyphens, starting with a letter and
# not ending with a hyphen (older projects may carry a domain prefix, `example.com:name`), or a project number; a
# location is `global`, a multi-region (`us`, `eu`) or a region such as us-central1 or northamerica-northeast2.
_PROJECT = re.compile(r"(?:[a-z][a-z0-9.-]{0,61}[a-z0-9]:)?[a-z][a-z0-9-]{4,28}[a-z0-9]|[0-9]{1,20}")
_LOCATION = re.compile(r"global|us|eu|[a-z]{2,20}-[a-z]{2,20}[0-9]{1,2}")


class DestinationRefused(UsageError):
    """A destination the command may not use (a malformed one, or one the data's class forbids): one line, exit 2."""


@dataclass(frozen=True)
class Destination:
    """One place images go: the roles sent there, the backend, its host (host[:port]) or model path, its class."""

    roles: tuple[str, ...]
    backend: str
    where: str
    kind: str  # one of DESTINATION_CLASSES
    attested: bool = False  # cloud-no-retention because the user attested it (--attest-endpoint zero-retention)
    url: str = ""  # an API backend's base URL as the calls use it ("" for Vertex AI's own endpoints and local ones)

    def describe(self) -> str:
        """E.g. "the writer and judge at api.example.org (openai, cloud)"."""
        roles = " and ".join(self.roles) if len(self.roles) < 3 else "writer, editor and judge"
        attested = ", attested zero-retention" if self.attested else ""
        return f"the {roles} at {printable(self.where)} ({self.backend}, {self.kind}{attested})"

    def to_json(self, classes: Iterable[str] = ()) -> dict:
        return {"roles": list(self.roles), "backend": self.backend, "where": self.where, "class": self.kind,
                "attested": self.attested, "url": scrub(self.url),  # a key in its query is not recorded
                "data_use": sorted(set(classes), key=DATA_USE_CLASSES.index)}


def printable(value) -> str:
    """A value from the command line or a file as one line of plain text (control characters escaped)."""
    return "".join(c if c.isprintable() else ascii(c)[1:-1] for c in str(value))


# ---------------------------------------------------------------- checks of what names a destination

def is_loopback(host: str | None) -> bool:
    """Whether `host` is this machine: `localhost` or a loopback address (127.0.0.0/8, ::1)."""
    if not host:
        return False
    if host.lower().rstrip(".") == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_base_url(url: str, what: str) -> None:
    """DestinationRefused unless `url` is https:// (or http:// to a loopback host) with a host and no user-info.
    `what` names where it came from (an option or a variable) in the message."""
    try:
        parts = urlsplit(url)
        host, _ = parts.hostname, parts.port  # a port that is not a number raises here
    except ValueError:
        raise DestinationRefused(f"{what}: {printable(url)!r} is not a URL") from None
    if "@" in parts.netloc:  # user-info: a password would travel with every request, and into logs
        raise DestinationRefused(f"{what}: a base URL holds no user name or password (put a key in the backend's "
                                 "key variable instead)")
    if parts.scheme not in ("https", "http") or not host:
        raise DestinationRefused(f"{what}: {printable(url)!r} is not an https:// URL with a host")
    if parts.scheme == "http" and not is_loopback(host):
        raise DestinationRefused(f"{what}: {printable(url)!r} is plain http:// to another machine; use https:// "
                                 "(plain http:// only to this machine: localhost, 127.0.0.1, ::1)")


def check_vertex(project: str | None, location: str | None, what: str = "Vertex AI") -> None:
    """DestinationRefused unless the project and location (each may be None) have the shapes Google documents."""
    if project is not None and not _PROJECT.fullmatch(project):
        raise DestinationRefused(f"{what} project {printable(project)!r} is not a Google Cloud project id (6-30 "
                                 "lowercase letters, digits and hyphens, starting with a letter) or number")
    if location is not None and not _LOCATION.fullmatch(location):
        raise DestinationRefused(f"{what} location {printable(location)!r} is not a Google Cloud location (global, "
                                 "us, eu, or a region such as us-central1)")


def _netloc(url: str) -> str:
    parts = urlsplit(url)
    host = parts.hostname or ""
    host = f"[{host}]" if ":" in host else host
    return f"{host}:{parts.port}" if parts.port else host


# ---------------------------------------------------------------- destinations

def destinations(roles: Mapping[str, str], *, gemini=None, openai=None, diffusers=None,
                 environ: Mapping[str, str] | None = None) -> list[Destination]:
    """Where each role's requests go, grouped by destination, from the chosen backends and their settings alone.

    `roles`: role -> backend name (writer, editor, judge; a role left out sends nothing). `gemini`, `openai`,
    `diffusers`: the backends' settings (backends/settings.py: GeminiSettings with base_url, vertex, vertex_project,
    vertex_location; OpenAISettings with base_url and zero_retention, which the user attests with
    --attest-endpoint zero-retention; DiffusersSettings with model), or any object with those attributes, None for
    defaults. The SDKs' variables in `environ` (default os.environ) count as they do for the calls.
    Raises DestinationRefused for a malformed base URL or Vertex AI project or location. No side effects."""
    environ = os.environ if environ is None else environ
    attest = bool(getattr(openai, "zero_retention", False))
    found: dict[tuple, list[str]] = {}
    for role, backend in roles.items():
        if backend:
            found.setdefault(_place(backend, gemini, openai, diffusers, attest, environ), []).append(role)
    return [Destination(tuple(r), *key) for key, r in found.items()]


def _place(backend: str, gemini, openai, diffusers, attest: bool, environ) -> tuple[str, str, str, bool, str]:
    """(backend, where, class, attested, url) of one backend."""
    if backend == "gemini":
        if vertex_on(gemini, environ):
            return ("gemini", vertex_host(gemini, environ), NO_RETENTION, False, environ.get(VERTEX_BASE_VARIABLE, ""))
        url, what = _given(getattr(gemini, "base_url", None), GEMINI_BASE_VARIABLE, GEMINI_API, environ)
        check_base_url(url, what)
        return ("gemini", _netloc(url), CLOUD, False, url)  # the Gemini Developer API, whichever host serves it
    if backend == "openai":
        url, what = _given(getattr(openai, "base_url", None), OPENAI_BASE_VARIABLE, OPENAI_API, environ)
        check_base_url(url, what)
        if is_loopback(urlsplit(url).hostname):
            return ("openai", _netloc(url), LOCAL, False, url)
        return ("openai", _netloc(url), NO_RETENTION if attest else CLOUD, attest, url)
    if backend in LOCAL_BACKENDS:
        where = LOCAL_BACKENDS[backend] or str(getattr(diffusers, "model", None) or "(no model given)")
        return (backend, where, LOCAL, False, "")
    return (backend, backend, CLOUD, False, "")  # registered elsewhere: medbanana cannot tell where it sends images


def vertex_on(gemini, environ: Mapping[str, str] | None = None) -> bool:
    """Whether the gemini backend calls Vertex AI: its settings say so, or the SDK's GOOGLE_GENAI_USE_VERTEXAI."""
    environ = os.environ if environ is None else environ
    return bool(getattr(gemini, "vertex", False)) or environ.get(VERTEX_VARIABLE, "").strip().lower() in ("true", "1")


def _given(option: str | None, variable: str, default: str, environ) -> tuple[str, str]:
    if option:
        return option, "the base URL"
    if environ.get(variable):
        return environ[variable], variable
    return default, "the default base URL"


def vertex_host(gemini, environ: Mapping[str, str] | None = None) -> str:
    """host[:port] Vertex AI calls go to: GOOGLE_VERTEX_BASE_URL, else the location's regional endpoint (checked)."""
    environ = os.environ if environ is None else environ
    project = getattr(gemini, "vertex_project", None) or environ.get(PROJECT_VARIABLE) or None
    location = getattr(gemini, "vertex_location", None) or environ.get(LOCATION_VARIABLE) or None
    check_vertex(project, location)
    if environ.get(VERTEX_BASE_VARIABLE):
        check_base_url(environ[VERTEX_BASE_VARIABLE], VERTEX_BASE_VARIABLE)
        return _netloc(environ[VERTEX_BASE_VARIABLE])
    if not project or (location or "global") == "global":  # express mode (an API key) and `global` alike
        return "aiplatform.googleapis.com"
    return f"{location}-aiplatform.googleapis.com"


# ---------------------------------------------------------------- data-use classes of a sources folder

@dataclass(frozen=True)
class DataUse:
    """A dataset folder's data-use class and the licences its manifest names."""

    kind: str
    licences: tuple[str, ...] = ()


def sources_data_use(sources: Path) -> dict[str, DataUse]:
    """Dataset folder name -> its data-use class, from `prepare_manifest.jsonl` in SOURCES (or in its parent folder
    when SOURCES is one dataset folder of a prepared folder). A dataset whose rows disagree takes the strictest
    class; rows without one, and datasets the manifest does not list, are `unknown` (callers: `.get(name)` is None
    for those). Reads that one file, a regular file only; nothing else."""
    sources = Path(sources)
    for folder in (sources, sources.parent):
        path = folder / MANIFEST
        if not_regular(path) is None:
            rows = [r for r in read_jsonl(path) if isinstance(r, dict) and isinstance(r.get("dataset"), str)]
            if folder == sources or any(r["dataset"] == sources.name for r in rows):
                return _by_dataset(rows)
    return {}


def _by_dataset(rows: list[dict]) -> dict[str, DataUse]:
    kinds: dict[str, set[str]] = {}
    licences: dict[str, set[str]] = {}
    for row in rows:
        kind = row.get("data_use") if row.get("data_use") in DATA_USE_CLASSES else UNKNOWN
        kinds.setdefault(row["dataset"], set()).add(kind)
        if isinstance(row.get("licence"), str) and row["licence"]:
            licences.setdefault(row["dataset"], set()).add(row["licence"])
    return {name: DataUse(strictest(found), tuple(sorted(licences.get(name, ())))) for name, found in kinds.items()}


def strictest(classes: Iterable[str]) -> str:
    """The strictest of some data-use classes (credentialed > unknown > open > synthetic); unknown when none."""
    order = (CREDENTIALED, UNKNOWN, OPEN, SYNTHETIC)
    found = set(classes)
    return next((c for c in order if c in found), UNKNOWN)


def classes_of(datasets: Iterable[str], data_use: Mapping[str, DataUse]) -> dict[str, set[str]]:
    """Data-use class -> the dataset folders of that class among `datasets` (unlisted ones are unknown)."""
    found: dict[str, set[str]] = {}
    for name in datasets:
        found.setdefault(data_use[name].kind if name in data_use else UNKNOWN, set()).add(name)
    return found


# ---------------------------------------------------------------- the gate

def gate(places: Iterable[Destination], classes: Mapping[str, Iterable[str]], command: str = "generate") -> list[str]:
    """The warning lines for sending images of `classes` (class -> dataset names) to `places`; raises
    DestinationRefused (one line: the class, the destination, what would be accepted) when one may not go there."""
    places = list(places)
    for kind in DATA_USE_CLASSES:
        datasets = sorted(classes.get(kind, ()))
        refused = [p for p in places if datasets and p.kind not in ACCEPTED[kind]]
        if refused:
            raise DestinationRefused(
                f"{kind} images ({_names(datasets)}) would go to {refused[0].describe()}; {kind} data goes only to "
                f"{' or '.join(ACCEPTED[kind])} destinations: a loopback OpenAI-compatible server, the diffusers "
                f"editor or the simulator, Vertex AI (--vertex), or an OpenAI-compatible endpoint you attest with "
                f"--attest-endpoint {ZERO_RETENTION}. Nothing was sent (see docs/data-destinations.md)")
    datasets = sorted(classes.get(UNKNOWN, ()))
    clouds = [p for p in places if p.kind == CLOUD]
    if datasets and clouds:
        return [f"images of unknown data use ({_names(datasets)}) go to {clouds[0].describe()}"
                f"{f' and {len(clouds) - 1} more' if len(clouds) > 1 else ''}: make sure their terms allow it "
                f"(`prepare folders --data-use CLASS` records a class)"]
    return []


def _names(datasets: list[str]) -> str:
    shown = ", ".join(printable(d) for d in datasets[:3])
    return shown + (f" and {len(datasets) - 3} more" if len(datasets) > 3 else "")


# ---------------------------------------------------------------- what a run records

def record_destinations(places: Iterable[Destination], classes: Iterable[str], earlier=None) -> list[dict]:
    """medbanana-run.json's `destinations`: each destination with the data-use classes sent there, merged with
    what `earlier` (the run's list before this command) records, so that a resumed run keeps every destination."""
    merged: dict[tuple, dict] = {}
    for entry in [*(earlier if isinstance(earlier, list) else []), *(p.to_json(classes) for p in places)]:
        if not isinstance(entry, dict):
            continue
        key = (entry.get("backend"), entry.get("where"), entry.get("class"))
        old = merged.setdefault(key, {**entry, "roles": [], "data_use": []})
        roles = set(old["roles"]) | {r for r in entry.get("roles") or () if isinstance(r, str)}
        old["roles"] = sorted(roles, key=lambda r: (ROLES.index(r) if r in ROLES else len(ROLES), r))
        use = set(old["data_use"]) | {c for c in entry.get("data_use") or () if c in DATA_USE_CLASSES}
        old["data_use"] = sorted(use, key=DATA_USE_CLASSES.index)
    return list(merged.values())


def describe_recorded(entries) -> list[str]:
    """One line per recorded destination, e.g. "editor at 127.0.0.1:8000 (openai, local): credentialed, open"."""
    lines = []
    for entry in entries if isinstance(entries, list) else []:
        if isinstance(entry, dict):
            roles = " and ".join(map(printable, entry.get("roles") or ())) or "(no role)"
            use = ", ".join(map(printable, entry.get("data_use") or ())) or "no class recorded"
            lines.append(f"{roles} at {printable(entry.get('where'))} ({printable(entry.get('backend'))}, "
                         f"{printable(entry.get('class'))}{', attested' if entry.get('attested') else ''}): {use}")
    return lines


def manifest_row(dataset: str, path: str, kind: str, licence: str | None = None, **fields) -> str:
    """One manifest line (JSON, newline-terminated) of an image with its data-use class."""
    return json.dumps({"dataset": dataset, "path": path, **fields, "data_use": kind, "licence": licence},
                      ensure_ascii=False) + "\n"
