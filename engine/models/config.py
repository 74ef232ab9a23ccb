"""A model's hyper-parameters, taken from GGUF metadata only: `DecoderConfig`, and the typed
metadata reader each architecture file builds it with."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..errors import ModelFileError, UnsupportedModelError
from ..modelfile.checks import describe_value
from ..modelfile.gguf_file import GGUFFile


@dataclass(frozen=True)
class RopeConfig:
    base: float
    interleaved: bool  # llama.cpp's "normal" RoPE pairs (2i, 2i+1); "neox" pairs (i, i+d/2)
    rotary_dim: int
    position_scale: float = 1.0  # linear RoPE scaling: positions are multiplied by this


@dataclass(frozen=True)
class ExpertConfig:
    """A mixture-of-experts feed-forward: each token runs `used` of `count` SiLU-gated experts
    of `ffn_dim`, chosen by a softmax router, their outputs weighted by the router's
    probabilities (divided by their sum where `normalize`), plus, where `shared_ffn_dim`,
    a shared expert every token runs, scaled by a sigmoid gate (Qwen2-MoE)."""

    count: int
    used: int
    ffn_dim: int
    normalize: bool
    shared_ffn_dim: int = 0


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
    # OLMoE: the same norm over all query heads together and all key heads together
    qk_norm_whole: bool = False
    post_norms: bool = False  # Gemma's norms on the attention and FFN outputs
    sliding_window: int = 0  # tokens a local layer sees (0: no local layers)
    local_layers: tuple[bool, ...] = ()  # which layers use the sliding window
    local_rope: RopeConfig | None = None  # RoPE of the local layers, if different
    final_logit_softcap: float = 0.0
    experts: ExpertConfig | None = None  # a mixture-of-experts feed-forward in every layer

    def is_local(self, layer: int) -> bool:
        return bool(self.local_layers) and self.local_layers[layer]


class MetadataReader:
    """Typed access to `<architecture>.<key>` metadata, with errors naming the file and key:
    a value of the wrong type (a string where a count belongs, a NaN epsilon) is a bad file,
    not a crash further on."""

    def __init__(self, gguf: GGUFFile):
        self.gguf = gguf

    def _raw(self, key: str, default, required: bool):
        value = self.gguf.arch_value(key)
        if value is None:
            if required:
                raise self.bad(key, "is missing")
            return default
        return value

    def bad(self, key: str, problem: str) -> ModelFileError:
        return ModelFileError(self.gguf.path, f"metadata {self.gguf.architecture}.{key} {problem}")

    def whole(self, key: str, default: int | None = None, required: bool = False) -> int:
        """A whole number (GGUF's integer types); booleans and floats are refused."""
        value = self._raw(key, default, required)
        if type(value) is not int:
            raise self.bad(key, f"is {describe_value(value)}, not a whole number")
        return value

    def real(self, key: str, default: float | None = None, required: bool = False) -> float:
        """A finite number, integer or float."""
        value = self._raw(key, default, required)
        if type(value) not in (int, float) or not math.isfinite(value):
            raise self.bad(key, f"is {describe_value(value)}, not a finite number")
        return float(value)

    def text(self, key: str, default: str) -> str:
        value = self._raw(key, default, required=False)
        if not isinstance(value, str):
            raise self.bad(key, f"is {describe_value(value)}, not text")
        return value

    def get(self, key: str, default=None):
        """The raw value (any type), for keys an architecture reads in more than one form."""
        return self._raw(key, default, required=False)

    def unsupported(self, reason: str) -> UnsupportedModelError:
        return UnsupportedModelError(self.gguf.path, reason)

    def common(self) -> dict:
        """Fields shared by every architecture's config."""
        dim = self.whole("embedding_length", required=True)
        n_heads = self.whole("attention.head_count", required=True)
        for key, value in (("embedding_length", dim), ("attention.head_count", n_heads)):
            if value <= 0:
                raise self.bad(key, f"is {value}, not a positive count")
        head_dim = self.whole("attention.key_length", dim // n_heads)
        if self.whole("attention.value_length", head_dim) != head_dim:
            raise self.unsupported("different key and value head sizes are not supported yet")
        if isinstance(self.get("attention.head_count_kv"), list):
            raise self.unsupported("per-layer KV head counts are not supported yet")
        n_kv_heads = self.whole("attention.head_count_kv", n_heads)
        vocab = self.gguf.tensor("token_embd.weight").shape[0]
        return dict(
            architecture=self.gguf.architecture,
            n_layers=self.whole("block_count", required=True),
            dim=dim,
            n_heads=n_heads,
            n_kv_heads=n_kv_heads,
            head_dim=head_dim,
            ffn_dim=self.whole("feed_forward_length", required=True),
            vocab_size=self.whole("vocab_size", vocab),
            norm_eps=self.real("attention.layer_norm_rms_epsilon", required=True),
            context_length=self.whole("context_length", 4096),
        )

    def experts(
        self, default_ffn: int, normalize: bool, shared: bool = False
    ) -> ExpertConfig | None:
        """The mixture-of-experts keys (None without `expert_count`): how many experts, how
        many a token uses, each one's width (`default_ffn` where the file does not say), and
        the shared expert's width where the architecture has one. Whether the chosen
        experts' weights are normalised is the architecture's, as llama.cpp's graph has it."""
        count = self.whole("expert_count", 0)
        if count == 0:
            return None
        if isinstance(self.get("expert_used_count"), list):
            raise self.unsupported("per-layer expert counts are not supported yet")
        shared_ffn = self.whole("expert_shared_feed_forward_length", default_ffn) if shared else 0
        return ExpertConfig(
            count=count,
            used=self.whole("expert_used_count", required=True),
            ffn_dim=self.whole("expert_feed_forward_length", default_ffn),
            normalize=normalize,
            shared_ffn_dim=shared_ffn,
        )

    def rope(self, interleaved: bool, head_dim: int) -> RopeConfig:
        scaling = self.text("rope.scaling.type", "none")
        factor = self.real("rope.scaling.factor", 1.0) or 1.0
        if scaling not in ("none", "linear") and factor != 1.0:
            raise self.unsupported(f"RoPE scaling '{scaling}' is not supported yet")
        if factor <= 0:
            raise self.bad("rope.scaling.factor", f"is {factor}, not positive")
        return RopeConfig(
            base=self.real("rope.freq_base", 10000.0),
            interleaved=interleaved,
            rotary_dim=self.whole("rope.dimension_count", head_dim),
            position_scale=1.0 / factor if scaling == "linear" else 1.0,
        )


# Upper bounds far above any real model's, so that a corrupt count is refused before it
# sizes a loop or an allocation (the largest open models have ~130 layers, 32k-wide states,
# 1M-token contexts and vocabularies of ~260k).
MAX_LAYERS = 4096
MAX_WIDTH = 1 << 20
MAX_CONTEXT = 1 << 24
MAX_EXPERTS = 4096  # the largest open models route over 256-512


def check_config(config: DecoderConfig, path) -> None:
    """Hyper-parameters that could not describe a working model are a bad file."""

    def bad(what: str) -> ModelFileError:
        return ModelFileError(path, f"metadata of {config.architecture}: {what}")

    counts = {
        "block_count": (config.n_layers, MAX_LAYERS),
        "embedding_length": (config.dim, MAX_WIDTH),
        "attention.head_count": (config.n_heads, MAX_WIDTH),
        "attention.head_count_kv": (config.n_kv_heads, MAX_WIDTH),
        "attention.key_length": (config.head_dim, MAX_WIDTH),
        "feed_forward_length": (config.ffn_dim, MAX_WIDTH),
        "vocab_size": (config.vocab_size, MAX_WIDTH),
        "context_length": (config.context_length, MAX_CONTEXT),
    }
    for key, (value, most) in counts.items():
        if not 1 <= value <= most:
            raise bad(f"{key} is {value}, outside 1..{most}")
    experts = config.experts
    if experts is not None:
        if not 1 <= experts.count <= MAX_EXPERTS:
            raise bad(f"expert_count is {experts.count}, outside 1..{MAX_EXPERTS}")
        if not 1 <= experts.used <= experts.count:
            raise bad(f"expert_used_count is {experts.used}, outside 1..{experts.count}")
        for key, value in (
            ("expert_feed_forward_length", experts.ffn_dim),
            ("expert_shared_feed_forward_length", experts.shared_ffn_dim or 1),
        ):
            if not 1 <= value <= MAX_WIDTH:
                raise bad(f"{key} is {value}, outside 1..{MAX_WIDTH}")
    if config.n_heads % config.n_kv_heads:
        raise bad(f"{config.n_heads} query heads do not share {config.n_kv_heads} KV heads")
    for rope in (config.rope, config.local_rope):
        if rope is None:
            continue
        if not 2 <= rope.rotary_dim <= config.head_dim or rope.rotary_dim % 2:
            raise bad(f"RoPE covers {rope.rotary_dim} of {config.head_dim} head dimensions")
        if rope.base <= 0:
            raise bad(f"the RoPE base is {rope.base}")
    if not config.norm_eps > 0:
        raise bad(f"the norm epsilon is {config.norm_eps}")
    if config.sliding_window < 0 or config.final_logit_softcap < 0:
        raise bad("a negative sliding window or logit soft-cap")


# Decode runs ~30 tensor ops per layer and each costs a microsecond or two of Python and
# dispatch overhead, about as much as the matmuls themselves on a small model. So the layers
# are plain classes calling each other's `forward` (no nn.Module attribute lookups or hooks),
# update the residual stream in place, and slice rather than split.
