"""`llama` (also Mistral-style files): RMSNorm, RoPE on adjacent pairs, GQA, SwiGLU."""

from __future__ import annotations

from ..modelfile.gguf_file import GGUFFile
from .config import DecoderConfig, MetadataReader


def config_from_gguf(gguf: GGUFFile) -> DecoderConfig:
    meta = MetadataReader(gguf)
    common = meta.common()
    # llama.cpp's converter permutes Q/K rows so llama files use "normal" (adjacent) RoPE.
    return DecoderConfig(**common, rope=meta.rope(interleaved=True, head_dim=common["head_dim"]))
