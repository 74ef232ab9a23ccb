"""An adapter laid out for one model's projections: what a forward pass reads.

The torch engine fuses Q, K and V into one projection, and gate and up into another, so an
adapter's pairs are regrouped the same way: per layer and projection, one A with the parts'
A stacked by rows (one pass over x for all of them) and each part's B with the outputs it
updates, in blocks of 32 outputs (native/lora.py). The tensors are the adapter's own values
(laid out once; the adapter file's copies are dropped), in the type the file stores (f32,
f16, bf16; Q8_0 as f16): a loaded adapter costs its own bytes, and the base model is never
copied.
"""

from __future__ import annotations

import ctypes
import mmap
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from ...native.lora import (
    PROJECTIONS,
    LoraUpdateStruct,
    ProjectionUpdate,
    UpdatePart,
)
from .adapter import AdapterError, LoraAdapter


@dataclass(frozen=True)
class PartLayout:
    """One base tensor's place in a fused projection's outputs."""

    tensor: str  # e.g. blk.0.attn_k.weight
    out_offset: int
    out_count: int


# Per layer, per projection (QKV, OUT, GATE_UP, DOWN): the tensors it stacks, in order.
ModelLayout = Sequence[Sequence[Sequence[PartLayout]]]


class BoundLora:
    """An adapter bound to a model of `layout`: `updates[layer][projection]` (None where it
    changes nothing) and their description for the native kernel (`native`, the address of
    an array [layers][PROJECTIONS])."""

    def __init__(self, name: str, adapter: LoraAdapter, layout: ModelLayout):
        self.name, self.path, self.rank = name, adapter.path, adapter.rank
        where = {
            part.tensor: (layer, projection)
            for layer, projections in enumerate(layout)
            for projection, parts in enumerate(projections)
            for part in parts
        }
        for tensor in adapter.pairs:
            if tensor not in where:
                raise AdapterError(
                    adapter.path, f"{tensor}: adapters on this weight are not supported"
                )
        updates = [[_update(adapter, parts) for parts in projections] for projections in layout]
        self._memory, self.updates = _packed(updates)
        self.nbytes = sum(u.nbytes for layer in self.updates for u in layer if u is not None)
        self._structs = (LoraUpdateStruct * (len(layout) * PROJECTIONS))()
        for layer, updates in enumerate(self.updates):
            for projection, update in enumerate(updates):
                if update is not None:
                    update.fill(self._structs[layer * PROJECTIONS + projection])
        self.native = ctypes.addressof(self._structs)

    def __repr__(self) -> str:
        return f"BoundLora({self.name!r}, rank {self.rank}, {self.nbytes} bytes)"


def _packed(updates: list[list[ProjectionUpdate | None]]):
    """The updates' tensors copied into one buffer, in the order a step reads them (layer
    by layer, projection by projection), on huge pages where the kernel gives them: a
    step then reads the adapter as one stream, which the hardware prefetches across its
    4 KiB pages' bounds (scattered small tensors read at half the speed). Returns the
    buffer (kept alive with them) and the updates over it."""
    tensors = [t for layer in updates for u in layer if u is not None for t in _tensors(u)]
    total = sum(_aligned(t.numel() * t.element_size()) for t in tensors)
    memory, buffer = _huge_buffer(total)
    at = 0

    def place(tensor: torch.Tensor) -> torch.Tensor:
        nonlocal at
        size = tensor.numel() * tensor.element_size()
        view = buffer[at : at + size].view(tensor.dtype).view(tensor.shape)
        view.copy_(tensor)
        at += _aligned(size)
        return view

    packed = []
    for layer in updates:
        packed.append([])
        for update in layer:
            if update is not None:
                parts = tuple(replace(part, b_blocks=place(part.b_blocks)) for part in update.parts)
                update = ProjectionUpdate(place(update.a), parts)  # A first: read first
            packed[-1].append(update)
    return memory, packed


def _tensors(update: ProjectionUpdate) -> list[torch.Tensor]:
    return [update.a, *(part.b_blocks for part in update.parts)]


def _aligned(size: int) -> int:
    return -(-size // 64) * 64


HUGE_PAGE = 2 << 20


def _huge_buffer(size: int) -> tuple[object, torch.Tensor]:
    """A zeroed uint8 buffer of `size` bytes, 2 MiB aligned and advised onto transparent
    huge pages (where Linux offers them; elsewhere plain pages). Below a huge page, plain
    memory: a small adapter would otherwise hold a whole 2 MiB page."""
    if size < HUGE_PAGE:
        return None, torch.zeros(size, dtype=torch.uint8)
    memory = mmap.mmap(-1, size + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    buffer = torch.frombuffer(memory, dtype=torch.uint8)
    start = -buffer.data_ptr() % HUGE_PAGE
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            memory.madvise(mmap.MADV_HUGEPAGE)
        except OSError:  # a kernel without transparent huge pages
            pass
    return memory, buffer[start : start + size]


def _update(adapter: LoraAdapter, parts: Sequence[PartLayout]) -> ProjectionUpdate | None:
    """The parts of one projection the adapter changes, their A stacked."""
    present = [(part, adapter.pairs[part.tensor]) for part in parts if part.tensor in adapter.pairs]
    if not present:
        return None
    dtypes = {pair.a.dtype for _, pair in present} | {pair.b.dtype for _, pair in present}
    dtype = dtypes.pop() if len(dtypes) == 1 else torch.float32
    a_rows, update_parts, rank_offset = [], [], 0
    for part, pair in present:
        a_rows.append(pair.a.to(dtype))
        b = pair.b.to(dtype)  # laid out in blocks of outputs for the kernel (see lora.cpp)
        update_parts.append(
            UpdatePart.blocked(part.out_offset, rank_offset, b, adapter.scaling(pair))
        )
        rank_offset += pair.rank
    a = a_rows[0].contiguous() if len(a_rows) == 1 else torch.cat(a_rows).contiguous()
    return ProjectionUpdate(a, tuple(update_parts))
