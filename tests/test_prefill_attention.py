"""A long prompt chunk on a GPU attends in one fused causal call (attention_backends.py),
where the CPU and speculative verification keep one call a row: the fused call must give
each row what its own call gives, up to rounding."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from miniapp.engine.models.attention_backends import (
    FUSED_PREFIX_ROWS,
    causal_prefix_attention,
    fuses_prefixes,
)

HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64  # SmolLM2's grouping: three query heads a key head


def _one_call_a_row(queries, keys, values, before, scale):
    rows = [
        F.scaled_dot_product_attention(
            queries[None, :, r : r + 1],
            keys[:, :, : before + r + 1],
            values[:, :, : before + r + 1],
            enable_gqa=True,
            scale=scale,
        )
        for r in range(queries.shape[1])
    ]
    return torch.cat(rows, dim=2)


def test_a_fused_prompt_chunk_gives_each_row_its_own_calls_result():
    generator = torch.Generator().manual_seed(0)
    rows, before, spare = 48, 70, 10  # the storage holds more slots than the rows see
    queries = torch.randn(HEADS, rows, HEAD_DIM, generator=generator)
    keys = torch.randn(1, KV_HEADS, before + rows + spare, HEAD_DIM, generator=generator)
    values = torch.randn(1, KV_HEADS, before + rows + spare, HEAD_DIM, generator=generator)
    scale = HEAD_DIM**-0.5
    fused = causal_prefix_attention(queries, keys, values, before, scale)
    each = _one_call_a_row(queries, keys, values, before, scale)
    assert fused.shape == each.shape == (1, HEADS, rows, HEAD_DIM)
    assert (fused - each).abs().max() < 1e-5
    # The last keys are seen by the last row only: changing them moves no other row.
    keys[:, :, before + rows - 1] += 1.0
    moved = causal_prefix_attention(queries, keys, values, before, scale)
    assert torch.equal(moved[:, :, :-1], fused[:, :, :-1])
    assert not torch.equal(moved[:, :, -1], fused[:, :, -1])


def test_only_a_prompt_chunk_off_the_cpu_is_fused():
    chunk, verification = FUSED_PREFIX_ROWS, 8
    assert not fuses_prefixes(torch.empty(HEADS, chunk, HEAD_DIM))  # the CPU: bit-exact rows
    # Any other device (the meta device stands in for a GPU here).
    assert fuses_prefixes(torch.empty(HEADS, chunk, HEAD_DIM, device="meta"))
    assert not fuses_prefixes(torch.empty(HEADS, verification, HEAD_DIM, device="meta"))
