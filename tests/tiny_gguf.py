"""Tiny random-weight GGUF files written with `gguf`'s writer, for oracle tests.

A byte-level SentencePiece-style vocabulary (<unk>, <s>, </s> and 256 byte tokens) is enough
for llama.cpp to load a model, and its size (259) is not a multiple of 16, which exercises the
row padding of our packed weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGUFWriter, quants
from gguf.constants import GGMLQuantizationType as Q

BYTE_TOKENS = [f"<0x{i:02X}>" for i in range(256)]
VOCAB = ["<unk>", "<s>", "</s>", *BYTE_TOKENS]
TOKEN_TYPES = [2, 3, 3] + [6] * 256  # unknown, control, control, byte


@dataclass(frozen=True)
class TinyLlama:
    n_layers: int = 2
    dim: int = 64
    n_heads: int = 4
    n_kv_heads: int = 2
    ffn_dim: int = 96
    context: int = 256
    rope_base: float = 10000.0
    norm_eps: float = 1e-5
    weight_type: Q = Q.Q4_1
    embed_type: Q = Q.Q8_0
    tied_output: bool = True
    architecture: str = "llama"
    down_type: Q | None = None  # override blk.*.ffn_down's type (e.g. a type we don't support)

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


def _add_weight(writer: GGUFWriter, name: str, values: np.ndarray, qtype: Q) -> None:
    if qtype not in (Q.F32, Q.F16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.BF16):
        # gguf cannot quantize this type: write random bytes of the right size instead.
        block, size = quants.GGML_QUANT_SIZES[qtype]
        rows, cols = values.shape
        raw = np.random.default_rng(0).integers(0, 256, (rows, cols // block * size), np.uint8)
        writer.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=qtype)
    elif qtype == Q.F32:
        writer.add_tensor(name, values.astype(np.float32))
    elif qtype == Q.F16:
        writer.add_tensor(name, values.astype(np.float16))
    else:
        packed = quants.quantize(values.astype(np.float32), qtype)
        writer.add_tensor(name, packed, raw_shape=packed.shape, raw_dtype=qtype)


def write_tiny_llama(path: Path, spec: TinyLlama = TinyLlama(), seed: int = 0) -> Path:
    rng = np.random.default_rng(seed)
    arch = spec.architecture
    writer = GGUFWriter(str(path), arch)
    writer.add_block_count(spec.n_layers)
    writer.add_context_length(spec.context)
    writer.add_embedding_length(spec.dim)
    writer.add_feed_forward_length(spec.ffn_dim)
    writer.add_head_count(spec.n_heads)
    writer.add_head_count_kv(spec.n_kv_heads)
    writer.add_rope_freq_base(spec.rope_base)
    writer.add_layer_norm_rms_eps(spec.norm_eps)
    writer.add_rope_dimension_count(spec.head_dim)
    writer.add_vocab_size(len(VOCAB))
    writer.add_tokenizer_model("llama")
    writer.add_token_list(VOCAB)
    writer.add_token_scores([0.0] * len(VOCAB))
    writer.add_token_types(TOKEN_TYPES)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_add_bos_token(True)

    def weight(rows: int, cols: int, scale: float) -> np.ndarray:
        return rng.normal(0.0, scale, size=(rows, cols))

    def norm() -> np.ndarray:
        return (1.0 + rng.normal(0.0, 0.1, size=spec.dim)).astype(np.float32)

    d, hd = spec.dim, spec.head_dim
    # Scales like a trained network's: attention logits and residual updates of order one,
    # so logits are not so chaotic that quantization noise decides the top token.
    w_in, w_ffn_out = 1.0 / np.sqrt(d), 1.0 / np.sqrt(spec.ffn_dim)
    _add_weight(writer, "token_embd.weight", weight(len(VOCAB), d, 1.0), spec.embed_type)
    for i in range(spec.n_layers):
        p = f"blk.{i}."
        writer.add_tensor(p + "attn_norm.weight", norm())
        _add_weight(
            writer, p + "attn_q.weight", weight(spec.n_heads * hd, d, w_in), spec.weight_type
        )
        _add_weight(
            writer, p + "attn_k.weight", weight(spec.n_kv_heads * hd, d, w_in), spec.weight_type
        )
        _add_weight(
            writer, p + "attn_v.weight", weight(spec.n_kv_heads * hd, d, w_in), spec.weight_type
        )
        _add_weight(
            writer, p + "attn_output.weight", weight(d, spec.n_heads * hd, w_in), spec.weight_type
        )
        writer.add_tensor(p + "ffn_norm.weight", norm())
        _add_weight(writer, p + "ffn_gate.weight", weight(spec.ffn_dim, d, w_in), spec.weight_type)
        _add_weight(writer, p + "ffn_up.weight", weight(spec.ffn_dim, d, w_in), spec.weight_type)
        _add_weight(
            writer,
            p + "ffn_down.weight",
            weight(d, spec.ffn_dim, w_ffn_out),
            spec.down_type or spec.weight_type,
        )
    writer.add_tensor("output_norm.weight", norm())
    if not spec.tied_output:
        _add_weight(writer, "output.weight", weight(len(VOCAB), d, 1.0), spec.weight_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
