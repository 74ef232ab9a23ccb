"""`qwen2` (Q/K/V biases) and `qwen3` (per-head QK RMSNorm): llama-like, "neox" RoPE."""

from __future__ import annotations

from ..modelfile.gguf_file import GGUFFile
from .config import DecoderConfig, MetadataReader


def qwen2_config(gguf: GGUFFile) -> DecoderConfig:
    meta = MetadataReader(gguf)
    common = meta.common()
    return DecoderConfig(**common, rope=meta.rope(interleaved=False, head_dim=common["head_dim"]))


def qwen3_config(gguf: GGUFFile) -> DecoderConfig:
    meta = MetadataReader(gguf)
    common = meta.common()
    rope = meta.rope(interleaved=False, head_dim=common["head_dim"])
    return DecoderConfig(**common, rope=rope, qk_norm=True)
