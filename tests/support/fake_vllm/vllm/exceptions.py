"""vLLM 0.32's exception classes (``vllm/exceptions.py``). ``VLLMValidationError`` is what a
rejected request raises (a ``SamplingParams`` check, a prompt too long); it is *not* a
``ValueError``."""
from __future__ import annotations

from typing import Any


class VLLMError(Exception):
    """Base class for all vLLM-specific errors."""


class VLLMClientError(VLLMError):
    """Errors caused by the client request (4xx)."""


class VLLMServerError(VLLMError):
    """Errors caused by the server (5xx)."""


class VLLMValidationError(VLLMClientError):
    def __init__(self, message: str, *, parameter: str | None = None, value: Any = None) -> None:
        super().__init__(message)
        self.parameter = parameter
        self.value = value

    def __str__(self):
        base = super().__str__()
        extras = []
        if self.parameter is not None:
            extras.append(f"parameter={self.parameter}")
        if self.value is not None:
            extras.append(f"value={self.value}")
        return f"{base} ({', '.join(extras)})" if extras else base
