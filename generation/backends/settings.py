"""What the command line sets for each backend, as frozen plain values (picklable: each worker process builds its
own backends from them). `share(n)` is one of n processes' part: the client-side rate limits divided by n, so
that together they keep to them. `options(out, roles)` is each role's constructor options for a run writing to
OUT: the API backends share one transport per run (one rate limit per model, one request cache under the run
directory, so a resumed run never pays twice for a finished call).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import ClassVar
from ..failures import UsageError

CACHE_DIR = "medbanana-cache"  # under the run directory, one folder per API backend


def batch_files_dir(run_dir: Path) -> Path:
    """Where `--batch` keeps a job's request and results files (JSONL, each can be gigabytes) while it runs."""
    return Path(run_dir) / CACHE_DIR / "batches"


def remove_batch_files(run_dir: Path) -> int:
    """Remove the batch files; how many there were. Called when a run is opened (the lock held: a file there was
    left by a process that is gone, and none is needed, as a job whose answers are not all in the request cache is
    polled and its results fetched again) and when a batch run ends."""
    removed = 0
    for path in batch_files_dir(run_dir).glob("*.jsonl"):
        path.unlink(missing_ok=True)
        removed += 1
    return removed


def _part(limit: float | None, n: int) -> float | None:
    return limit / n if limit else limit


@dataclass(frozen=True)
class _APISettings:
    """What the API backends share: where the server is, the client-side request rate, retries, and whether the
    writer sees the source image. A subclass names its backend, the roles it can play, its transport and each
    role's own options."""

    backend: ClassVar[str]  # its name in `roles`
    can_play: ClassVar[tuple[str, ...]]  # the roles it has a backend for
    base_url: str | None = None
    rpm: float | None = None
    timeout: float = 180.0
    max_attempts: int = 6
    retry_base_delay: float = 2.0
    image_aware_writer: bool = True

    def share(self, n: int):
        return replace(self, rpm=_part(self.rpm, n))

    def options(self, out: Path, roles: dict[str, str]) -> dict[str, dict]:
        played = [role for role in self.can_play if roles.get(role) == self.backend]
        if not played:
            return {}
        transport = self.transport(Path(out) / CACHE_DIR / self.backend)
        options = {role: {"transport": transport, **self.role_options(role, transport)} for role in played}
        if "writer" in options:
            options["writer"]["image_aware"] = self.image_aware_writer
        return options

    def transport_options(self, cache_dir: Path) -> dict:
        return dict(base_url=self.base_url, timeout=self.timeout, max_attempts=self.max_attempts, rpm=self.rpm,
                    retry_base_delay=self.retry_base_delay, cache_dir=cache_dir)

    def transport(self, cache_dir: Path):
        """The run's one transport, shared by every role this backend plays."""
        raise NotImplementedError

    def role_options(self, role: str, transport) -> dict:
        """The constructor options of `role`'s backend besides the transport (and the writer's image_aware)."""
        raise NotImplementedError


@dataclass(frozen=True)
class GeminiSettings(_APISettings):
    """The `gemini` writer, editor and judge: key from GEMINI_API_KEY or GOOGLE_API_KEY; a role without a model of
    its own gets its backend's default. `vertex`: Vertex AI through the same client, in `vertex_project` and
    `vertex_location` (else the SDK's GOOGLE_CLOUD_PROJECT / GOOGLE_CLOUD_LOCATION; GOOGLE_GENAI_USE_VERTEXAI=true
    does what `vertex` does)."""

    backend = "gemini"
    can_play = ("writer", "editor", "judge")
    writer_model: str | None = None
    editor_model: str | None = None
    judge_model: str | None = None
    tpm: float | None = None
    vertex: bool = False
    vertex_project: str | None = None
    vertex_location: str | None = None

    def share(self, n: int) -> GeminiSettings:
        return replace(super().share(n), tpm=_part(self.tpm, n))

    def transport(self, cache_dir: Path):
        from .gemini_client import VertexTarget
        from .gemini_transport import GeminiTransport

        vertex = VertexTarget(self.vertex_project, self.vertex_location) if self.vertex else None
        return GeminiTransport(tpm=self.tpm, vertex=vertex, **self.transport_options(cache_dir))

    def role_options(self, role: str, transport) -> dict:
        model = {"writer": self.writer_model, "editor": self.editor_model, "judge": self.judge_model}[role]
        return {"model": model} if model else {}


@dataclass(frozen=True)
class OpenAISettings(_APISettings):
    """The `openai` writer and judge: key from OPENAI_API_KEY; `model` serves both roles unless one is named.
    `zero_retention`: the user attests that a remote endpoint keeps no data (generation/destinations.py)."""

    backend = "openai"
    can_play = ("writer", "judge")
    model: str | None = None
    writer_model: str | None = None
    judge_model: str | None = None
    structured_output: str = "json_schema"
    zero_retention: bool = False

    def transport(self, cache_dir: Path):
        from .openai_compatible import OpenAITransport

        return OpenAITransport(**self.transport_options(cache_dir))

    def role_options(self, role: str, transport) -> dict:
        model = {"writer": self.writer_model, "judge": self.judge_model}[role] or self.model
        if not model:
            raise UsageError(f"the openai {role} needs a model: --openai-model (or --{role}-model), as the "
                             f"server at {transport.base_url or 'api.openai.com'} names it")
        return {"model": model, **({"structured_output": self.structured_output} if role == "judge" else {})}


@dataclass(frozen=True)
class SimulatorSettings:
    """The offline `simulator` editor's options: `drift`, the share of its edits whose frame moves as real editors'
    do (simulator/drift.py), for the geometry guard's paths offline."""

    drift: float = 0.0

    def share(self, n: int) -> SimulatorSettings:
        return self

    def options(self, out: Path, roles: dict[str, str]) -> dict[str, dict]:
        if roles.get("editor") != "simulator" or not self.drift:
            return {}
        return {"editor": {"drift": self.drift}}


@dataclass(frozen=True)
class DiffusersSettings:
    """The `diffusers` editor (DiffusersEditor's options; `model` is --editor-model)."""

    model: str | None = None
    steps: int = 20
    guidance_scale: float = 7.5
    image_guidance_scale: float = 1.5
    resolution: int = 512
    dtype: str = "auto"
    device: str = "auto"
    batch_size: int = 4
    attention: bool = False
    attention_dir: str | Path | None = None

    def share(self, n: int) -> DiffusersSettings:
        return self  # no client-side limits: a local model

    def options(self, out: Path, roles: dict[str, str]) -> dict[str, dict]:
        if roles.get("editor") != "diffusers":
            return {}
        return {"editor": {name: getattr(self, name) for name in self.__dataclass_fields__}}
