"""One file per architecture; `build_model` picks by the GGUF's `general.architecture`."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from ..errors import UnsupportedModelError
from ..gguf_file import GGUFFile
from . import llama

_BUILDERS: dict[str, Callable[[GGUFFile, int], nn.Module]] = {
    "llama": llama.LlamaModel.from_gguf,
}

SUPPORTED_ARCHITECTURES = tuple(sorted(_BUILDERS))


def build_model(gguf: GGUFFile, max_positions: int) -> nn.Module:
    arch = gguf.architecture
    builder = _BUILDERS.get(arch)
    if builder is None:
        raise UnsupportedModelError(
            gguf.path,
            f"architecture '{arch}' is not supported by the torch engine "
            f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})",
        )
    return builder(gguf, max_positions)
