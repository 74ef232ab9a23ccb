"""The native row operations of a decode step (`native/row_ops.py`: RMS norm after an
optional residual add, the query and key norms, RoPE in place) against their float64
references, and rows that come out bit-identical alone or in a batch."""

from __future__ import annotations

import pytest
import torch

from miniapp.engine.ops.layers import Rope
from miniapp.engine.platform.kernels import cpu_int4_kernel
from miniapp.native import reference
from miniapp.native.row_ops import NativeRowOps

NORM_TOLERANCE = 1e-6  # relative: one fp32 rounding of the scale and the product
ROPE_TOLERANCE = 2e-6  # relative: fp32 tables and two products


@pytest.fixture(scope="module")
def ops():
    choice = cpu_int4_kernel()
    assert choice.native, f"the native library must build and load here: {choice.reason}"
    return NativeRowOps(choice.library)


def _randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("dim", [576, 640, 7, 1])
def test_rms_norm_matches_the_reference_and_adds_first(ops, dim):
    x, add, weight = _randn(5, dim) * 3, _randn(5, dim, seed=1), _randn(dim, seed=2)
    stream = x.clone()
    got = ops.rms_norm(stream, weight, 1e-5, add=add)
    assert torch.equal(stream, x + add)  # the residual stream took the block's output
    want = reference.rms_norm(x + add, weight, 1e-5)
    assert (got.double() - want).abs().max() <= NORM_TOLERANCE * want.abs().max()
    unweighted = ops.rms_norm(x, None, 1e-6)
    want = reference.rms_norm(x, None, 1e-6)
    assert (unweighted.double() - want).abs().max() <= NORM_TOLERANCE * want.abs().max()


def test_a_zero_row_stays_zero_and_rows_are_independent(ops):
    x = _randn(6, 576)
    x[3] = 0
    together = ops.rms_norm(x, None, 1e-6)
    assert torch.equal(together[3], torch.zeros(576))
    for row in range(6):
        assert torch.equal(ops.rms_norm(x[row : row + 1], None, 1e-6), together[row : row + 1])


@pytest.mark.parametrize(
    ("heads", "head_dim", "rotary_dim", "interleaved"),
    [(12, 64, 64, True), (5, 256, 256, False), (3, 128, 64, False), (2, 96, 32, True)],
)
def test_rope_matches_first_principles(ops, heads, head_dim, rotary_dim, interleaved):
    rope = Rope(head_dim, rotary_dim, 10000.0, interleaved)
    start, rows = 3000, 7  # far from zero: positions must not lose their low bits
    tables = rope.tables(start, rows)
    x = _randn(rows, heads, head_dim)
    got = ops.rope_(x.clone(), tables.cos, tables.signed_sin, rotary_dim, interleaved)
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)
    want = reference.rope(x, torch.arange(start, start + rows), inv_freq, rotary_dim, interleaved)
    assert (got.double() - want).abs().max() <= ROPE_TOLERANCE * x.abs().max()


def test_rope_rows_are_independent_and_other_columns_untouched(ops):
    rope = Rope(64, 64, 10000.0, True)
    qkv = _randn(4, 20, 64)  # 15 rotated heads, then 5 value heads
    batch = qkv.clone()
    ops.rope_(batch[:, :15], *_tables(rope, 100, 4), 64, True)
    assert torch.equal(batch[:, 15:], qkv[:, 15:])
    assert not torch.equal(batch[:, :15], qkv[:, :15])
    for row in range(4):
        alone = qkv[row : row + 1].clone()
        ops.rope_(alone[:, :15], *_tables(rope, 100 + row, 1), 64, True)
        assert torch.equal(alone[0], batch[row])


def test_bad_shapes_are_refused(ops):
    with pytest.raises(ValueError):
        ops.rms_norm(_randn(2, 8), None, 1e-6, add=_randn(2, 9))
    rope = Rope(64, 64, 10000.0, True)
    with pytest.raises(ValueError):
        ops.rope_(_randn(3, 2, 64), *_tables(rope, 0, 2), 64, True)


def _tables(rope: Rope, start: int, rows: int):
    tables = rope.tables(start, rows)
    return tables.cos, tables.signed_sin


@pytest.mark.parametrize("whole", [False, True], ids=["per-head", "whole"])
def test_qk_norms_match_the_reference_and_leave_the_values_alone(ops, whole):
    tokens, heads, kv_heads, head_dim = 3, 4, 2, 16
    qkv = _randn(tokens, heads + 2 * kv_heads, head_dim) * 3
    q_weight = _randn(heads * head_dim if whole else head_dim, seed=1)
    k_weight = _randn(kv_heads * head_dim if whole else head_dim, seed=2)
    got = ops.qk_norm_(qkv.clone(), heads, kv_heads, q_weight, k_weight, whole, 1e-6)
    q, k = qkv[:, :heads], qkv[:, heads : heads + kv_heads]
    if whole:
        want_q = reference.rms_norm(q.reshape(tokens, -1), q_weight, 1e-6).view(q.shape)
        want_k = reference.rms_norm(k.reshape(tokens, -1), k_weight, 1e-6).view(k.shape)
    else:
        want_q = reference.rms_norm(q, q_weight, 1e-6)
        want_k = reference.rms_norm(k, k_weight, 1e-6)
    want = torch.cat([want_q, want_k], dim=1)
    normed = got[:, : heads + kv_heads].double()
    assert (normed - want).abs().max() <= NORM_TOLERANCE * want.abs().max()
    assert torch.equal(got[:, heads + kv_heads :], qkv[:, heads + kv_heads :])
