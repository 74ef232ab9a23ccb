"""Where one layer's keys and values are kept, apart from which positions they belong to.

`KVStorage` holds the tensors [1, kv_heads, slots, width] in the form their codecs give
(f32, f16, bf16, blocks of q8 / q4, see types.py), allocates and grows them, writes rows into
slots, and hands readers what they need to read them back. It knows nothing of positions:
the caches in cache.py decide which position goes into which slot, what each query may see,
and when rows are dropped; they tell the storage only slot numbers.

q4 keys are stored in tiles (key_tiles.py), which is why most of this class exists: a tile
is 32 consecutive slots, encoded once its last row is written, with the newest tiles' rows
kept exact in fp32 beside it. Every write, read and rewrite of keys therefore takes one of
two routes, and this is the one place that chooses between them, so the caches need not.

The first `front` slots are not part of the tiles. A ring with attention sinks keeps the
sinks there (at their own positions, then rotated into the current frame). With tiled keys
their keys are kept here as fp32 "lead" rows instead, which readers see before the tiles:
the sinks are too few to fill a tile, they are rewritten (rotated into the new frame) at
almost every step, and every query reads them. The lead lives in the storage rather than in
the ring because it is only another way of holding those slots' keys: the ring writes its
sinks, rotates them into the frame and names the slots it reads the same way for every type,
and only the storage knows whether a slot's key is a stored row or an fp32 lead row. (The
`keys` tensor keeps room for the front slots either way, unused with tiles, so slot numbers
mean the same for every type: the fixed-shape step writes values by them.)

Rows come to the writes already in their stored form, from the codecs' `encode` (fp32 for
tiled keys, which KeyTiles encodes itself). A cache encodes all of an update's rows at once
and then places them, some as sinks and the rest in the ring, so how an update is split
between slots never changes the bits stored. A decode step can also leave the writing to
its caller: `take_one` hands out the rows to write into (the fused native layer writes
there), so those must be views of the very tensors the storage holds.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import NamedTuple

import torch

from ...native.attention import TiledKeys
from ..ops.layers import Rope, RopeTables, apply_rope
from .codec import TILE_ROWS, KVCodec
from .key_tiles import KeyTiles
from .types import KVSetting


@dataclass(frozen=True)
class Slots:
    """Where a step's keys and values go, and everything its queries attend."""

    # (key rows, value rows) [1, kv_heads, n, width]
    slots: tuple[torch.Tensor, torch.Tensor] | None
    # (keys, values) [1, kv_heads, tokens, width]: what the last of the n rows attends; row
    # r of n attends the first tokens - (n - 1 - r) of them.
    stored: tuple[torch.Tensor, torch.Tensor] | None
    # Tiled keys: what the kernel reads besides (the key row is then an fp32 row of the
    # newest tiles), and what to call once the key is written (it completed a tile).
    tiled: TiledKeys | None = None
    written: Callable[[], None] | None = None
    # Instead of slots and stored (both None then): their addresses, for the fused layer,
    # which reads nothing else of them (making tensor views costs more than its call).
    addresses: SlotAddresses | None = None


class SlotAddresses(NamedTuple):
    """Where a step's key and value rows go and what its rows attend, as the native fused
    layer takes them: addresses and strides in bytes."""

    key_slot: int
    value_slot: int
    keys: int  # the first key the rows attend, kv head 0
    values: int
    key_head_stride: int
    value_head_stride: int
    n_keys: int  # keys the last row attends
    key_row_stride: int  # between consecutive slots
    value_row_stride: int


def _byte_layout(keys: torch.Tensor, values: torch.Tensor) -> tuple:
    """(keys, values, their addresses, row strides and head strides in bytes): what
    addresses of slots are computed from, kept while the tensors stay the same."""
    key_size, value_size = keys.element_size(), values.element_size()
    return (
        keys,
        values,
        keys.data_ptr(),
        values.data_ptr(),
        keys.stride(2) * key_size,
        values.stride(2) * value_size,
        keys.stride(1) * key_size,
        values.stride(1) * value_size,
    )


def _codecs(
    kind: KVSetting, head_dim: int, device: torch.device, key_tiles: bool = True
) -> tuple[KVCodec, KVCodec]:
    """The key and value codecs (the same one when both are stored alike). Without
    `key_tiles`, q4 keys are rows like values."""
    keys = KVCodec(kind.key, head_dim, device, keys=key_tiles)
    same = kind.value == kind.key and not keys.tiled
    return keys, keys if same else KVCodec(kind.value, head_dim, device)


def _whole_tiles(slots: int) -> int:
    return -(-slots // TILE_ROWS) * TILE_ROWS


def _shift(keys: torch.Tensor, rope: Rope, delta: int) -> torch.Tensor:
    """fp32 keys [1, kv_heads, n, head_dim] rotated by `delta` more positions."""
    heads = keys[0].transpose(0, 1)
    return apply_rope(heads, rope.shift_tables(delta).to(keys.device)).transpose(0, 1)[None]


def rotate_stored_keys(stored: torch.Tensor, tables: RopeTables, codec: KVCodec) -> torch.Tensor:
    """Stored keys [1, kv_heads, n, width] rotated by more positions (RoPE composes), stored
    again: `tables` shift all of them alike (`Rope.shift_tables`, [1, 1, head_dim]) or each
    by its own (`Rope.each_shift_tables`, [kv_heads, n, head_dim]). Quantized keys are
    decoded, rotated and quantized once more: the ring rotates from keys stored once (the
    sinks' own copies), so errors do not pile up there."""
    keys = codec.decode(stored)[0]  # [kv_heads, n, head_dim]
    return codec.encode(apply_rope(keys, tables.to(stored.device))[None])


class KVStorage:
    """One layer's keys and values in `slots` storage slots, as `kind` stores them.

    Slot numbers are indices along the token axis of `keys` and `values`. `front` slots come
    first and stay out of the tiles (tiled keys: their keys are the fp32 `lead`). Reads name
    a reader's slots start..end-1; for tiled keys the reader's slots before the tiles,
    `leads` of them from `start`, are lead rows, which the kernel and the decoders put
    before the tiled keys."""

    def __init__(
        self,
        n_kv_heads: int,
        head_dim: int,
        kind: KVSetting,
        device: torch.device | str,
        slots: int,
        front: int = 0,
        key_tiles: bool = True,
    ):
        """`key_tiles`: q4 keys in tiles (see the module); False stores them as rows, as
        values are, for a cache that moves single rows about (scored.py)."""
        device = torch.device(device)
        self.heads, self.front = n_kv_heads, front
        self.key_codec, self.value_codec = _codecs(kind, head_dim, device, key_tiles)
        self.tiles: KeyTiles | None = None
        self.lead: torch.Tensor | None = None  # fp32 [1, kv_heads, front, head_dim]
        if self.key_codec.tiled:
            self.tiles = KeyTiles(n_kv_heads, head_dim, device)
            if front:
                self.lead = torch.zeros((1, n_kv_heads, front, head_dim), device=device)
        self.keys, self.values = self.empty(slots)
        self._layout: tuple | None = None  # see _byte_layout

    @property
    def slots(self) -> int:
        return self.keys.shape[2]

    def empty(self, slots: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Zeroed keys and values of at least `slots` slots: the tiles whole, if any."""
        if self.tiles is not None:
            slots = self.front + _whole_tiles(slots - self.front)
        return self.key_codec.empty(self.heads, slots), self.value_codec.empty(self.heads, slots)

    def grow(self, slots: int, keep: int) -> None:
        """New tensors of `slots` slots (see `empty`) holding the first `keep` slots of the
        old ones. Tiles' exact rows are kept by KeyTiles, so they need nothing here."""
        keys, values = self.empty(slots)
        keys[:, :, :keep] = self.keys[:, :, :keep]
        values[:, :, :keep] = self.values[:, :, :keep]
        self.keys, self.values = keys, values

    def clear(self) -> None:
        """Forget the exact rows of the newest tiles (stale once nothing maps to them); the
        tensors, and their addresses, stay."""
        if self.tiles is not None:
            self.tiles.clear()

    # -- writing

    def write(self, at: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Rows in stored form into slots at, at + 1, ...: all of them before `front` (tiled
        keys: into the lead), or all from it on."""
        end = at + k.shape[2]
        tiles, front = self.tiles, self.front
        if tiles is None:
            self.keys[:, :, at:end] = k
        elif at < front:  # a ring's sinks
            self.lead[:, :, at:end] = k.float()
        else:
            tiles.write(self.keys[:, :, front:] if front else self.keys, at - front, k.float())
        self.values[:, :, at:end] = v

    def write_ring(
        self, first: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring: int
    ) -> None:
        """Rows in stored form into a ring of `ring` slots after `front`: row i into ring slot
        slots[i] (int64, any device), which is (first + i) % ring."""
        slots = slots.to(self.values.device)
        front = self.front
        if self.tiles is not None:
            self.tiles.write(self._tiled_rows(), first, k.float(), ring)
        else:
            self.keys[:, :, front:].index_copy_(2, slots, k)
        self.values[:, :, front:].index_copy_(2, slots, v)

    def none_in_tiles(self) -> None:
        """The last update wrote no rows into the tiles (all went to a ring's sinks): none
        of its rows has an own tile."""
        if self.tiles is not None:
            self.tiles.own_tiles = self.tiles.own_tiles[:0]

    def take_one(
        self, at: int, start: int, end: int, leads: int = 0, addresses: bool = False
    ) -> Slots:
        """A decode step whose caller writes the key and value of slot `at` itself (the
        fused native layer), reading slots start..end-1 (`leads` of them lead rows). With
        `addresses`, untiled storage answers with addresses alone (Slots.addresses)."""
        keys, values = self.keys, self.values
        if addresses and self.tiles is None:
            layout = self._layout
            if layout is None or layout[0] is not keys or layout[1] is not values:
                layout = self._layout = _byte_layout(keys, values)
            _, _, key_base, value_base, key_row, value_row, key_head, value_head = layout
            where = SlotAddresses(
                key_base + at * key_row,
                value_base + at * value_row,
                key_base + start * key_row,
                value_base + start * value_row,
                key_head,
                value_head,
                end - start,
                key_row,
                value_row,
            )
            return Slots(None, None, addresses=where)
        value_row = values[:, :, at : at + 1]
        if self.tiles is None:
            stored = keys[:, :, start:end], values[:, :, start:end]
            return Slots((keys[:, :, at : at + 1], value_row), stored)
        # As _tiled_rows, _lead and read do, written out: this runs for every layer and step.
        tiles, front, lead = self.tiles, self.front, self.lead
        key_row, written = tiles.take(keys[:, :, front:] if front else keys, at - front)
        tiled = tiles.for_kernel(None if lead is None else lead[:, :, start : start + leads], 1)
        stored = keys[:, :, front if start < front else start : end], values[:, :, start:end]
        return Slots((key_row, value_row), stored, tiled, written)

    def take_key_row(self, at: int) -> Callable[[], None] | None:
        """For a fixed-shape step that writes slot `at`'s key itself: with tiles, its fp32
        row of the newest tiles made ready, and what to call once the key is written (None:
        nothing to do)."""
        if self.tiles is None:
            return None
        return self.tiles.take(self._tiled_rows(), at - self.front)[1]

    def rotate_keys(self, source: int, to: int, n: int, rope: Rope, delta: int) -> None:
        """The keys of slots source.. rotated by `delta` more positions into slots to.. (with
        tiles: slots before `front` only, exact in fp32)."""
        if self.tiles is not None:
            self.lead[:, :, to : to + n] = _shift(self.lead[:, :, source : source + n], rope, delta)
        else:
            stored = self.keys[:, :, source : source + n]
            tables = rope.shift_tables(delta)
            self.keys[:, :, to : to + n] = rotate_stored_keys(stored, tables, self.key_codec)

    def close_gap(
        self, start: int, end: int, stop: int, rope: Rope, ring: int | None = None
    ) -> None:
        """Drop slots start..end-1 of start..stop-1: the later ones move down to start, their
        keys rotated back by the gap's length. Tiles from start's on are written again, from
        their keys as the newest row reads them (exact in its own tile); `ring`: the ring's
        capacity, as in write_ring. Slots from `front` on only, with tiles."""
        gap = end - start
        if self.tiles is not None:
            tiles, region, front = self.tiles, self._tiled_rows(), self.front
            lo, hi, used = start - front, end - front, stop - front
            first = lo // TILE_ROWS * TILE_ROWS
            held = tiles.decoded(region, used, None, tiles.own_tile(None, used - 1))
            moved = _shift(held[:, :, hi:], rope, -gap)
            kept = torch.cat([held[:, :, first:lo], moved], dim=2)
            tiles.clear()
            tiles.write(region, first, kept, ring)
        else:
            moved = self.keys[:, :, end:stop].clone()
            tables = rope.shift_tables(-gap)
            self.keys[:, :, start : stop - gap] = rotate_stored_keys(moved, tables, self.key_codec)
        self.values[:, :, start : stop - gap] = self.values[:, :, end:stop].clone()

    # -- reading

    def read(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of slots start..end-1, as stored (tiled keys: from `front` on;
        the slots before are lead rows, see tiled_view)."""
        if start < self.front and self.tiles is not None:
            return self.keys[:, :, self.front : end], self.values[:, :, start:end]
        return self.keys[:, :, start:end], self.values[:, :, start:end]

    def tiled_view(self, rows: int, start: int = 0, leads: int = 0) -> TiledKeys | None:
        """With tiles, what the native kernel reads besides the keys `read` returned, for
        the last write's final `rows` rows (None: no tiles, the keys are all there is)."""
        if self.tiles is None:
            return None
        return self.tiles.for_kernel(self._lead(start, leads), rows)

    def decode_keys(
        self, keys: torch.Tensor, row: int | None, newest: int, start: int = 0, leads: int = 0
    ) -> torch.Tensor:
        """fp32 keys [1, kv_heads, tokens, head_dim] of `keys` (what `read` returned) as the
        last write's row `row` reads them, or (None) a query whose newest key is in slot
        `newest` (negative: none): with tiles, the lead rows first, complete tiles decoded,
        and the reader's own tile exact."""
        if self.tiles is None:
            return self.key_codec.decode(keys)
        own = self.tiles.own_tile(row, newest - self.front)
        return self.tiles.decoded(self._tiled_rows(), keys.shape[2], self._lead(start, leads), own)

    def keys_by_own_tile(
        self,
        keys: torch.Tensor,
        rows: int,
        start: int = 0,
        leads: int = 0,
        ring: int | None = None,
    ) -> Iterator[tuple[int, int, torch.Tensor]]:
        """With tiles only: KeyTiles.by_own_tile over `keys` (what `read` returned) for the
        last write's final `rows` rows; `ring` as in write_ring."""
        lead = self._lead(start, leads)
        return self.tiles.by_own_tile(self._tiled_rows(), keys.shape[2], lead, rows, ring)

    def exact_slot(self, slot: int) -> int:
        """The latest slot at or before `slot` such that cutting the keys back to it (the
        slot written next) leaves them as keys that never held the rest would be: `slot`
        itself, except within a tile whose earlier rows are no longer exact."""
        if self.tiles is None or slot < self.front:
            return slot
        tiled = slot - self.front
        if self.tiles.trims_exactly_to(tiled):
            return slot
        return self.front + tiled // TILE_ROWS * TILE_ROWS

    def _tiled_rows(self) -> torch.Tensor:
        return self.keys if not self.front else self.keys[:, :, self.front :]

    def _lead(self, start: int, leads: int) -> torch.Tensor | None:
        return None if self.lead is None else self.lead[:, :, start : start + leads]
