"""The fp32 side of keys stored as q4 tiles (kv_types.py, "q4 keys").

A tile is TILE_ROWS consecutive storage rows (cache positions, or ring slots) of one kv
head; only complete tiles are stored quantized. The newest rows, which every query attends
to the most, stay exact: the two newest tiles' rows are kept here in fp32 (`recent`, tile t
in half t % 2), and a query reads its own tile from them. A tile is encoded into the storage
when its last row is written, from these exact rows, so writing rows one at a time or many
at once stores the same bits. Keeping the tile before the newest too means a speculative
roll-back across a tile boundary finds its rows still exact.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from ...native.attention import TiledKeys
from .codec import TILE_ROWS, decode_tiles, encode_tiles


class KeyTiles:
    """One cache's newest key rows in fp32, and the encoding of its tiles into the storage.
    `region` arguments are the storage's tiled rows, [1, kv_heads, slots, width]."""

    def __init__(self, heads: int, head_dim: int, device: torch.device):
        self.head_dim = head_dim
        self.recent = torch.zeros((heads, 2 * TILE_ROWS, head_dim), device=device)
        self.held = [-1, -1]  # the tile whose rows each half holds (-1: none)
        self.own_tiles = torch.full((0,), -1, dtype=torch.int32)  # of the last write's rows
        # The last write of several rows, exactly: (its first tile's first slot, and rows
        # [kv_heads, n, head_dim] from there: that tile's earlier rows, then the written).
        self.written: tuple[int, torch.Tensor] | None = None
        self._own_one = torch.zeros(1, dtype=torch.int32)  # a decode step's own tile
        self.native = None
        if device.type == "cpu":
            from ..platform.kernels import cpu_kv_codec  # lazily: it loads the native library

            self.native = cpu_kv_codec()

    def clear(self) -> None:
        self.held = [-1, -1]

    def trims_exactly_to(self, slot: int) -> bool:
        """Whether keys cut back so that `slot` is written next stay as a cache that never
        held the rest would hold them: the slot starts a tile, or its tile's earlier rows
        are still here in fp32 (a tile's rows decoded from its q4 codes are not the rows
        its queries read while it was open)."""
        tile = slot // TILE_ROWS
        return slot % TILE_ROWS == 0 or self.held[tile % 2] == tile

    def write(
        self, region: torch.Tensor, first_slot: int, k: torch.Tensor, ring: int | None = None
    ) -> None:
        """Store fp32 keys k [1, kv_heads, n, head_dim] at slots first_slot, first_slot + 1, ...
        (mod `ring`, a multiple of 2 * TILE_ROWS, for a ring), encoding every tile they
        complete."""
        n, own = k.shape[2], []
        self.written = None
        if n > 1:  # what a prompt chunk's queries read their own tiles from (by_own_tile)
            slot = first_slot if ring is None else first_slot % ring
            tile, row = divmod(slot, TILE_ROWS)
            half = self._open(region, tile)
            earlier = self.recent[:, half : half + row]
            self.written = (tile * TILE_ROWS, torch.cat([earlier, k[0].float()], dim=1))
        done = 0
        while done < n:
            slot = first_slot + done if ring is None else (first_slot + done) % ring
            tile, row = divmod(slot, TILE_ROWS)
            take = min(n - done, TILE_ROWS - row)
            half = self._open(region, tile)
            self.recent[:, half + row : half + row + take] = k[0, :, done : done + take]
            own.extend([tile] * take)
            if row + take == TILE_ROWS:
                self._encode(region, tile)
            done += take
        # A row's own tile is read from `recent` only while it is still there.
        held = torch.tensor(own, dtype=torch.int32)
        self.own_tiles = torch.where(
            (held == self.held[0]) | (held == self.held[1]), held, torch.full_like(held, -1)
        )

    def take(
        self, region: torch.Tensor, slot: int
    ) -> tuple[torch.Tensor, Callable[[], None] | None]:
        """A decode step's key row at `slot`, for a caller that writes the key itself (the
        fused native layer): the fp32 row [1, kv_heads, 1, head_dim] of `recent`, and what
        to call once it is written (None: the row completes no tile)."""
        tile, row = divmod(slot, TILE_ROWS)
        half = self._open(region, tile)
        self._own_one[0] = tile
        self.own_tiles, self.written = self._own_one, None
        key_row = self.recent[None, :, half + row : half + row + 1]
        if row < TILE_ROWS - 1:
            return key_row, None
        return key_row, lambda: self._encode(region, tile)

    def _open(self, region: torch.Tensor, tile: int) -> int:
        """The row of `recent` where tile's rows start, loading them from the storage when
        this half holds another tile (a ring overwriting an older lap's tile, whose other
        rows are still visible, or a roll-back past the two newest tiles)."""
        half = tile % 2
        if self.held[half] != tile:
            rows = region[:, :, tile * TILE_ROWS : (tile + 1) * TILE_ROWS]
            self.recent[:, half * TILE_ROWS : (half + 1) * TILE_ROWS] = self._decode(rows)[0]
            self.held[half] = tile
        return half * TILE_ROWS

    def decode(self, stored: torch.Tensor) -> torch.Tensor:
        """Tiles [1, kv_heads, tiles * TILE_ROWS, width] -> fp32 [1, kv_heads, rows, head_dim]."""
        return self._decode(stored).reshape(*stored.shape[:3], self.head_dim)

    def _encode(self, region: torch.Tensor, tile: int) -> None:
        half = tile % 2
        rows = self.recent[None, :, half * TILE_ROWS : (half + 1) * TILE_ROWS]
        into = region[:, :, tile * TILE_ROWS : (tile + 1) * TILE_ROWS]
        if self.native is not None:
            self.native.encode_tiles(rows, into)
        else:
            into.copy_(encode_tiles(rows))

    def _decode(self, stored: torch.Tensor) -> torch.Tensor:
        if self.native is not None:
            return self.native.decode_tiles(stored, self.head_dim)
        return decode_tiles(stored, self.head_dim)

    def decoded(
        self, region: torch.Tensor, used: int, lead: torch.Tensor | None, own_tile: int
    ) -> torch.Tensor:
        """fp32 [1, kv_heads, lead + used, head_dim]: the lead rows, then the first `used`
        slots as a query whose own tile is `own_tile` reads them (as the native kernel does:
        complete tiles decoded, the own tile's rows exact)."""
        whole = -(-used // TILE_ROWS) * TILE_ROWS
        keys = self.decode(region[:, :, :whole])
        if 0 <= own_tile and own_tile in self.held and own_tile * TILE_ROWS < whole:
            half, at = own_tile % 2, own_tile * TILE_ROWS
            keys[0, :, at : at + TILE_ROWS] = self.recent[:, half * TILE_ROWS :][:, :TILE_ROWS]
        keys = keys[:, :, :used]
        return keys if lead is None else torch.cat([lead.float(), keys], dim=2)

    def by_own_tile(
        self,
        region: torch.Tensor,
        used: int,
        lead: torch.Tensor | None,
        rows: int,
        ring: int | None = None,
    ) -> Iterator[tuple[int, int, torch.Tensor]]:
        """The last write's final `rows` rows in groups that share an own tile: (first row,
        end row, fp32 keys [1, kv_heads, lead + used, head_dim] as those rows read them:
        complete tiles decoded, their own tile exact). The keys are one tensor, changed
        between groups: use each before taking the next."""
        if self.written is None:  # one row (or none in the ring): as decode steps read
            yield 0, rows, self.decoded(region, used, lead, self.own_tile(-1, -1) if rows else -1)
            return
        keys = self.decoded(region, used, lead, -1)
        at_lead = 0 if lead is None else lead.shape[2]
        start, exact = self.written
        first_row = rows - self.own_tiles.shape[0]  # rows before these went to a ring's sinks
        if first_row > 0:
            yield 0, first_row, keys
        done = 0
        earlier = exact.shape[1] - self.own_tiles.shape[0]  # the first tile's older rows
        while done < self.own_tiles.shape[0]:
            slot = start + earlier + done
            slot = slot if ring is None else slot % ring
            tile, row = divmod(slot, TILE_ROWS)
            take = min(self.own_tiles.shape[0] - done, TILE_ROWS - row)
            # Rows [tile start, row + take) of this tile, exact, from the write's record.
            source = exact[:, earlier + done - row : earlier + done + take]
            at = at_lead + tile * TILE_ROWS
            saved = keys[0, :, at : at + source.shape[1]].clone()
            keys[0, :, at : at + source.shape[1]] = source
            yield first_row + done, first_row + done + take, keys
            keys[0, :, at : at + source.shape[1]] = saved
            done += take

    def own_tile(self, row: int | None, newest_slot: int) -> int:
        """The own tile of the last write's row `row`, or (None) of the newest slot."""
        if row is None:
            return newest_slot // TILE_ROWS if newest_slot >= 0 else -1
        return int(self.own_tiles[row]) if self.own_tiles.shape[0] else -1

    def for_kernel(self, lead: torch.Tensor | None, rows: int) -> TiledKeys:
        """What the native attention reads besides the tiles, for the last write's final
        `rows` rows (lead: [1, kv_heads, lead_rows, head_dim] fp32, or None)."""
        own = self.own_tiles[-rows:]
        if own.shape[0] < rows:  # the first rows went to a ring's sinks: lead rows, no tile
            own = torch.cat([torch.full((rows - own.shape[0],), -1, dtype=torch.int32), own])
        return TiledKeys(None if lead is None else lead[0], self.recent, own)
