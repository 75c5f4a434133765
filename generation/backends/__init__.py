"""Writers, editors and judges: the interfaces and registry (`base`), the Gemini and OpenAI-compatible clients with
their shared HTTP plumbing, the diffusers editor, and the offline `simulator/`."""

from .base import (BUILTIN, ROLES, APIError, BackendError, Editor, EditRefused, InstructionWriter, Judge, available,
                   backend_class, create, register, unregister)

__all__ = ["BUILTIN", "ROLES", "APIError", "BackendError", "Editor", "EditRefused", "InstructionWriter", "Judge",
           "available", "backend_class", "create", "register", "unregister"]
