"""Error types the engine raises for problems a user can fix (bad files, bad settings).

Interfaces print them as one line and exit with code 2; anything else is a bug.
"""

from __future__ import annotations

from pathlib import Path


class MiniappError(Exception):
    """A problem with the user's input, reported as one line without a traceback."""


class ModelFileError(MiniappError):
    """A model file that is missing, not GGUF, truncated or otherwise unreadable."""

    def __init__(self, path: Path | str, reason: str):
        self.path = Path(path)
        self.reason = reason
        super().__init__(f"{self.path}: {reason}")


class UnsupportedModelError(ModelFileError):
    """A valid GGUF that the torch engine cannot run (architecture or tensor type)."""

    def __init__(self, path: Path | str, reason: str, suggest_llamacpp: bool = True):
        if suggest_llamacpp:
            reason = f"{reason}; try --backend llamacpp"
        super().__init__(path, reason)


class InputFileError(MiniappError):
    """A non-model input file (text for eval, prompt file) that cannot be read."""


class ContextFullError(MiniappError):
    """More tokens than the context (KV cache) was sized for."""


class DeviceUnavailableError(MiniappError):
    """The requested device does not exist here (e.g. --device cuda on a machine without one)."""
