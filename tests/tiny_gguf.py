"""Tiny random-weight GGUF files written with `gguf`'s writer, for oracle tests.

One writer covers every architecture the engine supports; the spec says which variant's
tensors and metadata to write. A byte-level SentencePiece-style vocabulary (<unk>, <s>, </s>
and 256 byte tokens) is enough for llama.cpp to load a model, and its size (259) is not a
multiple of 16, which exercises the row padding of our packed weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGUFValueType, GGUFWriter, quants
from gguf.constants import GGMLQuantizationType as Q

BYTE_TOKENS = [f"<0x{i:02X}>" for i in range(256)]
VOCAB = ["<unk>", "<s>", "</s>", *BYTE_TOKENS]
TOKEN_TYPES = [2, 3, 3] + [6] * 256  # unknown, control, control, byte


def _gpt2_byte_chars() -> list[str]:
    """GPT-2's byte-level BPE spells each byte as one printable character: the printable
    Latin-1 ones as themselves, the rest as code points from 256 on, in order."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    others = [b for b in range(256) if b not in printable]
    chars = {b: chr(b) for b in printable} | {b: chr(256 + i) for i, b in enumerate(others)}
    return [chars[b] for b in range(256)]


# A byte-level BPE vocabulary (llama.cpp's "gpt2" tokenizer, as SmolLM2's): every byte, a few
# merges, and ChatML's control tokens.
GPT2_MERGES = ["Ġ t", "h e", "Ġt he", "i n"]
GPT2_VOCAB = [*_gpt2_byte_chars(), "Ġt", "he", "Ġthe", "in", "<|im_start|>", "<|im_end|>"]
GPT2_TOKEN_TYPES = [1] * (len(GPT2_VOCAB) - 2) + [3, 3]  # normal, then control


@dataclass(frozen=True)
class TinyModel:
    architecture: str = "llama"
    n_layers: int = 2
    dim: int = 64
    n_heads: int = 4
    n_kv_heads: int = 2
    head_dim: int = 16
    ffn_dim: int = 96
    context: int = 256
    rope_base: float = 10000.0
    norm_eps: float = 1e-5
    weight_type: Q = Q.Q4_1
    embed_type: Q = Q.Q8_0
    tied_output: bool = True
    down_type: Q | None = None  # override blk.*.ffn_down's type (e.g. a K-quant)
    value_type: Q | None = None  # override blk.*.attn_v's type (Q4_K_M files hold it in Q6_K)
    qkv_bias: bool = False  # qwen2
    qk_norm: bool = False  # qwen3, gemma3
    fused_qkv: bool = False  # phi3
    fused_gate_up: bool = False  # phi3
    post_norms: bool = False  # gemma3
    sliding_window: int = 0  # gemma3
    sliding_window_pattern: int = 0
    local_rope_base: float = 0.0
    final_logit_softcap: float = 0.0
    chat_template: str | None = None
    tokenizer: str = "llama"  # or "gpt2" (byte-level BPE)
    # A mixture of experts in every layer (0: a dense feed-forward): 3-D expert tensors
    n_experts: int = 0
    n_experts_used: int = 0
    expert_ffn_dim: int = 0
    shared_expert_ffn_dim: int = 0  # qwen2moe's shared expert
    qk_norm_whole: bool = False  # olmoe: one norm over all query (key) heads
    router_scale: float = 1.0  # the router's logits' spread (larger: clearer choices)
    # The final norm's weight (1: logits spread ~sqrt(dim), so peaked that a random token's
    # log-probability is tens of nats; ~0.15 spreads them like a trained model's)
    output_norm_scale: float = 1.0

    @property
    def vocab(self) -> list[str]:
        return GPT2_VOCAB if self.tokenizer == "gpt2" else VOCAB


# Variants per architecture, as llama.cpp reads them.
LLAMA = TinyModel()
QWEN2 = TinyModel(architecture="qwen2", qkv_bias=True, tied_output=False)
QWEN3 = TinyModel(architecture="qwen3", qk_norm=True, head_dim=32)
PHI3 = TinyModel(architecture="phi3", fused_qkv=True, fused_gate_up=True, tied_output=False)
# Mixtures of experts, as llama.cpp reads them (OLMoE's key norm spans n_embd: no GQA).
MIXTRAL = TinyModel(n_experts=4, n_experts_used=2, expert_ffn_dim=96)  # = ffn_dim, as llama's
QWEN2MOE = TinyModel(
    architecture="qwen2moe",
    qkv_bias=True,
    tied_output=False,
    n_experts=8,
    n_experts_used=2,
    expert_ffn_dim=64,
    shared_expert_ffn_dim=96,
)
QWEN3MOE = TinyModel(
    architecture="qwen3moe",
    qk_norm=True,
    head_dim=32,
    tied_output=False,
    n_experts=8,
    n_experts_used=2,
    expert_ffn_dim=64,
)
OLMOE = TinyModel(
    architecture="olmoe",
    n_kv_heads=4,
    qk_norm_whole=True,
    tied_output=False,
    n_experts=8,
    n_experts_used=4,
    expert_ffn_dim=96,  # = ffn_dim, as olmoe's
)
GEMMA3 = TinyModel(
    architecture="gemma3",
    n_layers=4,
    head_dim=32,
    qk_norm=True,
    post_norms=True,
    sliding_window=8,
    sliding_window_pattern=2,
    local_rope_base=20000.0,
    rope_base=1000000.0,
    norm_eps=1e-6,
    final_logit_softcap=30.0,
)


def quantize_k(values: np.ndarray, qtype: Q) -> np.ndarray:
    """A plain K-quant quantizer for test data (gguf has none): per sub-block range or
    absolute maximum, sub-block scales quantized against the super-block's. Not llama.cpp's
    optimised search, but valid blocks that decode close to `values`. uint8 [..., bytes]
    (values [..., cols]: experts' 3-D stacks too)."""
    x = values.astype(np.float32).reshape(-1, 256)
    if qtype == Q.Q6_K:
        blocks = _quantize_q6_k(x)
    else:
        blocks = _quantize_q45_k(x, bits=4 if qtype == Q.Q4_K else 5)
    return blocks.reshape(*values.shape[:-1], -1)


def _quantize_q45_k(x: np.ndarray, bits: int) -> np.ndarray:
    n, top = x.shape[0], (1 << bits) - 1
    sub = x.reshape(n, 8, 32)
    low = np.minimum(sub.min(-1), 0)
    step = np.maximum((sub.max(-1) - low) / top, 1e-8)
    d = (step.max(-1) / 63).astype(np.float16)
    dmin = ((-low).max(-1) / 63).astype(np.float16)
    dmin = np.maximum(dmin, np.float16(1e-4)).astype(np.float16)
    # Rounding sub-block scales and mins up keeps every value inside the coded range.
    sc = np.clip(np.ceil(step / d.astype(np.float32)[:, None]), 1, 63).astype(np.uint8)
    m = np.clip(np.ceil(-low / dmin.astype(np.float32)[:, None]), 0, 63).astype(np.uint8)
    scale = d.astype(np.float32)[:, None] * sc
    minimum = dmin.astype(np.float32)[:, None] * m
    q = np.clip(np.rint((sub + minimum[..., None]) / scale[..., None]), 0, top).astype(np.uint8)
    packed = np.zeros((n, 12), np.uint8)
    packed[:, 0:4] = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    packed[:, 4:8] = m[:, :4] | ((m[:, 4:] >> 4) << 6)
    packed[:, 8:12] = (sc[:, 4:] & 0x0F) | ((m[:, 4:] & 0x0F) << 4)
    pairs = (q & 0x0F).reshape(n, 4, 2, 32)
    qs = (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(n, 128)
    parts = [d.view(np.uint8).reshape(n, 2), dmin.view(np.uint8).reshape(n, 2), packed]
    if bits == 5:
        high = (q >> 4).reshape(n, 8, 32)  # bit j of qh[l] is group j's element l
        qh = np.zeros((n, 32), np.uint8)
        for j in range(8):
            qh |= high[:, j, :] << j
        parts.append(qh)
    return np.concatenate([*parts, qs], axis=1)


def _quantize_q6_k(x: np.ndarray) -> np.ndarray:
    n = x.shape[0]
    sub = x.reshape(n, 16, 16)
    step = np.maximum(np.abs(sub).max(-1) / 31, 1e-8)
    d = (step.max(-1) / 127).astype(np.float16)
    sc = np.clip(np.ceil(step / d.astype(np.float32)[:, None]), 1, 127).astype(np.int8)
    scale = d.astype(np.float32)[:, None] * sc
    q = np.clip(np.rint(sub / scale[..., None]) + 32, 0, 63).astype(np.uint8).reshape(n, 2, 4, 32)
    # element h*128 + c*32 + l: low nibble in ql[h*64 + (c % 2)*32 + l] (high half if c >= 2),
    # top two bits in qh[h*32 + l] at bit 2c.
    low = q & 0x0F
    ql = (low[:, :, 0:2] | (low[:, :, 2:4] << 4)).reshape(n, 128)
    high = q >> 4
    qh = high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4) | (high[:, :, 3] << 6)
    return np.concatenate(
        [ql, qh.reshape(n, 64), sc.view(np.uint8), d.view(np.uint8).reshape(n, 2)], axis=1
    )


K_QUANTS = (Q.Q4_K, Q.Q5_K, Q.Q6_K)
GGUF_QUANTIZABLE = (Q.F32, Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0)


def _add_tensor(writer: GGUFWriter, name: str, values: np.ndarray, qtype: Q) -> None:
    if qtype in K_QUANTS:
        raw = quantize_k(values, qtype)
        writer.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=qtype)
    elif qtype not in GGUF_QUANTIZABLE:
        # A type we only need to be rejected: random bytes of the right size.
        block, size = quants.GGML_QUANT_SIZES[qtype]
        *outer, cols = values.shape
        raw = np.random.default_rng(0).integers(0, 256, (*outer, cols // block * size), np.uint8)
        writer.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=qtype)
    elif qtype == Q.F32:
        writer.add_tensor(name, values.astype(np.float32))
    elif qtype == Q.F16:
        writer.add_tensor(name, values.astype(np.float16))
    else:
        packed = quants.quantize(values.astype(np.float32), qtype)
        writer.add_tensor(name, packed, raw_shape=packed.shape, raw_dtype=qtype)


def _write_metadata(writer: GGUFWriter, spec: TinyModel) -> None:
    arch = spec.architecture
    writer.add_block_count(spec.n_layers)
    writer.add_context_length(spec.context)
    writer.add_embedding_length(spec.dim)
    writer.add_feed_forward_length(spec.ffn_dim)
    writer.add_head_count(spec.n_heads)
    writer.add_head_count_kv(spec.n_kv_heads)
    writer.add_key_length(spec.head_dim)
    writer.add_value_length(spec.head_dim)
    writer.add_rope_freq_base(spec.rope_base)
    writer.add_layer_norm_rms_eps(spec.norm_eps)
    writer.add_rope_dimension_count(spec.head_dim)
    writer.add_vocab_size(len(spec.vocab))
    if spec.sliding_window:
        writer.add_uint32(f"{arch}.attention.sliding_window", spec.sliding_window)
        writer.add_uint32(f"{arch}.attention.sliding_window_pattern", spec.sliding_window_pattern)
    if spec.local_rope_base:
        writer.add_float32(f"{arch}.rope.freq_base_swa", spec.local_rope_base)
    if spec.final_logit_softcap:
        writer.add_float32(f"{arch}.final_logit_softcapping", spec.final_logit_softcap)
    if spec.n_experts:
        writer.add_expert_count(spec.n_experts)
        writer.add_expert_used_count(spec.n_experts_used)
        writer.add_expert_feed_forward_length(spec.expert_ffn_dim)
    if spec.shared_expert_ffn_dim:
        writer.add_expert_shared_feed_forward_length(spec.shared_expert_ffn_dim)
    if spec.tokenizer == "gpt2":
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("smollm")
        writer.add_token_list(GPT2_VOCAB)
        writer.add_token_types(GPT2_TOKEN_TYPES)
        writer.add_token_merges(GPT2_MERGES)
        writer.add_bos_token_id(GPT2_VOCAB.index("<|im_start|>"))
        writer.add_eos_token_id(GPT2_VOCAB.index("<|im_end|>"))
    else:
        writer.add_tokenizer_model("llama")
        writer.add_token_list(VOCAB)
        writer.add_token_scores([0.0] * len(VOCAB))
        writer.add_token_types(TOKEN_TYPES)
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
        writer.add_unk_token_id(0)
    writer.add_add_bos_token(True)
    if spec.chat_template is not None:
        writer.add_chat_template(spec.chat_template)


def write_tiny_model(
    path: Path,
    spec: TinyModel = LLAMA,
    seed: int = 0,
    metadata: dict | None = None,
    weights: dict[str, np.ndarray] | None = None,
) -> Path:
    """`metadata`: keys to write over the spec's, each as (value, GGUFValueType) or, for an
    array, (values, GGUFValueType.ARRAY, element type); None drops the key. `weights`: the
    values of some weight matrices by name, instead of the seed's (the rest are unchanged,
    so a model written again with a few weights replaced differs in those alone)."""
    rng = np.random.default_rng(seed)
    writer = GGUFWriter(str(path), spec.architecture)

    def _add_weight(writer: GGUFWriter, name: str, values: np.ndarray, qtype: Q) -> None:
        _add_tensor(writer, name, (weights or {}).get(name, values), qtype)

    _write_metadata(writer, spec)
    for key, value in (metadata or {}).items():
        writer.kv_data[0].pop(key, None)
        if value is not None:
            writer.add_key_value(
                key, value[0], value[1], sub_type=value[2] if len(value) > 2 else None
            )

    def weight(rows: int, cols: int, scale: float) -> np.ndarray:
        return rng.normal(0.0, scale, size=(rows, cols))

    def vector(size: int, mean: float = 1.0, spread: float = 0.1) -> np.ndarray:
        return (mean + rng.normal(0.0, spread, size=size)).astype(np.float32)

    d, hd, wt = spec.dim, spec.head_dim, spec.weight_type
    q_rows, kv_rows = spec.n_heads * hd, spec.n_kv_heads * hd
    # Scales like a trained network's: attention logits and residual updates of order one,
    # so logits are not so chaotic that quantization noise decides the top token.
    w_in, w_ffn_out, w_attn_out = 1 / np.sqrt(d), 1 / np.sqrt(spec.ffn_dim), 1 / np.sqrt(q_rows)
    embedding = weight(len(spec.vocab), d, 1.0)
    _add_weight(writer, "token_embd.weight", embedding, spec.embed_type)
    for i in range(spec.n_layers):
        p = f"blk.{i}."
        writer.add_tensor(p + "attn_norm.weight", vector(d))
        if spec.fused_qkv:
            _add_weight(writer, p + "attn_qkv.weight", weight(q_rows + 2 * kv_rows, d, w_in), wt)
        else:
            _add_weight(writer, p + "attn_q.weight", weight(q_rows, d, w_in), wt)
            _add_weight(writer, p + "attn_k.weight", weight(kv_rows, d, w_in), wt)
            _add_weight(
                writer, p + "attn_v.weight", weight(kv_rows, d, w_in), spec.value_type or wt
            )
        if spec.qkv_bias:
            writer.add_tensor(p + "attn_q.bias", vector(q_rows, 0.0, 0.3))
            writer.add_tensor(p + "attn_k.bias", vector(kv_rows, 0.0, 0.3))
            writer.add_tensor(p + "attn_v.bias", vector(kv_rows, 0.0, 0.3))
        if spec.qk_norm:
            writer.add_tensor(p + "attn_q_norm.weight", vector(hd))
            writer.add_tensor(p + "attn_k_norm.weight", vector(hd))
        if spec.qk_norm_whole:
            writer.add_tensor(p + "attn_q_norm.weight", vector(q_rows))
            writer.add_tensor(p + "attn_k_norm.weight", vector(kv_rows))
        _add_weight(writer, p + "attn_output.weight", weight(d, q_rows, w_attn_out), wt)
        if spec.post_norms:
            writer.add_tensor(p + "post_attention_norm.weight", vector(d))
        writer.add_tensor(p + "ffn_norm.weight", vector(d))
        if spec.n_experts:
            _add_experts(writer, _add_weight, spec, p, weight, vector)
        elif spec.fused_gate_up:
            _add_weight(writer, p + "ffn_up.weight", weight(2 * spec.ffn_dim, d, w_in), wt)
        else:
            _add_weight(writer, p + "ffn_gate.weight", weight(spec.ffn_dim, d, w_in), wt)
            _add_weight(writer, p + "ffn_up.weight", weight(spec.ffn_dim, d, w_in), wt)
        if not spec.n_experts:
            down = weight(d, spec.ffn_dim, w_ffn_out)
            _add_weight(writer, p + "ffn_down.weight", down, spec.down_type or wt)
        if spec.post_norms:
            writer.add_tensor(p + "post_ffw_norm.weight", vector(d))
    writer.add_tensor("output_norm.weight", spec.output_norm_scale * vector(d))
    if not spec.tied_output:
        # An untied head near the embedding, as trained models' heads are: a purely random
        # one makes many near-tied logits, where rounding noise decides the top token.
        head = embedding + weight(len(spec.vocab), d, 0.3)
        _add_weight(writer, "output.weight", head, wt)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _add_experts(writer, add_weight, spec: TinyModel, p: str, weight, vector) -> None:
    """A layer's router, experts [n_experts, rows, cols] and any shared expert."""
    d, e, ffn, wt = spec.dim, spec.n_experts, spec.expert_ffn_dim, spec.weight_type
    router = weight(e, d, spec.router_scale / np.sqrt(d))
    writer.add_tensor(p + "ffn_gate_inp.weight", router.astype(np.float32))

    def stacked(rows: int, cols: int) -> np.ndarray:
        return np.stack([weight(rows, cols, 1 / np.sqrt(cols)) for _ in range(e)])

    add_weight(writer, p + "ffn_gate_exps.weight", stacked(ffn, d), wt)
    add_weight(writer, p + "ffn_up_exps.weight", stacked(ffn, d), wt)
    add_weight(writer, p + "ffn_down_exps.weight", stacked(d, ffn), spec.down_type or wt)
    if spec.shared_expert_ffn_dim:
        shared = spec.shared_expert_ffn_dim
        writer.add_tensor(p + "ffn_gate_inp_shexp.weight", vector(d, 0.0, 1 / np.sqrt(d)))
        add_weight(writer, p + "ffn_gate_shexp.weight", weight(shared, d, 1 / np.sqrt(d)), wt)
        add_weight(writer, p + "ffn_up_shexp.weight", weight(shared, d, 1 / np.sqrt(d)), wt)
        down = weight(d, shared, 1 / np.sqrt(shared))
        add_weight(writer, p + "ffn_down_shexp.weight", down, spec.down_type or wt)


LORA_TARGETS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def write_tiny_adapter(
    path: Path,
    base: Path,
    rank: int = 4,
    alpha: float = 8.0,
    seed: int = 0,
    targets: tuple[str, ...] = LORA_TARGETS,
    zero_b: bool = False,
    dtype=np.float32,
    metadata: dict | None = None,
    tensors: dict | None = None,
) -> Path:
    """A LoRA adapter for the tiny model at `base`, as llama.cpp's converter writes one: a
    pair `<weight>.lora_a` [rank, inputs] and `.lora_b` [outputs, rank] for each target of
    every layer. `metadata` overrides keys as in write_tiny_model (None drops one);
    `tensors` adds (or, with None, drops) tensors by name."""
    from miniapp.engine.modelfile.gguf_file import GGUFFile

    model = GGUFFile(base)
    rng = np.random.default_rng(seed)
    writer = GGUFWriter(str(path), model.architecture)
    values = {"general.type": ("adapter", GGUFValueType.STRING)}
    values["adapter.type"] = ("lora", GGUFValueType.STRING)
    values["adapter.lora.alpha"] = (alpha, GGUFValueType.FLOAT32)
    for key, value in {**values, **(metadata or {})}.items():
        writer.kv_data[0].pop(key, None)
        if value is not None:
            writer.add_key_value(key, value[0], value[1])
    added = dict(tensors or {})
    for name, info in model.tensors.items():
        if not name.endswith(".weight") or name.split(".")[-2] not in targets:
            continue
        outputs, inputs = info.shape
        a = rng.normal(0.0, 1 / np.sqrt(inputs), size=(rank, inputs))
        b = np.zeros((outputs, rank)) if zero_b else rng.normal(0.0, 0.5, size=(outputs, rank))
        for suffix, array in ((".lora_a", a), (".lora_b", b)):
            if name + suffix not in added:
                added[name + suffix] = array.astype(dtype)
    for name, array in added.items():
        if array is not None:
            writer.add_tensor(name, array)
    model.close()
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
