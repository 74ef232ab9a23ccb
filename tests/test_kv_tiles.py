"""Keys stored as q4 tiles (KIVI's layout: 4-bit codes per channel over tiles of 32 tokens):
the native tile codec against the torch reference bit for bit and within the tile's error
bound, and the native attention over tiles, lead rows (a ring's sinks) and each query's own
tile in fp32 against its float64 reference, rows exact alone and together."""

from __future__ import annotations

import pytest
import torch

from miniapp.engine.kv import codec as kv_codec
from miniapp.engine.kv.cache import KVCache, RotatingKVCache
from miniapp.engine.kv.codec import TILE_ROWS, KVCodec
from miniapp.engine.kv.types import F32, Q4, Q8, KVPair
from miniapp.engine.ops.layers import Rope, apply_rope
from miniapp.engine.platform.kernels import cpu_int4_kernel
from miniapp.native import reference
from miniapp.native.attention import Q4_TILES, NativeAttention, NativeKVCodec, TiledKeys

CPU = torch.device("cpu")
TOLERANCE = 2e-5  # of the outputs' scale: fp32 sums over a few hundred keys


@pytest.fixture(scope="module")
def library():
    choice = cpu_int4_kernel()
    assert choice.native, f"the native library must build and load here: {choice.reason}"
    return choice.library


def _keys(heads, tokens, head_dim, seed=0):
    """Rows shaped as real keys: an offset and a scale per channel (a few large channels that
    are large for every token), one channel constant over the first tile (scale 0)."""
    generator = torch.Generator().manual_seed(seed)
    offsets = torch.randn(heads, 1, head_dim, generator=generator) * 4
    x = torch.randn(heads, tokens, head_dim, generator=generator) + offsets
    x[:, :, 5] *= 10
    x[:, :TILE_ROWS, 7] = 1.5
    return x[None]


@pytest.mark.parametrize("head_dim", [64, 256])
def test_native_tiles_are_the_torch_reference_bit_for_bit_within_the_bound(library, head_dim):
    codec, width = NativeKVCodec(library), Q4.width(head_dim)
    x = _keys(3, 4 * TILE_ROWS, head_dim)
    storage = torch.full((1, 3, 5 * TILE_ROWS, width), 0xAB, dtype=torch.uint8)
    codec.encode_tiles(x, storage[:, :, TILE_ROWS:])  # into a view, as a cache writes them
    assert torch.equal(storage[:, :, TILE_ROWS:], kv_codec.encode_tiles(x))
    assert bool((storage[:, :, :TILE_ROWS] == 0xAB).all())  # nothing written outside it
    decoded = codec.decode_tiles(storage[:, :, TILE_ROWS:], head_dim)
    assert torch.equal(decoded, kv_codec.decode_tiles(storage[:, :, TILE_ROWS:], head_dim))
    tiles = x.reshape(1, 3, 4, TILE_ROWS, head_dim)
    spread = tiles.amax(-2, keepdim=True) - tiles.amin(-2, keepdim=True)
    # Half a step, the f16 rounding of the minimum and of the step (15 of them), and slack.
    bound = spread / 30 + tiles.abs().amax(-2, keepdim=True) * 2.0**-10 + spread * 2.0**-8
    error = (decoded.reshape(tiles.shape) - tiles).abs()
    assert bool((error <= bound).all())
    assert error.max() > 0  # quantized: the test would notice if it were not
    assert bool((error[0, :, 0, :, 7] == 0).all())  # a constant channel is exact


def _case(head_dim, kv_heads, complete, partial, lead_rows, seed):
    """Stored tiles (complete ones, then `partial` rows of the last, every row's own), their
    fp32 originals, lead rows and a recent buffer holding the last two tiles' rows exactly.
    What must not be read is poisoned with large values (a NaN score would only vanish in
    the softmax): the incomplete tile's storage, and recent rows of no tile."""
    tokens = complete * TILE_ROWS + partial
    n_tiles = -(-tokens // TILE_ROWS)
    exact = _keys(kv_heads, n_tiles * TILE_ROWS, head_dim, seed)
    stored = torch.full((1, kv_heads, exact.shape[2], Q4.width(head_dim)), 0x77, dtype=torch.uint8)
    done = complete * TILE_ROWS
    stored[:, :, :done] = kv_codec.encode_tiles(exact[:, :, :done])
    recent = torch.full((kv_heads, 2 * TILE_ROWS, head_dim), 1e4)
    for tile in range(max(n_tiles - 2, 0), n_tiles):
        rows = exact[0, :, tile * TILE_ROWS : (tile + 1) * TILE_ROWS]
        recent[:, (tile % 2) * TILE_ROWS : (tile % 2 + 1) * TILE_ROWS] = rows
    lead = _keys(kv_heads, lead_rows, head_dim, seed + 1)[0] if lead_rows else None
    return stored[:, :, :tokens], exact, recent, lead


def _reference(queries, stored, recent, lead, own_tiles, values, lengths, scale):
    """Scores per key kind as the kernel takes them, then softmax and values in float64."""
    rows, n_heads, head_dim = queries.shape
    kv_heads = stored.shape[1]
    group = n_heads // kv_heads
    codes, tables = kv_codec.tile_tables(_whole_tiles(stored), head_dim)
    lead_rows = 0 if lead is None else lead.shape[1]
    out = torch.zeros(queries.shape, dtype=torch.float64)
    for r in range(rows):
        for h in range(n_heads):
            kv, q = h // group, queries[r, h]
            scores = []
            for j in range(lengths[r]):
                if j < lead_rows:
                    scores.append(q.double() @ lead[kv, j].double())
                    continue
                i = j - lead_rows
                tile = i // TILE_ROWS
                if tile == own_tiles[r]:
                    row = recent[kv, (tile % 2) * TILE_ROWS + i % TILE_ROWS]
                    scores.append(q.double() @ row.double())
                else:
                    scores.append(
                        reference.tiled_key_scores(q, codes[0, kv, i : i + 1], tables[0, kv, tile])[
                            0
                        ]
                    )
            weights = torch.softmax(torch.stack(scores) * scale, dim=0)
            out[r, h] = weights @ values[kv, : lengths[r]].double()
    return out


def _whole_tiles(stored):
    """The stored rows padded to whole tiles (the padding is never read as a key)."""
    pad = -stored.shape[2] % TILE_ROWS
    return torch.nn.functional.pad(stored, (0, 0, 0, pad)) if pad else stored


@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "complete", "partial", "lead_rows"),
    [(9, 3, 64, 9, 5, 0), (9, 3, 64, 12, 0, 4), (4, 1, 256, 3, 31, 4), (6, 2, 64, 1, 1, 0)],
)
def test_attention_over_tiles_is_the_reference(
    library, heads, kv_heads, head_dim, complete, partial, lead_rows
):
    stored, _, recent, lead = _case(head_dim, kv_heads, complete, partial, lead_rows, seed=1)
    tokens = lead_rows + stored.shape[2]
    value_codec = KVCodec(Q4, head_dim, CPU)  # rotated q4 values, as the q4 cache keeps them
    values = value_codec.encode(_keys(kv_heads, tokens, head_dim, seed=9))
    last = (stored.shape[2] - 1) // TILE_ROWS
    # The newest token; one a few back; one whose own tile is the one before the last (a
    # verification row before a tile boundary); the first token after the lead rows.
    lengths = [tokens, tokens - 2, lead_rows + last * TILE_ROWS, lead_rows + 1]
    own = [last, (tokens - 3 - lead_rows) // TILE_ROWS, last - 1, 0]
    queries = torch.randn(len(lengths), heads, head_dim, generator=torch.Generator().manual_seed(3))
    tiled = TiledKeys(lead, recent, torch.tensor(own, dtype=torch.int32))
    poisoned = torch.full_like(queries, float("nan"))
    got = NativeAttention(library)(
        queries,
        stored[0],
        values[0],
        0.125,
        lengths=torch.tensor(lengths),
        kv_type=(Q4_TILES, Q4.code),
        out=poisoned,
        tiled=tiled,
    )
    want = _reference(
        queries, stored, recent, lead, own, value_codec.decode(values)[0], lengths, 0.125
    )
    assert bool(torch.isfinite(got).all())
    assert (got.double() - want).abs().max() < TOLERANCE * want.abs().max()


def test_tiled_rows_are_bit_identical_alone_and_together(library):
    """Verification rows (one call, each with its own length and own tile) come out as each
    row's call of its own, across a tile boundary."""
    attend, head_dim = NativeAttention(library), 64
    stored, _, recent, lead = _case(head_dim, 3, 20, 0, 4, seed=5)
    tokens = 4 + stored.shape[2]
    values = torch.randn(3, tokens, head_dim, generator=torch.Generator().manual_seed(6))
    boundary = 4 + 19 * TILE_ROWS  # the first key of the last tile
    lengths = torch.arange(boundary - 4, boundary + 5, dtype=torch.int32)
    own = torch.tensor([(int(n) - 1 - 4) // TILE_ROWS for n in lengths], dtype=torch.int32)
    assert len(set(own.tolist())) == 2  # the rows cross a tile boundary
    queries = torch.randn(9, 9, head_dim, generator=torch.Generator().manual_seed(7))
    together = attend(
        queries,
        stored[0],
        values,
        0.125,
        lengths=lengths,
        kv_type=(Q4_TILES, F32.code),
        tiled=TiledKeys(lead, recent, own),
    )
    for r in range(9):
        alone = attend(
            queries[r : r + 1],
            stored[0],
            values,
            0.125,
            lengths=lengths[r : r + 1],
            kv_type=(Q4_TILES, F32.code),
            tiled=TiledKeys(lead, recent, own[r : r + 1]),
        )
        assert torch.equal(together[r : r + 1], alone)


def test_a_batch_of_sequences_with_tiled_keys_gives_each_row_as_alone(library):
    """A batch's decode steps in one call (each its own cache: tiles with sinks, tiles
    without, q8 rows) come out as each row's call of its own."""
    attend, head_dim = NativeAttention(library), 64
    with_lead = _case(head_dim, 3, 10, 7, 4, seed=11)
    without = _case(head_dim, 3, 4, 0, 0, seed=12)
    rows_q8 = KVCodec(Q8, head_dim, CPU).encode(_keys(3, 90, head_dim, seed=13))[0]
    keys = [with_lead[0][0], without[0][0], rows_q8]
    generator = torch.Generator().manual_seed(15)
    values = [
        torch.randn(3, k.shape[1] + lead, head_dim, generator=generator)
        for k, lead in zip(keys, (4, 0, 0), strict=True)
    ]
    tiled = [
        TiledKeys(with_lead[3], with_lead[2], torch.tensor([10], dtype=torch.int32)),
        TiledKeys(None, without[2], torch.tensor([3], dtype=torch.int32)),
        None,
    ]
    masks = [torch.arange(4 + 327) % 5 != 1, None, None]
    codes = [(Q4_TILES, F32.code), (Q4_TILES, F32.code), (Q8.code, F32.code)]
    queries = torch.randn(3, 9, head_dim, generator=torch.Generator().manual_seed(14))
    batch = attend.sequences(queries, keys, values, 0.125, masks, codes, tiled)
    for r in range(3):
        mask = None if masks[r] is None else masks[r][None]
        alone = attend(
            queries[r : r + 1].contiguous(),
            keys[r],
            values[r],
            0.125,
            mask=mask,
            kv_type=codes[r],
            tiled=tiled[r],
        )
        assert torch.equal(batch[r : r + 1], alone)
    assert not torch.equal(batch[0], batch[1])


def test_tiles_are_refused_where_the_kernel_cannot_read_them(library):
    attend, head_dim = NativeAttention(library), 64
    stored, _, recent, _ = _case(head_dim, 3, 2, 5, 0, seed=2)
    values = torch.zeros(3, stored.shape[2], head_dim)
    queries = torch.zeros(1, 9, head_dim)
    with pytest.raises(ValueError, match="lead and recent"):
        attend(queries, stored[0], values, 0.125, kv_type=(Q4_TILES, 0))
    not_own = TiledKeys(None, recent, torch.tensor([1], dtype=torch.int32))  # it is tile 2
    with pytest.raises(ValueError, match="incomplete last tile"):
        attend(queries, stored[0], values, 0.125, kv_type=(Q4_TILES, 0), tiled=not_own)


def _cache_keys(cache):
    """A cache's keys as its newest token reads them, fp32 [kv_heads, tokens, head_dim]."""
    fetched, _ = (
        cache._fetched()
        if isinstance(cache, RotatingKVCache)
        else (cache.keys[:, :, : cache.offset], None)
    )
    return cache.decode_keys(fetched)[0]


def test_a_cache_stores_the_same_tiles_written_at_once_one_by_one_or_rolled_back():
    """Tiles are encoded from exact rows when they complete, so a prompt written at once,
    token by token, or with speculative roll-backs across tile boundaries stores the same
    bits; complete tiles read as their encoding, the newest tile exactly."""
    head_dim, n = 64, 150
    x = _keys(3, n, head_dim, seed=4)
    caches = [KVCache(3, head_dim, 512, kv_type=Q4) for _ in range(3)]
    caches[0].update_and_fetch(x, x)
    for t in range(n):
        caches[1].update_and_fetch(x[:, :, t : t + 1], x[:, :, t : t + 1])
    generator, at = torch.Generator().manual_seed(5), 0
    while at < n:  # write up to 5 rows (the last ones wrong), keep some, trim the rest
        count = min(5, n - at)
        keep = int(torch.randint(1, count + 1, (1,), generator=generator))
        rows = x[:, :, at : at + count].clone()
        rows[:, :, keep:] += 100.0  # rejected drafts: never seen again
        caches[2].update_and_fetch(rows, rows)
        caches[2].trim(count - keep)
        at += keep
    complete = n // TILE_ROWS * TILE_ROWS
    for cache in caches[1:]:
        assert torch.equal(cache.keys[:, :, :complete], caches[0].keys[:, :, :complete])
        assert torch.equal(_cache_keys(cache), _cache_keys(caches[0]))
    read = _cache_keys(caches[0])
    encoded = kv_codec.decode_tiles(kv_codec.encode_tiles(x[:, :, :complete]), head_dim)
    assert torch.equal(read[:, :complete], encoded[0])
    assert torch.equal(read[:, complete:], x[0, :, complete:])


def test_a_ring_of_tiles_wrapping_reads_each_tile_as_encoded_from_its_rows():
    """A ring with sinks, written token by token and in prompt chunks through several wraps:
    both store the same bits; every complete tile reads as the encoding of the exact rows its
    slots hold, the newest token's own tile holds them exactly, and the sinks are fp32."""
    head_dim, sinks, window = 64, 4, 60
    rope = Rope(head_dim, head_dim, 10000.0, interleaved=False)
    x = _keys(2, 400, head_dim, seed=6)
    one = RotatingKVCache(2, head_dim, sinks, window, 4, rope, kv_type=Q4)
    chunked = RotatingKVCache(2, head_dim, sinks, window, 4, rope, kv_type=Q4)
    assert one.ring_capacity % (2 * TILE_ROWS) == 0
    for t in range(x.shape[2]):
        one.update_and_fetch(x[:, :, t : t + 1], x[:, :, t : t + 1])
    at = 0
    while at < x.shape[2]:
        take = min(chunked.max_chunk(), 7, x.shape[2] - at)
        chunked.update_and_fetch(x[:, :, at : at + take], x[:, :, at : at + take])
        at += take
    assert one.wrapped and one.offset - sinks > 4 * one.ring_capacity
    assert torch.equal(one.keys, chunked.keys)
    assert torch.equal(_cache_keys(one), _cache_keys(chunked))
    read = _cache_keys(one)[:, sinks:]  # the ring, slot by slot
    exact = x[0][:, one.ring_pos]  # each slot's row
    own = (one.ring_head - 1) % one.ring_capacity // TILE_ROWS
    for tile in range(one.ring_capacity // TILE_ROWS):
        slots = slice(tile * TILE_ROWS, (tile + 1) * TILE_ROWS)
        if tile == own:  # written in this lap up to the newest: exact
            newest = (one.ring_head - 1) % TILE_ROWS + 1
            lap = slice(tile * TILE_ROWS, tile * TILE_ROWS + newest)
            assert torch.equal(read[:, lap], exact[:, lap])
            continue
        encoded = kv_codec.decode_tiles(kv_codec.encode_tiles(exact[None, :, slots]), head_dim)
        assert torch.equal(read[:, slots], encoded[0])
    sinks_read = _cache_keys(one)[:, :sinks]
    shifted = rope.shift_tables(one.frame)
    truth = apply_rope(x[0, :, :sinks].transpose(0, 1), shifted).transpose(0, 1)
    assert torch.allclose(sinks_read, truth, atol=1e-4)


def test_forgetting_positions_rewrites_only_the_tiles_from_there():
    head_dim = 64
    rope = Rope(head_dim, head_dim, 10000.0, interleaved=False)
    x = _keys(2, 200, head_dim, seed=8)
    cache = KVCache(2, head_dim, 512, rope=rope, kv_type=Q4)
    cache.update_and_fetch(x, x)
    before = cache.keys[:, :, :64].clone()
    cache.forget(70, 90)
    assert cache.offset == 180 and torch.equal(cache.keys[:, :, :64], before)
    moved = apply_rope(x[0, :, 90:].transpose(0, 1), rope.shift_tables(-20)).transpose(0, 1)
    truth = torch.cat([x[0, :, :70], moved], dim=1)
    read = _cache_keys(cache)
    # Rows from tile 2 on were decoded, turned and encoded again: two quantizations, the
    # first one's error turned with its channel's RoPE partner (so, per pair of channels).
    spread = truth.amax(1, keepdim=True) - truth.amin(1, keepdim=True)
    half = head_dim // 2
    pair = torch.maximum(spread[..., :half], spread[..., half:]).repeat(1, 1, 2)
    assert bool(((read - truth).abs() <= pair / 15).all())
    assert torch.equal(read[:, 172:], truth[:, 172:])  # rows that were exact still are


def test_a_first_chunk_that_fills_the_sinks_and_starts_the_ring_attends_natively(library):
    """A short first prompt on a streaming cache: its rows that became sinks read lead rows
    only, the others their ring tile; the native kernel reads them all in one call."""
    head_dim, sinks, n = 64, 4, 9
    rope = Rope(head_dim, head_dim, 10000.0, interleaved=False)
    cache = RotatingKVCache(2, head_dim, sinks, 60, 4, rope, kv_type=KVPair(Q4, F32))
    x = _keys(2, n, head_dim, seed=9)
    mask = cache.make_mask(n)
    keys, values = cache.update_and_fetch(x, x)
    tiled = cache.tiled_keys(n)
    assert tiled.own_tiles.tolist() == [-1] * sinks + [0] * (n - sinks)
    queries = torch.randn(n, 4, head_dim, generator=torch.Generator().manual_seed(10))
    got = NativeAttention(library)(
        queries, keys[0], values[0], 0.125, mask=mask, kv_type=(Q4_TILES, F32.code), tiled=tiled
    )
    # Nothing is quantized yet (the ring's tile is the rows' own) and the frame is still 0.
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    want = torch.nn.functional.scaled_dot_product_attention(
        queries.transpose(0, 1)[None], x, x, attn_mask=causal, scale=0.125, enable_gqa=True
    )[0].transpose(0, 1)
    assert torch.allclose(got, want, atol=1e-5)
