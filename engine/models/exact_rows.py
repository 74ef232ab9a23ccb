"""What makes a pass over several tokens compute each row exactly as feeding them one at a
time would (speculative verification, and every sequence of a batch, must reproduce plain
decoding bit for bit): each row's decode-step mask and RoPE tables built position by
position. pass_metadata.py hands them to the rows of kind EXACT; the attention side is
`Attention._attend_rows` in decoder.py."""

from __future__ import annotations

import torch

from ..kv.cache import Cache
from ..ops.layers import Rope, RopeTables
from .placement import CPU


class RowMasks:
    """Decode-step masks for each row of an exact-rows pass. All caches of one kind hold
    the same positions, so the first layer of the kind computes each row's mask (just
    before its own update, as a decode step would) and the later layers reuse it. Layers
    on another device read copies through `to(device)`."""

    def __init__(self, device: torch.device = CPU, source: RowMasks | None = None):
        self.device, self._source = device, source
        self._masks: list[torch.Tensor | None] = []

    def get(self, row: int, cache: Cache) -> torch.Tensor | None:
        if row == len(self._masks):
            mask = cache.make_mask(1) if self._source is None else self._source.get(row, cache)
            self._masks.append(None if mask is None else mask.to(self.device))
        return self._masks[row]

    def to(self, device: torch.device) -> RowMasks:
        return self if device == self.device else RowMasks(device, self)


def row_tables(rope: Rope, offset: int, n_tokens: int) -> RopeTables:
    """RoPE tables built position by position, as decode steps build them (a table built
    for a span may round its last bit differently)."""
    rows = [rope.tables(offset + i, 1) for i in range(n_tokens)]
    return RopeTables(
        torch.cat([r.cos for r in rows]), torch.cat([r.signed_sin for r in rows]), rope
    )
