"""Plain-torch references for the native kernels: what each computes, for the tests.

Computed in float64 from x rounded to bf16 (the kernels' input precision) and scales and
zeros rounded to bf16 (their storage), so the only difference left is the kernels' own fp32
accumulation order.
"""

from __future__ import annotations

import torch

CODE_OFFSET = 8


def int4_weight(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """w = (code - 8) * scale + zero per group, float64 [rows, k]."""
    group = codes.shape[1] // scale.shape[1]
    scale = scale.to(torch.bfloat16).double().repeat_interleave(group, dim=1)
    zero = zero.to(torch.bfloat16).double().repeat_interleave(group, dim=1)
    return (codes.double() - CODE_OFFSET) * scale + zero


def int4_matmul(
    x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor
) -> torch.Tensor:
    """y = x @ w.T, float64 [M, rows]."""
    return x.to(torch.bfloat16).double() @ int4_weight(codes, scale, zero).T


def gated_int4_matmul(
    x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor
) -> torch.Tensor:
    """silu(x @ gate.T) * (x @ up.T) for w = gate rows then up rows, float64 [M, rows / 2]."""
    y = int4_matmul(x, codes, scale, zero)
    gate, up = y.chunk(2, dim=1)
    return torch.nn.functional.silu(gate) * up


def error_bound(
    x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor
) -> torch.Tensor:
    """A bound on an fp32 accumulation's error for each output: k * 2^-23 * sum |w x|
    (twice the textbook recursive-summation bound k * u, u = 2^-24). A wrong code, scale or
    row moves an output by about one |w x| term, far above this."""
    magnitude = x.to(torch.bfloat16).double().abs() @ int4_weight(codes, scale, zero).abs().T
    return codes.shape[1] * 2.0**-23 * magnitude
