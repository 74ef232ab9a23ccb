"""How attention is computed once a layer knows which rows attend which stored keys: one
backend per device, with the same three calls. `Attention` (decoder.py) picks one per call:
our native kernel for a few query rows on the CPU, torch's scaled_dot_product_attention on a
GPU and for long prompt chunks. The third way is the fused layer (native/decode_layer.py),
which attends inside its one call per layer: `Block` hands it the sequences it takes.

Every call takes the keys and values as the cache stores them ([1, kv_heads, tokens, width]
in its storage type) and the cache itself, for its codecs and q4 key tiles; queries are
[heads, rows, head_dim] and results [1, heads, rows, head_dim], as
scaled_dot_product_attention returns them.
- `attend`: the rows see the keys as one mask says (None: all of them).
- `attend_one_each`: one decode row per sequence, each over its own cache.
- `attend_prefixes`: row r sees the first `before + r + 1` keys (exact rows whose decode
  steps would each see a prefix of one storage).
- `attend_rows`: row r sees the keys mask row r says, as a decode step under that mask
  would (exact rows of a fixed-shape verification step).

Off the CPU, where Triton runs, `StoredAttention` reads the stored rows in one kernel for
all rows of a call (engine/ops/stored_attention.py) and hands the rest - q4 keys in tiles,
long prompt chunks, float masks - to torch's."""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

from ..kv.cache import Cache
from ..kv.codec import KVCodec
from ..ops.layers import RopeTables
from ..platform.devices import stored_attention_unavailable

# (keys, values, mask, cache) of one sequence's decode row.
StoredRow = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, Cache]


class AttentionBackend(Protocol):
    def attend(self, queries, keys, values, cache: Cache, mask=None) -> torch.Tensor: ...

    def attend_one_each(self, queries: torch.Tensor, stored: list[StoredRow]) -> torch.Tensor: ...

    def attend_prefixes(self, queries, keys, values, cache: Cache, before: int) -> torch.Tensor: ...
    def attend_rows(self, queries, keys, values, cache: Cache, masks) -> torch.Tensor: ...


def kernel_types(cache: Cache) -> tuple[int, int]:
    """The native attention's type codes for a cache's keys and values."""
    return cache.key_codec.kernel_code, cache.value_codec.kernel_code


class NativeCpuAttention:
    """Our CPU kernel (native/attention.py): reads the stored types directly (q8 and q4 as
    integer dot products), each row in an order fixed by its own keys alone, so that a row
    comes out the same in any batch."""

    def __init__(self, kernel, scale: float):
        self.kernel, self.scale = kernel, scale

    def attend(self, queries, keys, values, cache: Cache, mask=None, lengths=None):
        rows_first = queries.transpose(0, 1).contiguous()
        out = self.kernel(
            rows_first,
            keys[0],
            values[0],
            self.scale,
            lengths,
            mask,
            kernel_types(cache),
            tiled=cache.tiled_keys(rows_first.shape[0]),
        )
        return out.transpose(0, 1)[None]

    def attend_one_each(self, queries: torch.Tensor, stored: list[StoredRow]) -> torch.Tensor:
        attended = self.kernel.sequences(
            queries.transpose(0, 1).contiguous(),
            [keys[0] for keys, _, _, _ in stored],
            [values[0] for _, values, _, _ in stored],
            self.scale,
            [None if mask is None else mask[0] for _, _, mask, _ in stored],
            [kernel_types(cache) for _, _, _, cache in stored],
            [cache.tiled_keys(1) for _, _, _, cache in stored],
        )
        return attended.transpose(0, 1)[None]

    def attend_prefixes(self, queries, keys, values, cache: Cache, before: int):
        n_rows = queries.shape[1]
        lengths = torch.arange(before + 1, before + n_rows + 1, dtype=torch.int32)
        return self.attend(queries, keys, values, cache, lengths=lengths)

    def attend_rows(self, queries, keys, values, cache: Cache, masks):
        return self.attend(queries, keys, values, cache, mask=masks)  # each row on its own


# From this many rows on a GPU (a prompt chunk; speculative verification brings fewer), the
# rows attend in one fused causal call instead of one call each.
FUSED_PREFIX_ROWS = 32


def fuses_prefixes(queries: torch.Tensor) -> bool:
    """Whether rows that each see a prefix of one storage attend in one fused call: on a
    GPU, for a prompt chunk. One call a row is what keeps each row bit for bit its decode
    step's (the CPU, verification rows); on a GPU a 2,000-token prompt would be 2,000 calls a
    layer, and a fused kernel rounds a row's sums in its own order, so a long prompt chunk
    there may differ from its decode steps in the last bits."""
    return queries.device.type != "cpu" and queries.shape[1] >= FUSED_PREFIX_ROWS


def causal_prefix_attention(queries, keys, values, before: int, scale: float) -> torch.Tensor:
    """Row r of `queries` [heads, rows, head_dim] over the first before + r + 1 of the
    decoded `keys` and `values` [1, kv_heads, >= before + rows, head_dim], in one call
    whose causal mask runs from the bottom right (SDPA's memory-efficient kernel on a GPU,
    no mask tensor). The key heads are repeated for the query heads that share them: that
    kernel takes fp32 but not grouped heads, and without it the mask would be materialized."""
    from torch.nn.attention.bias import causal_lower_right

    heads, rows = queries.shape[:2]
    seen = before + rows
    keys, values = keys[:, :, :seen], values[:, :, :seen]
    group = heads // keys.shape[1]
    if group > 1:  # query head h reads key head h // group, as enable_gqa pairs them
        keys = keys.repeat_interleave(group, dim=1)
        values = values.repeat_interleave(group, dim=1)
    return F.scaled_dot_product_attention(
        queries[None], keys, values, attn_mask=causal_lower_right(rows, seen), scale=scale
    )


class TorchAttention:
    """torch's scaled_dot_product_attention over keys decoded one layer at a time (the copy
    lives for this layer's call only), in the precision `attention_dtype` says. Any device."""

    def __init__(self, scale: float):
        self.scale = scale

    def attend(self, queries, keys, values, cache: Cache, mask=None):
        if cache.key_codec.tiled:
            return self._by_own_tile(queries, keys, values, mask, cache)
        queries, keys, values = _meeting(queries, keys, values, cache)
        return F.scaled_dot_product_attention(
            queries[None],
            keys,
            values,
            attn_mask=_mask(mask, queries),
            enable_gqa=True,
            scale=self.scale,
        )

    def attend_one_each(self, queries: torch.Tensor, stored: list[StoredRow]) -> torch.Tensor:
        outs = [
            self.attend(queries[:, j : j + 1], keys, values, cache, mask)
            for j, (keys, values, mask, cache) in enumerate(stored)
        ]
        return torch.cat(outs, dim=2)

    def attend_prefixes(self, queries, keys, values, cache: Cache, before: int):
        tiled = cache.key_codec.tiled  # each row reads its own tile exactly
        dtype = attention_dtype(queries.device, cache)
        queries, values = _as(queries, dtype), _values(values, cache, dtype)
        decoded = None if tiled else _keys(keys, cache, dtype)
        if not tiled and fuses_prefixes(queries):
            return causal_prefix_attention(queries, decoded, values, before, self.scale)
        rows = [
            F.scaled_dot_product_attention(
                queries[None, :, row : row + 1],
                (_as(cache.decode_keys(keys, row), dtype) if tiled else decoded)[
                    :, :, : before + row + 1
                ],
                values[:, :, : before + row + 1],
                enable_gqa=True,
                scale=self.scale,
            )
            for row in range(queries.shape[1])
        ]
        return torch.cat(rows, dim=2)

    def attend_rows(self, queries, keys, values, cache: Cache, masks):
        """One call a row over keys decoded once: a call over all rows rounds its sums in
        another order than the decode step's call of one row."""
        queries, keys, values = _meeting(queries, keys, values, cache)
        rows = [
            F.scaled_dot_product_attention(
                queries[None, :, row : row + 1],
                keys,
                values,
                attn_mask=_mask(masks[row : row + 1], queries),
                enable_gqa=True,
                scale=self.scale,
            )
            for row in range(queries.shape[1])
        ]
        return torch.cat(rows, dim=2)

    def _by_own_tile(self, queries, keys, values, mask, cache: Cache) -> torch.Tensor:
        """Over tiled keys: each group of rows that share a tile reads it exactly, the
        complete tiles before it decoded, as their decode steps would."""
        dtype = attention_dtype(queries.device, cache)
        queries, values = _as(queries, dtype), _values(values, cache, dtype)
        outs = []
        for first, end, group_keys in cache.keys_by_own_tile(keys, queries.shape[1]):
            group_mask = None if mask is None else mask[first:end]
            outs.append(
                F.scaled_dot_product_attention(
                    queries[None, :, first:end],
                    _as(group_keys, dtype),
                    values,
                    attn_mask=_mask(group_mask, queries),
                    enable_gqa=True,
                    scale=self.scale,
                )
            )
        return torch.cat(outs, dim=2)


# Up to this many query rows over one storage (a decode step, a verification) the stored
# rows are read by the Triton kernel; a longer prompt chunk takes SDPA's fused kernels.
STORED_ATTENTION_ROWS = FUSED_PREFIX_ROWS


def stored_attention_runs(device: torch.device) -> bool:
    """Whether attention on `device` reads the stored rows through the Triton kernel
    (platform/devices.py says where it does and why not elsewhere)."""
    return stored_attention_unavailable(device.type) is None


class StoredAttention:
    """The Triton kernel over the rows as stored (ops/stored_attention.py), each row in an
    order fixed by its own keys, so that it comes out the same alone, in a batch, or as a
    verification row. It hands to `fallback` what it does not read: q4 keys in tiles, heads
    whose size is not a power of two, float masks, and prompt chunks of more than
    STORED_ATTENTION_ROWS rows."""

    def __init__(self, scale: float, fallback: TorchAttention, head_dim: int):
        self.scale, self.fallback = scale, fallback
        self.takes_heads = kernel_takes_heads(head_dim)

    def attend(self, queries, keys, values, cache: Cache, mask=None):
        rows = queries.shape[1]
        masks = _row_masks(mask, rows)
        if rows > STORED_ATTENTION_ROWS or masks is None or not self._reads(cache, keys, values):
            return self.fallback.attend(queries, keys, values, cache, mask)
        return self._run(queries, [(keys, values, m) for m in masks], cache)

    def attend_one_each(self, queries: torch.Tensor, stored: list[StoredRow]) -> torch.Tensor:
        cache = stored[0][3]
        masks = [_row_masks(mask, 1) for _, _, mask, _ in stored]
        readable = all(
            m is not None and self._reads(c, k, v) and kernel_types(c) == kernel_types(cache)
            for (k, v, _, c), m in zip(stored, masks, strict=True)
        )
        if not readable:
            return self.fallback.attend_one_each(queries, stored)
        rows = [(k, v, m[0]) for (k, v, _, _), m in zip(stored, masks, strict=True)]
        return self._run(queries, rows, cache)

    def reads_one_each(self, stored: list[StoredRow]) -> bool:
        """Whether the kernel reads all these rows (one query row each, caches of one
        kind) itself."""
        kinds = kernel_types(stored[0][3])
        return all(
            _row_masks(mask, 1) is not None
            and self._reads(cache, keys, values)
            and kernel_types(cache) == kinds
            for keys, values, mask, cache in stored
        )

    def attend_with_rope(
        self, queries: torch.Tensor, stored: list[StoredRow], rotation: RopeTables
    ) -> torch.Tensor:
        """queries [rows, heads, head_dim] straight from the projection (any float type,
        not yet turned by RoPE), row r over stored[r], which reads_one_each takes: the
        kernel applies `rotation` (cos / signed sin [rows or 1, 1, head_dim]) to them as
        it loads them. Returns [rows, heads, head_dim]."""
        rows = [(k, v, _row_masks(mask, 1)[0]) for k, v, mask, _ in stored]
        return self._launch(queries, rows, stored[0][3], rotation)

    def attend_prefixes(self, queries, keys, values, cache: Cache, before: int):
        if fuses_prefixes(queries) or not self._reads(cache, keys, values):
            return self.fallback.attend_prefixes(queries, keys, values, cache, before)
        seen = [before + row + 1 for row in range(queries.shape[1])]
        rows = [(keys[:, :, :n], values[:, :, :n], None) for n in seen]
        return self._run(queries, rows, cache)

    def attend_rows(self, queries, keys, values, cache: Cache, masks):
        rows = queries.shape[1]
        each = _row_masks(masks, rows)
        if each is None or not self._reads(cache, keys, values):
            return self.fallback.attend_rows(queries, keys, values, cache, masks)
        return self._run(queries, [(keys, values, m) for m in each], cache)

    def _reads(self, cache: Cache, keys: torch.Tensor, values: torch.Tensor) -> bool:
        return (
            self.takes_heads
            and not cache.key_codec.tiled
            and all(
                s.dim() == 4 and s.stride(3) == 1 and s.stride(2) == s.shape[3]
                for s in (keys, values)
            )
        )

    def _run(self, queries: torch.Tensor, rows: list, cache: Cache) -> torch.Tensor:
        """queries [heads, rows, head_dim]; rows: (keys, values, mask) a query row."""
        out = self._launch(queries.transpose(0, 1).float().contiguous(), rows, cache)
        return out.transpose(0, 1)[None]

    def _launch(
        self, queries: torch.Tensor, rows: list, cache: Cache, rotation: RopeTables | None = None
    ) -> torch.Tensor:
        """The kernel over queries [rows, heads, head_dim] (turned by `rotation`'s RoPE
        first where given) -> [rows, heads, head_dim]. Quantized rows are stored rotated;
        the kernel turns queries and output itself."""
        from ..ops.stored_attention import stored_attention

        rope = None if rotation is None else rotation.rope
        return stored_attention(
            queries,
            [k for k, _, _ in rows],
            [v for _, v, _ in rows],
            [m for _, _, m in rows],
            list(kernel_types(cache)),
            self.scale,
            attention_dtype(queries.device, cache),
            _stored_rotation(cache.key_codec, cache.value_codec),
            None if rotation is None else rotation.cos,
            None if rotation is None else rotation.signed_sin,
            rope is not None and rope.interleaved,
            0 if rope is None else rope.rotary_dim,
        )


def kernel_takes_heads(head_dim: int) -> bool:
    """Whether the Triton kernels read and write heads of this size: their tiles span a
    head, so a power of two, and at least tl.dot's 16."""
    return head_dim >= 16 and head_dim & (head_dim - 1) == 0


def _stored_rotation(key_codec: KVCodec, value_codec: KVCodec) -> torch.Tensor | None:
    """The rotation the kernels turn rows by: the same matrix for keys and values, held by
    whichever codec stores its rows rotated (None: neither does)."""
    return key_codec.rotation if key_codec.rotation is not None else value_codec.rotation


def write_rows_as_stored(
    new_keys: torch.Tensor,
    new_values: torch.Tensor,
    stores: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    key_codec: KVCodec,
    value_codec: KVCodec,
    sinks: tuple[int, list[RopeTables]] | None = None,
    rotation: RopeTables | None = None,
    heads_from: tuple[int, int] = (0, 0),
) -> None:
    """new_keys and new_values [entries, heads, head_dim] (the stores' kv_heads from head
    heads_from[0] and heads_from[1] on), encoded as the codecs store them, into (keys,
    values, slots) of `stores` (whole storages, int64 slots on their device), entries in
    order: as many as the slots together. One Triton launch
    (ops/stored_attention.py) does what `index_copy_(2, slots, codec.encode(k))` does for
    each store. `sinks`: (how many, each store's shift): the keys' sinks, stored in slots
    0..sinks-1, are then turned by the shift into slots sinks..2*sinks-1 in the same
    launch, as decode, apply_rope and encode would. `rotation` (cos / signed sin [entries
    or 1, 1, head_dim]): the new keys' RoPE, applied by the kernel first."""
    from ..ops.stored_attention import write_stored

    count, shifts, rope = 0, None, None
    if sinks is not None and sinks[0]:
        count, shifts = sinks
        rope = shifts[0].rope
    if rotation is not None:
        rope = rotation.rope
    write_stored(
        new_keys,
        new_values,
        [keys for keys, _, _ in stores],
        [values for _, values, _ in stores],
        [slots for _, _, slots in stores],
        [key_codec.kind.code, value_codec.kind.code],
        _stored_rotation(key_codec, value_codec),
        [shift.cos.reshape(-1) for shift in shifts or ()],
        [shift.signed_sin.reshape(-1) for shift in shifts or ()],
        count,
        rope is not None and rope.interleaved,
        0 if rope is None else rope.rotary_dim,
        None if rotation is None else rotation.cos,
        None if rotation is None else rotation.signed_sin,
        *heads_from,
    )


def write_static_rows(
    views: list,
    new_keys: torch.Tensor,
    new_values: torch.Tensor,
    rotation: RopeTables | None = None,
    heads_from: tuple[int, int] = (0, 0),
) -> None:
    """A static step's cache views (all of one kind), in Triton: new_keys and new_values
    [rows, heads, head_dim] (the kv_heads from heads_from on, as write_rows_as_stored
    takes them) written as stored at each view's slots, one row a slot, and every view's
    sinks turned into its frame, in one launch. `rotation`: the keys' RoPE, where they
    come unturned."""
    first = views[0]
    stores = [(view.keys, view.values, view.inputs.write_at) for view in views]
    shifts = [view.inputs.sink_shift for view in views]
    sinks = (first.sinks, shifts) if first.sinks else None
    codecs = (first.key_codec, first.value_codec)
    write_rows_as_stored(new_keys, new_values, stores, *codecs, sinks, rotation, heads_from)


def _row_masks(mask: torch.Tensor | None, rows: int) -> list[torch.Tensor | None] | None:
    """Each query row's bool mask over the keys (None: all keys), from a mask of one row for
    all or of one row each; None where the kernel cannot take it (a float mask)."""
    if mask is None:
        return [None] * rows
    if mask.dtype is not torch.bool or mask.dim() != 2 or mask.shape[0] not in (1, rows):
        return None
    return [mask[0 if mask.shape[0] == 1 else row] for row in range(rows)]


def reduced_precision(device: torch.device) -> bool:
    """Whether attention over 16-bit or quantized rows runs in 16 bits on this device: off
    the CPU. On the CPU torch's attention is faster in fp32 at decode sizes, and fp32 keeps
    the bits the native kernels give."""
    return device.type != "cpu"


def attention_dtype(device: torch.device, cache: Cache) -> torch.dtype:
    """The dtype queries, keys and values meet in. fp32 rows are read as stored, without a
    copy, so they stay fp32. Otherwise, off the CPU: the rows' own 16-bit type, or bf16 for
    quantized rows, which decode into it in the same pass. That halves the bytes of the
    decoded rows, takes SDPA's flash kernels, and hands the output to the int4 product
    (which takes bf16) without a cast after attention."""
    if not reduced_precision(device):
        return torch.float32
    stored = {cache.key_codec.dtype, cache.value_codec.dtype}
    if torch.float32 in stored:
        return torch.float32
    if len(stored) == 1 and stored <= {torch.float16, torch.bfloat16}:
        return stored.pop()
    return torch.bfloat16


def _meeting(queries, keys, values, cache: Cache):
    """Queries, and keys and values as stored (not tiled keys), in attention_dtype."""
    dtype = attention_dtype(queries.device, cache)
    return _as(queries, dtype), _keys(keys, cache, dtype), _values(values, cache, dtype)


def _keys(keys: torch.Tensor, cache: Cache, dtype: torch.dtype) -> torch.Tensor:
    """Stored keys (not tiled) in dtype: read as stored where they are in it already."""
    return keys if keys.dtype is dtype else _as(cache.decode_keys(keys), dtype)


def _values(values: torch.Tensor, cache: Cache, dtype: torch.dtype) -> torch.Tensor:
    return values if values.dtype is dtype else _as(cache.value_codec.decode(values), dtype)


def _as(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x in dtype, without dispatching an op where it already is (an uncompiled graph
    replays each op it recorded)."""
    return x if x.dtype is dtype else x.to(dtype)


def _mask(mask: torch.Tensor | None, queries: torch.Tensor) -> torch.Tensor | None:
    """SDPA takes a float mask only in the queries' dtype."""
    if mask is None or mask.dtype is torch.bool:
        return mask
    return mask.to(queries.dtype)
