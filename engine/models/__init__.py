"""Architectures: each maps GGUF metadata to a `DecoderConfig`; `build_model` does the rest."""

from __future__ import annotations

from collections.abc import Callable

from ..errors import UnsupportedModelError
from ..modelfile.checks import check_model_file
from ..modelfile.gguf_file import GGUFFile
from ..ops.quant import SUPPORTED_TYPES
from . import gemma3, llama, olmoe, phi3, qwen
from .config import DecoderConfig, check_config
from .decoder import DecoderModel
from .loading import build_decoder
from .placement import CPU_PLACEMENT, CachePolicy, Placement

CONFIGS: dict[str, Callable[[GGUFFile], DecoderConfig]] = {
    "llama": llama.config_from_gguf,
    "qwen2": qwen.qwen2_config,
    "qwen3": qwen.qwen3_config,
    "phi3": phi3.config_from_gguf,
    "gemma3": gemma3.config_from_gguf,
    "qwen2moe": qwen.qwen2moe_config,
    "qwen3moe": qwen.qwen3moe_config,
    "olmoe": olmoe.config_from_gguf,
}

SUPPORTED_ARCHITECTURES = tuple(sorted(CONFIGS))

__all__ = ["CachePolicy", "DecoderModel", "Placement", "build_model", "check_supported"]


def check_supported(gguf: GGUFFile) -> DecoderConfig:
    """The model's config, or UnsupportedModelError if the torch engine cannot run it
    (ModelFileError if the file is bad)."""
    check_model_file(gguf)
    arch = gguf.architecture
    if arch not in CONFIGS:
        raise UnsupportedModelError(
            gguf.path,
            f"architecture '{arch}' is not supported by the torch engine "
            f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})",
        )
    for info in gguf.tensors.values():
        if info.ggml_type not in SUPPORTED_TYPES:
            raise UnsupportedModelError(
                gguf.path,
                f"tensor {info.name} has type {info.ggml_type.name}, "
                "which the torch engine does not support yet",
            )
    config = CONFIGS[arch](gguf)
    check_config(config, gguf.path)
    return config


def build_model(
    gguf: GGUFFile, placement: Placement = CPU_PLACEMENT, config: DecoderConfig | None = None
) -> DecoderModel:
    """The model, placed as asked. `config` is check_supported's answer for this file when
    the caller already has it: the check reads every vocabulary string, so it runs once."""
    return build_decoder(gguf, config or check_supported(gguf), placement)
