"""Our GGML block decoding against the `gguf` package's reference, and the int4 kernel
against a pure-torch reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import quants
from gguf.constants import GGMLQuantizationType as Q
from miniapp.engine.layers import DenseLinear, Int4Linear, linear_from_raw
from miniapp.engine.quant import dequantize_rows, int4_groups_from_raw, q8_0_to_int4_pair

RNG = np.random.default_rng(1234)


def _raw(values: np.ndarray, qtype: Q) -> torch.Tensor:
    packed = quants.quantize(values.astype(np.float32), qtype)
    return torch.from_numpy(
        np.ascontiguousarray(packed).view(np.uint8).reshape(values.shape[0], -1)
    )


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.F16, Q.BF16, Q.F32])
def test_dequantize_matches_gguf_reference(qtype):
    values = RNG.normal(0, 2.0, size=(37, 96))
    raw = _raw(values, qtype)
    reference = quants.dequantize(raw.numpy(), qtype).reshape(values.shape)
    ours = dequantize_rows(raw, qtype, values.shape[1]).numpy()
    # Bound: fp32 evaluation order differs from gguf's (d*q + m vs (q-8)*d + (m+8d)), which
    # moves results by a few ulps; anything larger would be a decoding bug.
    np.testing.assert_allclose(ours, reference, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1])
def test_int4_groups_encode_exactly(qtype):
    values = RNG.normal(0, 1.0, size=(16, 64))
    raw = _raw(values, qtype)
    groups = int4_groups_from_raw(raw, qtype)
    assert groups.codes.max() <= 15
    reference = quants.dequantize(raw.numpy(), qtype).reshape(values.shape)
    np.testing.assert_allclose(groups.dequantize().numpy(), reference, rtol=1e-6, atol=1e-6)


def test_q8_0_pair_is_exact():
    values = RNG.normal(0, 3.0, size=(8, 64))
    raw = _raw(values, Q.Q8_0)
    pair = q8_0_to_int4_pair(raw).dequantize()  # [rows, 2*cols]: hi plane then lo plane
    combined = pair[:, :64] + pair[:, 64:]
    reference = quants.dequantize(raw.numpy(), Q.Q8_0).reshape(values.shape)
    np.testing.assert_allclose(combined.numpy(), reference, rtol=1e-6, atol=1e-5)


# Rows that are not a multiple of 16 exercise the padding; several M cover decode and prefill.
@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q8_0])
@pytest.mark.parametrize("rows", [16, 40, 259])
@pytest.mark.parametrize("m", [1, 3, 17])
def test_int4_linear_matches_reference(qtype, rows, m):
    cols = 96
    weights = RNG.normal(0, 0.5, size=(rows, cols))
    raw = _raw(weights, qtype)
    layer = linear_from_raw([(raw, qtype)], cols)
    assert isinstance(layer, Int4Linear)
    x = torch.randn(m, cols)
    reference = x.to(torch.bfloat16).float() @ dequantize_rows(raw, qtype, cols).T
    y = layer(x).float()
    assert y.shape == (m, rows)
    # Bound: bf16 scales/zeros (2^-9 relative) and a bf16 output (2^-9 relative) around an
    # fp32 accumulation; 2% of the output's scale is far above that and far below a bug.
    scale = reference.abs().max()
    assert (y - reference).abs().max() <= 0.02 * scale


def test_fused_rows_equal_separate_linears():
    cols = 64
    parts = [(_raw(RNG.normal(0, 1, size=(r, cols)), Q.Q4_1), Q.Q4_1) for r in (48, 16, 16)]
    fused = linear_from_raw(parts, cols)
    x = torch.randn(2, cols)
    separate = torch.cat([linear_from_raw([p], cols)(x) for p in parts], dim=-1)
    torch.testing.assert_close(fused(x), separate)


def test_float_weights_stay_in_their_dtype():
    raw = _raw(RNG.normal(0, 1, size=(16, 32)), Q.F16)
    layer = linear_from_raw([(raw, Q.F16)], 32)
    assert isinstance(layer, DenseLinear) and layer.weight.dtype == torch.float16
