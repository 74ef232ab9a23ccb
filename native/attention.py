"""Decode-shaped attention of `int4_gemm.cpp` ("Attention" section), from Python.

A few query rows, each over its own keys: the first `lengths[r]` of them, or those its mask
row marks. Used for decode steps and speculative verification on the CPU, where every row
must come out exactly as it would alone. See `reference.py` for the same in plain torch.
"""

from __future__ import annotations

import ctypes

import torch

from .int4 import Library

MAX_GROUP = 16  # query heads per kv head the kernel takes
MAX_HEAD_DIM = 512


class NativeAttention:
    def __init__(self, library: Library):
        function = library.cdll.miniapp_attend_rows
        i64, ptr, i32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
        function.argtypes = [ptr, ptr, ptr, i64, ptr, ptr, i64, i64, i64, i64, i64,
                             ctypes.c_float, ptr, i32]  # fmt: skip
        function.restype = i32
        self._attend = function

    @staticmethod
    def takes(n_heads: int, n_kv_heads: int, head_dim: int) -> bool:
        """Whether the kernel handles these head shapes."""
        group, rest = divmod(n_heads, n_kv_heads)
        return not rest and group <= MAX_GROUP and head_dim % 8 == 0 and head_dim <= MAX_HEAD_DIM

    def __call__(
        self,
        queries: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        scale: float,
        lengths: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """queries fp32 [rows, heads, head_dim] (contiguous); keys and values fp32
        [kv_heads, tokens, head_dim] with contiguous rows (one layout for both). Each row
        sees the keys its mask row marks (bool [rows, tokens]), else its first lengths[r]
        (int32 [rows]), else all of them. Returns fp32 [rows, heads, head_dim]."""
        rows, n_heads, head_dim = queries.shape
        kv_heads, tokens, _ = keys.shape
        if keys.stride() != values.stride() or keys.stride(2) != 1 or keys.stride(1) != head_dim:
            raise ValueError("keys and values need one layout with contiguous rows")
        out = torch.empty_like(queries)
        mask_ptr = lengths_ptr = None
        if mask is not None:
            mask = mask.view(torch.uint8) if mask.dtype is torch.bool else mask.to(torch.uint8)
            mask = mask.contiguous()
            mask_ptr = mask.data_ptr()
        elif lengths is not None:
            if lengths.dtype is not torch.int32:
                lengths = lengths.to(torch.int32)
            lengths_ptr = lengths.contiguous().data_ptr()
        status = self._attend(
            queries.data_ptr(), keys.data_ptr(), values.data_ptr(), keys.stride(0),
            lengths_ptr, mask_ptr, tokens, rows, n_heads, kv_heads, head_dim, scale,
            out.data_ptr(), torch.get_num_threads(),
        )  # fmt: skip
        if status:
            raise ValueError(f"native attention refused queries {tuple(queries.shape)}")
        return out
