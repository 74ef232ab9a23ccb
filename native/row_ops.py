"""The row operations of a decode step in `row_ops.cpp`, from Python: RMS norm (after an
optional residual add) and RoPE in place. A one-token step runs them 90 times for SmolLM2; as
torch ops each costs 4-6 dispatches (see engine/ops/layers.py), as these one call. See
`reference.py` for the same in plain torch.
"""

from __future__ import annotations

import ctypes

import torch

from .int4 import Library


class NativeRowOps:
    def __init__(self, library: Library):
        i64, ptr, i32, f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_float
        norm = library.cdll.miniapp_add_rms_norm
        norm.argtypes = [ptr, i64, ptr, i64, ptr, i64, i64, f32, ptr, i64]
        norm.restype = i32
        self._norm = norm
        rope = library.cdll.miniapp_rope
        rope.argtypes = [ptr, i64, i64, i64, i64, i64, i32, ptr, ptr]
        rope.restype = i32
        self._rope = rope

    def rms_norm(
        self,
        x: torch.Tensor,
        weight: torch.Tensor | None,
        eps: float,
        add: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """fp32 [rows, dim] -> fp32 [rows, dim]: x / sqrt(mean(x^2) + eps) * weight. With
        `add` (fp32 [rows, dim]), x += add first, in place. x and add need contiguous rows;
        weight fp32 [dim], contiguous."""
        rows, dim = x.shape
        _check_rows(x)
        out = torch.empty((rows, dim), dtype=torch.float32)
        add_ptr = ld_add = 0
        if add is not None:
            _check_rows(add)
            if add.shape != x.shape:
                raise ValueError(f"cannot add {tuple(add.shape)} to {tuple(x.shape)}")
            add_ptr, ld_add = add.data_ptr(), add.stride(0)
        weight_ptr = None if weight is None else weight.data_ptr()
        status = self._norm(
            x.data_ptr(),
            x.stride(0),
            add_ptr or None,
            ld_add,
            weight_ptr,
            rows,
            dim,
            eps,
            out.data_ptr(),
            dim,
        )
        if status:
            raise ValueError(f"native RMS norm refused x {tuple(x.shape)}")
        return out

    def rope_(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        signed_sin: torch.Tensor,
        rotary_dim: int,
        interleaved: bool,
    ) -> torch.Tensor:
        """Rotates x fp32 [rows, heads, head_dim] (heads and values contiguous within a row)
        in place by the tables fp32 [rows, 1, head_dim] (contiguous; engine/ops/layers.py's Rope)
        and returns it."""
        rows, heads, head_dim = x.shape
        if x.dtype is not torch.float32 or x.stride(2) != 1 or x.stride(1) != head_dim:
            raise ValueError("RoPE rows need fp32 heads one after another")
        for table in (cos, signed_sin):
            if table.dtype is not torch.float32 or not table.is_contiguous():
                raise ValueError("RoPE tables must be fp32 and contiguous")
            if table.numel() != rows * head_dim:
                raise ValueError(f"RoPE tables of {table.numel()} values for {rows} rows")
        status = self._rope(
            x.data_ptr(),
            x.stride(0),
            rows,
            heads,
            head_dim,
            rotary_dim,
            int(interleaved),
            cos.data_ptr(),
            signed_sin.data_ptr(),
        )
        if status:
            raise ValueError(f"native RoPE refused x {tuple(x.shape)}")
        return x


def _check_rows(x: torch.Tensor) -> None:
    if x.dtype is not torch.float32 or x.dim() != 2 or x.stride(1) != 1:
        raise ValueError("rows must be fp32 [rows, dim] with contiguous values")
