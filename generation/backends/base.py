"""Backend interfaces (writer, editor, judge) and the registry that builds them by name.

A backend is a small class with one async method; its class attributes say what a run records about it (`name`,
`prompts`). Registry entries are import strings so that an optional dependency is imported only when that backend
is constructed, and fails there with the pip extra to install.

The built-in table is read-only. To add a backend, name its class by import string: `create("judge",
"mypkg.judge:MyJudge")`, or `register("mine", "judge", "mypkg.judge:MyJudge")` (this process only; `unregister`
takes it back) so that `--judge mine` and `available()` know it.
"""

from __future__ import annotations

import abc
import importlib
from types import MappingProxyType
from typing import Mapping

from ..records import EditedImage, Instruction, SourceImage, Task, Usage, Verdict, Attempt
from ..secrets import scrub
from ..failures import UsageError


class BackendError(Exception):
    """Base of the errors a backend raises on purpose."""


class EditRefused(BackendError):
    """A permanent, per-attempt failure: safety block, no image in the answer, invalid argument.

    The loop records the round with this reason and goes on to the next round; it is not retried as is. `usage`:
    the tokens the refused calls were billed for, when the answers said.
    """

    def __init__(self, kind: str, message: str, usage: Usage | None = None):
        super().__init__(scrub(f"{kind}: {message}"))  # messages quote answers, which may echo the key
        self.kind = kind
        self.usage = usage or Usage()


class APIError(BackendError):
    """A transport or service failure that survived the backend's retries; the task becomes api_failed."""

    def __init__(self, kind: str, message: str):
        super().__init__(scrub(f"{kind}: {message}"))  # error bodies may echo the request's headers
        self.kind = kind


class _Backend:
    name = ""
    prompts: tuple[str, ...] = ()  # the generation/prompts it fills in: a run records their versions


class InstructionWriter(_Backend, abc.ABC):
    """Writes round 1's instruction, and later ones from the full history of instructions and verdicts."""

    name = "writer"

    @abc.abstractmethod
    async def write(self, task: Task, source: SourceImage, history: list[Attempt]) -> Instruction: ...


class Editor(_Backend, abc.ABC):
    """Edits the ORIGINAL source image according to an instruction."""

    name = "editor"

    @abc.abstractmethod
    async def edit(self, task: Task, source: SourceImage, instruction: str, seed: int) -> EditedImage: ...


class Judge(_Backend, abc.ABC):
    """Judges an edit against the original and the instruction with the medical rubric.

    A judge that also grades edits 0-10 for evaluation has `score(task, source, edited, instruction,
    ground_truth)` -> records.EditScores, and says how: `scoring_prompt` (the prompt it sends) or
    `scoring_mapping` (how it maps measurements to scores)."""

    name = "judge"
    scoring_prompt = ""
    scoring_mapping = ""

    @abc.abstractmethod
    async def judge(self, task: Task, source: SourceImage, edited: EditedImage, instruction: str) -> Verdict: ...


ROLES = ("writer", "editor", "judge")

# name -> role -> "module:Class" (relative to medbanana.generation.backends)
BUILTIN: Mapping[str, Mapping[str, str]] = MappingProxyType({name: MappingProxyType(roles) for name, roles in {
    "simulator": {"writer": ".simulator.writer:TemplateWriter",
                  "editor": ".simulator.editor:SimulatedEditor",
                  "judge": ".simulator.judge:PixelJudge"},
    "gemini": {"writer": ".gemini:GeminiWriter", "editor": ".gemini:GeminiEditor", "judge": ".gemini:GeminiJudge"},
    "openai": {"writer": ".openai_compatible:OpenAIWriter", "judge": ".openai_compatible:OpenAIJudge"},
    "diffusers": {"editor": ".diffusers_editor:DiffusersEditor"},
}.items()})
_registered: dict[str, dict[str, str]] = {}  # this process's additions (register), looked up before BUILTIN


def register(name: str, role: str, target: str) -> None:
    """Register a backend class by import string for this process, e.g. register("mine", "judge",
    "mypkg.judge:MyJudge")."""
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, not {role!r}")
    _registered.setdefault(name, {})[role] = target


def unregister(name: str) -> None:
    """Forget what `register` added under `name` (the built-in backends stay)."""
    _registered.pop(name, None)


def _target(role: str, name: str) -> str | None:
    for table in (_registered, BUILTIN):
        if role in table.get(name, {}):
            return table[name][role]
    return None


def available(role: str) -> list[str]:
    return sorted(name for name in {*BUILTIN, *_registered} if _target(role, name))


def backend_class(role: str, name: str) -> type:
    """The class of the `role` backend registered as `name`, or named by an import string "package.module:Class"."""
    target = _target(role, name) or (name if ":" in name else None)
    if target is None:
        raise UsageError(f"no {role} backend named {name!r}; available: {', '.join(available(role))}")
    module_name, _, class_name = target.partition(":")
    module = importlib.import_module(module_name, package=__package__)
    return getattr(module, class_name)


def create(role: str, name: str, **options):
    """Construct the `role` backend registered as `name` (or named by an import string) with keyword options."""
    return backend_class(role, name)(**options)
