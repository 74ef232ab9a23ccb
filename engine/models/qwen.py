"""`qwen2` (Q/K/V biases) and `qwen3` (per-head QK RMSNorm): llama-like, "neox" RoPE. Their
mixture-of-experts kin: `qwen2moe` (top-k weights as the softmax gives them, plus a shared
expert behind a sigmoid gate) and `qwen3moe` (top-k weights normalised, no shared expert).
An expert's width defaults to feed_forward_length / expert_used_count, as llama.cpp's."""

from __future__ import annotations

import dataclasses

from ..modelfile.gguf_file import GGUFFile
from .config import DecoderConfig, ExpertConfig, MetadataReader


def qwen2_config(gguf: GGUFFile) -> DecoderConfig:
    meta = MetadataReader(gguf)
    common = meta.common()
    return DecoderConfig(**common, rope=meta.rope(interleaved=False, head_dim=common["head_dim"]))


def qwen3_config(gguf: GGUFFile) -> DecoderConfig:
    meta = MetadataReader(gguf)
    common = meta.common()
    rope = meta.rope(interleaved=False, head_dim=common["head_dim"])
    return DecoderConfig(**common, rope=rope, qk_norm=True)


def qwen2moe_config(gguf: GGUFFile) -> DecoderConfig:
    meta = MetadataReader(gguf)
    common = meta.common()
    rope = meta.rope(interleaved=False, head_dim=common["head_dim"])
    return DecoderConfig(**common, rope=rope, experts=_experts(meta, common, normalize=False))


def qwen3moe_config(gguf: GGUFFile) -> DecoderConfig:
    meta = MetadataReader(gguf)
    common = meta.common()
    rope = meta.rope(interleaved=False, head_dim=common["head_dim"])
    experts = _experts(meta, common, normalize=True)
    return DecoderConfig(**common, rope=rope, qk_norm=True, experts=experts)


def _experts(meta: MetadataReader, common: dict, normalize: bool) -> ExpertConfig:
    used = meta.whole("expert_used_count", 1)
    default = common["ffn_dim"] // used if used > 0 else common["ffn_dim"]
    shared = meta.gguf.architecture == "qwen2moe"
    experts = meta.experts(default_ffn=default, normalize=normalize, shared=shared)
    if experts is None:
        raise meta.bad("expert_count", "is missing or 0 (this architecture routes to experts)")
    if shared:  # the shared expert's width defaults to feed_forward_length
        width = meta.whole("expert_shared_feed_forward_length", common["ffn_dim"])
        experts = dataclasses.replace(experts, shared_ffn_dim=width)
    return experts
