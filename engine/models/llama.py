"""The `llama` architecture (also Mistral-style files): RMSNorm, RoPE, GQA, SwiGLU.

Hyper-parameters come from GGUF metadata only. Weights stay in their GGML formats: Q/K/V are
fused into one int4 matmul, as are gate/up, so a decode step makes 4 weight calls per layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..cache import KVCache
from ..errors import ContextFullError, ModelFileError, UnsupportedModelError
from ..gguf_file import GGUFFile
from ..layers import BlockEmbedding, RMSNorm, Rope, apply_rope, linear_from_raw
from ..quant import dequantize_rows


@dataclass(frozen=True)
class LlamaConfig:
    n_layers: int
    dim: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    vocab_size: int
    norm_eps: float
    rope_base: float
    context_length: int

    @classmethod
    def from_gguf(cls, gguf: GGUFFile) -> LlamaConfig:
        def need(key: str):
            value = gguf.arch_value(key)
            if value is None:
                raise ModelFileError(gguf.path, f"missing metadata key {gguf.architecture}.{key}")
            return value

        dim = int(need("embedding_length"))
        n_heads = int(need("attention.head_count"))
        head_dim = int(gguf.arch_value("attention.key_length", dim // n_heads))
        rope_dim = int(gguf.arch_value("rope.dimension_count", head_dim))
        if rope_dim != head_dim:
            raise UnsupportedModelError(
                gguf.path, "partial rotary embeddings are not supported yet"
            )
        scaling = gguf.arch_value("rope.scaling.type", "none")
        if scaling not in ("none", None):
            raise UnsupportedModelError(gguf.path, f"RoPE scaling '{scaling}' is not supported yet")
        vocab = gguf.arch_value("vocab_size") or gguf.tensor("token_embd.weight").shape[0]
        return cls(
            n_layers=int(need("block_count")),
            dim=dim,
            n_heads=n_heads,
            n_kv_heads=int(gguf.arch_value("attention.head_count_kv", n_heads)),
            head_dim=head_dim,
            ffn_dim=int(need("feed_forward_length")),
            vocab_size=int(vocab),
            norm_eps=float(need("attention.layer_norm_rms_epsilon")),
            rope_base=float(gguf.arch_value("rope.freq_base", 10000.0)),
            context_length=int(gguf.arch_value("context_length", 4096)),
        )


# Decode runs ~30 tensor ops per layer and each costs a microsecond or two of Python and
# dispatch overhead, about as much as the matmuls themselves on a small model. So the layer
# code below calls submodules' `forward` directly (skipping nn.Module's hook machinery),
# updates the residual stream in place, and slices rather than splits.


class Attention(nn.Module):
    def __init__(self, config: LlamaConfig, wqkv: nn.Module, wo: nn.Module):
        super().__init__()
        self.wqkv, self.wo = wqkv, wo
        self.n_heads, self.n_kv_heads = config.n_heads, config.n_kv_heads
        self.head_dim = config.head_dim
        # Q and K sit side by side in the fused projection, so one matmul rotates both.
        self.n_rotated = config.n_heads + config.n_kv_heads

    def forward(
        self,
        x: torch.Tensor,
        rotation: torch.Tensor,
        cache: KVCache,
        mask: torch.Tensor | None,
    ) -> torch.Tensor:
        """x: [tokens, dim] -> [tokens, dim]."""
        n_tokens = x.shape[0]
        # Attention runs in fp32: torch's CPU attention and small bmm are several times faster
        # in fp32 than in bf16 at decode sizes, and the cache keeps full precision.
        heads = self.wqkv.forward(x).float().view(n_tokens, -1, self.head_dim)
        # [tokens, heads, head_dim] -> [heads, tokens, head_dim]
        qk = apply_rope(heads[:, : self.n_rotated], rotation).transpose(0, 1)
        v = heads[:, self.n_rotated :].transpose(0, 1)
        keys, values = cache.update_and_fetch(qk[self.n_heads :][None], v[None])
        out = F.scaled_dot_product_attention(
            qk[: self.n_heads][None], keys, values, attn_mask=mask, enable_gqa=True
        )
        return self.wo.forward(out[0].transpose(0, 1).reshape(n_tokens, -1))


class FeedForward(nn.Module):
    def __init__(self, w_gate_up: nn.Module, w_down: nn.Module, ffn_dim: int):
        super().__init__()
        self.w_gate_up, self.w_down, self.ffn_dim = w_gate_up, w_down, ffn_dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.w_gate_up.forward(x)
        gate, up = gate_up[:, : self.ffn_dim], gate_up[:, self.ffn_dim :]
        return self.w_down.forward(F.silu(gate).mul_(up))


class Block(nn.Module):
    def __init__(self, attn_norm, attention, ffn_norm, feed_forward):
        super().__init__()
        self.attn_norm, self.attention = attn_norm, attention
        self.ffn_norm, self.feed_forward = ffn_norm, feed_forward

    def forward(self, x, rotation, cache, mask):
        """Updates the residual stream `x` (fp32 [tokens, dim]) in place and returns it."""
        x.add_(self.attention.forward(self.attn_norm.forward(x), rotation, cache, mask))
        return x.add_(self.feed_forward.forward(self.ffn_norm.forward(x)))


class LlamaModel(nn.Module):
    def __init__(self, config: LlamaConfig, embed, layers, norm, output, max_positions: int):
        super().__init__()
        self.config = config
        self.embed, self.layers, self.norm, self.output = embed, nn.ModuleList(layers), norm, output
        self.max_positions = max_positions
        self.rope = Rope(config.head_dim, config.head_dim, config.rope_base, interleaved=True)

    def make_caches(self, max_tokens: int | None = None) -> list[KVCache]:
        size = max_tokens or self.max_positions
        c = self.config
        return [KVCache(c.n_kv_heads, c.head_dim, size) for _ in range(c.n_layers)]

    def forward(
        self, tokens: torch.Tensor, caches: list[KVCache], all_logits: bool = False
    ) -> torch.Tensor:
        """tokens: int64 [n]. Returns logits [n, vocab] if `all_logits`, else [1, vocab]."""
        offset, n_tokens = caches[0].offset, tokens.shape[0]
        if offset + n_tokens > self.max_positions:
            raise ContextFullError(
                f"context full: {offset + n_tokens} tokens exceed --ctx {self.max_positions}"
            )
        rotation = self.rope.matrices(offset, n_tokens)
        mask = caches[0].make_mask(n_tokens)
        x = self.embed(tokens)
        for layer, cache in zip(self.layers, caches, strict=True):
            x = layer.forward(x, rotation, cache, mask)
        if not all_logits:
            x = x[-1:]
        return self.output.forward(self.norm.forward(x)).float()

    @classmethod
    def from_gguf(cls, gguf: GGUFFile, max_positions: int) -> LlamaModel:
        config = LlamaConfig.from_gguf(gguf)
        weights = _WeightReader(gguf)
        layers = []
        for i in range(config.n_layers):
            p = f"blk.{i}."
            wqkv = weights.linear([p + "attn_q.weight", p + "attn_k.weight", p + "attn_v.weight"])
            attention = Attention(config, wqkv, weights.linear([p + "attn_output.weight"]))
            gate_up = weights.linear([p + "ffn_gate.weight", p + "ffn_up.weight"])
            ffn = FeedForward(gate_up, weights.linear([p + "ffn_down.weight"]), config.ffn_dim)
            layers.append(
                Block(
                    RMSNorm(weights.vector(p + "attn_norm.weight"), config.norm_eps),
                    attention,
                    RMSNorm(weights.vector(p + "ffn_norm.weight"), config.norm_eps),
                    ffn,
                )
            )
        # Many small models tie the output head to the embedding.
        head_name = "output.weight" if "output.weight" in gguf.tensors else "token_embd.weight"
        output = weights.linear([head_name])
        embed = weights.embedding("token_embd.weight", config.dim)
        norm = RMSNorm(weights.vector("output_norm.weight"), config.norm_eps)
        return cls(config, embed, layers, norm, output, max_positions)


class _WeightReader:
    """Turns named GGUF tensors into modules, releasing each tensor's mapped pages once
    repacked, so the file and its repacked copy are never both resident."""

    def __init__(self, gguf: GGUFFile):
        self.gguf = gguf

    def linear(self, names: list[str]) -> nn.Module:
        infos = [self.gguf.tensor(n) for n in names]
        module = linear_from_raw(
            [(self.gguf.raw(i), i.ggml_type) for i in infos], infos[0].shape[-1]
        )
        self.gguf.release()
        return module

    def vector(self, name: str) -> torch.Tensor:
        info = self.gguf.tensor(name)
        return dequantize_rows(self.gguf.raw(info), info.ggml_type, info.n_elements)[0].clone()

    def embedding(self, name: str, dim: int) -> BlockEmbedding:
        # Looked-up rows are read straight from the memory map: no copy of the table.
        info = self.gguf.tensor(name)
        return BlockEmbedding(self.gguf.raw(info), info.ggml_type, dim)
