"""The native decode attention (`native/attention.py`) against its float64 reference: grouped
heads, key counts across part boundaries, masks, and rows bit-identical whether attended in a
batch or alone, with one thread or two (speculative verification relies on it)."""

from __future__ import annotations

import pytest
import torch

from miniapp.engine.platform.kernels import cpu_int4_kernel
from miniapp.native import reference
from miniapp.native.attention import NativeAttention

TOLERANCE = 2e-5  # of the values' scale: fp32 sums over up to ~3000 keys


@pytest.fixture(scope="module")
def attend():
    choice = cpu_int4_kernel()
    assert choice.native, f"the native library must build and load here: {choice.reason}"
    return NativeAttention(choice.library)


def _cache(kv_heads, tokens, head_dim, seed=0, capacity=None):
    """Keys and values as a cache holds them: a view of the first `tokens` of a larger
    storage (so the head stride is the capacity's)."""
    generator = torch.Generator().manual_seed(seed)
    capacity = capacity or tokens + 7
    keys = torch.randn(kv_heads, capacity, head_dim, generator=generator)
    values = torch.randn(kv_heads, capacity, head_dim, generator=generator)
    return keys[:, :tokens], values[:, :tokens]


def _queries(rows, heads, head_dim, seed=1):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(rows, heads, head_dim, generator=generator) * 2


@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "tokens"),
    [(9, 3, 64, 37), (9, 3, 64, 1300), (4, 1, 256, 700), (8, 8, 32, 5), (2, 1, 64, 512)],
)
def test_rows_match_the_reference(attend, heads, kv_heads, head_dim, tokens):
    keys, values = _cache(kv_heads, tokens, head_dim)
    lengths = [tokens, max(tokens - 3, 1), 1, tokens // 2 + 1]
    queries = _queries(len(lengths), heads, head_dim)
    got = attend(queries, keys, values, 0.125, lengths=torch.tensor(lengths))
    want = reference.attend_rows(queries, keys, values, 0.125, lengths=lengths)
    assert (got.double() - want).abs().max() < TOLERANCE * want.abs().max()


def test_masked_rows_match_the_reference_and_a_row_that_sees_nothing_is_zero(attend):
    keys, values = _cache(3, 900, 64)
    generator = torch.Generator().manual_seed(5)
    mask = torch.rand(3, 900, generator=generator) < 0.7
    mask[2] = False
    queries = _queries(3, 9, 64)
    got = attend(queries, keys, values, 0.125, mask=mask)
    want = reference.attend_rows(queries, keys, values, 0.125, mask=mask)
    assert (got.double() - want).abs().max() < TOLERANCE * want.abs().max()
    assert torch.equal(got[2], torch.zeros_like(got[2]))


def test_a_row_is_bit_identical_alone_in_a_batch_and_on_any_thread_count(attend):
    keys, values = _cache(3, 1400, 64)
    lengths = torch.tensor([1391, 1392, 1393, 1394, 1395, 1396, 1397, 1398, 1399])
    queries = _queries(9, 9, 64)
    threads = torch.get_num_threads()
    try:
        batch = attend(queries, keys, values, 0.125, lengths=lengths)
        torch.set_num_threads(1)
        alone = [
            attend(queries[r : r + 1], keys, values, 0.125, lengths=lengths[r : r + 1])
            for r in range(9)
        ]
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(batch, torch.cat(alone))


def test_a_mask_marking_a_prefix_gives_the_prefix_result_bit_for_bit(attend):
    """A decode step with a mask and a verification row with a length see the same keys."""
    keys, values = _cache(3, 600, 64)
    queries = _queries(1, 9, 64)
    mask = torch.zeros(1, 600, dtype=torch.bool)
    mask[0, :600] = True
    by_mask = attend(queries, keys, values, 0.125, mask=mask)
    by_length = attend(queries, keys, values, 0.125, lengths=torch.tensor([600]))
    assert torch.equal(by_mask, by_length)


def test_shapes_it_does_not_take_are_refused():
    assert NativeAttention.takes(9, 3, 64) and NativeAttention.takes(4, 1, 256)
    assert not NativeAttention.takes(9, 2, 64)  # heads not a multiple of kv heads
    assert not NativeAttention.takes(9, 3, 60)  # head_dim not a multiple of 8
    assert not NativeAttention.takes(32, 1, 64)  # more than 16 query heads per kv head


def test_without_lengths_or_mask_every_row_sees_every_key(attend):
    keys, values = _cache(3, 300, 64)
    queries = _queries(2, 9, 64)
    everything = attend(queries, keys, values, 0.125)
    by_length = attend(queries, keys, values, 0.125, lengths=torch.tensor([300, 300]))
    assert torch.equal(everything, by_length)


def test_a_row_longer_than_the_keys_is_refused(attend):
    keys, values = _cache(3, 50, 64)
    with pytest.raises(ValueError, match="refused"):
        attend(_queries(1, 9, 64), keys, values, 0.125, lengths=torch.tensor([51]))


def test_rows_of_different_sequences_in_one_call(attend):
    """A batch's decode steps: each row over its own cache (different lengths, storages,
    masks), bit-identical to a call of its own, and matching the reference."""
    heads, kv_heads, head_dim = 9, 3, 64
    sources = [
        _cache(kv_heads, n, head_dim, seed=s, capacity=n + 3 * s)
        for s, n in enumerate([5, 300, 37, 1024])
    ]
    keys = [k for k, _ in sources]
    values = [v for _, v in sources]
    masks = [None, torch.arange(300) % 3 != 0, None, torch.arange(1024) > 900]
    queries = _queries(4, heads, head_dim)
    got = attend.sequences(queries, keys, values, 0.125, masks)
    for row, (k, v, mask) in enumerate(zip(keys, values, masks, strict=True)):
        alone = attend(
            queries[row : row + 1].contiguous(),
            k,
            v,
            0.125,
            mask=None if mask is None else mask[None],
        )
        assert torch.equal(got[row : row + 1], alone)
    want = reference.attend_sequences(queries, keys, values, 0.125, masks)
    torch.testing.assert_close(got.double(), want, rtol=0, atol=TOLERANCE * 10)
    with pytest.raises(ValueError, match="one key, value and mask source per row"):
        attend.sequences(queries, keys[:3], values, 0.125, masks)
