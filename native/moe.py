"""A mixture-of-experts feed-forward run by `moe.cpp`: each row's chosen experts, grouped by
expert so that each expert's weights are read once a call, weighted and summed; and the same
in plain torch (`reference_moe`), the reference the kernel is tested against.

An expert is a SiLU-gated gate|up `PackedGgml` and a down `PackedGgml` (the file's own
blocks, see ggml.py).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Sequence

import torch

from .ggml import PackedGgml
from .int4 import Library

_i64, _i32, _ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p


class NativeExperts:
    """The experts of one layer, bound for `miniapp_moe_ffn`.

    `forward(x, ids, weights)`: x fp32 [m, dim], ids int32 [m, k] (each row's chosen experts,
    in its own order), weights fp32 [m, k] -> fp32 [m, dim]."""

    def __init__(self, library: Library, gate_up: Sequence[PackedGgml], down: Sequence[PackedGgml]):
        if not gate_up or len(gate_up) != len(down):
            raise ValueError("each expert needs a gate|up and a down weight")
        ffn, dim = gate_up[0].shape.outputs, down[0].shape.outputs
        for up, back in zip(gate_up, down, strict=True):
            if not up.shape.gated or up.shape.outputs != ffn or back.shape.k != ffn:
                raise ValueError("experts of one layer share one SiLU-gated shape")
            if back.shape.outputs != dim or up.shape.k != dim:
                raise ValueError("experts of one layer share one width")
        self.gate_up, self.down = list(gate_up), list(down)
        self.n_experts, self.ffn, self.dim = len(gate_up), ffn, dim
        pointers = ctypes.c_void_p * self.n_experts
        self._gate_up = pointers(*(ctypes.addressof(w._ggml) for w in self.gate_up))
        self._down = pointers(*(ctypes.addressof(w._ggml) for w in self.down))
        self._call = library.cdll.miniapp_moe_ffn
        self._call.argtypes = [_ptr, _ptr, _i64, _i64, _ptr, _i64, _i64, _i64, _ptr, _ptr, _i64]
        self._call.argtypes += [_ptr, _i32]
        self._call.restype = _i32
        self._route = library.cdll.miniapp_moe_route
        self._route.argtypes = [_ptr, _i64, _ptr, _i64, _i64, _i64, _i64, _i32, _ptr, _ptr, _i32]
        self._route.restype = _i32

    def route(
        self, router: torch.Tensor, x: torch.Tensor, k: int, normalize: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's k experts (int32 [m, k], most probable first, ties to the lower id) and
        their weights (fp32 [m, k]) from the router's fp32 [n_experts, dim] weights, as
        `experts.route` computes them from float64 logits (the reference)."""
        if x.dtype is not torch.float32 or x.stride(-1) != 1:
            x = x.float().contiguous()
        m = x.shape[0]
        ids = torch.empty(m, k, dtype=torch.int32)
        weights = torch.empty(m, k)
        status = self._route(
            router.data_ptr(),
            router.shape[0],
            x.data_ptr(),
            x.stride(0),
            m,
            x.shape[1],
            k,
            int(normalize),
            ids.data_ptr(),
            weights.data_ptr(),
            torch.get_num_threads(),
        )
        if status != 0:
            raise RuntimeError("the native router chose no expert (non-finite activations?)")
        return ids, weights

    def expert_bytes(self, expert: int) -> int:
        """Bytes of weights one expert's two products read."""
        return self.gate_up[expert].nbytes + self.down[expert].nbytes

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        if x.dtype is not torch.float32 or x.stride(-1) != 1:
            x = x.float().contiguous()
        m, k = ids.shape
        if x.shape != (m, self.dim) or weights.shape != (m, k):
            raise ValueError("x, ids and weights disagree on rows, width or choices")
        ids = ids.to(torch.int32).contiguous()
        weights = weights.float().contiguous()
        y = torch.empty(m, self.dim)
        status = self._call(
            self._gate_up,
            self._down,
            self.n_experts,
            self.ffn,
            x.data_ptr(),
            x.stride(0),
            m,
            self.dim,
            ids.data_ptr(),
            weights.data_ptr(),
            k,
            y.data_ptr(),
            torch.get_num_threads(),
        )
        if status != 0:
            raise RuntimeError("the native MoE kernel refused its arguments (an expert id?)")
        return y

    __call__ = forward


Expert = Callable[[torch.Tensor], torch.Tensor]  # rows [n, dim] -> fp32 [n, dim]


def reference_moe(
    experts: Sequence[Expert], x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    """What `miniapp_moe_ffn` computes, one row and one choice at a time: y[r] = sum over j in
    the row's order of weights[r, j] * experts[ids[r, j]](x[r]). `experts` are any callables
    (the reference GGML matmuls in float64, in the tests; a GPU's linears)."""
    rows = []
    for r in range(x.shape[0]):
        total = None
        for j in range(ids.shape[1]):
            term = weights[r, j] * experts[int(ids[r, j])](x[r : r + 1])
            total = term if total is None else total + term
        rows.append(total)
    return torch.cat(rows)
