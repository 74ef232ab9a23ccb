"""A model's hyper-parameters, taken from GGUF metadata only: `DecoderConfig`, and the typed
metadata reader each architecture file builds it with."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ModelFileError, UnsupportedModelError
from ..gguf_file import GGUFFile


@dataclass(frozen=True)
class RopeConfig:
    base: float
    interleaved: bool  # llama.cpp's "normal" RoPE pairs (2i, 2i+1); "neox" pairs (i, i+d/2)
    rotary_dim: int
    position_scale: float = 1.0  # linear RoPE scaling: positions are multiplied by this


@dataclass(frozen=True)
class DecoderConfig:
    architecture: str
    n_layers: int
    dim: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    vocab_size: int
    norm_eps: float
    context_length: int
    rope: RopeConfig
    activation: str = "silu"  # "silu" | "gelu_tanh", gating the up projection
    attention_scale: float | None = None  # default 1/sqrt(head_dim)
    embed_scale: float = 1.0  # Gemma multiplies embeddings by sqrt(dim)
    qk_norm: bool = False  # RMSNorm of each query and key head before RoPE
    post_norms: bool = False  # Gemma's norms on the attention and FFN outputs
    sliding_window: int = 0  # tokens a local layer sees (0: no local layers)
    local_layers: tuple[bool, ...] = ()  # which layers use the sliding window
    local_rope: RopeConfig | None = None  # RoPE of the local layers, if different
    final_logit_softcap: float = 0.0

    def is_local(self, layer: int) -> bool:
        return bool(self.local_layers) and self.local_layers[layer]


class MetadataReader:
    """Typed access to `<architecture>.<key>` metadata, with errors naming the file."""

    def __init__(self, gguf: GGUFFile):
        self.gguf = gguf

    def need(self, key: str):
        value = self.gguf.arch_value(key)
        if value is None:
            raise ModelFileError(
                self.gguf.path, f"missing metadata key {self.gguf.architecture}.{key}"
            )
        return value

    def get(self, key: str, default=None):
        value = self.gguf.arch_value(key)
        return default if value is None else value

    def unsupported(self, reason: str) -> UnsupportedModelError:
        return UnsupportedModelError(self.gguf.path, reason)

    def common(self) -> dict:
        """Fields shared by every architecture's config."""
        dim = int(self.need("embedding_length"))
        n_heads = int(self.need("attention.head_count"))
        head_dim = int(self.get("attention.key_length", dim // n_heads))
        if int(self.get("attention.value_length", head_dim)) != head_dim:
            raise self.unsupported("different key and value head sizes are not supported yet")
        n_kv_heads = self.get("attention.head_count_kv", n_heads)
        if isinstance(n_kv_heads, list):
            raise self.unsupported("per-layer KV head counts are not supported yet")
        vocab = self.get("vocab_size") or self.gguf.tensor("token_embd.weight").shape[0]
        return dict(
            architecture=self.gguf.architecture,
            n_layers=int(self.need("block_count")),
            dim=dim,
            n_heads=n_heads,
            n_kv_heads=int(n_kv_heads),
            head_dim=head_dim,
            ffn_dim=int(self.need("feed_forward_length")),
            vocab_size=int(vocab),
            norm_eps=float(self.need("attention.layer_norm_rms_epsilon")),
            context_length=int(self.get("context_length", 4096)),
        )

    def rope(self, interleaved: bool, head_dim: int) -> RopeConfig:
        scaling = self.get("rope.scaling.type", "none")
        factor = float(self.get("rope.scaling.factor", 1.0) or 1.0)
        if scaling not in ("none", "linear") and factor != 1.0:
            raise self.unsupported(f"RoPE scaling '{scaling}' is not supported yet")
        return RopeConfig(
            base=float(self.get("rope.freq_base", 10000.0)),
            interleaved=interleaved,
            rotary_dim=int(self.get("rope.dimension_count", head_dim)),
            position_scale=1.0 / factor if scaling == "linear" else 1.0,
        )


# Decode runs ~30 tensor ops per layer and each costs a microsecond or two of Python and
# dispatch overhead, about as much as the matmuls themselves on a small model. So the layers
# are plain classes calling each other's `forward` (no nn.Module attribute lookups or hooks),
# update the residual stream in place, and slice rather than split.
