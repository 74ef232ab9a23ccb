"""The sliding-window cache against a naive StreamingLLM reference: for every query, the
kept tokens are the sinks plus the last `window`, placed at consecutive positions within the
cache, and attention over them computed from scratch."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from cache_snapshots import restore, snapshot

from miniapp.engine.kv.cache import KVCache, RotatingKVCache
from miniapp.engine.ops.layers import Rope, apply_rope

HEADS, KV_HEADS, HEAD_DIM = 4, 2, 16


def _stream(n_tokens: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    shape = (n_tokens, HEADS, HEAD_DIM), (n_tokens, KV_HEADS, HEAD_DIM)
    return (
        torch.randn(*shape[0], generator=g),
        torch.randn(*shape[1], generator=g),
        torch.randn(*shape[1], generator=g),
    )


def _rope() -> Rope:
    return Rope(HEAD_DIM, HEAD_DIM, 10000.0, interleaved=False)


def _ours(cache, rope, q_raw, k_raw, v, chunks, start: int = 0):
    """Feed the stream through `cache` as the model does; attention outputs per query."""
    outputs, position = [], start
    chunks = list(chunks)
    while position < len(q_raw):
        wanted = chunks.pop(0) if chunks else 1
        n = min(wanted, cache.max_chunk(), len(q_raw) - position)
        tables = rope.tables(position, n)
        q = apply_rope(q_raw[position : position + n], tables).transpose(0, 1)[None]
        k = apply_rope(k_raw[position : position + n], tables).transpose(0, 1)[None]
        mask = cache.make_mask(n)
        keys, values = cache.update_and_fetch(k, v[position : position + n].transpose(0, 1)[None])
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)
        outputs.append(out[0].transpose(0, 1))
        position += n
    return torch.cat(outputs)


def _reference(q_raw, k_raw, v, sinks: int, window: int):
    """Per query: sinks + last `window` tokens at cache positions 0, 1, 2, ..., naive maths."""
    rope, outputs = _rope(), []
    for t in range(len(q_raw)):
        kept = list(range(min(sinks, t + 1))) + list(range(max(sinks, t - window + 1), t + 1))
        keys = torch.stack(
            [apply_rope(k_raw[p][None], rope.tables(i, 1))[0] for i, p in enumerate(kept)]
        )
        query = apply_rope(q_raw[t][None], rope.tables(len(kept) - 1, 1))[0]
        group = HEADS // KV_HEADS
        out = []
        for h in range(HEADS):
            scores = keys[:, h // group] @ query[h] / math.sqrt(HEAD_DIM)
            out.append(torch.softmax(scores, 0) @ v[kept, h // group])
        outputs.append(torch.stack(out))
    return torch.stack(outputs)


@pytest.mark.parametrize("sinks", [0, 4])
@pytest.mark.parametrize("chunks", [[1] * 200, [60, 33, 7], [200]], ids=["decode", "mixed", "one"])
def test_attention_equals_naive_reference_over_kept_tokens(sinks, chunks):
    q, k, v = _stream(200)
    window, slack = 24, 8  # the ring wraps many times over 200 tokens
    cache = RotatingKVCache(KV_HEADS, HEAD_DIM, sinks, window, slack, _rope())
    ours = _ours(cache, _rope(), q, k, v, chunks)
    torch.testing.assert_close(ours, _reference(q, k, v, sinks, window), rtol=1e-4, atol=1e-4)
    assert cache.wrapped and cache.offset == 200
    assert cache.keys.shape[2] == 2 * sinks + window + slack  # constant memory


def test_sinks_are_kept_at_their_own_positions():
    q, k, v = _stream(120)
    rope = _rope()
    cache = RotatingKVCache(KV_HEADS, HEAD_DIM, 4, 16, 4, rope)
    _ours(cache, rope, q, k, v, [1] * 120)
    first_four = apply_rope(k[:4], rope.tables(0, 4)).transpose(0, 1)[None]
    torch.testing.assert_close(cache.keys[:, :, :4], first_four)
    torch.testing.assert_close(cache.values[:, :, :4], v[:4].transpose(0, 1)[None])
    assert cache.frame == 120 - 1 - (4 + 16 - 1)  # sinks sit right before the window


@pytest.mark.parametrize("sinks", [0, 4])
def test_trim_across_the_wrap_is_exact(sinks):
    """Speculative roll-back: write 6 tokens (pushing older ones out), trim them, write
    others; the result equals never having written the 6."""
    window, slack = 16, 8
    q, k, v = _stream(100)
    q2, k2, v2 = _stream(100, seed=1)
    rope = _rope()
    rolled = RotatingKVCache(KV_HEADS, HEAD_DIM, sinks, window, slack, rope)
    _ours(rolled, rope, q[:90], k[:90], v[:90], [1] * 90)
    head_before = rolled.ring_head
    _ours(rolled, rope, q2[:96], k2[:96], v2[:96], [1] * 6, start=90)  # drafts at 90..95
    assert rolled.ring_head != head_before and rolled.can_trim(6)
    assert rolled.trim(6) == 6 and rolled.offset == 90
    out = _ours(rolled, rope, q[:100], k[:100], v[:100], [1] * 10, start=90)
    fresh = RotatingKVCache(KV_HEADS, HEAD_DIM, sinks, window, slack, rope)
    expected = _ours(fresh, rope, q, k, v, [1] * 100)[90:]
    torch.testing.assert_close(out, expected)
    assert not rolled.can_trim(slack + 2)  # beyond the slack the window would have holes


def test_ring_wraparound_positions():
    cache = RotatingKVCache(1, 2, sinks=2, window=5, slack=2, rope=_rope_small())
    for _ in range(12):
        cache.update_and_fetch(torch.zeros(1, 1, 1, 2), torch.zeros(1, 1, 1, 2))
    # Positions 0, 1 are sinks; the ring holds the last 7 (window + slack): 5..11.
    assert sorted(cache.ring_pos.tolist()) == list(range(5, 12))
    assert cache.ring_head == (12 - 2) % 7
    mask = cache.make_mask(1)
    assert mask.shape == (1, 2 + 7) and mask.sum() == 2 + 5  # sinks + window


def _rope_small() -> Rope:
    return Rope(2, 2, 10000.0, interleaved=False)


@pytest.mark.parametrize("cache_kind", ["full", "rotating"])
def test_forget_closes_the_gap_without_recomputing(cache_kind):
    """Dropping positions 10..19 then continuing equals a stream that never had them."""
    q, k, v = _stream(60)
    rope = _rope()

    def make():
        if cache_kind == "full":
            return KVCache(KV_HEADS, HEAD_DIM, 128, rope=rope)
        return RotatingKVCache(KV_HEADS, HEAD_DIM, 4, 64, 8, rope)

    cache = make()
    _ours(cache, rope, q[:40], k[:40], v[:40], [40])
    cache.forget(10, 20)
    assert cache.offset == 30
    keep = list(range(10)) + list(range(20, 60))
    out = _ours(cache, rope, q[keep], k[keep], v[keep], [1] * 20, start=30)
    expected = _ours(make(), rope, q[keep], k[keep], v[keep], [50])[30:]
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)


def test_state_round_trip():
    q, k, v = _stream(50)
    rope = _rope()
    cache = RotatingKVCache(KV_HEADS, HEAD_DIM, 4, 16, 4, rope)
    _ours(cache, rope, q[:40], k[:40], v[:40], [1] * 40)
    saved = snapshot(cache)
    after = _ours(cache, rope, q, k, v, [1] * 10, start=40)
    restore(cache, saved)
    again = _ours(cache, rope, q, k, v, [1] * 10, start=40)
    torch.testing.assert_close(after, again)
