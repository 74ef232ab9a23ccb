"""One file per architecture; `build_model` picks by the GGUF's `general.architecture`."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from ..errors import UnsupportedModelError
from ..gguf_file import GGUFFile
from ..quant import LINEAR_TYPES
from . import llama

_BUILDERS: dict[str, Callable[[GGUFFile, int], nn.Module]] = {
    "llama": llama.LlamaModel.from_gguf,
}

SUPPORTED_ARCHITECTURES = tuple(sorted(_BUILDERS))


def check_supported(gguf: GGUFFile) -> None:
    """Raise UnsupportedModelError unless the torch engine can run this file."""
    arch = gguf.architecture
    if arch not in _BUILDERS:
        raise UnsupportedModelError(
            gguf.path,
            f"architecture '{arch}' is not supported by the torch engine "
            f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})",
        )
    for info in gguf.tensors.values():
        if info.ggml_type not in LINEAR_TYPES:
            raise UnsupportedModelError(
                gguf.path,
                f"tensor {info.name} has type {info.ggml_type.name}, "
                "which the torch engine does not support yet",
            )


def build_model(gguf: GGUFFile, max_positions: int) -> nn.Module:
    check_supported(gguf)
    return _BUILDERS[gguf.architecture](gguf, max_positions)
