"""LoRA updates of a projection for the rows of a call that carry adapters (`lora.cpp`), and
the same in plain torch (`reference_delta`), the reference the kernel is tested against and
the path a GPU takes.

A projection's update by one adapter: u = A x, then for each part p (Q, K and V of a fused
Q|K|V; gate and up) outputs out_offset .. out_offset + out_count get
scale * factor * B_p u[rank_offset .. rank_offset + rank], B_p kept in blocks. Rows
without an adapter get -0.0, which leaves W x bit for bit as it is when the GEMM adds the
delta (`BoundGemm.forward`'s `pre`).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from .int4 import Library

MAX_PARTS = 3
PROJECTIONS = 4  # Q|K|V, the output projection, gate|up, down
QKV, OUT, GATE_UP, DOWN = range(PROJECTIONS)
LORA_TYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}

_i64, _i32, _f32, _ptr = ctypes.c_int64, ctypes.c_int32, ctypes.c_float, ctypes.c_void_p


class LoraUpdateStruct(ctypes.Structure):
    """LoraUpdate in lora.cpp; `a` null: no update of that projection."""

    _fields_ = [
        ("a", _ptr),
        ("rank", _i64),
        ("k", _i64),
        ("type", _i32),
        ("n_parts", _i32),
        ("b", _ptr * MAX_PARTS),
        ("out_offset", _i64 * MAX_PARTS),
        ("out_count", _i64 * MAX_PARTS),
        ("rank_offset", _i64 * MAX_PARTS),
        ("part_rank", _i64 * MAX_PARTS),
        ("factor", _f32 * MAX_PARTS),
    ]


class LoraGroupStruct(ctypes.Structure):
    _fields_ = [
        ("updates", _ptr),
        ("scale", _f32),
        ("position", _i32),
        ("rows", _ptr),
        ("n_rows", _i64),
    ]


class LoraCallStruct(ctypes.Structure):
    _fields_ = [("groups", _ptr), ("n_groups", _i64), ("layer", _i64)]


OUT_BLOCK = 32  # outputs per block of B (kOutBlock in lora.cpp)


@dataclass(frozen=True)
class UpdatePart:
    """Part p of a projection's update: B in blocks of OUT_BLOCK outputs, `b_blocks`
    [ceil(out_count / OUT_BLOCK), rank, OUT_BLOCK] (contiguous; rows past out_count zero),
    for outputs from `out_offset`, reading u from `rank_offset`; `factor`: alpha / rank,
    or 1. `blocked(b, ...)` lays a B [out_count, rank] out so."""

    out_offset: int
    rank_offset: int
    b_blocks: torch.Tensor
    factor: float
    out_count: int

    @property
    def rank(self) -> int:
        return self.b_blocks.shape[1]

    @property
    def b(self) -> torch.Tensor:
        """B [out_count, rank] again (the reference's view)."""
        blocks, rank, width = self.b_blocks.shape
        return self.b_blocks.transpose(1, 2).reshape(blocks * width, rank)[: self.out_count]

    @classmethod
    def blocked(cls, out_offset: int, rank_offset: int, b: torch.Tensor, factor: float):
        count, rank = b.shape
        blocks = -(-count // OUT_BLOCK)
        padded = torch.zeros(blocks * OUT_BLOCK, rank, dtype=b.dtype)
        padded[:count] = b
        laid = padded.view(blocks, OUT_BLOCK, rank).transpose(1, 2).contiguous()
        return cls(out_offset, rank_offset, laid, factor, count)


@dataclass(frozen=True)
class ProjectionUpdate:
    """One adapter's update of one projection: `a` [rank, k], the parts' A stacked."""

    a: torch.Tensor
    parts: tuple[UpdatePart, ...]

    @property
    def nbytes(self) -> int:
        tensors = (self.a, *(part.b_blocks for part in self.parts))
        return sum(t.numel() * t.element_size() for t in tensors)

    def fill(self, struct: LoraUpdateStruct) -> None:
        """The kernel's description of this update (the tensors must outlive it)."""
        struct.a, struct.rank, struct.k = self.a.data_ptr(), self.a.shape[0], self.a.shape[1]
        struct.type, struct.n_parts = LORA_TYPES[self.a.dtype], len(self.parts)
        for p, part in enumerate(self.parts):
            struct.b[p] = part.b_blocks.data_ptr()
            struct.out_offset[p], struct.out_count[p] = part.out_offset, part.out_count
            struct.rank_offset[p], struct.part_rank[p] = part.rank_offset, part.rank
            struct.factor[p] = part.factor


class LoraKernel:
    """`miniapp_lora_delta` of the loaded library."""

    def __init__(self, library: Library):
        self.library = library
        self._function = library.cdll.miniapp_lora_delta
        self._function.argtypes = [_ptr, ctypes.c_int, _ptr, _i64, _i64, _i64, _ptr, _i64, _i64]
        self._function.argtypes += [ctypes.c_int]
        self._function.restype = ctypes.c_int

    def delta(
        self, call: LoraCallStruct, projection: int, x: torch.Tensor, n_out: int
    ) -> torch.Tensor | None:
        """fp32 [rows, n_out] updates of `projection` for x [rows, k] (fp32), or None when
        no row of the call has one there."""
        if x.dtype != torch.float32 or x.stride(-1) != 1:
            x = x.float().contiguous()
        m, k = x.shape
        delta = torch.empty((m, n_out), dtype=torch.float32)
        status = self._function(
            ctypes.addressof(call),
            projection,
            x.data_ptr(),
            x.stride(0),
            k,
            m,
            delta.data_ptr(),
            n_out,
            n_out,
            torch.get_num_threads(),
        )
        if status < 0:
            raise ValueError(f"the LoRA kernel refused x {tuple(x.shape)} for {n_out} outputs")
        return delta if status else None


def reference_delta(
    groups: list[tuple[ProjectionUpdate | None, float, torch.Tensor]],
    x: torch.Tensor,
    n_out: int,
) -> torch.Tensor | None:
    """The same in torch: `groups` holds (update, scale, row indices), in the order rows add
    their adapters; None when no group has an update."""
    delta = None
    for update, scale, rows in groups:
        if update is None or rows.numel() == 0:
            continue
        if delta is None:
            delta = torch.full((x.shape[0], n_out), -0.0, dtype=torch.float32, device=x.device)
        # (Adapters stay in host memory: a layer on a GPU takes copies of what it uses.)
        u = x[rows].float() @ update.a.to(x.device, torch.float32).T
        for part in update.parts:
            ranks = u[:, part.rank_offset : part.rank_offset + part.rank]
            outputs = slice(part.out_offset, part.out_offset + part.out_count)
            b = part.b.to(x.device, torch.float32)
            delta[rows, outputs] += (scale * part.factor) * (ranks @ b.T)
    return delta
