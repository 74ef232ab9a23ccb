"""Weights kept as the GGUF file's own quantized blocks, multiplied by `ggml_dot.cpp`.

A weight is the memory-mapped rows of the file, read at the file's own bits per weight, and
the kernel decodes each block as it multiplies. With `interleave`, the types that have an
interleaved layout (Q4_K, Q6_K, Q5_0, Q8_0: `INTERLEAVED`) are copied natively at load into
it, the same bytes with each 8 rows side by side, which the kernel multiplies up to 3.5x faster;
the copy goes a slice at a time, each slice's file pages released once copied, so memory
holds one copy of a weight, never two.

One weight may stack up to four tensors of different types that share an input (Q|K|V,
where V is often wider), or hold a gate and an up projection whose outputs it combines as
silu(gate) * up. A bias is added inside the call.

`PackedGgml` has the interface of `int4.PackedInt4` that the rest of the engine uses
(`forward`, `shape.gated`, `shape.outputs`, and an `Int4Weight` address the fused decode
layer takes), so a layer mixes both kinds freely.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .int4 import (
    EPILOGUE_SILU_MUL,
    EPILOGUE_STORE,
    ISA_AVX2,
    ISA_AVX512,
    BoundGemm,
    Library,
    _Weight,
)

MAX_PARTS = 4
# GGML type ids (gguf's GGMLQuantizationType) the kernel reads, and their blocks:
# (weights per block, bytes per block).
BLOCKS = {
    2: (32, 18),  # Q4_0
    3: (32, 20),  # Q4_1
    6: (32, 22),  # Q5_0
    7: (32, 24),  # Q5_1
    8: (32, 34),  # Q8_0
    12: (256, 144),  # Q4_K
    13: (256, 176),  # Q5_K
    14: (256, 210),  # Q6_K
    112: (256, 144),  # ours: Q4_K with each 8 rows interleaved (the same bytes)
    114: (256, 210),  # ours: Q6_K, the same
    106: (32, 22),  # ours: Q5_0, the same
    108: (32, 34),  # ours: Q8_0, the same
}
# Types whose rows the kernel reads faster interleaved 8 at a time, and the result's type.
INTERLEAVED = {12: 112, 14: 114, 6: 106, 8: 108}
GROUP_ROWS = 8
_SLICE_BYTES = 16 << 20  # interleaved a slice at a time (see PackedGgml's `release`)
SUPER_BLOCK_TYPES = frozenset({12, 13, 14, 112, 114})
ISA_AUTO = 0  # the best path this CPU has; ISA_AVX2 / ISA_AVX512 force one (tests)


class _Part(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("rows", ctypes.c_int64),
        ("row_bytes", ctypes.c_int64),
        ("type", ctypes.c_int32),
        ("reserved", ctypes.c_int32),
    ]


class _GgmlWeight(ctypes.Structure):
    """GgmlWeight in ggml_dot.cpp."""

    _fields_ = [
        ("parts", _Part * MAX_PARTS),
        ("n_parts", ctypes.c_int64),
        ("k", ctypes.c_int64),
        ("n", ctypes.c_int64),
        ("bias", ctypes.c_void_p),
        ("epilogue", ctypes.c_int32),
        ("isa", ctypes.c_int32),
    ]


def takes(ggml_type: int, k: int) -> bool:
    """Whether the kernel reads rows of k columns of this type."""
    block = BLOCKS.get(int(ggml_type))
    return block is not None and k % block[0] == 0


@dataclass(frozen=True)
class GgmlShape:
    rows: int  # stacked rows of all parts
    k: int  # input columns
    types: tuple[int, ...]  # each part's GGML type
    gated: bool = False  # two parts, gate then up; y = silu(gate) * up

    @property
    def outputs(self) -> int:
        return self.rows // 2 if self.gated else self.rows


class PackedGgml(BoundGemm):
    """Raw GGML rows bound for the kernel; `forward(x)` gives fp32 [M, outputs] for x [M, k].

    `parts`: (uint8 [rows, row_bytes], GGML type id) each, sharing k input columns. The
    tensors (memory-mapped file rows, usually) are kept alive here and never written.
    `interleave`: copy each part that has an interleaved layout into it (whole groups of 8
    rows, from a group boundary of the stack), calling `release` with each source slice once
    copied; `parts` then holds the copies."""

    def __init__(
        self,
        library: Library,
        parts: list[tuple[torch.Tensor, int]],
        k: int,
        bias: torch.Tensor | None = None,
        gated: bool = False,
        isa: int = ISA_AUTO,
        interleave: bool = False,
        release: Callable[[torch.Tensor], None] | None = None,
    ):
        self._kernel = "GGML kernel"
        if not 1 <= len(parts) <= MAX_PARTS:
            raise ValueError(f"a GGML weight stacks 1 to {MAX_PARTS} tensors, not {len(parts)}")
        if gated and (len(parts) != 2 or parts[0][0].shape[0] != parts[1][0].shape[0]):
            raise ValueError("a gated GGML weight is a gate and an up tensor of equal rows")
        rows = 0
        for raw, ggml_type in parts:
            block = BLOCKS.get(int(ggml_type))
            if block is None or k % block[0]:
                raise ValueError(f"the GGML kernel does not read type {ggml_type} rows of {k}")
            if (
                raw.dtype != torch.uint8
                or raw.dim() != 2
                or raw.shape[1] != k // block[0] * block[1]
            ):
                raise ValueError(f"rows of type {ggml_type} and {k} columns do not match the data")
            if raw.stride(1) != 1 or raw.stride(0) != raw.shape[1]:
                raise ValueError("GGML rows must be contiguous")
            rows += raw.shape[0]
        if interleave:
            parts = _interleaved(library, parts, k, release)
        if bias is not None:
            bias = bias.float().contiguous()
            if bias.shape != (rows,):
                raise ValueError(f"the bias has {tuple(bias.shape)} values for {rows} rows")
        self.library = library
        self.parts = parts
        self.bias = bias
        self.shape = GgmlShape(rows, k, tuple(int(t) for _, t in parts), gated)
        self._ggml = _GgmlWeight()
        for slot, (raw, ggml_type) in enumerate(parts):
            self._ggml.parts[slot] = _Part(
                raw.data_ptr(), raw.shape[0], raw.shape[1], int(ggml_type), 0
            )
        self._ggml.n_parts, self._ggml.k, self._ggml.n = len(parts), k, self.shape.outputs
        self._ggml.bias = None if bias is None else bias.data_ptr()
        self._ggml.epilogue = EPILOGUE_SILU_MUL if gated else EPILOGUE_STORE
        self._ggml.isa = self.isa = isa
        # The int4 kernel's weight structure, pointing here: what the fused layer passes on.
        self._weight = _Weight(
            None, 0, k, 0, self.shape.outputs, 0, 0, ctypes.addressof(self._ggml)
        )
        self._address = ctypes.addressof(self._weight)
        self._gemm = library.gemm
        self._k, self._outputs = k, self.shape.outputs

    @property
    def nbytes(self) -> int:
        """Bytes of weights a call reads."""
        return sum(raw.numel() for raw, _ in self.parts)

    def with_isa(self, isa: int) -> PackedGgml:
        """The same weight run on another path (tests compare paths on one machine)."""
        return PackedGgml(self.library, self.parts, self.shape.k, self.bias, self.shape.gated, isa)

    @property
    def interleaved(self) -> bool:
        """Whether any part is held interleaved (see INTERLEAVED)."""
        return any(t in INTERLEAVED.values() for t in self.shape.types)


def _interleaved(
    library: Library,
    parts: list[tuple[torch.Tensor, int]],
    k: int,
    release: Callable[[torch.Tensor], None] | None,
) -> list[tuple[torch.Tensor, int]]:
    """The parts with each type that has an interleaved layout rewritten in it (a copy in
    memory, the same size), where its rows come in whole groups from a group boundary.
    A slice at a time; `release` is called with each source slice once copied."""
    out, start = [], 0
    for raw, ggml_type in parts:
        rows = raw.shape[0]
        target = INTERLEAVED.get(int(ggml_type))
        if target is not None and rows % GROUP_ROWS == 0 and start % GROUP_ROWS == 0:
            dst = torch.empty_like(raw)
            step = max(1, _SLICE_BYTES // (GROUP_ROWS * raw.shape[1])) * GROUP_ROWS
            for first in range(0, rows, step):
                src = raw[first : first + step]
                if _interleave(library, ggml_type, src, k, dst[first:]) != target:
                    raise RuntimeError(f"the native library did not interleave type {ggml_type}")
                if release is not None:
                    release(src)
            raw, ggml_type = dst, target
        out.append((raw, ggml_type))
        start += rows
    return out


def _interleave(
    library: Library,
    ggml_type: int,
    src: torch.Tensor,
    k: int,
    dst: torch.Tensor,
    threads: int | None = None,
) -> int:
    """The native interleaving of src's rows into dst (which has room for them); returns the
    result's type id, or -1 where the library refused."""
    return library.cdll.miniapp_ggml_interleave(
        int(ggml_type),
        ctypes.c_void_p(src.data_ptr()),
        ctypes.c_int64(len(src)),
        ctypes.c_int64(k),
        ctypes.c_void_p(dst.data_ptr()),
        threads or torch.get_num_threads(),
    )


def group_byte_order(library: Library, ggml_type: int) -> torch.Tensor | None:
    """Where each byte of a row's block lands in its interleaved group's block: int64 [8 rows,
    block bytes] of offsets into the 8 rows' block (for each type whose interleaving only
    moves bytes), so that a row's file bytes can be gathered back (a tied embedding reads
    the output head's interleaved copy). None for types whose interleaving re-encodes bytes.

    Found by interleaving a block whose bytes number themselves, low then high bits."""
    target = INTERLEAVED.get(int(ggml_type))
    if target is None:
        return None
    columns, size = BLOCKS[int(ggml_type)]
    ids = torch.arange(GROUP_ROWS * size, dtype=torch.int64)
    found = torch.zeros(GROUP_ROWS * size, dtype=torch.int64)
    for shift in (0, 8):
        src = ((ids >> shift) & 0xFF).to(torch.uint8).view(GROUP_ROWS, size)
        dst = torch.empty_like(src)
        if _interleave(library, ggml_type, src, columns, dst, threads=1) != target:
            return None
        found |= dst.view(-1).to(torch.int64) << shift
    if not torch.equal(found.sort().values, ids):  # not a permutation: bytes re-encoded
        return None
    order = torch.empty_like(found)
    order[found] = ids
    return order.view(GROUP_ROWS, size)


def cpu_has(library: Library, isa: int) -> bool:
    """Whether this CPU runs the GGML kernels on the path ISA_AVX2 or ISA_AVX512."""
    return bool(library.cdll.miniapp_ggml_cpu_has(isa))


__all__ = [
    "ISA_AUTO",
    "ISA_AVX2",
    "ISA_AVX512",
    "PackedGgml",
    "cpu_has",
    "group_byte_order",
    "takes",
]
