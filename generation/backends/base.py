"""Backend interfaces (writer, editor, judge) and the registry that builds them by name.

A backend is a small class with one async method. Registry entries are import strings so that an optional
dependency is imported only when that backend is constructed, and fails there with the pip extra to install.
"""

from __future__ import annotations

import abc
import importlib

from ..records import EditedImage, Instruction, SourceImage, Task, Verdict, Attempt
from ..secrets import scrub


class BackendError(Exception):
    """Base of the errors a backend raises on purpose."""


class EditRefused(BackendError):
    """A permanent, per-attempt failure: safety block, no image in the answer, invalid argument.

    The loop records the round with this reason and goes on to the next round; it is not retried as is.
    """

    def __init__(self, kind: str, message: str):
        super().__init__(scrub(f"{kind}: {message}"))  # messages quote answers, which may echo the key
        self.kind = kind


class APIError(BackendError):
    """A transport or service failure that survived the backend's retries; the task becomes api_failed."""

    def __init__(self, kind: str, message: str):
        super().__init__(scrub(f"{kind}: {message}"))  # error bodies may echo the request's headers
        self.kind = kind


class InstructionWriter(abc.ABC):
    """Writes round 1's instruction, and later ones from the full history of instructions and verdicts."""

    name = "writer"

    @abc.abstractmethod
    async def write(self, task: Task, source: SourceImage, history: list[Attempt]) -> Instruction: ...


class Editor(abc.ABC):
    """Edits the ORIGINAL source image according to an instruction."""

    name = "editor"

    @abc.abstractmethod
    async def edit(self, task: Task, source: SourceImage, instruction: str, seed: int) -> EditedImage: ...


class Judge(abc.ABC):
    """Judges an edit against the original and the instruction with the medical rubric."""

    name = "judge"

    @abc.abstractmethod
    async def judge(self, task: Task, source: SourceImage, edited: EditedImage, instruction: str) -> Verdict: ...


ROLES = ("writer", "editor", "judge")

# name -> role -> "module:Class" (relative to medbanana.generation)
REGISTRY: dict[str, dict[str, str]] = {
    "simulator": {"writer": ".simulator.writer:TemplateWriter",
                  "editor": ".simulator.editor:SimulatedEditor",
                  "judge": ".simulator.judge:PixelJudge"},
    "gemini": {"writer": ".gemini:GeminiWriter", "editor": ".gemini:GeminiEditor", "judge": ".gemini:GeminiJudge"},
    "openai": {"writer": ".openai_compatible:OpenAIWriter", "judge": ".openai_compatible:OpenAIJudge"},
    "diffusers": {"editor": ".diffusers_editor:DiffusersEditor"},
}


def register(name: str, role: str, target: str) -> None:
    """Register a backend class by import string, e.g. register("mine", "judge", "mypkg.judge:MyJudge")."""
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, not {role!r}")
    REGISTRY.setdefault(name, {})[role] = target


def available(role: str) -> list[str]:
    return sorted(name for name, roles in REGISTRY.items() if role in roles)


def create(role: str, name: str, **options):
    """Construct the `role` backend registered as `name` with keyword options."""
    try:
        target = REGISTRY[name][role]
    except KeyError:
        raise ValueError(f"no {role} backend named {name!r}; available: {', '.join(available(role))}") from None
    module_name, _, class_name = target.partition(":")
    module = importlib.import_module(module_name, package=__package__)
    return getattr(module, class_name)(**options)
