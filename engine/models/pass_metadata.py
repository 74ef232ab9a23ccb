"""What a forward pass knows before its first layer runs, built once per pass and read by every
layer: which rows belong to which sequence, what kind of rows they are, their RoPE tables and
their masks. A pass over one sequence is the case of one; a batched step (continuous
batching) holds several.

The layers never look at the caches' types to find out how to attend: the row kind says it.
- DECODE: one token, a decode step.
- EXACT: several tokens of one sequence, each row computed bit for bit as its own decode
  step would compute it (speculative verification, prompt chunks under batching).
- CHUNK: several prompt tokens attended together, as fast as the device allows (a lone
  prompt's prefill, where no other pass has to match it row for row).

Each row of a kind gets what its kind needs: DECODE and CHUNK rows one mask for the span
(the cache's own, None when every key is visible), EXACT rows a decode step's mask each
(`RowMasks`) and RoPE tables built position by position (`row_tables`). A sequence whose
caches carry LoRA adapters (`caches.lora`, set by the scheduler) has its rows' adapters
grouped here once for every layer (engine/lora/rows.py)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from enum import StrEnum

import torch

from ..kv.cache import Cache
from ..lora.rows import PassLora, pass_lora
from ..ops.layers import Rope, RopeTables
from .exact_rows import RowMasks, row_tables

Mask = torch.Tensor | None | RowMasks


class RowKind(StrEnum):
    DECODE = "decode"
    EXACT = "exact"
    CHUNK = "chunk"


def row_kind(count: int, exact: bool) -> RowKind:
    if count == 1:
        return RowKind.DECODE
    return RowKind.EXACT if exact else RowKind.CHUNK


@dataclass(frozen=True)
class RowSpan:
    """One sequence's rows in a pass: `count` rows from row `first`, all of one kind."""

    first: int
    count: int
    kind: RowKind

    @property
    def rows(self) -> slice:
        return slice(self.first, self.first + self.count)


@dataclass(frozen=True)
class LayerRows:
    """One layer's view of a pass: for each sequence, its rows, its cache for this layer and
    its mask for this layer's kind (sliding-window or global)."""

    spans: Sequence[RowSpan]
    caches: Sequence[Cache]
    masks: Sequence[Mask]
    lora: PassLora | None = None  # the rows' LoRA adapters (None: none carries any)
    layer: int = 0  # the layer's index (its adapters' updates are per layer)

    def __iter__(self) -> Iterator[tuple[RowSpan, Cache, Mask]]:
        return iter(zip(self.spans, self.caches, self.masks, strict=True))

    def __len__(self) -> int:
        return len(self.spans)

    @property
    def alone(self) -> bool:
        """One sequence: the pass is that sequence's own."""
        return len(self.spans) == 1

    def subset(self, indices: Sequence[int]) -> LayerRows:
        """The chosen sequences, their rows renumbered from 0 in the order given (for a
        part of the pass that runs on its own gathered rows)."""
        spans, first = [], 0
        for index in indices:
            spans.append(replace(self.spans[index], first=first))
            first += self.spans[index].count
        caches, masks = [self.caches[i] for i in indices], [self.masks[i] for i in indices]
        lora = None if self.lora is None else self.lora.subset(indices)
        return LayerRows(spans, caches, masks, lora, self.layer)


@dataclass(frozen=True)
class PassMetadata:
    """The rows, RoPE tables and masks of one pass. `rotations[local]` and `masks[local]`
    are keyed by whether a layer is sliding-window (its own RoPE and mask); `masks[local]`
    holds one mask per sequence. `caches[i]` are sequence i's caches, one per layer."""

    spans: Sequence[RowSpan]
    caches: Sequence[Sequence[Cache]]
    rotations: dict[bool, RopeTables]
    masks: dict[bool, list[Mask]]
    lora: PassLora | None = None

    @property
    def rows(self) -> int:
        return sum(span.count for span in self.spans)

    def layer(self, index: int, local: bool) -> LayerRows:
        caches = [one[index] for one in self.caches]
        return LayerRows(self.spans, caches, self.masks[local], self.lora, index)

    def to(self, device: torch.device) -> PassMetadata:
        """Tables and masks are built on the CPU; a model on a GPU takes copies once a pass."""
        rotations = {kind: tables.to(device) for kind, tables in self.rotations.items()}
        masks = {
            kind: [None if m is None else m.to(device) for m in per_sequence]
            for kind, per_sequence in self.masks.items()
        }
        return replace(self, rotations=rotations, masks=masks)


def build_pass_metadata(
    counts: Sequence[int],
    caches: Sequence[Sequence[Cache]],
    exact: bool,
    kinds: dict[bool, int],
    ropes: dict[bool, Rope],
) -> PassMetadata:
    """The metadata of a pass in which sequence i feeds `counts[i]` tokens to `caches[i]`.
    `kinds` maps each kind of layer in the pass to its first layer there: all caches of a
    kind hold the same positions, so that layer's cache answers for masks and positions."""
    spans, first = [], 0
    for count in counts:
        spans.append(RowSpan(first, count, row_kind(count, exact)))
        first += count
    rotations: dict[bool, RopeTables] = {}
    masks: dict[bool, list[Mask]] = {}
    for local, layer in kinds.items():
        rope, tables, masks[local] = ropes[local], [], []
        for span, one in zip(spans, caches, strict=True):
            cache = one[layer]
            if span.kind is RowKind.EXACT:
                tables.append(row_tables(rope, cache.offset, span.count))
                masks[local].append(RowMasks())
            else:
                tables.append(rope.tables(cache.offset, span.count))
                masks[local].append(cache.make_mask(span.count))
        if len(tables) == 1:
            rotations[local] = tables[0]
        else:
            cos = torch.cat([t.cos for t in tables])
            rotations[local] = RopeTables(cos, torch.cat([t.signed_sin for t in tables]), rope)
    sets = [getattr(one, "lora", None) for one in caches]
    lora = pass_lora(sets, [(span.first, span.count) for span in spans], caches[0])
    return PassMetadata(spans, caches, rotations, masks, lora)
