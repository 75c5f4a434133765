"""What the command line sets for each backend, as frozen plain values (picklable: each worker process builds its
own backends from them). `share(n)` is one of n processes' part: the client-side rate limits divided by n, so
that together they keep to them. `options(out, roles)` is each role's constructor options for a run writing to
OUT: the API backends share one transport per run (one rate limit per model, one request cache under the run
directory, so a resumed run never pays twice for a finished call).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

CACHE_DIR = "medbanana-cache"  # under the run directory, one folder per API backend


def _part(limit: float | None, n: int) -> float | None:
    return limit / n if limit else limit


@dataclass(frozen=True)
class GeminiSettings:
    writer_model: str | None = None
    editor_model: str | None = None
    judge_model: str | None = None
    rpm: float | None = None
    tpm: float | None = None
    timeout: float = 180.0
    max_attempts: int = 6
    retry_base_delay: float = 2.0
    image_aware_writer: bool = True
    base_url: str | None = None

    def share(self, n: int) -> GeminiSettings:
        return replace(self, rpm=_part(self.rpm, n), tpm=_part(self.tpm, n))

    def options(self, out: Path, roles: dict[str, str]) -> dict[str, dict]:
        if "gemini" not in roles.values():
            return {}
        from .gemini_transport import GeminiTransport

        transport = GeminiTransport(base_url=self.base_url, timeout=self.timeout, max_attempts=self.max_attempts,
                                    rpm=self.rpm, tpm=self.tpm, retry_base_delay=self.retry_base_delay,
                                    cache_dir=Path(out) / CACHE_DIR / "gemini")
        models = {"writer": self.writer_model, "editor": self.editor_model, "judge": self.judge_model}
        options = {role: {"transport": transport, **({"model": models[role]} if models[role] else {})}
                   for role, name in roles.items() if name == "gemini"}
        if "writer" in options:
            options["writer"]["image_aware"] = self.image_aware_writer
        return options


@dataclass(frozen=True)
class OpenAISettings:
    """The `openai` writer and judge: key from OPENAI_API_KEY; `model` serves both roles unless one is named."""

    base_url: str | None = None
    model: str | None = None
    writer_model: str | None = None
    judge_model: str | None = None
    structured_output: str = "json_schema"
    rpm: float | None = None
    timeout: float = 180.0
    max_attempts: int = 6
    retry_base_delay: float = 2.0
    image_aware_writer: bool = True

    def share(self, n: int) -> OpenAISettings:
        return replace(self, rpm=_part(self.rpm, n))

    def options(self, out: Path, roles: dict[str, str]) -> dict[str, dict]:
        openai_roles = [role for role in ("writer", "judge") if roles.get(role) == "openai"]
        if not openai_roles:
            return {}
        from .openai_compatible import OpenAITransport

        transport = OpenAITransport(base_url=self.base_url, timeout=self.timeout, max_attempts=self.max_attempts,
                                    rpm=self.rpm, retry_base_delay=self.retry_base_delay,
                                    cache_dir=Path(out) / CACHE_DIR / "openai")
        models = {"writer": self.writer_model or self.model, "judge": self.judge_model or self.model}
        options: dict[str, dict] = {}
        for role in openai_roles:
            if not models[role]:
                raise ValueError(f"the openai {role} needs a model: --openai-model (or --{role}-model), as the "
                                 f"server at {transport.base_url or 'api.openai.com'} names it")
            options[role] = {"transport": transport, "model": models[role]}
        if "writer" in options:
            options["writer"]["image_aware"] = self.image_aware_writer
        if "judge" in options:
            options["judge"]["structured_output"] = self.structured_output
        return options


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
