"""How the google-genai client is made: the API key, Vertex AI, and the HTTP options every call goes out with.

One `genai.Client` serves the Gemini API and Vertex AI alike (its public constructor: `vertexai=True` with a project
and location, or Vertex AI express mode with an API key); the SDK's own environment variables
(GOOGLE_GENAI_USE_VERTEXAI, GOOGLE_CLOUD_PROJECT, GOOGLE_CLOUD_LOCATION) work as they do for any of its users.

The HTTP stack is the SDK's: its aiohttp transport when aiohttp is installed (the `google-genai[aiohttp]` extra,
which medbanana depends on), else httpx. Retries are http.Transport's, so the client's own are switched off with
public options: `HttpRetryOptions(attempts=1)`; without retry options the SDK would instead retry a refused or
dropped connection once by itself, after sleeping 1 to 10 s, under our per-call timeout. Every answer passes
guard.py (no redirect to another host, a size limit) through the public `HttpOptions(async_client_args=...)`.
On the Gemini API with no proxy and no netrc file in the environment, the client gets its aiohttp session through
the public `HttpOptions(aiohttp_client=...)`: the SDK's own, less its look-ups of them on every request
(`plain_session`).
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass, replace
from pathlib import Path
from urllib.request import getproxies

import google.auth
from google.auth import exceptions as auth_errors
from google import genai
from google.genai import types

from ..destinations import VERTEX_VARIABLE
from .guard import aiohttp_middlewares, httpx_event_hooks
from ..failures import UsageError

API_KEY_VARIABLES = ("GEMINI_API_KEY", "GOOGLE_API_KEY")
READ_BUFFER_SIZE = 2**22  # what the SDK's own aiohttp session reads at once (answers carry megabytes of base64)
CLOUD_PLATFORM = "https://www.googleapis.com/auth/cloud-platform"  # the scope the SDK asks ADC for


def resolve_api_key(api_key: str | None = None, *, required: bool = True) -> str | None:
    """The API key given, else the first of API_KEY_VARIABLES set; ValueError when `required` and there is none."""
    key = (api_key or next((os.environ[v] for v in API_KEY_VARIABLES if os.environ.get(v)), "")).strip()
    if not key and required:
        raise UsageError(f"no Gemini API key: set {' or '.join(API_KEY_VARIABLES)} to a key from "
                         "https://aistudio.google.com/apikey (`generate` also runs on Vertex AI: --vertex)")
    return key or None


@dataclass(frozen=True)
class VertexTarget:
    """Vertex AI as the endpoint: a Google Cloud project and location, signed in with `credentials` (a google.auth
    credentials object; None: Application Default Credentials, e.g. `gcloud auth application-default login`).
    Without a project (here or in GOOGLE_CLOUD_PROJECT) an API key is Vertex AI express mode."""

    project: str | None = None
    location: str | None = None
    credentials: object | None = None

    @classmethod
    def from_environment(cls) -> VertexTarget | None:
        """A target when GOOGLE_GENAI_USE_VERTEXAI is true (project and location from the SDK's variables)."""
        return cls() if os.environ.get(VERTEX_VARIABLE, "").strip().lower() in ("true", "1") else None

    @property
    def resolved_project(self) -> str | None:
        return self.project or os.environ.get("GOOGLE_CLOUD_PROJECT") or None

    @property
    def resolved_location(self) -> str:
        return self.location or os.environ.get("GOOGLE_CLOUD_LOCATION") or "global"

    @property
    def express(self) -> bool:
        """Whether calls are signed with an API key (no project, no credentials) rather than OAuth credentials."""
        return not self.resolved_project and self.credentials is None

    def describe(self) -> dict:
        """What a run records of the target (medbanana-run.json; --retry-failed reads it back): never credentials."""
        if self.express:
            return {"project": None, "location": None}
        return {"project": self.resolved_project, "location": self.resolved_location}

    def signed_in(self) -> VertexTarget:
        """This target with its credentials object: Application Default Credentials loaded here (google.auth's
        public `default`, as the SDK would load them) rather than inside the SDK, so that the access tokens they
        fetch can be read from `credentials.token` and scrubbed like a key. ValueError when there are none."""
        if self.express or self.credentials is not None:
            return self
        try:
            credentials, _ = google.auth.default(scopes=[CLOUD_PLATFORM])
        except auth_errors.DefaultCredentialsError as exc:
            raise UsageError(f"Vertex AI needs Application Default Credentials (GOOGLE_APPLICATION_CREDENTIALS, or "
                             f"`gcloud auth application-default login`): {' '.join(str(exc).split())}") from None
        return replace(self, credentials=credentials)


def environment_routes_requests() -> bool:
    """Whether aiohttp's `trust_env`, which the SDK's own session sets, would find anything for a request: a proxy
    in the environment (what urllib's `getproxies` reads: HTTP(S)_PROXY, ALL_PROXY, ...) or a netrc file (NETRC,
    else ~/.netrc: credentials it would send)."""
    if any(scheme != "no" for scheme in getproxies()):  # "no": NO_PROXY's exceptions, with no proxy to except from
        return True
    try:
        netrc = Path(os.environ["NETRC"]) if "NETRC" in os.environ else Path.home() / (
            "_netrc" if os.name == "nt" else ".netrc")
    except RuntimeError:  # no home folder: aiohttp finds no file either
        return False
    return netrc.exists()


def plain_session():
    """The aiohttp session of a Gemini API client in a plain environment (`environment_routes_requests` false),
    made in the running event loop: the SDK's own session but with `trust_env` off. With it on, aiohttp looks the
    proxy and netrc up again on a worker thread for every request: two thread hops, which cost ~5 ms a call on a
    busy event loop (docs/benchmarks.md); here there is nothing for them to find."""
    import aiohttp

    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), trust_env=False,
                                 read_bufsize=READ_BUFFER_SIZE)


def client_options(api_key: str | None, base_url: str | None, vertex: VertexTarget | None,
                   timeout: float) -> dict:
    """`genai.Client(**client_options(...))`: the endpoint, how calls are signed, and the HTTP options."""
    # The client's own timeout is a backstop; http.Transport's per-call timeout bounds the whole call.
    # aiohttp takes `middlewares` as a request argument, httpx (the SDK's fallback) `event_hooks` as a client one:
    # the SDK passes each only to the stack that knows it
    guards = {"middlewares": aiohttp_middlewares(), "event_hooks": httpx_event_hooks()}
    http_options = types.HttpOptions(timeout=int((timeout + 5) * 1000), async_client_args=guards,
                                     retry_options=types.HttpRetryOptions(attempts=1))
    if base_url:
        http_options.base_url = base_url
    if vertex is None:
        return {"api_key": api_key, "http_options": http_options}
    if vertex.express:
        if not api_key:
            raise UsageError(f"Vertex AI needs a project (--vertex-project or GOOGLE_CLOUD_PROJECT) or, in express "
                             f"mode, an API key ({' or '.join(API_KEY_VARIABLES)})")
        return {"vertexai": True, "api_key": api_key, "http_options": http_options}
    return {"vertexai": True, "project": vertex.resolved_project, "location": vertex.resolved_location,
            "credentials": vertex.credentials, "http_options": http_options}


class Clients:
    """The google-genai client a transport calls through. On the Gemini API in a plain environment (`plain`), one
    per event loop, made at its first use there with a `plain_session`, and closed in that loop: by `aclose`, or
    by asyncio.run as the loop ends. Otherwise the SDK's own client, made now (with its sessions, one per loop)."""

    def __init__(self, options: dict, *, plain: bool):
        self.options, self.plain = options, plain
        self._client = None if plain else genai.Client(**options)
        self._loop = self._open = None  # (plain) the loop of the client made, and what closes it there

    async def client(self) -> genai.Client:
        if not self.plain:
            return self._client
        loop = asyncio.get_running_loop()
        if self._client is None or self._loop is not loop:
            session = plain_session()
            http_options = self.options["http_options"].model_copy(update={"aiohttp_client": session})
            self._loop, self._client = loop, genai.Client(**{**self.options, "http_options": http_options})
            self._open = _open_until_closed(self._client, session)
            await anext(self._open)
        return self._client

    async def aclose(self) -> None:
        if not self.plain:
            await self._client.aio.aclose()
            return
        if self._open is not None and self._loop is asyncio.get_running_loop():  # another loop's closed with it
            await self._open.aclose()
        self._client = self._loop = self._open = None  # the next call, in this loop or another, makes a new client


async def _open_until_closed(client: genai.Client, session):
    """Suspended while `client` and its aiohttp session are in use; closes both in their event loop when closed:
    by Clients.aclose, or by asyncio.run, which closes every async generator before it closes its loop (a session
    left open would be reported as unclosed when collected)."""
    try:
        yield
    finally:
        await client.aio.aclose()
        await session.close()
