"""Writers, editors and judges: the interfaces and registry (`base`), the Gemini and OpenAI-compatible clients with
their shared HTTP plumbing, the diffusers editor, and the offline `simulator/`."""

from .base import (REGISTRY, ROLES, APIError, BackendError, Editor, EditRefused, InstructionWriter, Judge, available, create,
                   register)

__all__ = ["REGISTRY", "ROLES", "APIError", "BackendError", "Editor", "EditRefused", "InstructionWriter", "Judge", "available",
           "create", "register"]
