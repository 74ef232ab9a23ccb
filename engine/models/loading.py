"""Building a `DecoderModel` from a GGUF file: each named tensor becomes a module (repacked
once, on the device its `Placement` says), and a tensor the model would not use is an error."""

from __future__ import annotations

import torch
from gguf.constants import GGMLQuantizationType

from ...native import ggml as native_ggml
from ...native.moe import NativeExperts
from ..errors import ModelFileError, UnsupportedModelError
from ..lora.bound import PartLayout
from ..modelfile.gguf_file import GGUFFile, TensorInfo
from ..ops.layers import (
    CPU_INT4,
    BlockEmbedding,
    Linear,
    RawWeight,
    RMSNorm,
    WeightTarget,
    linear_from_raw,
    packed_ggml,
)
from ..ops.quant import all_finite, dequantize_rows
from ..platform.kernels import cpu_int4_kernel
from .config import DecoderConfig
from .decoder import Attention, Block, DecoderModel, FeedForward
from .experts import MixtureFeedForward, Router, SharedExpert, TorchExpert, TorchExperts
from .placement import CPU_PLACEMENT, Placement

_CHECK_BYTES = 16 << 20  # the slice of a tensor checked for non-finite scales at once


def build_decoder(
    gguf: GGUFFile, config: DecoderConfig, placement: Placement = CPU_PLACEMENT
) -> DecoderModel:
    weights = WeightReader(gguf)
    layers = [
        _build_block(weights, config, i, placement.layer_target(i)) for i in range(config.n_layers)
    ]
    # Many small models tie the output head to the embedding.
    head = "output.weight" if weights.has("output.weight") else "token_embd.weight"
    head_target = placement.head_target(config.n_layers)
    output = weights.linear([head], config.dim, [config.vocab_size], "output.bias", head_target)
    tied = head == "token_embd.weight" and BlockEmbedding.tied_to(output, config.dim)
    embed = tied or weights.embedding("token_embd.weight", config.vocab_size, config.dim)
    norm_weight = weights.vector("output_norm.weight", config.dim).to(head_target.device)
    norm = RMSNorm(norm_weight, config.norm_eps)
    # Llama 3.1-style frequency factors: each RoPE frequency is divided by its factor.
    freq_factors = None
    if weights.has("rope_freqs.weight"):
        freq_factors = weights.vector("rope_freqs.weight", config.rope.rotary_dim // 2)
    weights.check_all_used()
    model = DecoderModel(config, embed, layers, norm, output, freq_factors, placement)
    model.head_weight = weights.raw_weight(head)
    return model


def _build_block(
    weights: WeightReader, config: DecoderConfig, i: int, target: WeightTarget
) -> Block:
    p = f"blk.{i}."
    eps, dim = config.norm_eps, config.dim
    q_rows, kv_rows = config.n_heads * config.head_dim, config.n_kv_heads * config.head_dim
    if weights.has(p + "attn_qkv.weight"):
        qkv_rows = [q_rows + 2 * kv_rows]
        wqkv = weights.linear([p + "attn_qkv.weight"], dim, qkv_rows, p + "attn_qkv.bias", target)
    else:
        names = [p + "attn_q.weight", p + "attn_k.weight", p + "attn_v.weight"]
        biases = [p + "attn_q.bias", p + "attn_k.bias", p + "attn_v.bias"]
        wqkv = weights.linear(names, dim, [q_rows, kv_rows, kv_rows], biases, target)
    qk_norm = None
    if config.qk_norm_whole:  # OLMoE: one weight across all query heads, one across keys
        q_norm = weights.vector(p + "attn_q_norm.weight", q_rows)
        k_norm = weights.vector(p + "attn_k_norm.weight", kv_rows)
        qk_norm = torch.cat([q_norm, k_norm]).to(target.device).contiguous()
    elif config.qk_norm:
        q_norm = weights.vector(p + "attn_q_norm.weight", config.head_dim)
        k_norm = weights.vector(p + "attn_k_norm.weight", config.head_dim)
        qk_norm = torch.cat(
            [q_norm.expand(config.n_heads, -1), k_norm.expand(config.n_kv_heads, -1)]
        )
        qk_norm = qk_norm.to(target.device).contiguous()
    wo = weights.linear([p + "attn_output.weight"], q_rows, [dim], p + "attn_output.bias", target)
    attention = Attention(config, wqkv, wo, qk_norm)
    if config.experts is not None:
        ffn = _build_mixture(weights, config, p, target)
    else:
        ffn = _build_feed_forward(weights, config, p, target, config.ffn_dim)

    def norm(name: str) -> RMSNorm:
        return RMSNorm(weights.vector(p + name, dim).to(target.device), eps)

    post_attn = norm("post_attention_norm.weight") if config.post_norms else None
    post_ffn = norm("post_ffw_norm.weight") if config.post_norms else None
    return Block(
        norm("attn_norm.weight"), attention, norm("ffn_norm.weight"), ffn, post_attn, post_ffn
    )


def _build_feed_forward(
    weights: WeightReader,
    config: DecoderConfig,
    p: str,
    target: WeightTarget,
    ffn_dim: int,
    suffix: str = "",
) -> FeedForward:
    """A dense gated feed-forward: the layer's own, or (suffix "_shexp") a shared expert."""
    dim = config.dim
    gated = config.activation == "silu"  # the kernel may fuse silu(gate) * up
    if weights.has(p + f"ffn_gate{suffix}.weight"):
        names = [p + f"ffn_gate{suffix}.weight", p + f"ffn_up{suffix}.weight"]
        gate_up = weights.linear(names, dim, [ffn_dim, ffn_dim], target=target, gated=gated)
    else:  # Phi-3 stores gate and up as one tensor of 2 * ffn_dim rows, gate first
        names = [p + f"ffn_up{suffix}.weight"]
        gate_up = weights.linear(names, dim, [2 * ffn_dim], target=target, gated=gated)
    down = weights.linear([p + f"ffn_down{suffix}.weight"], ffn_dim, [dim], target=target)
    return FeedForward(gate_up, down, ffn_dim, config.activation)


def _build_mixture(
    weights: WeightReader, config: DecoderConfig, p: str, target: WeightTarget
) -> MixtureFeedForward:
    """The router, the experts (from the 3-D ffn_*_exps tensors) and any shared expert."""
    experts, dim = config.experts, config.dim
    router_weight = weights.matrix(p + "ffn_gate_inp.weight", experts.count, dim)
    router = Router(router_weight.to(target.device))
    # Experts stay on the CPU where the placement keeps them there (--cpu-moe).
    expert_target = target if not target.experts_on_cpu else CPU_INT4
    built = weights.experts(p, experts.count, experts.ffn_dim, dim, expert_target)
    shared = None
    if experts.shared_ffn_dim:
        shared_ffn = _build_feed_forward(
            weights, config, p, target, experts.shared_ffn_dim, suffix="_shexp"
        )
        gate = weights.vector(p + "ffn_gate_inp_shexp.weight", dim).to(target.device)
        shared = SharedExpert(shared_ffn, gate)
    expert_device = expert_target.device if expert_target.device != target.device else None
    return MixtureFeedForward(router, built, experts.used, experts.normalize, shared, expert_device)


def _native_expert_types(gate, up, down, dim: int, ffn_dim: int) -> bool:
    """Whether the native MoE kernel reads these expert types: the GGML kernel's, with gate
    and up of one type (its SiLU epilogue pairs their rows)."""
    return (
        gate == up
        and gate in _GGML_EXPERT_TYPES
        and down in _GGML_EXPERT_TYPES
        and native_ggml.takes(gate, dim)
        and native_ggml.takes(down, ffn_dim)
    )


# Expert weights go to the GGML kernel in any type it reads (there is no int4 path for them).
_GGML_EXPERT_TYPES = frozenset(GGMLQuantizationType(t) for t in native_ggml.BLOCKS if t < 100)


def lora_layout(gguf: GGUFFile, config: DecoderConfig) -> list[list[list[PartLayout]]]:
    """Per layer, per projection (Q|K|V, output, gate|up, down): the base tensors the
    projection stacks and where each one's outputs sit, as `_build_block` fuses them. An
    adapter's pairs are laid out by it (engine/lora/bound.py)."""
    q_rows, kv_rows = config.n_heads * config.head_dim, config.n_kv_heads * config.head_dim
    dim, ffn = config.dim, config.ffn_dim
    layout = []
    for i in range(config.n_layers):
        p = f"blk.{i}."
        if p + "attn_qkv.weight" in gguf.tensors:
            qkv = [PartLayout(p + "attn_qkv.weight", 0, q_rows + 2 * kv_rows)]
        else:
            qkv = [
                PartLayout(p + "attn_q.weight", 0, q_rows),
                PartLayout(p + "attn_k.weight", q_rows, kv_rows),
                PartLayout(p + "attn_v.weight", q_rows + kv_rows, kv_rows),
            ]
        if p + "ffn_gate.weight" in gguf.tensors:
            gate_up = [
                PartLayout(p + "ffn_gate.weight", 0, ffn),
                PartLayout(p + "ffn_up.weight", ffn, ffn),
            ]
        else:  # Phi-3: gate and up in one tensor, gate first
            gate_up = [PartLayout(p + "ffn_up.weight", 0, 2 * ffn)]
        out = [PartLayout(p + "attn_output.weight", 0, dim)]
        down = [PartLayout(p + "ffn_down.weight", 0, dim)]
        if config.experts is not None:  # adapters on the attention projections only
            gate_up, down = [], []
        layout.append([qkv, out, gate_up, down])
    return layout


class WeightReader:
    """Turns named GGUF tensors into modules. Releases each tensor's mapped pages once
    repacked, so the file and its repacked copy are never both resident, and remembers
    what it read, so a tensor the model would silently ignore becomes an error.

    Every tensor is taken with the shape the config gives it, as llama.cpp's loader does,
    and with finite scales: a file whose tensors disagree with its metadata, or whose
    numbers are NaN, is refused by name here rather than failing (or printing nonsense)
    at the first token."""

    def __init__(self, gguf: GGUFFile):
        self.gguf = gguf
        self.used: set[str] = set()

    def has(self, name: str) -> bool:
        return name in self.gguf.tensors

    def _take(self, name: str, shape: tuple[int, ...]) -> TensorInfo:
        self.used.add(name)
        info = self.gguf.tensor(name)
        if info.shape != shape:
            raise ModelFileError(
                self.gguf.path,
                f"tensor {name} has shape {list(info.shape)}, but the metadata gives {list(shape)}",
            )
        raw = self.gguf.raw(info)
        # A large tensor is checked a slice at a time, each slice's pages dropped after it:
        # the whole tensor is never resident at once only for this check.
        step = max(1, _CHECK_BYTES // max(1, raw.shape[1]))
        for start in range(0, raw.shape[0], step):
            rows = raw[start : start + step]
            if not all_finite(rows, info.ggml_type):
                raise ModelFileError(self.gguf.path, f"tensor {name} holds NaN or infinite values")
            if raw.shape[0] > step:
                self.gguf.release_view(rows)
        return info

    def linear(
        self,
        names: list[str],
        n_cols: int,
        rows: list[int],
        bias: str | list[str] | None = None,
        target: WeightTarget = CPU_INT4,
        gated: bool = False,
    ) -> Linear:
        infos = [self._take(n, (r, n_cols)) for n, r in zip(names, rows, strict=True)]
        raws = [(self.gguf.raw(i), i.ggml_type) for i in infos]
        bias_vector = self._bias(bias, infos)
        module = linear_from_raw(
            raws, n_cols, bias_vector, target, gated, release=self.gguf.release_view
        )
        self.gguf.release()
        return module

    def _bias(self, bias: str | list[str] | None, infos: list[TensorInfo]) -> torch.Tensor | None:
        names = [bias] if isinstance(bias, str) else list(bias or [])
        present = [self.has(n) for n in names]
        if not any(present):
            return None
        parts = [
            self.vector(n, info.shape[0]) if here else torch.zeros(info.shape[0])
            for n, here, info in zip(names, present, infos, strict=True)
        ]
        return torch.cat(parts)

    def experts(
        self, p: str, count: int, ffn_dim: int, dim: int, target: WeightTarget
    ) -> NativeExperts | TorchExperts:
        """A layer's experts from its ffn_gate_exps, ffn_up_exps [count, ffn_dim, dim] and
        ffn_down_exps [count, dim, ffn_dim]: for the native MoE kernel where it takes their
        types (each expert's rows in the file's blocks, interleaved as the dense weights
        are), else as torch linears."""
        names = [p + f"ffn_{part}_exps.weight" for part in ("gate", "up", "down")]
        shapes = [(count, ffn_dim, dim), (count, ffn_dim, dim), (count, dim, ffn_dim)]
        gate, up, down = (
            (self.gguf.raw(info), info.ggml_type)
            for info in (self._take(n, s) for n, s in zip(names, shapes, strict=True))
        )
        library = cpu_int4_kernel().library if target.on_cpu and not target.dense else None
        if library is not None and _native_expert_types(gate[1], up[1], down[1], dim, ffn_dim):
            release = self.gguf.release_view
            gate_up_weights, down_weights = [], []
            for e in range(count):
                rows = slice(e * ffn_dim, (e + 1) * ffn_dim)
                parts = [(gate[0][rows], gate[1]), (up[0][rows], up[1])]
                gate_up_weights.append(packed_ggml(library, parts, dim, None, True, release))
                back = [(down[0][e * dim : (e + 1) * dim], down[1])]
                down_weights.append(packed_ggml(library, back, ffn_dim, release=release))
            self.gguf.release()
            return NativeExperts(library, gate_up_weights, down_weights)
        built = []
        for e in range(count):
            rows = slice(e * ffn_dim, (e + 1) * ffn_dim)
            parts = [(gate[0][rows], gate[1]), (up[0][rows], up[1])]
            gate_up = linear_from_raw(parts, dim, target=target)
            back = [(down[0][e * dim : (e + 1) * dim], down[1])]
            down_linear = linear_from_raw(back, ffn_dim, target=target)
            built.append(TorchExpert(gate_up, down_linear, ffn_dim))
        self.gguf.release()
        return TorchExperts(built)

    def raw_weight(self, name: str) -> RawWeight:
        """A tensor's stored rows and type, as memory-mapped (no copy)."""
        info = self.gguf.tensor(name)
        return self.gguf.raw(info), info.ggml_type

    def matrix(self, name: str, rows: int, cols: int) -> torch.Tensor:
        """A small weight dequantized to fp32 [rows, cols] (a router)."""
        info = self._take(name, (rows, cols))
        return dequantize_rows(self.gguf.raw(info), info.ggml_type, cols).clone()

    def vector(self, name: str, size: int) -> torch.Tensor:
        info = self._take(name, (size,))
        return dequantize_rows(self.gguf.raw(info), info.ggml_type, info.n_elements)[0].clone()

    def embedding(self, name: str, vocab_size: int, dim: int) -> BlockEmbedding:
        # Looked-up rows are read straight from the memory map: no copy of the table.
        info = self._take(name, (vocab_size, dim))
        return BlockEmbedding(self.gguf.raw(info), info.ggml_type, dim)

    def check_all_used(self) -> None:
        unused = sorted(set(self.gguf.tensors) - self.used)
        if unused:
            more = f" (and {len(unused) - 1} more)" if len(unused) > 1 else ""
            raise UnsupportedModelError(
                self.gguf.path,
                f"tensor {unused[0]}{more} is not understood by the torch engine's "
                f"{self.gguf.architecture} model",
            )
