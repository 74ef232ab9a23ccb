"""Our GGML block decoding against the `gguf` package's reference dequantizer, and the int4
kernel path against a pure-torch reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import quants
from gguf.constants import GGML_QUANT_SIZES
from gguf.constants import GGMLQuantizationType as Q
from tiny_gguf import quantize_k

from miniapp.engine.ops import layers
from miniapp.engine.ops.layers import (
    BlockEmbedding,
    DenseLinear,
    GgmlLinear,
    Int4Linear,
    linear_from_raw,
)
from miniapp.engine.ops.quant import (
    PLAIN,
    QUANT_TYPES,
    all_finite,
    decode,
    dequantize_rows,
    effective_weight,
    expand_input,
    layout_for,
    shared_layout,
    to_int4,
)
from miniapp.engine.platform.kernels import GGML_ENV, INTERLEAVE_ENV
from miniapp.native import ggml as native_ggml

RNG = np.random.default_rng(1234)
K_QUANTS = (Q.Q4_K, Q.Q5_K, Q.Q6_K)  # gguf cannot quantize these: random blocks instead
ALL_QUANTS = (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, *K_QUANTS)


def random_raw(qtype: Q, rows: int, cols: int, scale: float = 1.0) -> torch.Tensor:
    """Random rows of `qtype` blocks as uint8 [rows, row_bytes]."""
    values = RNG.normal(0, scale, size=(rows, cols)).astype(np.float32)
    if qtype in K_QUANTS:
        return torch.from_numpy(quantize_k(values, qtype))
    packed = np.ascontiguousarray(quants.quantize(values, qtype))
    return torch.from_numpy(packed.view(np.uint8).reshape(rows, -1))


def gguf_reference(raw: torch.Tensor, qtype: Q, cols: int) -> np.ndarray:
    return quants.dequantize(raw.numpy(), qtype).reshape(raw.shape[0], cols)


@pytest.mark.parametrize("qtype", [*ALL_QUANTS, Q.F16, Q.BF16, Q.F32], ids=lambda q: q.name)
def test_dequantize_matches_gguf_reference(qtype):
    cols = 512
    raw = random_raw(qtype, 7, cols)
    ours = dequantize_rows(raw, qtype, cols).numpy()
    # Bound: exact up to fp32 evaluation order (a few ulps of the largest weight).
    reference = gguf_reference(raw, qtype, cols)
    np.testing.assert_allclose(ours, reference, rtol=1e-6, atol=1e-6 * np.abs(reference).max())


@pytest.mark.parametrize("qtype", K_QUANTS, ids=lambda q: q.name)
def test_k_quant_decoding_of_arbitrary_bits(qtype):
    """Every bit pattern, not just what our test quantizer writes: random bytes, with the
    fp16 super-block scales set to finite values."""
    block, size = GGML_QUANT_SIZES[qtype]
    raw = RNG.integers(0, 256, (5, 2, size), dtype=np.uint8)
    for at in {Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}[qtype]:
        raw[:, :, at : at + 2] = (
            RNG.uniform(0.001, 0.01, (5, 2, 1)).astype(np.float16).view(np.uint8)
        )
    raw = torch.from_numpy(raw.reshape(5, -1))
    reference = gguf_reference(raw, qtype, 2 * block)
    ours = dequantize_rows(raw, qtype, 2 * block).numpy()
    np.testing.assert_allclose(ours, reference, rtol=1e-6, atol=1e-6 * np.abs(reference).max())


def test_test_quantizer_round_trips():
    values = RNG.normal(0, 1, size=(4, 512)).astype(np.float32)
    for qtype in K_QUANTS:
        decoded = gguf_reference(torch.from_numpy(quantize_k(values, qtype)), qtype, 512)
        assert np.abs(decoded - values).max() < 0.35, qtype  # a 4-bit step is ~0.5 here


@pytest.mark.parametrize("qtype", ALL_QUANTS, ids=lambda q: q.name)
def test_int4_kernel_format_within_bf16_rounding(qtype):
    """The groups and input layout the kernel runs encode the same weights, up to the bf16
    rounding of each group's scale and zero (relative 2^-8 each)."""
    cols = 512
    raw = random_raw(qtype, 9, cols)
    codes = decode(raw, qtype)
    groups = to_int4(codes)
    assert groups.codes.max() <= 15
    zero_per_column = _zero_per_column(groups).numpy()
    hi_distance = _hi_distance_per_column(groups).numpy()
    # Stored as the kernel stores them: bf16 scales and zeros.
    groups.scale = groups.scale.bfloat16().float()
    groups.zero = groups.zero.bfloat16().float()
    reference = gguf_reference(raw, qtype, cols)
    error = np.abs(effective_weight(groups).numpy() - reference)
    # Bound: each weight is (lo - 8)*s + 16*(hi - 8)*s + zero, and bf16 rounding moves s and
    # the zero by at most 2^-8 of themselves; |lo - 8| <= 8. (The hi plane is centred per
    # group, so for real data |hi - 8| is at most 1, 2 and 8 for 5-, 6- and 8-bit codes.)
    step = codes.scale.abs().repeat_interleave(codes.group, dim=1).numpy()
    bound = 2**-8 * ((16 * hi_distance + 8) * step + np.abs(zero_per_column)) * 1.001 + 1e-9
    assert (error <= bound).all(), (error / bound).max()


def _zero_per_column(groups) -> torch.Tensor:
    """The zero term each weight column receives, in weight units."""
    width = groups.layout.interleave
    if not width:
        return groups.zero.repeat_interleave(groups.layout.group, dim=1)
    return 17 * groups.zero.repeat_interleave(width, dim=1)  # shared by hi and lo slots


def _hi_distance_per_column(groups) -> torch.Tensor:
    """|hi - 8| of each weight column's hi-plane code (0 without a hi plane)."""
    distance = (groups.codes.int() - 8).abs()
    width = groups.layout.interleave
    if not width:
        return torch.zeros_like(distance)
    rows = distance.shape[0]
    return distance.view(rows, -1, 2, width)[:, :, 0].reshape(rows, -1)


# Rows that are not a multiple of 16 exercise the padding; several M cover decode and prefill.
@pytest.mark.parametrize("qtype", ALL_QUANTS, ids=lambda q: q.name)
@pytest.mark.parametrize("rows", [16, 40, 259])
@pytest.mark.parametrize("m", [1, 3, 17])
def test_int4_linear_matches_reference(qtype, rows, m, monkeypatch):
    monkeypatch.setenv(GGML_ENV, "0")  # every type through the int4 layout
    cols = 256
    raw = random_raw(qtype, rows, cols, scale=0.5)
    layer = linear_from_raw([(raw, qtype)], cols)
    assert isinstance(layer, Int4Linear)
    x = torch.randn(m, cols)
    reference = x.to(torch.bfloat16).float() @ dequantize_rows(raw, qtype, cols).T
    y = layer(x).float()
    assert y.shape == (m, rows)
    # Bound: bf16 scales/zeros (above) and a bf16 output (2^-9 relative) around an fp32
    # accumulation; 2% of the output's scale is far above that and far below a bug.
    scale = reference.abs().max()
    assert (y - reference).abs().max() <= 0.02 * scale


@pytest.mark.parametrize("qtype", ALL_QUANTS, ids=lambda q: q.name)
@pytest.mark.parametrize("m", [1, 5])
@pytest.mark.parametrize("interleave", ["1", "0"])
def test_ggml_linear_reads_the_file_blocks_and_matches_reference(qtype, m, interleave, monkeypatch):
    monkeypatch.setenv(GGML_ENV, "all")
    monkeypatch.setenv(INTERLEAVE_ENV, interleave)
    cols = 512
    raw = random_raw(qtype, 40, cols, scale=0.5)
    layer = linear_from_raw([(raw, qtype)], cols)
    assert isinstance(layer, GgmlLinear)
    assert layer.nbytes == raw.numel()  # the file's own bytes, in place or interleaved
    if interleave == "1" and qtype in native_ggml.INTERLEAVED:
        assert layer.native.interleaved
    else:  # read in place: no copy of the weights
        assert layer.native.parts[0][0].data_ptr() == raw.data_ptr()
    x = torch.randn(m, cols)
    reference = x @ dequantize_rows(raw, qtype, cols).T
    # x is quantized to int8 per block (steps of max/127): well within 2% of the scale.
    assert (layer(x) - reference).abs().max() <= 0.02 * reference.abs().max()


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q6_K, Q.Q4_K], ids=lambda q: q.name)
def test_a_tied_embedding_reads_the_heads_interleaved_copy_where_it_can(qtype):
    """One copy of a tied table in memory: the embedding gathers its rows from the head's
    interleaved groups (Q8_0, Q6_K); a head whose interleaving re-encodes bytes (Q4_K) leaves
    the embedding to the file's rows."""
    dim = 512
    raw = random_raw(qtype, 48, dim, scale=0.5)
    head = linear_from_raw([(raw, qtype)], dim)
    tied = BlockEmbedding.tied_to(head, dim)
    if qtype == Q.Q4_K:
        assert tied is None
        return
    tokens = torch.tensor([0, 7, 8, 47, 21, 21])
    assert torch.equal(tied(tokens), BlockEmbedding(raw, qtype, dim)(tokens))
    assert tied.raw.data_ptr() == head.native.parts[0][0].data_ptr()


@pytest.mark.parametrize("qtype", ALL_QUANTS, ids=lambda q: q.name)
def test_a_table_looked_up_inside_a_step_makes_no_tensor_from_host_data(qtype):
    """A GPU's fixed-shape step looks its tokens up in the table inside its graph: decoding
    the blocks must not make a tensor from Python data (a copy from the host, which a
    captured graph cannot hold). The copy `to` a device keeps the rows."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class HostData(TorchDispatchMode):
        made = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in (torch.ops.aten.lift_fresh.default, torch.ops.aten.lift_fresh_copy.default):
                HostData.made += 1
            return func(*args, **(kwargs or {}))

    dim = 512
    raw = random_raw(qtype, 16, dim)
    table = BlockEmbedding(raw, qtype, dim)
    tokens = torch.tensor([3, 0, 15, 3])
    want = torch.from_numpy(gguf_reference(raw, qtype, dim))[tokens]
    with HostData():
        got = table(tokens)
    assert HostData.made == 0
    assert torch.allclose(got, want, rtol=0, atol=1e-5 * float(want.abs().max()))
    assert table.to(torch.device("cpu")) is table
    # On another device, every tensor the decoding makes is made there (meta: shapes only).
    moved = table.to(torch.device("meta"))
    assert moved.raw.device.type == "meta"
    assert moved(tokens.to("meta")).shape == (len(tokens), dim)


def test_types_that_keep_the_int4_layout_by_default():
    cols = 256
    for qtype in (Q.Q4_0, Q.Q4_1):
        assert isinstance(linear_from_raw([(random_raw(qtype, 16, cols), qtype)], cols), Int4Linear)
    for qtype in (Q.Q4_K, Q.Q5_0, Q.Q6_K, Q.Q8_0):
        assert isinstance(linear_from_raw([(random_raw(qtype, 16, cols), qtype)], cols), GgmlLinear)


@pytest.mark.parametrize("qtype,width", [(Q.Q6_K, 16), (Q.Q8_0, 32)])
def test_interleaved_input_layout(qtype, width):
    x = torch.arange(64.0).view(1, 64)
    layout = to_int4(decode(random_raw(qtype, 1, 256), qtype)).layout
    assert layout.interleave == width and layout.group == 2 * width
    expanded = expand_input(x, layout)
    assert expanded.shape == (1, 128)
    torch.testing.assert_close(expanded[0, :width], 16 * x[0, :width])
    torch.testing.assert_close(expanded[0, width : 2 * width], x[0, :width])
    torch.testing.assert_close(expanded[0, 2 * width : 3 * width], 16 * x[0, width : 2 * width])


def test_fused_rows_equal_separate_linears():
    cols = 64
    parts = [(random_raw(Q.Q4_1, r, cols), Q.Q4_1) for r in (48, 16, 16)]
    fused = linear_from_raw(parts, cols)
    x = torch.randn(2, cols)
    separate = torch.cat([linear_from_raw([p], cols)(x) for p in parts], dim=-1)
    torch.testing.assert_close(fused(x), separate)


def test_mixed_layouts_become_separate_kernels_with_bias():
    cols = 256
    parts = [(random_raw(Q.Q4_K, 32, cols), Q.Q4_K), (random_raw(Q.Q6_K, 16, cols), Q.Q6_K)]
    bias = torch.randn(48)
    layer = linear_from_raw(parts, cols, bias=bias)
    x = torch.randn(3, cols)
    weight = torch.cat([dequantize_rows(r, t, cols) for r, t in parts])
    reference = x.to(torch.bfloat16).float() @ weight.T + bias
    assert (layer(x) - reference).abs().max() <= 0.02 * reference.abs().max()


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q4_K], ids=lambda q: q.name)
@pytest.mark.parametrize("wide", [Q.Q6_K, Q.Q8_0], ids=lambda q: q.name)
def test_4_bit_codes_widened_to_an_interleaved_layout_keep_their_weights(qtype, wide):
    """Held in a wider type's layout (to share its product), 4-bit codes encode the same
    weights, up to the bf16 rounding of each group's scale and zero, as in their own."""
    cols = 512
    raw = random_raw(qtype, 9, cols)
    layout = layout_for(wide)
    groups = to_int4(decode(raw, qtype), layout)
    assert groups.layout == layout and groups.codes.shape == (9, 2 * cols)
    assert groups.codes.max() <= 15
    bound_terms = _hi_distance_per_column(groups).numpy(), _zero_per_column(groups).numpy()
    groups.scale = groups.scale.bfloat16().float()
    groups.zero = groups.zero.bfloat16().float()
    error = np.abs(effective_weight(groups).numpy() - gguf_reference(raw, qtype, cols))
    codes = decode(raw, qtype)
    step = codes.scale.abs().repeat_interleave(codes.group, dim=1).numpy()
    hi_distance, zero = bound_terms
    bound = 2**-8 * ((16 * hi_distance + 8) * step + np.abs(zero)) * 1.001 + 1e-9
    assert (error <= bound).all(), (error / bound).max()


def test_which_types_share_one_kernel_layout():
    assert shared_layout([Q.Q4_0, Q.Q4_K]) == PLAIN
    assert shared_layout([Q.Q4_K, Q.Q6_K]) == layout_for(Q.Q6_K)
    assert shared_layout([Q.Q8_0, Q.Q4_1]) == layout_for(Q.Q8_0)
    assert shared_layout([Q.Q5_0, Q.Q8_0]) == layout_for(Q.Q8_0)
    assert shared_layout([Q.Q6_K, Q.Q8_0]) is None  # two interleavings: no one product
    assert shared_layout([Q.Q4_K, Q.Q6_K, Q.Q8_0]) is None


_QWEN_LIKE_QKV = ((Q.Q4_K, 64), (Q.Q4_K, 16), (Q.Q6_K, 16))  # Q4_K_M: Q and K, then V


def _qkv_parts(cols: int) -> list:
    return [(random_raw(qtype, rows, cols, scale=0.5), qtype) for qtype, rows in _QWEN_LIKE_QKV]


def test_off_the_cpu_mixed_layouts_make_one_product_with_bias(monkeypatch):
    """A GPU runs Q4_K Q|K beside a Q6_K V as one int4 product (Q|K widened), not three."""
    monkeypatch.setenv(GGML_ENV, "0")
    monkeypatch.setattr(layers, "one_product_across_layouts", lambda target: True)
    cols = 256
    parts = _qkv_parts(cols)
    bias = torch.randn(96)
    layer = linear_from_raw(parts, cols, bias=bias)
    assert isinstance(layer, Int4Linear) and layer.layout == layout_for(Q.Q6_K)
    assert layer.in_features == cols and layer.out_features == 96
    x = torch.randn(3, cols)
    weight = torch.cat([dequantize_rows(r, t, cols) for r, t in parts])
    reference = x.to(torch.bfloat16).float() @ weight.T + bias
    assert (layer(x).float() - reference).abs().max() <= 0.02 * reference.abs().max()


def test_on_the_cpu_mixed_layouts_make_one_product_per_run_of_one_layout(monkeypatch):
    """The CPU reads Q|K once, in its own layout: one product for Q|K and one for V."""
    monkeypatch.setenv(GGML_ENV, "0")
    cols = 256
    parts = _qkv_parts(cols)
    layer = linear_from_raw(parts, cols)
    assert [p.out_features for p in layer.parts] == [80, 16]
    assert [p.layout for p in layer.parts] == [PLAIN, layout_for(Q.Q6_K)]
    x = torch.randn(2, cols)
    weight = torch.cat([dequantize_rows(r, t, cols) for r, t in parts])
    reference = x.to(torch.bfloat16).float() @ weight.T
    assert (layer(x) - reference).abs().max() <= 0.02 * reference.abs().max()


def test_float_weights_stay_in_their_dtype():
    raw = random_raw(Q.F16, 16, 32)
    layer = linear_from_raw([(raw, Q.F16)], 32)
    assert isinstance(layer, DenseLinear) and layer.weight.dtype == torch.float16


def test_every_quant_type_is_covered():
    assert set(ALL_QUANTS) == set(QUANT_TYPES)


@pytest.mark.parametrize(
    "qtype, at", [(Q.Q4_1, 0), (Q.Q4_1, 2), (Q.Q8_0, 0), (Q.Q6_K, 208)], ids=str
)
@pytest.mark.parametrize(
    "value, finite",
    [
        (float("inf"), False),
        (float("-inf"), False),
        (float("nan"), False),
        (65504.0, True),
        (-65504.0, True),
        (6e-8, True),
    ],
)
def test_a_non_finite_block_scale_is_found_in_any_of_its_fields(qtype, at, value, finite):
    raw = random_raw(qtype, 6, 512, scale=0.5)
    size = GGML_QUANT_SIZES[qtype][1]
    assert all_finite(raw, qtype)
    blocks = raw.view(6, -1, size)
    blocks[4, 1, at : at + 2] = torch.tensor([value], dtype=torch.float16).view(torch.uint8)
    assert all_finite(raw, qtype) is finite
