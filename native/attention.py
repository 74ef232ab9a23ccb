"""Decode-shaped attention of `attention.cpp`, from Python, and the codecs of the KV storage
it reads (`kv_codec.cpp`, the layouts in `kv_codec.h`).

A few query rows, each over its own keys: the first `lengths[r]` of them, or those its mask
row marks (`__call__`), or each over another sequence's cache (`sequences`, a batch's decode
steps). Used for decode steps, speculative verification and batches on the CPU, where every
row must come out exactly as it would alone. Keys and values are read as the cache stores
them (engine/kv/types.py: f32, f16, bf16, q8, q4), never dequantized into a copy first. See
`reference.py` for the same in plain torch.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from .int4 import Library

MAX_GROUP = 16  # query heads per kv head the kernel takes
MAX_HEAD_DIM = 512
Q4_TILES = 5  # the kernel's type number for keys stored as q4 tiles
TILE_ROWS = 32  # tokens a tile (kTileRows)
# The kernel's KV types of a call: a KVType.code for keys and values alike, or (key, value).
KernelTypes = int | tuple[int, int]


@dataclass(frozen=True)
class TiledKeys:
    """What a call over keys stored as q4 tiles reads besides the tiles (common.h,
    RowKeys): keys 0..lead_rows-1 are `lead`'s rows, the rest the tiles' rows in order, except
    that a row's own tile comes from `recent` (tile t's row i at (t % 2) * TILE_ROWS + i)."""

    lead: torch.Tensor | None  # fp32 [kv_heads, lead_rows, head_dim] (a ring's sinks), or None
    recent: torch.Tensor  # fp32 [kv_heads, 2 * TILE_ROWS, head_dim]: the newest tiles' rows
    own_tiles: torch.Tensor  # int32 [rows]: each query row's own tile (-1: none)

    @property
    def lead_rows(self) -> int:
        return 0 if self.lead is None else self.lead.shape[1]

    def check(self, tiles: torch.Tensor, reach: torch.Tensor) -> None:
        """A one-line error unless the kernel can read these with `tiles` [kv_heads, tokens,
        width] for query rows that see keys up to reach[r] (exclusive, lead rows counted):
        fp32 rows, contiguous, and only complete tiles read from storage (an incomplete last
        tile must be the own tile of every row that sees into it)."""
        rows = reach.shape[0]
        for part in (self.lead, self.recent):
            if part is not None and (part.dtype != torch.float32 or not _rows_packed(part)):
                raise ValueError("lead and recent keys must be fp32 with contiguous rows")
        if self.recent.shape[1] != 2 * TILE_ROWS or self.own_tiles.shape != (rows,):
            raise ValueError("recent keys hold two tiles, and each row names its own tile")
        last = tiles.shape[1] // TILE_ROWS
        sees_last = reach > self.lead_rows + last * TILE_ROWS
        if tiles.shape[1] % TILE_ROWS and bool((sees_last & (self.own_tiles != last)).any()):
            raise ValueError("an incomplete last tile must be every row's own")


class NativeAttention:
    def __init__(self, library: Library):
        function = library.cdll.miniapp_attend_rows
        i64, ptr, i32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
        function.argtypes = [
            ptr,
            ptr,
            ptr,
            i32,
            i32,
            i64,
            i64,
            ptr,
            ptr,
            i64,
            i64,
            i64,
            i64,
            i64,
            ctypes.c_float,
            ptr,
            i64,
            i64,
            ptr,
            i64,
            ptr,
            ptr,
            i32,
        ]
        function.restype = i32
        self._attend = function
        sequences = library.cdll.miniapp_attend_sequences
        sequences.argtypes = [
            ptr,
            ptr,
            ptr,
            ptr,
            ptr,
            ptr,
            ptr,
            ptr,
            ptr,
            i64,
            i64,
            i64,
            i64,
            ctypes.c_float,
            ptr,
            ptr,
            ptr,
            ptr,
            ptr,
            ptr,
            ptr,
            i32,
        ]
        sequences.restype = i32
        self._attend_sequences = sequences

    @staticmethod
    def takes(n_heads: int, n_kv_heads: int, head_dim: int) -> bool:
        """Whether the kernel handles these head shapes."""
        group, rest = divmod(n_heads, n_kv_heads)
        return not rest and group <= MAX_GROUP and head_dim % 8 == 0 and head_dim <= MAX_HEAD_DIM

    def __call__(
        self,
        queries: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        scale: float,
        lengths: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
        kv_type: KernelTypes = 0,
        out: torch.Tensor | None = None,
        tiled: TiledKeys | None = None,
    ) -> torch.Tensor:
        """queries fp32 [rows, heads, head_dim] (contiguous); keys and values stored as
        `kv_type` (a KVType.code for both, or (key code, value code)) [kv_heads, tokens,
        width] with contiguous rows. Each row sees the keys its mask row marks (bool [rows,
        tokens]), else its first lengths[r] (int32 [rows]), else all of them. Returns fp32
        [rows, heads, head_dim] (written into `out` when given, as tests do to catch
        unwritten values). Keys stored as q4 tiles (Q4_TILES) need `tiled`, whose lead rows
        come first among the keys that masks and lengths count."""
        rows, n_heads, head_dim = queries.shape
        kv_heads, tokens, _ = keys.shape
        key_type, value_type = _codes(kv_type)
        lead_rows = tiled.lead_rows if key_type == Q4_TILES and tiled is not None else 0
        _check_layout(keys, values, lead_rows)
        lead_ptr = recent_ptr = own_ptr = None
        lead_stride = recent_stride = 0
        if key_type == Q4_TILES:
            if tiled is None:
                raise ValueError("keys stored as q4 tiles need their lead and recent rows")
            tiled.check(keys, _reach(rows, tokens + lead_rows, lengths, mask))
            if tiled.lead is not None:
                lead_ptr, lead_stride = tiled.lead.data_ptr(), tiled.lead.stride(0)
            recent_ptr, recent_stride = tiled.recent.data_ptr(), tiled.recent.stride(0)
            own = tiled.own_tiles.to(torch.int32).contiguous()
            own_ptr = own.data_ptr()
            tokens += lead_rows
        out = torch.empty_like(queries) if out is None else out
        mask_ptr = lengths_ptr = None
        if mask is not None:
            mask = mask.view(torch.uint8) if mask.dtype is torch.bool else mask.to(torch.uint8)
            mask = mask.contiguous()
            mask_ptr = mask.data_ptr()
        elif lengths is not None:
            if lengths.dtype is not torch.int32:
                lengths = lengths.to(torch.int32)
            lengths_ptr = lengths.contiguous().data_ptr()
        status = self._attend(
            queries.data_ptr(),
            keys.data_ptr(),
            values.data_ptr(),
            key_type,
            value_type,
            _head_bytes(keys),
            _head_bytes(values),
            lengths_ptr,
            mask_ptr,
            tokens,
            rows,
            n_heads,
            kv_heads,
            head_dim,
            scale,
            lead_ptr,
            lead_rows,
            lead_stride,
            recent_ptr,
            recent_stride,
            own_ptr,
            out.data_ptr(),
            torch.get_num_threads(),
        )
        if status:
            raise ValueError(f"native attention refused queries {tuple(queries.shape)}")
        return out

    def sequences(
        self,
        queries: torch.Tensor,
        keys: list[torch.Tensor],
        values: list[torch.Tensor],
        scale: float,
        masks: list[torch.Tensor | None],
        kv_types: list[KernelTypes] | None = None,
        tiled: list[TiledKeys | None] | None = None,
    ) -> torch.Tensor:
        """Rows of different sequences in one call (a batch's decode steps): queries fp32
        [rows, heads, head_dim] (contiguous); row r attends over keys[r] and values[r],
        stored as kv_types[r] (as in `__call__`; default: f32) [kv_heads, tokens_r, width]
        with contiguous rows, seeing the keys masks[r] marks (bool [tokens_r]) or,
        for None, all of them. Each row comes out bit-identical to the same row in a call of
        its own. Rows over q4 tiles need their `tiled[r]` (for one row), whose lead rows
        count among the keys a mask marks. fp32 [rows, heads, head_dim]."""
        rows, n_heads, head_dim = queries.shape
        if not len(keys) == len(values) == len(masks) == rows:
            raise ValueError("one key, value and mask source per row")
        kv_heads = keys[0].shape[0] if rows else 1
        held = []  # the masks' byte copies, alive until the call returns
        key_ptrs, value_ptrs, key_strides, value_strides, counts, mask_ptrs = ([] for _ in range(6))
        codes = [_codes(t) for t in ([0] * rows if kv_types is None else kv_types)]
        tiled = [None] * rows if tiled is None else tiled
        tile_args = _TileArrays(rows)
        for r, (k, v, mask) in enumerate(zip(keys, values, masks, strict=True)):
            lead_rows = 0
            if codes[r][0] == Q4_TILES:
                if tiled[r] is None:
                    raise ValueError("keys stored as q4 tiles need their lead and recent rows")
                lead_rows = tiled[r].lead_rows
                row_mask = None if mask is None else mask.reshape(1, -1)
                tiled[r].check(k, _reach(1, k.shape[1] + lead_rows, None, row_mask))
                tile_args.put(r, tiled[r])
            _check_layout(k, v, lead_rows)
            if k.shape[0] != kv_heads:
                raise ValueError("every row needs the same number of kv heads")
            key_ptrs.append(k.data_ptr())
            value_ptrs.append(v.data_ptr())
            key_strides.append(_head_bytes(k))
            value_strides.append(_head_bytes(v))
            counts.append(k.shape[1] + lead_rows)
            if mask is None:
                mask_ptrs.append(None)
                continue
            if mask.shape[-1] != k.shape[1] + lead_rows:
                raise ValueError("a mask marks each of its row's keys")
            as_bytes = mask.reshape(-1).to(torch.uint8).contiguous()
            held.append(as_bytes)
            mask_ptrs.append(as_bytes.data_ptr())
        out = torch.empty_like(queries)
        pointers = ctypes.c_void_p * max(rows, 1)
        int64s, int32s = ctypes.c_int64 * max(rows, 1), ctypes.c_int32 * max(rows, 1)
        status = self._attend_sequences(
            queries.data_ptr(),
            pointers(*key_ptrs),
            pointers(*value_ptrs),
            int32s(*(c[0] for c in codes)),
            int32s(*(c[1] for c in codes)),
            int64s(*key_strides),
            int64s(*value_strides),
            int64s(*counts),
            pointers(*mask_ptrs),
            rows,
            n_heads,
            kv_heads,
            head_dim,
            scale,
            *tile_args.arguments(),
            out.data_ptr(),
            torch.get_num_threads(),
        )
        if status:
            raise ValueError(f"native attention refused queries {tuple(queries.shape)}")
        return out


class _TileArrays:
    """The per-row tile arguments of miniapp_attend_sequences (null when no row is tiled)."""

    def __init__(self, rows: int):
        self.rows, self.used = rows, False
        self.leads, self.recents = [None] * rows, [None] * rows
        self.lead_rows, self.lead_strides = [0] * rows, [0] * rows
        self.recent_strides, self.own = [0] * rows, [-1] * rows

    def put(self, row: int, tiled: TiledKeys) -> None:
        self.used = True
        if tiled.lead is not None:
            self.leads[row], self.lead_strides[row] = tiled.lead.data_ptr(), tiled.lead.stride(0)
            self.lead_rows[row] = tiled.lead_rows
        self.recents[row] = tiled.recent.data_ptr()
        self.recent_strides[row] = tiled.recent.stride(0)
        self.own[row] = int(tiled.own_tiles[0])

    def arguments(self) -> tuple:
        if not self.used:
            return (None,) * 6
        n = max(self.rows, 1)
        pointers, int64s = ctypes.c_void_p * n, ctypes.c_int64 * n
        return (
            pointers(*self.leads),
            int64s(*self.lead_rows),
            int64s(*self.lead_strides),
            pointers(*self.recents),
            int64s(*self.recent_strides),
            (ctypes.c_int32 * n)(*self.own),
        )


def _reach(rows: int, keys: int, lengths, mask) -> torch.Tensor:
    """One past the last key each row sees."""
    if mask is not None:
        seen = mask.reshape(rows, keys).bool()
        last = keys - seen.flip(-1).int().argmax(-1)
        return torch.where(seen.any(-1), last, torch.zeros_like(last))
    if lengths is not None:
        return torch.as_tensor(lengths).reshape(rows)
    return torch.full((rows,), keys)


def _codes(kv_type: KernelTypes) -> tuple[int, int]:
    return (kv_type, kv_type) if isinstance(kv_type, int) else tuple(kv_type)


def _rows_packed(stored: torch.Tensor) -> bool:
    return stored.stride(2) == 1 and stored.stride(1) == stored.shape[2]


def _check_layout(keys: torch.Tensor, values: torch.Tensor, lead_rows: int = 0) -> None:
    """Keys and values of the same heads and tokens (the values of tiled keys' lead rows
    first), with contiguous rows."""
    same = keys.shape[0] == values.shape[0] and keys.shape[1] + lead_rows == values.shape[1]
    if not same or not (_rows_packed(keys) and _rows_packed(values)):
        raise ValueError("keys and values need the same heads and tokens, with contiguous rows")


def _head_bytes(stored: torch.Tensor) -> int:
    return stored.stride(0) * stored.element_size()


class NativeKVCodec:
    """fp32 rows into a KV type's storage and back, as engine/kv/types.py does in torch
    (bit for bit), for the caches on the CPU."""

    def __init__(self, library: Library):
        i64, ptr, i32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
        self._encode = library.cdll.miniapp_kv_encode
        self._encode.argtypes = [i32, ptr, i64, i64, i64, i64, i64, ptr]
        self._encode.restype = i32
        self._decode = library.cdll.miniapp_kv_decode
        self._decode.argtypes = [i32, ptr, i64, i64, i64, i64, ptr, i32]
        self._decode.restype = i32
        self._encode_tiles = library.cdll.miniapp_kv_encode_tiles
        self._encode_tiles.argtypes = [ptr, i64, i64, i64, i64, i64, ptr, i64]
        self._encode_tiles.restype = i32
        self._decode_tiles = library.cdll.miniapp_kv_decode_tiles
        self._decode_tiles.argtypes = [ptr, i64, i64, i64, i64, ptr]
        self._decode_tiles.restype = i32

    def encode(self, kind: int, x: torch.Tensor, width: int, dtype: torch.dtype) -> torch.Tensor:
        """x fp32 [1, heads, tokens, head_dim] (any strides, values contiguous) -> storage
        [1, heads, tokens, width] of `dtype`, contiguous."""
        _, heads, tokens, head_dim = x.shape
        if x.stride(3) != 1:
            x = x.contiguous()
        out = torch.empty((1, heads, tokens, width), dtype=dtype)
        status = self._encode(
            kind, x.data_ptr(), heads, tokens, x.stride(1), x.stride(2), head_dim, out.data_ptr()
        )
        if status:
            raise ValueError(f"native KV codec refused type {kind} with head_dim {head_dim}")
        return out

    def decode(
        self, kind: int, stored: torch.Tensor, head_dim: int, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """storage [1, heads, tokens, width] (token rows contiguous) -> fp32 [1, heads,
        tokens, head_dim], contiguous (into `out` when given)."""
        _, heads, tokens, width = stored.shape
        if stored.stride(3) != 1 or stored.stride(2) != width:
            stored = stored.contiguous()
        if out is None:
            out = torch.empty((1, heads, tokens, head_dim), dtype=torch.float32)
        status = self._decode(
            kind,
            stored.data_ptr(),
            heads,
            tokens,
            _head_bytes(stored[0]),
            head_dim,
            out.data_ptr(),
            torch.get_num_threads(),
        )
        if status:
            raise ValueError(f"native KV codec refused type {kind} with head_dim {head_dim}")
        return out

    def encode_tiles(self, x: torch.Tensor, out: torch.Tensor) -> None:
        """x fp32 [1, heads, tiles * TILE_ROWS, head_dim] (values contiguous) -> q4 tiles,
        written into `out` [1, heads, tiles * TILE_ROWS, width] uint8 (token rows
        contiguous; a view of a cache's storage)."""
        _, heads, tokens, head_dim = x.shape
        if x.stride(3) != 1:
            x = x.contiguous()
        if tokens % TILE_ROWS or out.shape[:3] != x.shape[:3] or not _rows_packed(out[0]):
            raise ValueError("q4 tiles take whole tiles of rows into contiguous rows")
        status = self._encode_tiles(
            x.data_ptr(),
            heads,
            tokens // TILE_ROWS,
            x.stride(1),
            x.stride(2),
            head_dim,
            out.data_ptr(),
            _head_bytes(out[0]),
        )
        if status:
            raise ValueError(f"native KV codec refused q4 tiles with head_dim {head_dim}")

    def decode_tiles(self, stored: torch.Tensor, head_dim: int) -> torch.Tensor:
        """q4 tiles [1, heads, tiles * TILE_ROWS, width] (token rows contiguous) -> fp32
        [1, heads, tiles * TILE_ROWS, head_dim], contiguous."""
        _, heads, tokens, _ = stored.shape
        if tokens % TILE_ROWS or not _rows_packed(stored[0]):
            raise ValueError("q4 tiles decode whole tiles of contiguous rows")
        out = torch.empty((1, heads, tokens, head_dim), dtype=torch.float32)
        status = self._decode_tiles(
            stored.data_ptr(),
            heads,
            tokens // TILE_ROWS,
            _head_bytes(stored[0]),
            head_dim,
            out.data_ptr(),
        )
        if status:
            raise ValueError(f"native KV codec refused q4 tiles with head_dim {head_dim}")
        return out
