"""What a model file needs in memory before it is loaded: its weights, and its KV cache as
a KV type stores it (the device plan weighs them against what a device has)."""

from __future__ import annotations

from ..platform.devices import ModelFootprint
from .types import F32, KVSetting, bytes_per_token


def estimate_footprint(gguf, ctx: int, kv: KVSetting = F32) -> ModelFootprint:
    """From the GGUF's tensor table and metadata alone (nothing loaded). The KV estimate is
    for every layer caching ctx positions as `kv` stores them; sliding-window layers need
    less."""
    int4_bytes = sum(info.nbytes for info in gguf.tensors.values())
    bf16_bytes = sum(2 * info.n_elements for info in gguf.tensors.values())

    def largest(value) -> int:  # a per-layer list (some architectures) counts its largest
        return int(max(value, default=1)) if isinstance(value, list) else int(value)

    n_layers = int(gguf.arch_value("block_count", 1))
    n_heads = largest(gguf.arch_value("attention.head_count", 1))
    kv_heads = largest(gguf.arch_value("attention.head_count_kv", n_heads))
    dim = int(gguf.arch_value("embedding_length", 0))
    head_dim = int(gguf.arch_value("attention.key_length", dim // max(n_heads, 1)))
    kv_bytes = bytes_per_token(kv, n_layers, kv_heads, head_dim) * ctx
    experts = [info for name, info in gguf.tensors.items() if name.endswith("_exps.weight")]
    table = gguf.tensors.get("token_embd.weight")
    tied = table is not None and "output.weight" not in gguf.tensors
    return ModelFootprint(
        int4_bytes,
        bf16_bytes,
        kv_bytes,
        n_layers,
        expert_int4_bytes=sum(info.nbytes for info in experts),
        expert_bf16_bytes=sum(2 * info.n_elements for info in experts),
        table_copy_bytes=table.nbytes if tied else 0,
    )
