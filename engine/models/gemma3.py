"""`gemma3`: Gemma 3's text decoder.

Differences from llama, each taken from the file's metadata or from how llama.cpp reads it:
- embeddings are multiplied by sqrt(dim);
- RMSNorm weights are stored as (1 + w) by llama.cpp's converter, so the plain norm applies;
- per-head RMSNorm of queries and keys (QK-norm) before RoPE;
- norms on the attention and FFN outputs before they join the residual stream;
- a GELU-tanh gated MLP;
- sliding-window ("local") layers, by default 5 of every 6, with their own RoPE base
  (10000 unless the file says otherwise); the others are global;
- queries scaled by 1/sqrt(head_dim) (1/sqrt(dim / heads) for the 27B model);
- optional final-logit soft-capping. Gemma 3 has no attention soft-capping (Gemma 2 had).
"""

from __future__ import annotations

import math

from ..modelfile.gguf_file import GGUFFile
from .config import DecoderConfig, MetadataReader, RopeConfig

DEFAULT_PATTERN = 6  # every 6th layer is global
DEFAULT_LOCAL_ROPE_BASE = 10000.0
LAYERS_OF_27B = 62


def config_from_gguf(gguf: GGUFFile) -> DecoderConfig:
    meta = MetadataReader(gguf)
    common = meta.common()
    n_layers, head_dim = common["n_layers"], common["head_dim"]
    rope = meta.rope(interleaved=False, head_dim=head_dim)
    window = meta.whole("attention.sliding_window", 0)
    local_layers: tuple[bool, ...] = ()
    local_rope = None
    if window > 0:
        local_layers = _local_layer_pattern(meta, n_layers)
        local_rope = RopeConfig(
            base=meta.real("rope.freq_base_swa", DEFAULT_LOCAL_ROPE_BASE),
            interleaved=False,
            rotary_dim=rope.rotary_dim,
        )
    if n_layers == LAYERS_OF_27B:
        attention_scale = 1.0 / math.sqrt(common["dim"] / common["n_heads"])
    else:
        attention_scale = 1.0 / math.sqrt(head_dim)
    return DecoderConfig(
        **common,
        rope=rope,
        activation="gelu_tanh",
        attention_scale=attention_scale,
        embed_scale=math.sqrt(common["dim"]),
        qk_norm=True,
        post_norms=True,
        sliding_window=window,
        local_layers=local_layers,
        local_rope=local_rope,
        final_logit_softcap=meta.real("final_logit_softcapping", 0.0),
    )


def _local_layer_pattern(meta: MetadataReader, n_layers: int) -> tuple[bool, ...]:
    """Which layers are local: an explicit per-layer list, or "every n-th is global"."""
    pattern = meta.get("attention.sliding_window_pattern", DEFAULT_PATTERN)
    if isinstance(pattern, list):
        if len(pattern) != n_layers:
            raise meta.unsupported("sliding_window_pattern length does not match block_count")
        if any(type(v) not in (bool, int) for v in pattern):
            raise meta.bad("attention.sliding_window_pattern", "holds values that are not flags")
        return tuple(bool(v) for v in pattern)
    n = meta.whole("attention.sliding_window_pattern", DEFAULT_PATTERN)
    if n < 0:
        raise meta.bad("attention.sliding_window_pattern", f"is {n}")
    return tuple(n == 0 or i % n < n - 1 for i in range(n_layers))
