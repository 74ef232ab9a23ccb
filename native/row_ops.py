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
        qk_norm = library.cdll.miniapp_qk_norm
        qk_norm.argtypes = [ptr, i64, i64, i64, i64, i64, ptr, ptr, i32, f32]
        qk_norm.restype = i32
        self._qk_norm = qk_norm

    def qk_norm_(
        self,
        qkv: torch.Tensor,
        n_heads: int,
        kv_heads: int,
        q_weight: torch.Tensor,
        k_weight: torch.Tensor,
        whole: bool,
        eps: float,
    ) -> torch.Tensor:
        """The query and key norms of a fused Q|K|V projection fp32 [tokens, heads, head_dim]
        (heads and values contiguous within a token), in place: each head alone with its
        weight [head_dim], or (`whole`) all query heads as one vector with q_weight
        [n_heads * head_dim] and all key heads with k_weight [kv_heads * head_dim]."""
        tokens, _, head_dim = qkv.shape
        if qkv.dtype is not torch.float32 or qkv.stride(2) != 1 or qkv.stride(1) != head_dim:
            raise ValueError("Q/K norm rows need fp32 heads one after another")
        q_size, k_size = (n_heads, kv_heads) if whole else (1, 1)
        for weight, heads in ((q_weight, q_size), (k_weight, k_size)):
            if weight.dtype is not torch.float32 or not weight.is_contiguous():
                raise ValueError("Q/K norm weights must be fp32 and contiguous")
            if weight.numel() != heads * head_dim:
                raise ValueError(f"a Q/K norm weight of {weight.numel()} values")
        status = self._qk_norm(
            qkv.data_ptr(),
            qkv.stride(0),
            tokens,
            n_heads,
            kv_heads,
            head_dim,
            q_weight.data_ptr(),
            k_weight.data_ptr(),
            int(whole),
            eps,
        )
        if status:
            raise ValueError(f"native Q/K norm refused {tuple(qkv.shape)}")
        return qkv

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
