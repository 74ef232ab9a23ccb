"""`phi3`: fused QKV and gate/up tensors, "neox" RoPE.

llama.cpp disables Phi-3's sliding window (its converters record it inconsistently), so we
do too, to compute what the oracle computes. LongRoPE files (128k context, per-frequency
factors chosen by context length) are not supported yet.
"""

from __future__ import annotations

from ..modelfile.gguf_file import GGUFFile
from .config import DecoderConfig, MetadataReader


def config_from_gguf(gguf: GGUFFile) -> DecoderConfig:
    meta = MetadataReader(gguf)
    if "rope_factors_long.weight" in gguf.tensors:
        raise meta.unsupported("Phi-3 LongRoPE (rope_factors_long) is not supported yet")
    common = meta.common()
    return DecoderConfig(**common, rope=meta.rope(interleaved=False, head_dim=common["head_dim"]))
