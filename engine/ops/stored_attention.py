"""Decode attention in Triton over the KV cache as it is stored: f32, f16 or bf16 rows, or
q8 / q4 rows (kv/types.py), decoded in registers. torch's path on a GPU first decodes a
layer's whole cache into a bf16 copy that attention then reads back: three passes over the
cache where this kernel makes one, and several kernels where this takes one.

One launch serves every query row of a call, each over its own stored keys and values,
through a table of addresses (one entry a row: where its keys and values start, their
head strides, its mask and its length). So a batch of sequences attends in one launch
whatever caches they own, and a verification's rows, each over a prefix of one storage,
do too.

The work is split along the keys ("flash decoding"): a program takes one row, one key head
(with the query heads that share it) and TOKENS_PER_SPLIT keys, and leaves its running
maximum, sum and weighted values; the last of a row's programs to finish (an atomic
counter says which) combines the row's splits, in order, so the call is one launch. The
splits fall at fixed key positions, and splits past a row's keys add exact zeros, so a row
comes out bit for bit the same alone, in any batch, or as a verification row over the same
keys: what the CPU's native kernel guarantees, kept on a GPU.

q8 and q4 rows are stored rotated (kv/codec.py): the kernel turns the queries into the
rotation and the output back out of it itself, so those cost no kernels of their own. A
second kernel (`write_stored`) writes a step's new keys and values the way the codecs
encode them, every row's in one launch, through the same kind of table; where the caches
keep attention sinks, each key's program then turns its cache's sinks into the newest frame
(decode, RoPE shift, encode), after its own write, since a fresh cache's new key may be a
sink.

This module imports Triton; attention_backends.py loads it only where Triton runs (a CUDA
or ROCm build of torch, or Triton's CPU interpreter, `TRITON_INTERPRET=1`, which the tests
use). The pure-torch references are the codecs' decode followed by SDPA (TorchAttention),
and the codecs' encode followed by index_copy_ (and decode, apply_rope, encode for sinks)."""

from __future__ import annotations

from collections import OrderedDict

import torch
import triton
import triton.language as tl

TOKENS_PER_SPLIT = 128  # keys a program reads; fixed, so that a row's sums keep their order
MIN_DOT = 16  # tl.dot's smallest side: the query heads of a key head are padded to it


def attention_block(head_dim: int) -> int:
    """Keys a program loads at once (fixed for a head size, so that a row's sums keep their
    order). Compiled for sm_90 (scripts/compile_kernels.py) on Triton's 4 warps, blocks of
    32 spill 280-340 bytes a thread at heads of 128 and 2.3-6.3 KB at 256, blocks of 16
    nothing; at 64 neither spills, and 32 holds bf16 in fewer registers. Chosen by spills,
    not yet timed on a GPU."""
    return 32 if head_dim <= 64 else MIN_DOT


QUANTIZED = 3  # type codes from here on (q8, q4) are stored rotated
TABLE_COLUMNS = 6  # key address, value address, key head stride, value head stride, mask, length
_TABLE_COLUMNS = tl.constexpr(TABLE_COLUMNS)  # as a kernel reads it
# write_stored's entries: key and value addresses and head strides, the slot's address, the
# sinks' shift (cos and signed sin addresses, 0 without sinks), one unused.
WRITE_COLUMNS = 8
_WRITE_COLUMNS = tl.constexpr(WRITE_COLUMNS)  # as a kernel reads it
_TABLES_KEPT = 1024


@triton.jit
def _stored_rows(base, tokens, valid, KIND: tl.constexpr, D: tl.constexpr, ROW: tl.constexpr):
    """fp32 [len(tokens), D]: the rows `tokens` of one key head's storage at `base` (a byte
    pointer), each ROW bytes, stored as KIND (KVType.code: 0 f32, 1 f16, 2 bf16, 3 q8, 4 q4).
    Rows not `valid` read as zeros."""
    d = tl.arange(0, D)[None, :]
    t = tokens[:, None].to(tl.int64)
    m = valid[:, None]
    halves = base.to(tl.pointer_type(tl.float16), bitcast=True)
    if KIND == 0:
        words = base.to(tl.pointer_type(tl.float32), bitcast=True)
        x = tl.load(words + t * (ROW // 4) + d, mask=m, other=0.0)
    elif KIND == 1:
        x = tl.load(halves + t * (ROW // 2) + d, mask=m, other=0.0).to(tl.float32)
    elif KIND == 2:
        brain = base.to(tl.pointer_type(tl.bfloat16), bitcast=True)
        x = tl.load(brain + t * (ROW // 2) + d, mask=m, other=0.0).to(tl.float32)
    elif KIND == 3:
        # q8: D int8 codes, then an f16 scale per block of 32.
        codes = tl.load(base + t * ROW + d, mask=m, other=0).to(tl.int8, bitcast=True)
        scale = tl.load(halves + t * (ROW // 2) + D // 2 + d // 32, mask=m, other=0.0)
        x = codes.to(tl.float32) * scale.to(tl.float32)
    else:
        # q4: a block's value i in byte i's low nibble and value i + 16 in its high one,
        # then an f16 scale per block, then an f16 minimum per block.
        byte = tl.load(base + t * ROW + (d // 32) * 16 + d % 16, mask=m, other=0)
        code = (byte >> ((d % 32) // 16 * 4).to(tl.uint8)) & 15
        scale = tl.load(halves + t * (ROW // 2) + D // 4 + d // 32, mask=m, other=0.0)
        low = tl.load(halves + t * (ROW // 2) + D // 4 + D // 32 + d // 32, mask=m, other=0.0)
        x = code.to(tl.float32) * scale.to(tl.float32) + low.to(tl.float32)
    return x


@triton.jit
def _partner(d, INTERLEAVED: tl.constexpr, ROTARY: tl.constexpr):
    """Each dimension's RoPE partner, as Rope.swap pairs them: neighbours (interleaved) or
    halves of the ROTARY span; the tail past ROTARY pairs with itself."""
    if INTERLEAVED:
        partner = tl.where(d < ROTARY, d ^ 1, d)
    else:
        half = ROTARY // 2
        partner = tl.where(d < half, d + half, tl.where(d < ROTARY, d - half, d))
    return partner


@triton.jit
def _roped(x, swapped, cos, sin):
    """RoPE as apply_rope computes it (x * cos + swap(x) * signed sin), fp32."""
    return x * cos + swapped * sin


@triton.jit
def _head_start(entry, storage, head):
    """Byte pointer to `head`'s rows in a table entry's storage 0 (keys) or 1 (values): the
    storage's address sits in column `storage`, its head stride in bytes two columns on."""
    start = tl.load(entry + storage).to(tl.pointer_type(tl.uint8))
    return start + head * tl.load(entry + storage + 2)


@triton.jit
def _split_partials(
    queries,  # [rows, HEADS, D], any float type, rows contiguous
    table,  # int64 [rows, TABLE_COLUMNS]
    part_max,  # fp32 [rows, HEADS, splits]: the split's largest score (log2 units)
    part_sum,  # fp32 [rows, HEADS, splits]: its sum of exp2(score - max)
    part_out,  # fp32 [rows, HEADS, splits, D]: its values weighted alike
    out,  # [rows, HEADS, D]: the attended values
    counters,  # int32, zero: finished programs a (row, key head)
    rope_cos,  # fp32 [rows or 1, D]: the queries' RoPE (with ROPE)
    rope_sin,  # fp32 signed sin alike
    rope_stride,  # rope_cos's row stride (0: one table for all)
    query_row_stride,
    query_head_stride,
    scale_log2,
    splits,
    HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    D: tl.constexpr,
    KEY_KIND: tl.constexpr,
    VALUE_KIND: tl.constexpr,
    KEY_ROW: tl.constexpr,
    VALUE_ROW: tl.constexpr,
    TOKENS: tl.constexpr,
    BLOCK: tl.constexpr,
    ROPE: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    ROTARY: tl.constexpr,
):
    row, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    entry = table + row * _TABLE_COLUMNS
    keys, values = _head_start(entry, 0, kv_head), _head_start(entry, 1, kv_head)
    mask_at = tl.load(entry + 4)
    length = tl.load(entry + 5)

    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, D)
    heads = kv_head * GROUP + g
    own = queries + row * query_row_stride + heads[:, None] * query_head_stride
    present = (g < GROUP)[:, None]
    q = tl.load(own + d[None, :], mask=present, other=0.0).to(tl.float32)
    if ROPE:  # queries straight from the projection: turned here, not by a kernel of its own
        partner = _partner(d, INTERLEAVED, ROTARY)[None, :]
        swapped = tl.load(own + partner, mask=present, other=0.0).to(tl.float32)
        at = row * rope_stride + d[None, :]
        q = _roped(q, swapped, tl.load(rope_cos + at), tl.load(rope_sin + at))
    # Keys stored rotated meet queries rotated alike (a product keeps its value when both
    # sides turn by one orthogonal matrix). Each program rotates its own copy, in
    # butterflies: cheaper than a kernel of its own.
    if KEY_KIND >= 3:  # q8, q4
        q = _hadamard(q, GROUP_PAD, D)
    best = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    total = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, D], tl.float32)
    for offset in tl.static_range(0, TOKENS, BLOCK):
        first = split * TOKENS + offset
        # Blocks past the row's keys are skipped: they would add exact zeros (a short row
        # in a batch with long ones, the padding of a span bucket).
        if first < length:
            tokens = first + tl.arange(0, BLOCK)
            valid = tokens < length
            if mask_at != 0:
                seen = tl.load(mask_at.to(tl.pointer_type(tl.uint8)) + tokens, mask=valid, other=0)
                valid = valid & (seen != 0)
            k = _stored_rows(keys, tokens, valid, KEY_KIND, D, KEY_ROW)
            scores = tl.dot(q, tl.trans(k), input_precision="ieee") * scale_log2
            scores = tl.where(valid[None, :], scores, float("-inf"))
            new_best = tl.maximum(best, tl.max(scores, axis=1))
            shift = tl.where(new_best == float("-inf"), 0.0, new_best)
            weights = tl.exp2(scores - shift[:, None])
            kept = tl.exp2(best - shift)
            total = total * kept + tl.sum(weights, axis=1)
            v = _stored_rows(values, tokens, valid, VALUE_KIND, D, VALUE_ROW)
            acc = acc * kept[:, None] + tl.dot(weights, v, input_precision="ieee")
            best = new_best

    at = (row * HEADS + heads) * splits + split
    real = g < GROUP
    tl.store(part_max + at, best, mask=real)
    tl.store(part_sum + at, total, mask=real)
    tl.store(part_out + at[:, None] * D + d[None, :], acc, mask=real[:, None])
    # The last of the (row, key head)'s programs to finish combines its splits: one launch
    # a call, not a second kernel. It resets the counter for the next call.
    tl.debug_barrier()
    counter = counters + row * tl.num_programs(1) + kv_head
    if tl.atomic_add(counter, 1, sem="acq_rel") == splits - 1:
        _combine_splits(
            part_max,
            part_sum,
            part_out,
            out,
            row * HEADS + heads,
            real,
            splits,
            D,
            VALUE_KIND >= 3,
        )
        tl.atomic_xchg(counter, 0, sem="relaxed")


@triton.jit
def _hadamard(x, ROWS: tl.constexpr, D: tl.constexpr):
    """x [ROWS, D] fp32 times the normalised Hadamard matrix of size D (a power of two), as
    the codecs rotate rows (kv/codec.py: `rotate`): log2(D) butterfly levels in registers.
    A [D, D] product would hold the matrix in registers, which spills at heads of 128
    (scripts/compile_kernels.py)."""
    for level in tl.static_range(10):  # heads up to 1024
        if (1 << level) < D:
            x = _butterflies(x, ROWS, D, 1 << level)
    return x * (1.0 / tl.sqrt(D * 1.0))


@triton.jit
def _butterflies(x, ROWS: tl.constexpr, D: tl.constexpr, H: tl.constexpr):
    """One level: element i = block * 2H + side * H + j, and each pair (side 0, side 1)
    becomes (a + b, a - b)."""
    pairs = tl.permute(tl.reshape(x, [ROWS, D // (2 * H), 2, H]), [0, 1, 3, 2])
    a, b = tl.split(pairs)
    return tl.reshape(tl.permute(tl.join(a + b, a - b), [0, 1, 3, 2]), [ROWS, D])


@triton.jit
def _combine_splits(
    part_max,
    part_sum,
    part_out,
    out,
    heads,
    real,
    splits,
    D: tl.constexpr,
    ROTATE: tl.constexpr,
):
    """The query `heads` ([GROUP_PAD] indices into the calls' rows x heads, `real` where a
    head exists): their splits combined one after another, in order, so that the result
    does not depend on which program combines. Values stored rotated come out rotated, so
    with ROTATE the result is turned back (the rotation is its own inverse)."""
    d = tl.arange(0, D)
    first = heads * splits
    best = tl.load(part_max + first, mask=real, other=float("-inf"))
    for split in range(1, splits):
        best = tl.maximum(best, tl.load(part_max + first + split, mask=real, other=float("-inf")))
    shift = tl.where(best == float("-inf"), 0.0, best)
    total = tl.zeros_like(best)
    acc = tl.zeros([best.shape[0], D], tl.float32)
    for split in range(0, splits):
        weight = tl.exp2(tl.load(part_max + first + split, mask=real, other=float("-inf")) - shift)
        total += tl.load(part_sum + first + split, mask=real, other=0.0) * weight
        rows = part_out + (first + split)[:, None] * D + d[None, :]
        acc += tl.load(rows, mask=real[:, None], other=0.0) * weight[:, None]
    total = tl.where(real, total, 1.0)
    result = acc / total[:, None]
    if ROTATE:
        result = _hadamard(result, result.shape[0], D)
    tl.store(out + heads[:, None] * D + d[None, :], result, mask=real[:, None])


class _Counters:
    """Per device, zeroed int32 counters, one a (row, key head) of a call: how many of its
    programs have finished. Each call leaves them zero again. Allocated once and never
    replaced, since captured graphs hold their address."""

    SIZE = 1 << 16  # rows x key heads of the largest call (256 KiB a device)

    def __init__(self):
        self.kept: dict[torch.device, torch.Tensor] = {}

    def at_least(self, n: int, device: torch.device) -> torch.Tensor:
        if n > self.SIZE:
            raise ValueError(f"stored attention counts at most {self.SIZE} rows x key heads")
        found = self.kept.get(device)
        if found is None:
            found = torch.zeros(self.SIZE, dtype=torch.int32, device=device)
            self.kept[device] = found
        return found


class _AddressTables:
    """Device tables of rows' addresses, kept by their contents: a captured step's call
    finds the table its warm-up built (no host-to-device copy inside a capture), and a
    table only ever holds the addresses it is keyed by. A table a capture used stays for
    good: the graph reads it at every replay, so it must never be freed (one a layer and
    graph). The others, from uncaptured calls (prompts, eager steps), go oldest first."""

    def __init__(self):
        self.kept: OrderedDict[tuple, torch.Tensor] = OrderedDict()
        self.captured: dict[tuple, torch.Tensor] = {}

    def table(
        self, entries: tuple, device: torch.device, columns: int = TABLE_COLUMNS
    ) -> torch.Tensor:
        key = (device, entries)
        found = self.captured.get(key)
        if found is not None:
            return found
        found = self.kept.pop(key, None)
        if found is None:
            found = torch.tensor(entries, dtype=torch.int64).view(-1, columns).to(device)
        if _capturing(device):
            self.captured[key] = found
            return found
        self.kept[key] = found  # the newest last
        if len(self.kept) > _TABLES_KEPT:
            self.kept.popitem(last=False)
        return found


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


_TABLES = _AddressTables()
_COUNTERS = _Counters()


def _entry(keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None) -> tuple:
    """One row's table entry: keys and values [1, kv_heads, tokens, width] as stored (a
    view of a cache's storage; rows contiguous), mask None or bool [tokens...]."""
    for stored in (keys, values):
        if stored.stride(3) != 1 or stored.stride(2) != stored.shape[3]:
            raise ValueError("stored attention reads whole rows, one after another")
    length = keys.shape[2]
    mask_at = 0
    if mask is not None:
        if mask.dtype is not torch.bool or mask.stride(-1) != 1 or mask.shape[-1] < length:
            raise ValueError("stored attention takes a bool mask over the keys")
        mask_at = mask.data_ptr()
    return (
        keys.data_ptr(),
        values.data_ptr(),
        keys.stride(1) * keys.element_size(),
        values.stride(1) * values.element_size(),
        mask_at,
        length,
    )


@torch.library.custom_op("miniapp::stored_attention", mutates_args=())
def stored_attention(
    queries: torch.Tensor,
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
    masks: list[torch.Tensor | None],
    kinds: list[int],
    scale: float,
    out_dtype: torch.dtype,
    rotation: torch.Tensor | None = None,
    rope_cos: torch.Tensor | None = None,
    rope_sin: torch.Tensor | None = None,
    interleaved: bool = False,
    rotary: int = 0,
) -> torch.Tensor:
    """queries [rows, heads, head_dim] (any float type); row r attends keys[r] and values[r] ([1,
    kv_heads, tokens, width] as stored, of type codes `kinds` = [key code, value code])
    where masks[r] (bool, None: everywhere) allows. q8 and q4 rows are stored rotated:
    `rotation` (fp32 [head_dim, head_dim], x @ it), the codecs' matrix, says so, needed
    when either kind is one of them; the kernel turns queries and output by the same
    normalised Hadamard matrix itself, in butterflies (kv/codec.py's `rotate`). With rope_cos and
    rope_sin (fp32 [rows or 1, head_dim]: cos and signed sin; `interleaved` pairs and
    `rotary` rotated dimensions as the model's Rope), the queries are turned by that RoPE
    first, so that they come straight from the projection. Returns [rows, heads,
    head_dim] in out_dtype. A custom op: torch.compile calls it as it is, and a
    CUDA graph captures its one launch."""
    rows, heads, head_dim = queries.shape
    if rotation is None and max(kinds) >= QUANTIZED:
        raise ValueError("rows stored rotated need their rotation")
    kv_heads = keys[0].shape[1]
    group = heads // kv_heads
    entries = sum((_entry(k, v, m) for k, v, m in zip(keys, values, masks, strict=True)), ())
    table = _TABLES.table(entries, queries.device)
    splits = max(1, triton.cdiv(max(k.shape[2] for k in keys), TOKENS_PER_SPLIT))
    part_max = queries.new_empty((rows, heads, splits), dtype=torch.float32)
    part_sum = queries.new_empty((rows, heads, splits), dtype=torch.float32)
    part_out = queries.new_empty((rows, heads, splits, head_dim), dtype=torch.float32)
    out = queries.new_empty((rows, heads, head_dim), dtype=out_dtype)
    queries = _rows_contiguous(queries)
    rope = rope_cos is not None and rope_sin is not None
    if rope:
        rope_cos, rope_sin = _rope_rows(rope_cos), _rope_rows(rope_sin)
    _split_partials[(rows, kv_heads, splits)](
        queries,
        table,
        part_max,
        part_sum,
        part_out,
        out,
        _COUNTERS.at_least(rows * kv_heads, queries.device),
        rope_cos if rope else queries,  # never read without
        rope_sin if rope else queries,
        rope_cos.stride(0) if rope and rope_cos.shape[0] > 1 else 0,
        queries.stride(0),
        queries.stride(1),
        scale * 1.4426950408889634,  # log2(e): the kernel's exponentials are exp2
        splits,
        HEADS=heads,
        GROUP=group,
        GROUP_PAD=max(MIN_DOT, triton.next_power_of_2(group)),
        D=head_dim,
        KEY_KIND=kinds[0],
        VALUE_KIND=kinds[1],
        KEY_ROW=keys[0].shape[3] * keys[0].element_size(),
        VALUE_ROW=values[0].shape[3] * values[0].element_size(),
        TOKENS=TOKENS_PER_SPLIT,
        BLOCK=attention_block(head_dim),
        ROPE=rope,
        INTERLEAVED=interleaved,
        ROTARY=rotary,
    )
    return out


@stored_attention.register_fake
def _(
    queries,
    keys,
    values,
    masks,
    kinds,
    scale,
    out_dtype,
    rotation=None,
    rope_cos=None,
    rope_sin=None,
    interleaved=False,
    rotary=0,
):
    return queries.new_empty(queries.shape, dtype=out_dtype)


# Writing new keys and values as stored. The rotation and quantization of a q8 or q4 row
# are a dozen small ops in torch, which inductor splits into several kernels a layer (a
# reduction per block, then the codes, then the bytes put together); here they are one
# launch for the keys and values of every row of a call.

F16_MAX = tl.constexpr(65504.0)  # a scale past f16's range saturates, as the codecs do


@triton.jit
def _rounded(y):
    """Round half to even, as torch.round: y - floor(y) is exact at these sizes."""
    down = tl.floor(y)
    frac = y - down
    odd = down - 2.0 * tl.floor(down * 0.5)
    up = (frac > 0.5) | ((frac == 0.5) & (odd != 0.0))
    return tl.where(up, down + 1.0, down)


@triton.jit
def _f16(x):
    return tl.minimum(tl.maximum(x, -F16_MAX), F16_MAX).to(tl.float16)


@triton.jit
def _bf16(x):
    """fp32 -> bf16 rounded to nearest even, as torch rounds (on its bits: Triton's
    interpreter truncates). NaN passes as it is."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    rounded = bits.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    return tl.where(x == x, rounded, x.to(tl.bfloat16))


@triton.jit
def _store_row(x, base, KIND: tl.constexpr, D: tl.constexpr):
    """One row x [D] fp32 stored as KIND at `base` (byte pointer to its slot), exactly as
    the codecs' encode lays it out (kv/types.py)."""
    d = tl.arange(0, D)
    if KIND == 0:
        tl.store(base.to(tl.pointer_type(tl.float32), bitcast=True) + d, x)
    elif KIND == 1:
        tl.store(base.to(tl.pointer_type(tl.float16), bitcast=True) + d, x.to(tl.float16))
    elif KIND == 2:
        tl.store(base.to(tl.pointer_type(tl.bfloat16), bitcast=True) + d, _bf16(x))
    else:
        _store_quantized(x, base, KIND, D)


@triton.jit
def _store_quantized(x, base, KIND: tl.constexpr, D: tl.constexpr):
    """One row x [D] fp32 stored as q8 (KIND 3) or q4 (4) at `base`, rotated first."""
    halves = base.to(tl.pointer_type(tl.float16), bitcast=True)
    blocks = tl.arange(0, D // 32)
    if KIND == 3:
        # q8: codes round(x / scale) in [-127, 127], scale = a block's largest |x| / 127.
        columns = blocks[:, None] * 32 + tl.arange(0, 32)[None, :]
        x = tl.reshape(_hadamard(tl.reshape(x, [1, D]), 1, D), [D // 32, 32])
        scale16 = _f16(tl.max(tl.abs(x), axis=1) / 127.0)
        scale = scale16.to(tl.float32)[:, None]
        safe = tl.where(scale > 0, scale, 1.0)
        codes = tl.where(scale > 0, _rounded(x / safe), 0.0)
        codes = tl.minimum(tl.maximum(codes, -127.0), 127.0).to(tl.int8)
        tl.store(base.to(tl.pointer_type(tl.int8), bitcast=True) + columns, codes)
        tl.store(halves + D // 2 + blocks, scale16)
    else:
        # q4: codes round((x - low) / scale) in [0, 15] over a block's minimum and range;
        # byte i of a block holds value i (low nibble) and value i + 16 (high nibble).
        columns = blocks[:, None] * 32 + tl.arange(0, 16)[None, :]
        turned = tl.reshape(_hadamard(tl.reshape(x, [1, D]), 1, D), [D // 32, 2, 16])
        first, second = tl.split(tl.permute(turned, [0, 2, 1]))
        low16 = _f16(tl.minimum(tl.min(first, axis=1), tl.min(second, axis=1)))
        high = tl.maximum(tl.max(first, axis=1), tl.max(second, axis=1))
        scale16 = _f16((high - low16.to(tl.float32)) / 15.0)
        low = low16.to(tl.float32)[:, None]
        scale = scale16.to(tl.float32)[:, None]
        safe = tl.where(scale > 0, scale, 1.0)
        a = tl.where(scale > 0, _rounded((first - low) / safe), 0.0)
        b = tl.where(scale > 0, _rounded((second - low) / safe), 0.0)
        a = tl.minimum(tl.maximum(a, 0.0), 15.0).to(tl.uint8)
        b = tl.minimum(tl.maximum(b, 0.0), 15.0).to(tl.uint8)
        packed = blocks[:, None] * 16 + tl.arange(0, 16)[None, :]
        tl.store(base + packed, a | (b << 4))
        tl.store(halves + D // 4 + blocks, scale16)
        tl.store(halves + D // 4 + D // 32 + blocks, low16)


@triton.jit
def _write_rows(
    new_keys,  # [entries, kv_heads, D], any float type, rows contiguous
    new_values,  # the same for the values
    table,  # int64 [entries, WRITE_COLUMNS]
    rope_cos,  # fp32 [entries or 1, D]: the new keys' RoPE (with KEY_ROPE)
    rope_sin,  # fp32 signed sin alike
    rope_stride,  # rope_cos's entry stride (0: one table for all)
    key_entry_stride,
    key_head_stride,
    value_entry_stride,
    value_head_stride,
    D: tl.constexpr,
    KEY_KIND: tl.constexpr,
    VALUE_KIND: tl.constexpr,
    KEY_ROW: tl.constexpr,
    VALUE_ROW: tl.constexpr,
    SINKS: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    ROTARY: tl.constexpr,
    KEY_ROPE: tl.constexpr,
):
    """Program (entry, head, side): the entry's new key (side 0, turned by its RoPE first
    with KEY_ROPE) or value (side 1) of that head stored at its slot. With SINKS, the key
    program of a cache's first entry then turns the cache's sinks into the frame: after
    its own write, which may be a sink when it is the cache's only new key."""
    entry_at, head, side = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    entry = table + entry_at * _WRITE_COLUMNS
    slot = tl.load(tl.load(entry + 4).to(tl.pointer_type(tl.int64)))
    d = tl.arange(0, D)
    if side == 0:
        base = _head_start(entry, 0, head)
        key = new_keys + entry_at * key_entry_stride + head * key_head_stride
        x = tl.load(key + d).to(tl.float32)
        if KEY_ROPE:
            swapped = tl.load(key + _partner(d, INTERLEAVED, ROTARY)).to(tl.float32)
            at = entry_at * rope_stride + d
            x = _roped(x, swapped, tl.load(rope_cos + at), tl.load(rope_sin + at))
        _store_row(x, base + slot * KEY_ROW, KEY_KIND, D)
        cos_at = tl.load(entry + 5)
        if SINKS > 0 and cos_at != 0:  # a cache's first entry turns its sinks
            tl.debug_barrier()  # the sinks read what this program's threads just wrote
            cos = cos_at.to(tl.pointer_type(tl.float32))
            sin = tl.load(entry + 6).to(tl.pointer_type(tl.float32))
            for sink in tl.static_range(SINKS):
                _reframe_sink(
                    base, cos, sin, sink, SINKS, KEY_KIND, D, KEY_ROW, INTERLEAVED, ROTARY
                )
    else:
        base = _head_start(entry, 1, head)
        value = new_values + entry_at * value_entry_stride + head * value_head_stride
        # fp32 in both branches: a compiled kernel's branches must leave x one type
        x = tl.load(value + d).to(tl.float32)
        _store_row(x, base + slot * VALUE_ROW, VALUE_KIND, D)


@triton.jit
def _reframe_sink(
    base,
    cos,
    sin,
    sink,
    SINKS: tl.constexpr,
    KIND: tl.constexpr,
    D: tl.constexpr,
    ROW: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    ROTARY: tl.constexpr,
):
    """Sink `sink` of a head's keys (rows from `base`): its own key (slot sink) decoded,
    turned by RoPE from its own position into the frame (cos and signed sin [D] of the
    shift) and stored at slot SINKS + sink, as the static step's torch path does (decode,
    apply_rope, encode)."""
    tokens = sink + tl.arange(0, 1)
    own = tl.sum(_stored_rows(base, tokens, tokens < SINKS, KIND, D, ROW), axis=0)
    d = tl.arange(0, D)
    x = own
    if KIND >= 3:  # stored rotated: the rotation is its own inverse
        x = tl.reshape(_hadamard(tl.reshape(own, [1, D]), 1, D), [D])
    swapped = tl.gather(x, _partner(d, INTERLEAVED, ROTARY), 0)
    framed = _roped(x, swapped, tl.load(cos + d), tl.load(sin + d))
    _store_row(framed, base + (SINKS + sink) * ROW, KIND, D)


def _write_entries(
    keys: torch.Tensor,
    values: torch.Tensor,
    slots: torch.Tensor,
    shift: tuple[torch.Tensor, torch.Tensor] | None,
) -> tuple:
    """Table entries for writing into keys and values (a cache's whole storage [1,
    kv_heads, slots, width], rows contiguous) at the slots in int64 `slots` [n], one a
    slot; `shift`: the sinks' (cos, signed sin) tables [head_dim] into the frame, in the
    first entry only (its program turns the sinks)."""
    for store in (keys, values):
        if store.stride(3) != 1 or store.stride(2) != store.shape[3]:
            raise ValueError("stored writes fill whole rows, one after another")
    if slots.dtype is not torch.int64 or slots.stride(-1) != 1:
        raise ValueError("stored writes take int64 slots")
    cos_at = sin_at = 0
    if shift is not None:
        if not all(table.is_contiguous() for table in shift):
            raise ValueError("the shift's tables are read as they lie")
        cos_at, sin_at = shift[0].data_ptr(), shift[1].data_ptr()
    key_head = keys.stride(1) * keys.element_size()
    value_head = values.stride(1) * values.element_size()
    at = slots.data_ptr()
    entries = []
    for i in range(slots.numel()):
        entries += [keys.data_ptr(), values.data_ptr(), key_head, value_head, at + 8 * i]
        entries += [cos_at, sin_at, 0] if i == 0 else [0, 0, 0]
    return tuple(entries)


def _rows_contiguous(x: torch.Tensor) -> torch.Tensor:
    """x [entries, kv_heads, head_dim] read by strides: copied only where a row is not
    contiguous."""
    return x if x.stride(-1) == 1 else x.contiguous()


@torch.library.custom_op("miniapp::write_stored", mutates_args=("key_stores", "value_stores"))
def write_stored(
    new_keys: torch.Tensor,
    new_values: torch.Tensor,
    key_stores: list[torch.Tensor],
    value_stores: list[torch.Tensor],
    slots: list[torch.Tensor],
    kinds: list[int],
    rotation: torch.Tensor | None,
    sink_cos: list[torch.Tensor],
    sink_sin: list[torch.Tensor],
    sinks: int,
    interleaved: bool,
    rotary: int,
    key_cos: torch.Tensor | None = None,
    key_sin: torch.Tensor | None = None,
    key_head: int = 0,
    value_head: int = 0,
) -> None:
    """new_keys and new_values [entries, heads, head_dim] (any float type; the kv_heads of
    the stores from head key_head and value_head on: one projection's output may be both,
    which a compiled step then makes once) stored as
    `kinds` ([key code, value code]) into key_stores[c] and value_stores[c] (whole storages
    [1, kv_heads, slots, width]) at the slots slots[c] (int64 [n_c], on the device: a graph
    replays them), entries taken in order, n_0 + n_1 + ... of them. q8 and q4 rows are
    stored rotated: `rotation`, the codecs' matrix, says so (the kernel turns rows by the
    same normalised Hadamard matrix in butterflies, bit for bit the codecs' own).

    With `sinks` (else 0, and the tables' lists empty), each cache's sinks (slots
    0..sinks-1 of its keys) are then turned by RoPE from their own positions into the
    frame (sink_cos[c] and sink_sin[c]: fp32 [head_dim] tables of the shift;
    `interleaved` pairs and `rotary` rotated dimensions as the model's Rope) into slots
    sinks..2*sinks-1, by the program of its first new key, after that key's write. So a
    cache taking several new keys must not take a sink among them: a static step's
    caches hold all their sinks before it runs (the caches' `static_ready`).

    key_cos and key_sin (fp32 [entries or 1, head_dim], cos and signed sin): the new keys
    are turned by this RoPE first (`interleaved` and `rotary` as above), so that they come
    straight from the projection. One launch for all."""
    entries, _, head_dim = new_keys.shape
    kv_heads = key_stores[0].shape[1]
    if key_head + kv_heads > new_keys.shape[1] or value_head + kv_heads > new_values.shape[1]:
        raise ValueError("the new rows hold every head of the stores")
    if rotation is None and max(kinds) >= QUANTIZED:
        raise ValueError("rows stored rotated need their rotation")
    shifts = [None] * len(key_stores)
    if sinks:
        shifts = list(zip(sink_cos, sink_sin, strict=True))
    stores = zip(key_stores, value_stores, slots, shifts, strict=True)
    table_entries = sum((_write_entries(*store) for store in stores), ())
    if len(table_entries) != entries * WRITE_COLUMNS:
        raise ValueError("one new key and value a slot")
    new_keys, new_values = _rows_contiguous(new_keys), _rows_contiguous(new_values)
    key_rope = key_cos is not None and key_sin is not None
    if key_rope:
        key_cos, key_sin = _rope_rows(key_cos), _rope_rows(key_sin)
    table = _TABLES.table(table_entries, new_keys.device, WRITE_COLUMNS)
    _write_rows[(entries, kv_heads, 2)](
        new_keys[:, key_head:],
        new_values[:, value_head:],
        table,
        key_cos if key_rope else table,  # never read without
        key_sin if key_rope else table,
        key_cos.stride(0) if key_rope and key_cos.shape[0] > 1 else 0,
        new_keys.stride(0),
        new_keys.stride(1),
        new_values.stride(0),
        new_values.stride(1),
        D=head_dim,
        KEY_KIND=kinds[0],
        VALUE_KIND=kinds[1],
        KEY_ROW=key_stores[0].shape[3] * key_stores[0].element_size(),
        VALUE_ROW=value_stores[0].shape[3] * value_stores[0].element_size(),
        SINKS=sinks,
        INTERLEAVED=interleaved,
        ROTARY=rotary,
        KEY_ROPE=key_rope,
    )


def _rope_rows(table: torch.Tensor) -> torch.Tensor:
    """A RoPE table ([rows, 1, head_dim] or [rows, head_dim]) as fp32 rows read whole."""
    table = table.reshape(table.shape[0], table.shape[-1])
    return (table if table.stride(-1) == 1 else table.contiguous()).float()


@write_stored.register_fake
def _(
    new_keys,
    new_values,
    key_stores,
    value_stores,
    slots,
    kinds,
    rotation,
    sink_cos,
    sink_sin,
    sinks,
    interleaved,
    rotary,
    key_cos=None,
    key_sin=None,
    key_head=0,
    value_head=0,
):
    return None
