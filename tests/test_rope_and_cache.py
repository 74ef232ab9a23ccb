from __future__ import annotations

import math

import pytest
import torch
from cache_snapshots import restore, snapshot

from miniapp.engine.errors import ContextFullError
from miniapp.engine.kv.cache import KVCache
from miniapp.engine.ops.layers import Rope, apply_rope


def _rotate_reference(x: torch.Tensor, position: int, base: float, interleaved: bool):
    """Textbook RoPE on one head vector, pair by pair."""
    d = x.shape[-1]
    out = x.clone()
    for i in range(d // 2):
        a, b = (2 * i, 2 * i + 1) if interleaved else (i, i + d // 2)
        angle = position * base ** (-2 * i / d)
        c, s = math.cos(angle), math.sin(angle)
        out[a] = x[a] * c - x[b] * s
        out[b] = x[a] * s + x[b] * c
    return out


@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("start,count", [(0, 5), (62, 5), (1000, 1), (5, 200)])
def test_rope_matrices_match_textbook(interleaved, start, count):
    rope = Rope(head_dim=16, rotary_dim=16, base=10000.0, interleaved=interleaved)
    heads = torch.randn(count, 3, 16)
    rotated = apply_rope(heads, rope.tables(start, count))
    for t in (0, count - 1):
        for h in range(3):
            expected = _rotate_reference(heads[t, h], start + t, 10000.0, interleaved)
            torch.testing.assert_close(rotated[t, h], expected, rtol=1e-5, atol=1e-5)


def test_rope_block_cache_gives_same_tables_as_fresh_build():
    rope = Rope(16, 16, 10000.0, interleaved=True)
    stepwise = torch.cat([rope.tables(p, 1).signed_sin for p in range(60, 70)])
    fresh = Rope(16, 16, 10000.0, interleaved=True).tables(60, 10).signed_sin
    torch.testing.assert_close(stepwise, fresh)


def test_sequences_decoding_far_apart_take_their_tables_from_kept_blocks(monkeypatch):
    # A batch's sequences sit at positions in different blocks: each block is built once
    # and kept, not built again every step for each sequence in turn. Past the blocks
    # kept, the least recently used goes first.
    rope = Rope(16, 16, 10000.0, interleaved=False)
    built = []
    build = rope._build
    monkeypatch.setattr(
        rope, "_build", lambda start, count: built.append(start) or build(start, count)
    )
    positions = [5, 1000, 70, 40000]
    for step in range(10):
        for p in positions:
            tables = rope.tables(p + step, 1)
            fresh = Rope(16, 16, 10000.0, interleaved=False).each_shift_tables(
                torch.tensor([[p + step]])
            )
            assert torch.equal(tables.cos, fresh.cos)
    assert sorted(built) == [0, 64, 960, 40000]
    for block in range(Rope.BLOCKS_KEPT):  # 64 new blocks push out all four
        rope.tables(100_000 + block * Rope.BLOCK, 1)
    rope.tables(5, 1)
    assert built.count(0) == 2


@pytest.mark.parametrize("interleaved", [True, False])
def test_linear_scaling_and_frequency_factors(interleaved):
    x = torch.randn(1, 1, 8)
    factors = torch.tensor([1.0, 2.0, 4.0, 8.0])
    scaled = Rope(8, 8, 10000.0, interleaved, position_scale=0.5, freq_factors=factors)
    out = apply_rope(x, scaled.tables(10, 1))[0, 0]
    expected = x[0, 0].clone()
    for i in range(4):
        a, b = (2 * i, 2 * i + 1) if interleaved else (i, i + 4)
        angle = 10 * 0.5 * 10000.0 ** (-2 * i / 8) / factors[i].item()
        c, s = math.cos(angle), math.sin(angle)
        expected[a], expected[b] = x[0, 0, a] * c - x[0, 0, b] * s, x[0, 0, a] * s + x[0, 0, b] * c
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_partial_rotary_leaves_tail_untouched():
    for interleaved in (True, False):
        rope = Rope(head_dim=16, rotary_dim=8, base=10000.0, interleaved=interleaved)
        x = torch.randn(1, 2, 16)
        out = apply_rope(x, rope.tables(7, 1))
        torch.testing.assert_close(out[..., 8:], x[..., 8:])
        assert not torch.allclose(out[..., :8], x[..., :8])


def test_kv_cache_update_trim_mask_state():
    cache = KVCache(n_kv_heads=2, head_dim=4, max_tokens=8)
    k = torch.randn(1, 2, 3, 4)
    keys, values = cache.update_and_fetch(k, k * 2)
    assert cache.offset == 3 and keys.shape == (1, 2, 3, 4)
    torch.testing.assert_close(values, k * 2)
    mask = cache.make_mask(2)
    assert mask.shape == (2, 5)
    assert mask.tolist() == [[True] * 4 + [False], [True] * 5]
    assert cache.make_mask(1) is None
    saved = snapshot(cache)
    assert cache.trim(2) == 2 and cache.offset == 1
    cache.update_and_fetch(torch.zeros(1, 2, 1, 4), torch.zeros(1, 2, 1, 4))
    restore(cache, saved)
    assert cache.offset == 3
    torch.testing.assert_close(cache.keys[:, :, :3], k)
    with pytest.raises(ContextFullError):
        cache.update_and_fetch(torch.zeros(1, 2, 6, 4), torch.zeros(1, 2, 6, 4))


def test_kv_cache_grows_on_demand_and_keeps_contents():
    cache = KVCache(n_kv_heads=1, head_dim=2, max_tokens=1000)
    assert cache.capacity == KVCache.INITIAL_TOKENS
    first = torch.randn(1, 1, 200, 2)
    cache.update_and_fetch(first, first)
    keys, _ = cache.update_and_fetch(torch.ones(1, 1, 300, 2), torch.ones(1, 1, 300, 2))
    assert cache.capacity == 512 and keys.shape[2] == 500
    torch.testing.assert_close(keys[:, :, :200], first)
    cache.update_and_fetch(torch.ones(1, 1, 480, 2), torch.ones(1, 1, 480, 2))
    assert cache.capacity == 1000  # capped at max_tokens
    with pytest.raises(ContextFullError):
        cache.update_and_fetch(torch.ones(1, 1, 21, 2), torch.ones(1, 1, 21, 2))
