"""The adapters of one forward pass's rows, grouped once per pass and read by every layer.

Each sequence of a pass runs with its own adapter set (engine/lora/registry.py), or none.
Rows that carry the same adapter at the same scale, as the same position in their sets,
form one group; groups go in order of that position, so every row adds its adapters'
updates in its own order, as it would alone. The native kernel reads each group's A and B
once for all its rows (`LoraCallStruct`, built once per pass and layer); elsewhere (a GPU,
no native library) the same groups go through torch (`reference_delta`).
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Sequence

import torch

from ...native.lora import (
    PROJECTIONS,
    LoraCallStruct,
    LoraGroupStruct,
    LoraKernel,
    reference_delta,
)
from ..platform.kernels import cpu_int4_kernel
from .bound import BoundLora
from .registry import AdapterSet


class PassLora:
    """`sets[i]`: sequence i's adapters (None: the base alone); `spans[i]`: its rows
    (first, count) in the pass. `kernel`: the native LoRA kernel, or None for torch."""

    def __init__(
        self,
        sets: Sequence[AdapterSet | None],
        spans: Sequence[tuple[int, int]],
        kernel: LoraKernel | None,
    ):
        self.sets, self.spans, self.kernel = list(sets), list(spans), kernel
        self.groups = _groups(self.sets, self.spans)
        self._subsets: dict[tuple[int, ...], PassLora | None] = {}
        self._structs = None
        self._calls: dict[int, LoraCallStruct] = {}

    def call(self, layer: int) -> LoraCallStruct:
        """The native kernel's view of the pass at `layer` (built on first use)."""
        call = self._calls.get(layer)
        if call is None:
            if self._structs is None:
                structs = (LoraGroupStruct * len(self.groups))()
                for struct, (adapter, scale, rows, position) in zip(
                    structs, self.groups, strict=True
                ):
                    struct.updates, struct.scale, struct.position = adapter.native, scale, position
                    struct.rows, struct.n_rows = rows.data_ptr(), rows.numel()
                self._structs = structs
            call = LoraCallStruct(ctypes.addressof(self._structs), len(self.groups), layer)
            self._calls[layer] = call
        return call

    def delta(self, layer: int, projection: int, x: torch.Tensor, n_out: int):
        """fp32 [rows, n_out]: every row's updates of the projection (-0.0 for rows without
        one), or None when no row has one there."""
        if self.kernel is not None and x.is_cpu:
            return self.kernel.delta(self.call(layer), projection, x, n_out)
        groups = [
            (adapter.updates[layer][projection], scale, rows.to(x.device))
            for adapter, scale, rows, _ in self.groups
        ]
        return reference_delta(groups, x, n_out)

    def subset(self, indices: Sequence[int]) -> PassLora | None:
        """The chosen sequences alone, their rows renumbered from 0 in the order given (a
        part of the pass that runs on its own gathered rows); None if none of them carries
        an adapter. The same for every layer of the pass, so it is built once."""
        key = tuple(indices)
        if key not in self._subsets:
            sets = [self.sets[i] for i in indices]
            spans, first = [], 0
            for i in indices:
                spans.append((first, self.spans[i][1]))
                first += self.spans[i][1]
            chosen = any(s is not None for s in sets)
            self._subsets[key] = PassLora(sets, spans, self.kernel) if chosen else None
        return self._subsets[key]


def cpu_lora_kernel() -> LoraKernel | None:
    """The native LoRA kernel where the native library loads (None: torch does it)."""
    library = cpu_int4_kernel().library
    return None if library is None else _kernel_of(library)


@functools.cache
def _kernel_of(library) -> LoraKernel:
    return LoraKernel(library)


def pass_lora(
    sets: Sequence[AdapterSet | None], spans: Sequence[tuple[int, int]], holder=None
) -> PassLora | None:
    """The pass's adapters, or None when no sequence of it carries any (the common case,
    which then costs the layers nothing). Decode steps repeat the same sets over the same
    spans step after step, so the grouping (and the native call structures) of the last
    pass is kept on `holder` (the first sequence's caches, where they take it) and handed
    out again; it goes with them."""
    if all(s is None for s in sets):
        return None
    key = (tuple(0 if s is None else id(s) for s in sets), tuple(spans))
    kept = getattr(holder, "lora_pass", None)
    if kept is not None and kept[0] == key:
        return kept[1]
    found = PassLora(sets, spans, cpu_lora_kernel())  # holds the sets: their ids stay theirs
    if hasattr(holder, "lora_pass"):
        holder.lora_pass = (key, found)
    return found


def _groups(sets, spans) -> list[tuple[BoundLora, float, torch.Tensor, int]]:
    """(adapter, scale, row indices, position) per group, in order of the adapters'
    positions in their sets (the groups of one position hold different rows: the kernel
    runs them side by side)."""
    depth = max((len(s.entries) for s in sets if s is not None), default=0)
    groups = []
    for position in range(depth):
        rows_of: dict[tuple[int, float], tuple[BoundLora, list[int]]] = {}
        for adapters, (first, count) in zip(sets, spans, strict=True):
            if adapters is None or position >= len(adapters.entries):
                continue
            adapter, scale = adapters.entries[position]
            entry = rows_of.setdefault((id(adapter), scale), (adapter, []))
            entry[1].extend(range(first, first + count))
        for (_, scale), (adapter, rows) in rows_of.items():
            groups.append((adapter, scale, torch.tensor(rows, dtype=torch.int64), position))
    return groups


__all__ = ["PROJECTIONS", "PassLora", "cpu_lora_kernel", "pass_lora"]
