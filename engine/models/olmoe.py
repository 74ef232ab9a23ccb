"""`olmoe`: OLMoE, a llama-like decoder with a mixture of experts in every layer.

Differences from llama, as llama.cpp reads the file: "neox" RoPE; RMSNorm of the whole query
projection (all heads together) and of the whole key projection before RoPE, each with its
own weight; top-k expert weights as the softmax gives them (not normalised).
"""

from __future__ import annotations

import dataclasses

from ..modelfile.gguf_file import GGUFFile
from .config import DecoderConfig, MetadataReader


def config_from_gguf(gguf: GGUFFile) -> DecoderConfig:
    meta = MetadataReader(gguf)
    common = meta.common()
    experts = meta.experts(default_ffn=common["ffn_dim"], normalize=False)
    if experts is None:
        raise meta.bad("expert_count", "is missing or 0 (this architecture routes to experts)")
    # llama.cpp sizes an olmoe file's experts by feed_forward_length
    experts = dataclasses.replace(experts, ffn_dim=common["ffn_dim"])
    rope = meta.rope(interleaved=False, head_dim=common["head_dim"])
    return DecoderConfig(**common, rope=rope, qk_norm_whole=True, experts=experts)
