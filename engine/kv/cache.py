"""Per-layer key/value caches, passed into the model explicitly (never hidden module state).

What the model, speculative roll-back and the runtime need of a cache is the `Cache`
protocol below; the fixed-shape decode step (a GPU replaying a captured graph, see
`models/static_step.py`) needs a little more, `StaticCache`. Two kinds provide both:
`KVCache` holds every position up to a fixed maximum; `RotatingKVCache` keeps the first
`sinks` tokens plus a sliding window of the most recent ones, in constant memory.

Each is a position policy over a `KVStorage` (storage.py): the cache decides which position
goes into which storage slot, what each query may see (its mask), where the sinks and the
frame are, and what trimming, forgetting and prefix reuse keep. The storage keeps the keys
and values as the `KVSetting` says (f32, f16, bf16, or blocks of q8 / q4, see types.py) and
does all that depends on it, q4 key tiles above all, so the policies read the same for every
type. `update_and_fetch` takes fp32 and returns the stored form, which the model's attention
reads as it is (the native kernel) or decodes (`decode_keys`, `value_codec.decode`). The
storage's tensors and codecs are also the cache's `keys`, `values`, `key_codec`,
`value_codec` and `key_tiles`, for the code that reads them directly.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np
import torch

from ...native.attention import TiledKeys
from ..errors import ContextFullError
from ..ops.layers import Rope
from .codec import TILE_ROWS, KVCodec
from .key_tiles import KeyTiles
from .storage import KVStorage, Slots
from .types import F32, KVSetting


@dataclass(frozen=True)
class _Update:
    to_sinks: int  # new tokens stored as sinks
    slots: torch.Tensor  # ring slots of the others
    positions: torch.Tensor  # and their positions
    ring_count: int  # tokens held in the ring afterwards
    wrapped: bool
    allocated: int  # ring slots allocated afterwards


@dataclass(frozen=True)
class StaticStep:
    """The bookkeeping of one fixed-shape decode step (see `advance_one`)."""

    write_at: int  # storage index (token axis) of the new token's keys and values
    # bool [1, span]: which of `static_span` the new query sees (valid until the cache's
    # next step: a buffer the cache may reuse)
    mask: torch.Tensor
    frame: int  # positions by which the frame sinks are rotated (0 without sinks)
    # q4 keys in tiles: what to call once the step has written its key (it completed a tile).
    written: Callable[[], None] | None = None


@runtime_checkable
class Cache(Protocol):
    """One layer's keys and values, as the model and speculative roll-back use them."""

    offset: int  # the position of the next token
    key_codec: KVCodec  # how keys are stored
    value_codec: KVCodec  # and values

    def update_and_fetch(
        self, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store this step's keys/values, fp32 [1, kv_heads, n, head_dim] (already rotated by
        RoPE at their positions); return all keys/values the step's queries may attend to,
        as stored ([1, kv_heads, tokens, width])."""
        ...

    def tiled_keys(self, rows: int) -> TiledKeys | None:
        """For keys stored as q4 tiles, what the native attention reads besides the keys
        update_and_fetch returned, for the last update's final `rows` rows (None: other
        types, whose returned keys are all there is)."""
        ...

    def decode_keys(self, keys: torch.Tensor, row: int | None = None) -> torch.Tensor:
        """fp32 keys [1, kv_heads, tokens, head_dim] of what update_and_fetch returned, as
        the last update's row `row` reads them, or (None) the newest token (tiled keys: the
        reader's own tile exact)."""
        ...

    def keys_by_own_tile(
        self, keys: torch.Tensor, rows: int
    ) -> Iterator[tuple[int, int, torch.Tensor]]:
        """Tiled keys only: the last update's final `rows` rows in groups that share an own
        tile, each with fp32 keys as its rows read them (KeyTiles.by_own_tile), for
        attention outside the native kernel (a prompt chunk, a GPU)."""
        ...

    def take_one(self, addresses: bool = False) -> Slots | None:
        """A decode step's bookkeeping for a caller that writes the token's key and value
        itself (the fused native layer): the storage rows they go into, and what
        update_and_fetch would return after writing them (with `addresses`, as addresses
        where the storage can: Slots.addresses). None, with nothing changed, when this step
        needs update_and_fetch instead."""
        ...

    def take_rows(self, n: int) -> Slots | None:
        """take_one for n consecutive tokens of an exact-rows pass (verification), whose
        decode steps would each see, unmasked, a prefix of one storage. None, with nothing
        changed, when they would not (rows_share_storage) or keys are stored as tiles."""
        ...

    def make_mask(self, n_new: int) -> torch.Tensor | None:
        """The attention mask for the next `n_new` queries over what the next
        `update_and_fetch` returns (None when every query may see everything)."""
        ...

    def max_chunk(self) -> int:
        """How many tokens the next update may take at once."""
        ...

    def rows_share_storage(self, n_new: int) -> bool:
        """Whether the next `n_new` rows, fed one at a time, would each see a prefix of one
        storage (exact-rows verification can then write them all at once)."""
        ...

    def can_trim(self, n: int) -> bool: ...

    def exact_prefix(self, n: int) -> int:
        """The longest prefix of at most n positions that trimming back to keeps as a cache
        that only ever held it would be (prefix reuse): n, or less with keys in q4 tiles."""
        ...

    def trim(self, n: int) -> int:
        """Forget the newest n positions (prefix reuse, speculative roll-back); returns how
        many were trimmed."""
        ...

    def can_forget(self, start: int) -> bool: ...

    def forget(self, start: int, end: int) -> None:
        """Drop positions start..end-1 and close the gap (a chat's dropped turns)."""
        ...

    def clear(self) -> None:
        """Forget everything, keeping the storage (and its address)."""
        ...


@runtime_checkable
class StaticCache(Cache, Protocol):
    """What the fixed-shape decode step needs besides: storage allocated in full once, a
    fixed span of it that attention reads, and the bookkeeping of one step."""

    keys: torch.Tensor  # [1, kv_heads, storage, width], as the codecs store them
    values: torch.Tensor
    sinks: int  # frame sinks to re-rotate each step (0: none)

    def reserve(self) -> None:
        """Allocate the full storage now (it never moves afterwards)."""
        ...

    def static_ready(self) -> bool:
        """Whether the next token can take a fixed-shape step."""
        ...

    def static_rows_ready(self, n: int) -> bool:
        """Whether the next `n` tokens can take one fixed-shape step together (speculative
        verification): all written before any attends, each row still sees what its own
        decode step would. False wherever `static_ready` is."""
        ...

    def static_span(self) -> tuple[int, int]:
        """(start, length) of the storage attention reads in a fixed-shape step."""
        ...

    def static_extent(self) -> int:
        """How much of the span is in use."""
        ...

    def advance_one(self) -> StaticStep:
        """The bookkeeping of one fixed-shape step: where its keys go, and its mask."""
        ...

    def advance_alike(self) -> Callable[[], None] | None:
        """The same bookkeeping for a cache whose kind's first cache described the step
        (`advance_one`); returns only its `written`."""
        ...


class _OnStorage:
    """What other code reads of a cache's storage (the model's attention, the static step,
    tests): the tensors through properties, since growing replaces them; the codecs and
    tiles, which never change, as plain attributes (the attention reads them every step)."""

    storage: KVStorage
    key_codec: KVCodec
    value_codec: KVCodec
    key_tiles: KeyTiles | None

    def _keep_in(self, storage: KVStorage) -> None:
        self.storage = storage
        self.key_codec, self.value_codec = storage.key_codec, storage.value_codec
        self.key_tiles = storage.tiles

    @property
    def keys(self) -> torch.Tensor:
        return self.storage.keys

    @keys.setter
    def keys(self, keys: torch.Tensor) -> None:
        self.storage.keys = keys

    @property
    def values(self) -> torch.Tensor:
        return self.storage.values

    @values.setter
    def values(self, values: torch.Tensor) -> None:
        self.storage.values = values


class KVCache(_OnStorage):
    """Every position up to `max_tokens`, in order: position p in slot p. Storage grows by
    doubling (from `INITIAL_TOKENS`), so a short chat with a large --ctx does not hold a
    full context."""

    INITIAL_TOKENS = 256
    sinks = 0  # no attention sinks: nothing re-rotates

    def __init__(
        self,
        n_kv_heads: int,
        head_dim: int,
        max_tokens: int,
        rope: Rope | None = None,
        kv_type: KVSetting = F32,
        device: torch.device | str = "cpu",
    ):
        self.max_tokens = max_tokens
        self.rope = rope  # needed only by `forget`, to re-rotate shifted keys
        self.offset = 0
        tokens = min(max_tokens, self.INITIAL_TOKENS)
        self._keep_in(KVStorage(n_kv_heads, head_dim, kv_type, device, tokens))

    @property
    def capacity(self) -> int:
        return self.storage.slots

    def _grow(self, needed: int) -> None:
        capacity = self.capacity
        while capacity < needed:
            capacity *= 2
        self.storage.grow(min(capacity, self.max_tokens), self.offset)

    def max_chunk(self) -> int:
        return max(self.max_tokens - self.offset, 0)

    def update_and_fetch(
        self, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        storage = self.storage
        end = self.offset + k.shape[2]
        if end > storage.keys.shape[2]:
            if end > self.max_tokens:
                raise ContextFullError(
                    f"context full: {end} tokens do not fit in a context of {self.max_tokens}"
                )
            self._grow(end)
        storage.write(self.offset, self.key_codec.encode(k), self.value_codec.encode(v))
        self.offset = end
        return storage.read(0, end)

    def tiled_keys(self, rows: int) -> TiledKeys | None:
        return self.storage.tiled_view(rows)

    def decode_keys(self, keys: torch.Tensor, row: int | None = None) -> torch.Tensor:
        return self.storage.decode_keys(keys, row, self.offset - 1)

    def keys_by_own_tile(self, keys: torch.Tensor, rows: int):
        return self.storage.keys_by_own_tile(keys, rows)

    def take_one(self, addresses: bool = False) -> Slots | None:
        at = self.offset
        if at + 1 > self.storage.keys.shape[2]:
            return None  # the storage grows first, in update_and_fetch
        self.offset = at + 1
        return self.storage.take_one(at, 0, at + 1, addresses=addresses)

    def take_rows(self, n: int) -> Slots | None:
        if self.storage.tiles is not None or not self.rows_share_storage(n):
            return None
        at, self.offset = self.offset, self.offset + n
        return Slots(self.storage.read(at, self.offset), self.storage.read(0, self.offset))

    def make_mask(self, n_new: int) -> torch.Tensor | None:
        """Boolean [n_new, offset + n_new]: each query sees keys up to its own position."""
        if n_new == 1:
            return None
        total = self.offset + n_new
        query_pos = torch.arange(self.offset, total).unsqueeze(1)
        return torch.arange(total).unsqueeze(0) <= query_pos

    def can_trim(self, n: int) -> bool:
        return True

    def exact_prefix(self, n: int) -> int:
        return self.storage.exact_slot(n)  # less within a tile: its rows are written again

    def rows_share_storage(self, n_new: int) -> bool:
        """Whether n_new tokens written at once leave each one's decode-step view (every
        key up to its own, unmasked) a prefix of the same storage: unless it must grow."""
        return self.offset + n_new <= self.capacity

    def can_forget(self, start: int) -> bool:
        return self.rope is not None

    def trim(self, n: int) -> int:
        """Drop the newest `n` positions; returns how many were dropped."""
        n = max(0, min(n, self.offset))
        self.offset -= n
        return n

    def clear(self) -> None:
        self.offset = 0
        self.storage.clear()

    def forget(self, start: int, end: int) -> None:
        """Drop positions start..end-1; later keys move down and are re-rotated to match, as
        llama.cpp's context shift does, so nothing is evaluated again."""
        gap = end - start
        if gap <= 0:
            return
        self.storage.close_gap(start, end, self.offset, self.rope)
        self.offset -= gap

    # -- fixed-shape decode steps

    def reserve(self) -> None:
        """Allocate all `max_tokens` now, so the storage never moves again."""
        if self.capacity < self.max_tokens:
            self._grow(self.max_tokens)

    def static_span(self) -> tuple[int, int]:
        return 0, self.max_tokens

    def static_ready(self) -> bool:
        return self.capacity >= self.max_tokens > self.offset  # tiles may round it up

    def static_rows_ready(self, n: int) -> bool:
        return self.static_ready() and self.offset + n <= self.max_tokens

    def static_extent(self) -> int:
        """Slots of the span in use (the newest token's included)."""
        return self.offset

    def advance_one(self) -> StaticStep:
        """Account for one token whose keys and values the caller writes at `write_at`."""
        at = self.offset
        mask = torch.arange(self.max_tokens).unsqueeze(0) <= at
        return StaticStep(at, mask, 0, self.advance_alike())

    def advance_alike(self) -> Callable[[], None] | None:
        at = self.offset
        self.offset += 1
        return self.storage.take_key_row(at)  # tiles: its fp32 row, loaded if need be


class RotatingKVCache(_OnStorage):
    """The first `sinks` tokens plus the most recent `window`, in constant memory.

    Queries attend to the sinks and to the tokens of the last `window` positions (their own
    included). This is StreamingLLM's cache, and with no sinks it is exactly a sliding-window
    layer (Gemma 3's local layers). Positions are handled as StreamingLLM does: distances
    are measured within the cache, so a sink sits right before the window however long the
    stream, and positions never leave the range the model was trained on.

    Storage slots: [sinks at their own positions | sinks rotated into the current frame |
    ring of recent tokens]. Recent keys keep the rotation of their absolute positions, so
    their distances to a query are already right; only the sinks need moving, by the number
    of tokens evicted since (the "frame"), which costs `sinks` rotations per step instead of
    re-rotating the window. Attention reads [frame sinks | ring] as one contiguous block
    (with q4 keys the storage holds the sinks' keys apart, in fp32: see storage.py).

    The ring holds `slack` more tokens than the window: `trim(n)` for n <= slack (speculative
    roll-back) restores exactly the window the trimmed tokens had pushed out, and prompt
    chunks of up to slack + 1 tokens keep every query's full window.
    """

    INITIAL_TOKENS = 256

    def __init__(
        self,
        n_kv_heads: int,
        head_dim: int,
        sinks: int,
        window: int,
        slack: int,
        rope: Rope,
        kv_type: KVSetting = F32,
        device: torch.device | str = "cpu",
    ):
        # Keys and values live on `device`; the bookkeeping (ring positions, masks) stays on
        # the CPU, where it is cheap to build; the model moves masks to the layer's device.
        if window < 1:
            raise ValueError("window must be at least 1")
        if kv_type.key.tiled_keys:
            # Whole tiles in the ring, an even number of them (KeyTiles keeps tile t in half
            # t % 2 of its recent rows, across the wrap too): more slack, never less.
            slack += -(window + slack) % (2 * TILE_ROWS)
        self.sinks, self.window, self.slack, self.rope = sinks, window, slack, rope
        self.ring_capacity = window + slack
        self.offset = 0
        self.sinks_held = 0
        self.ring_count = 0  # tokens held in the ring
        self.ring_head = 0  # ring slot of the next write
        self.wrapped = False  # the ring has overwritten a token (slots are no longer in order)
        self.frame = 0  # positions by which the frame sinks are rotated beyond their own
        allocated = min(self.ring_capacity, self.INITIAL_TOKENS)
        front = 2 * sinks  # the sinks' two copies come before the ring
        self._keep_in(KVStorage(n_kv_heads, head_dim, kv_type, device, front + allocated, front))
        self.ring_pos = torch.full((allocated,), -1, dtype=torch.long)  # -1: empty

    @property
    def lead(self) -> torch.Tensor | None:
        """q4 keys: the sinks' keys in fp32, at their own positions then in the frame."""
        return self.storage.lead

    # -- layout helpers

    @property
    def _allocated(self) -> int:
        return self._allocated_slots

    def _fetch_length(self) -> int:
        ring = self._allocated if self.wrapped else self.ring_count
        return self.sinks_held + ring if self.sinks_held == self.sinks else self.sinks_held

    def _grow(self, allocated: int) -> None:
        keep = 2 * self.sinks + self.ring_count  # the ring is in order until it wraps
        self.storage.grow(2 * self.sinks + allocated, keep)
        positions = torch.full((allocated,), -1, dtype=torch.long)
        positions[: self.ring_count] = self.ring_pos[: self.ring_count]
        self.ring_pos = positions

    @property
    def ring_pos(self) -> torch.Tensor:
        """The position held in each ring slot (int64 [allocated], on the CPU; -1: empty)."""
        return self._ring_pos

    @ring_pos.setter
    def ring_pos(self, positions: torch.Tensor) -> None:
        self._ring_pos = positions
        # The same memory through numpy: a decode step writes one element per layer, ~0.3 us
        # there against ~5 us through torch's indexing.
        self._ring_pos_view = positions.numpy()
        self._allocated_slots = positions.shape[0]  # read by every static step's checks

    # -- the interface

    def max_chunk(self) -> int:
        """Tokens the next update may take while every query in it stays exact: a query's
        window must survive the chunk's own writes (no overwrites, or at most slack + 1
        tokens), and with sinks the frame must not move inside the chunk (it moves on every
        token once the window is full)."""
        room_in_sinks = self.sinks - self.sinks_held
        limit = room_in_sinks + max(self.ring_capacity - self.ring_count, self.slack + 1)
        if self.sinks:
            limit = min(limit, room_in_sinks + max(self.window - self.ring_count, 1))
        return limit

    def _plan(self, n_new: int) -> _Update:
        """Where the next `n_new` tokens go, and the ring's shape afterwards."""
        to_sinks = min(n_new, self.sinks - self.sinks_held)
        rest = n_new - to_sinks
        if rest > self.ring_capacity:
            raise ValueError(f"{rest} tokens at once exceed the ring of {self.ring_capacity}")
        wraps = self.wrapped or self.ring_count + rest > self.ring_capacity
        count = min(self.ring_count + rest, self.ring_capacity)
        allocated = self._allocated
        if not self.wrapped and count > allocated:
            allocated = self._allocation_for(count)
        return _Update(
            to_sinks=to_sinks,
            slots=(self.ring_head + torch.arange(rest)) % self.ring_capacity,
            positions=torch.arange(self.offset + to_sinks, self.offset + n_new),
            ring_count=count,
            wrapped=wraps,
            allocated=allocated,
        )

    def _allocation_for(self, needed: int) -> int:
        allocated = self._allocated
        while allocated < needed:
            allocated *= 2
        return min(allocated, self.ring_capacity)

    def update_and_fetch(
        self, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        n_new = k.shape[2]
        k, v = self.key_codec.encode(k), self.value_codec.encode(v)
        if n_new == 1 and self.sinks_held == self.sinks and self._room_for_one():
            return self._append_one(k, v)  # the decode step, without planning tensors
        plan, storage = self._plan(n_new), self.storage
        to_sinks = plan.to_sinks
        if to_sinks:
            at, sink_k, sink_v = self.sinks_held, k[:, :, :to_sinks], v[:, :, :to_sinks]
            storage.write(at, sink_k, sink_v)  # at their own positions
            storage.write(self.sinks + at, sink_k, sink_v)  # and in the frame (still 0)
            self.sinks_held += to_sinks
        rest = n_new - to_sinks
        if rest:
            if plan.allocated > self._allocated:
                self._grow(plan.allocated)
            ring_k, ring_v = k[:, :, to_sinks:], v[:, :, to_sinks:]
            storage.write_ring(self.ring_head, plan.slots, ring_k, ring_v, self.ring_capacity)
            self.ring_pos[plan.slots] = plan.positions
            self.wrapped, self.ring_count = plan.wrapped, plan.ring_count
            self.ring_head = (self.ring_head + rest) % self.ring_capacity
        else:
            storage.none_in_tiles()
        self.offset += n_new
        self._move_frame()
        return self._fetched()

    def _fetched(self) -> tuple[torch.Tensor, torch.Tensor]:
        """What attention reads: [frame sinks | ring]."""
        return self.storage.read(self.sinks, self.sinks + self._fetch_length())

    def tiled_keys(self, rows: int) -> TiledKeys | None:
        return self.storage.tiled_view(rows, self.sinks, self.sinks_held)

    def decode_keys(self, keys: torch.Tensor, row: int | None = None) -> torch.Tensor:
        ring_head, sinks = self.ring_head, self.sinks
        newest = 2 * sinks + (ring_head - 1) % self.ring_capacity if self.ring_count else -1
        return self.storage.decode_keys(keys, row, newest, sinks, self.sinks_held)

    def keys_by_own_tile(self, keys: torch.Tensor, rows: int):
        return self.storage.keys_by_own_tile(
            keys, rows, self.sinks, self.sinks_held, self.ring_capacity
        )

    def _room_for_one(self) -> bool:
        """One more token fits without growing the storage (it may overwrite the oldest)."""
        return self.ring_count < self._allocated or self._allocated == self.ring_capacity

    def _append_one(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        one = self._one_slot()
        one.slots[0].copy_(k)
        one.slots[1].copy_(v)
        if one.written is not None:
            one.written()
        return one.stored

    def take_one(self, addresses: bool = False) -> Slots | None:
        if self.sinks_held != self.sinks or not self._room_for_one():
            return None
        return self._one_slot(addresses)

    def take_rows(self, n: int) -> Slots | None:
        if self.storage.tiles is not None or not self.rows_share_storage(n):
            return None
        # Before the ring wraps its slots are in order: the n tokens take the next n.
        first = 2 * self.sinks + self.ring_head
        for _ in range(n):
            self._take_slot()
        self._move_frame()  # the frame stays put until the window is full
        return Slots(self.storage.read(first, first + n), self._fetched())

    def _one_slot(self, addresses: bool = False) -> Slots:
        slot = self._take_slot()
        sinks = self.sinks
        if sinks:
            self._move_frame()  # the sinks only: the new token's row is not read
        end = sinks + self._fetch_length()
        return self.storage.take_one(2 * sinks + slot, sinks, end, self.sinks_held, addresses)

    def _take_slot(self) -> int:
        """Bookkeeping of one token entering the ring; returns its slot."""
        slot = self.ring_head
        self._ring_pos_view[slot] = self.offset
        self.ring_head = (slot + 1) % self.ring_capacity
        if self.ring_count < self.ring_capacity:
            self.ring_count += 1
        else:
            self.wrapped = True
        self.offset += 1
        return slot

    def _move_frame(self) -> None:
        """Rotate the sinks so that they sit right before the newest query's window."""
        if not self.sinks_held:
            return
        frame = self._frame_needed()
        if frame != self.frame:  # from their own positions' keys, stored once
            self.storage.rotate_keys(0, self.sinks, self.sinks_held, self.rope, frame)
            self.frame = frame

    def _frame_needed(self) -> int:
        # The ring holds contiguous positions ending at the newest; the newest query sees the
        # last `window` of them, so its position within the cache is sinks + visible - 1.
        newest = self.offset - 1
        visible = min(self.window, self.ring_count)
        return newest - (self.sinks_held + visible - 1)

    def make_mask(self, n_new: int) -> torch.Tensor | None:
        """Boolean [n_new, keys fetched] for the next update of `n_new` tokens: each query
        sees the sinks up to its own position and the ring tokens within its window."""
        if n_new == 1 and self.sinks_held == self.sinks and self._room_for_one():
            return self._mask_one()
        plan = self._plan(n_new)
        if n_new == 1 and plan.ring_count <= self.window and not plan.wrapped:
            return None
        query_pos = torch.arange(self.offset, self.offset + n_new).unsqueeze(1)
        sinks_after = self.sinks_held + plan.to_sinks
        sinks_visible = torch.arange(sinks_after).unsqueeze(0) <= query_pos
        if sinks_after < self.sinks:
            return sinks_visible  # the ring is still empty
        ring_pos = torch.full((plan.allocated,), -1, dtype=torch.long)
        ring_pos[: self._allocated] = self.ring_pos
        ring_pos[plan.slots] = plan.positions
        if not plan.wrapped:
            ring_pos = ring_pos[: plan.ring_count]
        ring_pos = ring_pos.unsqueeze(0)
        in_window = (ring_pos >= 0) & (ring_pos <= query_pos) & (query_pos - ring_pos < self.window)
        return torch.cat([sinks_visible, in_window], dim=1)

    def can_trim(self, n: int) -> bool:
        """Whether dropping the newest n leaves the next query its whole window: after a
        wrap, the tokens they pushed out are gone (the slack keeps `slack` of them)."""
        return not self.wrapped or n <= self.ring_count - self.window + 1

    def exact_prefix(self, n: int) -> int:
        if n <= self.sinks:
            return n  # the sinks' keys are held whole (in fp32 with q4 keys)
        at = 2 * self.sinks + (n - self.sinks) % self.ring_capacity  # the slot written next
        return n - (at - self.storage.exact_slot(at))

    def rows_share_storage(self, n_new: int) -> bool:
        """As KVCache's: while the window is not full, nothing is masked, the frame stays
        put and the ring is in order, so decode-step views are prefixes of one storage."""
        return (
            self.sinks_held == self.sinks
            and not self.wrapped
            and self.ring_count + n_new <= min(self.window, self._allocated)
        )

    def can_forget(self, start: int) -> bool:
        # A trim just after the first wrap can leave emptied slots inside the ordered ring.
        in_order = bool((self.ring_pos[: self.ring_count] >= 0).all())
        return not self.wrapped and start >= self.sinks_held and in_order

    def _mask_one(self) -> torch.Tensor | None:
        """The decode step's mask: None while every held token is in the window."""
        if not self.wrapped and self.ring_count < self.window:
            return None
        query = self.offset
        positions = self.ring_pos.clone()
        positions[self.ring_head] = query
        if not self.wrapped:
            positions = positions[: self.ring_count + 1]
        # Empty slots hold -1, which is never inside a window that is already full.
        in_window = positions > query - self.window
        sinks = torch.ones(self.sinks, dtype=torch.bool)
        return torch.cat([sinks, in_window]).unsqueeze(0)

    def trim(self, n: int) -> int:
        """Drop the newest n positions. Exact across a wrap while `can_trim(n)`: the older
        tokens they overwrote were outside every remaining query's window."""
        n = max(0, min(n, self.offset))
        if n == 0:
            return 0  # every draft accepted: a verification's usual end, kept cheap
        from_ring = max(0, min(n, self.offset - self.sinks, self.ring_count))
        for back in range(1, from_ring + 1):  # a few slots: numpy's view, not torch indexing
            self._ring_pos_view[(self.ring_head - back) % self.ring_capacity] = -1
        self.ring_head = (self.ring_head - from_ring) % self.ring_capacity
        self.sinks_held -= n - from_ring
        self.offset -= n
        # Leave the ring as a cache that never held the trimmed tokens would be: tokens ever
        # put in the ring are offset - sinks_held (forget only runs before the first wrap),
        # so that decides whether it has wrapped and how full it is. Slots the trimmed
        # tokens overwrote stay empty (-1): their old tokens were outside every window.
        ever_in_ring = self.offset - self.sinks_held
        self.wrapped = ever_in_ring > self.ring_capacity
        self.ring_count = min(ever_in_ring, self.ring_capacity)
        if self.ring_count == 0 and not self.wrapped:
            self.ring_head = 0
        if self.offset:
            self._move_frame()  # the sinks back where the newest remaining query needs them
        return n

    def clear(self) -> None:
        """Empty, as a new cache: stale storage is never read (nothing maps to it)."""
        self.offset = self.sinks_held = self.ring_count = self.ring_head = self.frame = 0
        self.wrapped = False
        self.ring_pos.fill_(-1)
        self.storage.clear()

    def forget(self, start: int, end: int) -> None:
        """Drop positions start..end-1 (after the sinks) and close the gap, re-rotating the
        later keys; only before the ring first wraps, while positions are still in order."""
        gap = end - start
        if gap <= 0:
            return
        if self.wrapped or start < self.sinks_held:
            raise ContextFullError("cannot drop tokens from a cache that has already rotated")
        lo, hi = start - self.sinks, end - self.sinks  # ring slots, in order before a wrap
        count, front = self.ring_count, 2 * self.sinks
        self.storage.close_gap(front + lo, front + hi, front + count, self.rope, self.ring_capacity)
        self.ring_pos[lo : count - gap] = self.ring_pos[hi:count] - gap
        self.ring_pos[count - gap : count] = -1
        self.ring_count -= gap
        self.ring_head = self.ring_count
        self.offset -= gap

    # -- fixed-shape decode steps

    def reserve(self) -> None:
        """Allocate the whole ring now, so the storage never moves again."""
        if self._allocated < self.ring_capacity:
            self._grow(self.ring_capacity)

    def static_span(self) -> tuple[int, int]:
        """[frame sinks | whole ring], as `update_and_fetch` reads once the ring is full."""
        return self.sinks, self.sinks + self.ring_capacity

    def static_ready(self) -> bool:
        return self.sinks_held == self.sinks and self._allocated == self.ring_capacity

    def static_rows_ready(self, n: int) -> bool:
        """A later row of the step overwrites the slot of the position `ring_capacity`
        before its own, which an earlier row sees only if they are more than `slack` apart.
        Sinks are rotated into one frame per step, and the frame moves with every token
        once the ring holds more than the window."""
        if not self.static_ready():
            return False
        if self.sinks:
            return self.ring_count + n <= self.window
        return n <= self.slack + 1

    def static_extent(self) -> int:
        """Slots of the span in use (the newest token's included): the ring fills in order
        until it wraps."""
        return self.sinks + (self.ring_capacity if self.wrapped else self.ring_count)

    def advance_one(self) -> StaticStep:
        """Account for one token whose keys and values the caller writes at `write_at`, and
        whose step re-rotates the sinks by `frame` (`self.frame` already says so)."""
        at = 2 * self.sinks + self.ring_head
        written = self.advance_alike()
        # Empty slots hold -1; the new token's own slot is already recorded. Written into
        # one buffer through numpy: one operation, where torch took six (a host cost each
        # step and sequence).
        oldest_seen = max(self.offset - 1 - self.window, -1)
        mask, ring_seen = self._step_mask()
        np.greater(self._ring_pos_view, oldest_seen, out=ring_seen)
        return StaticStep(at, mask, self.frame, written)

    def _step_mask(self) -> tuple[torch.Tensor, np.ndarray]:
        """The buffer `advance_one` writes its mask into, bool [1, sinks + ring]: the sinks
        always seen; and the ring's part of it, as numpy."""
        mask = getattr(self, "_mask", None)
        if mask is None or mask.shape[1] != self.sinks + len(self._ring_pos_view):
            size = self.sinks + len(self._ring_pos_view)
            mask = self._mask = torch.ones(1, size, dtype=torch.bool)
            self._mask_ring = mask.numpy()[0, self.sinks :]
        return mask, self._mask_ring

    def advance_alike(self) -> Callable[[], None] | None:
        """`advance_one`'s bookkeeping alone, for a layer whose step another cache of its
        kind has described (they hold the same positions): it runs for every layer on the
        host's path between two steps of a GPU, once a layer and sequence, so `_take_slot`
        and `_frame_needed` are written out here (a call costs as much as their work).
        Returns the step's `written` (q4 tiles)."""
        slot = self.ring_head
        self._ring_pos_view[slot] = newest = self.offset
        self.offset = newest + 1
        self.ring_head = 0 if slot + 1 == self.ring_capacity else slot + 1
        if self.ring_count < self.ring_capacity:
            self.ring_count += 1
        else:
            self.wrapped = True
        if self.sinks:
            visible = self.window if self.window < self.ring_count else self.ring_count
            self.frame = newest - (self.sinks_held + visible - 1)
        if self.key_tiles is None:
            return None
        return self.storage.take_key_row(2 * self.sinks + slot)


def common_prefix(a: Sequence, b: Sequence) -> int:
    """How many leading items (tokens, or any comparable units) a and b share."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def reusable_length(caches: Sequence[Cache], held: Sequence[int], prompt: Sequence[int]) -> int:
    """How many leading tokens of `prompt` caches that hold `held` can keep: the shared
    prefix, less at least the prompt's last token (its logits are needed), if every cache
    can trim back to it (a rotated ring cannot bring back what it pushed out); else 0."""
    shared = min(common_prefix(held, prompt), len(prompt) - 1)
    shared = min((cache.exact_prefix(shared) for cache in caches), default=shared)
    if all(cache.can_trim(len(held) - shared) for cache in caches):
        return shared
    return 0


def keep_first(caches: Sequence[Cache], n: int) -> None:
    """Keep the first n positions of every cache. Each is trimmed by its own offset: a step
    cut short (Ctrl-C inside a forward pass) leaves the first layers one token ahead."""
    if n == 0:  # a rotated ring cannot be trimmed back to empty; cleared, it keeps its storage
        for cache in caches:
            cache.clear()
    for cache in caches:
        cache.trim(cache.offset - n)
