"""`llama` (also Mistral-style files): RMSNorm, RoPE on adjacent pairs, GQA, SwiGLU; with
`expert_count`, Mixtral's mixture of experts (top-k weights normalised to sum to one)."""

from __future__ import annotations

import dataclasses

from ..modelfile.gguf_file import GGUFFile
from .config import DecoderConfig, MetadataReader


def config_from_gguf(gguf: GGUFFile) -> DecoderConfig:
    meta = MetadataReader(gguf)
    common = meta.common()
    # llama.cpp's converter permutes Q/K rows so llama files use "normal" (adjacent) RoPE.
    rope = meta.rope(interleaved=True, head_dim=common["head_dim"])
    experts = meta.experts(default_ffn=common["ffn_dim"], normalize=True)
    if experts is not None:  # llama.cpp sizes a llama file's experts by feed_forward_length
        experts = dataclasses.replace(experts, ffn_dim=common["ffn_dim"])
    return DecoderConfig(**common, rope=rope, experts=experts)
