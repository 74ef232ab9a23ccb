"""torch's attention (TorchAttention, the path off the CPU and of a graph-captured step) meets
16-bit and quantized rows in 16 bits off the CPU: the decoded rows take half the bytes, SDPA
its flash kernels, and the output goes to the int4 product without a cast. It must give the
fp32 attention up to bf16's rounding; fp32 rows and the CPU stay fp32."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from miniapp.engine.kv.cache import KVCache
from miniapp.engine.kv.types import kv_type
from miniapp.engine.models import attention_backends
from miniapp.engine.models.attention_backends import TorchAttention, attention_dtype

HEADS, KV_HEADS, HEAD_DIM = 6, 2, 64
SCALE = HEAD_DIM**-0.5


def _filled(kind: str, tokens: int, seed: int = 0) -> tuple[KVCache, torch.Tensor, torch.Tensor]:
    """A cache of `kind` decoded by torch (no native codec), holding `tokens` random rows, and
    what its last update returned (keys and values as stored)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MINIAPP_NATIVE", "0")
        cache = KVCache(KV_HEADS, HEAD_DIM, 4096, kv_type=kv_type(kind))
    generator = torch.Generator().manual_seed(seed)
    keys = torch.randn(1, KV_HEADS, tokens, HEAD_DIM, generator=generator)
    keys[..., 5] *= 12.0  # a large channel, as real keys have
    values = torch.randn(1, KV_HEADS, tokens, HEAD_DIM, generator=generator)
    stored_keys, stored_values = cache.update_and_fetch(keys, values)
    return cache, stored_keys, stored_values


def _fp32(queries, keys, values, cache, mask=None) -> torch.Tensor:
    """The reference: every stored row decoded to fp32, then attention in fp32."""
    keys, values = cache.decode_keys(keys), cache.value_codec.decode(values)
    return F.scaled_dot_product_attention(
        queries[None], keys, values, attn_mask=mask, enable_gqa=True, scale=SCALE
    )


@pytest.fixture
def off_the_cpu(monkeypatch):
    """Attention as it runs off the CPU, on the CPU (its SDPA takes bf16 too)."""
    monkeypatch.setattr(attention_backends, "reduced_precision", lambda device: True)


@pytest.mark.parametrize(
    ("kind", "dtype"),
    [
        ("f32", torch.float32),  # read as stored, no copy of the cache
        ("q8", torch.bfloat16),
        ("q4", torch.bfloat16),
        ("bf16", torch.bfloat16),
        ("f16", torch.float16),
        ("q8/f16", torch.bfloat16),
        ("q8/f32", torch.float32),
    ],
)
def test_off_the_cpu_16_bit_and_quantized_rows_meet_the_queries_in_16_bits(
    off_the_cpu, kind, dtype
):
    cache, keys, values = _filled(kind, 257)
    assert attention_dtype(torch.device("cpu"), cache) is dtype
    queries = torch.randn(HEADS, 1, HEAD_DIM, generator=torch.Generator().manual_seed(3))
    attention, tolerance = TorchAttention(SCALE), 1e-6 if dtype is torch.float32 else 0.02
    cases = [(attention.attend(queries, keys, values, cache), _fp32(queries, keys, values, cache))]
    if not cache.key_codec.tiled:  # rows of a verification step and of a prompt chunk
        three = queries.expand(-1, 3, -1)
        mask = torch.rand(3, 257, generator=torch.Generator().manual_seed(4)) > 0.3
        cases.append(
            (
                attention.attend_rows(three, keys, values, cache, mask),
                torch.cat(
                    [
                        _fp32(three[:, r : r + 1], keys, values, cache, mask[r : r + 1])
                        for r in range(3)
                    ],
                    2,
                ),
            )
        )
        cases.append(
            (
                attention.attend_prefixes(three, keys, values, cache, 254),
                _fp32(three, keys, values, cache, _prefixes(254, 3)),
            )
        )
    for got, want in cases:
        assert got.dtype is dtype and got.shape == want.shape
        difference = (got.float() - want).abs().max()
        assert difference < tolerance
        assert difference > 0 or dtype is torch.float32  # it did run in 16 bits


def _prefixes(before: int, rows: int) -> torch.Tensor:
    """[rows, before + rows]: row r sees the first before + r + 1 keys."""
    return torch.arange(before + rows)[None] <= before + torch.arange(rows)[:, None]


def test_on_the_cpu_attention_stays_fp32():
    cache, *_ = _filled("q8", 10)
    assert attention_dtype(torch.device("cpu"), cache) is torch.float32
