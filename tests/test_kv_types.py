"""The KV cache's storage types (`--kv-type`): the native codec against the torch reference
bit for bit, decoding within each type's error bound, the native attention reading every type
as its float64 reference over the decoded rows, rows exact alone and in a batch, sinks
re-rotated through 20 wraps of a ring without piling up error, and a bad name refused in one
line."""

from __future__ import annotations

import math

import pytest
import torch

from miniapp.engine.errors import MiniappError
from miniapp.engine.kv import codec as kv_codec
from miniapp.engine.kv.cache import RotatingKVCache
from miniapp.engine.kv.codec import KVCodec
from miniapp.engine.kv.types import (
    BLOCK,
    F16,
    F32,
    KV_TYPES,
    Q4,
    Q8,
    KVPair,
    bytes_per_token,
    kv_type,
)
from miniapp.engine.ops.layers import Rope
from miniapp.engine.platform.kernels import cpu_int4_kernel
from miniapp.native import reference
from miniapp.native.attention import NativeAttention, NativeKVCodec

CPU = torch.device("cpu")
KINDS = list(KV_TYPES.values())
# Keys and values stored apart: rotated keys with rotated values in fewer bits, with plain
# values, and plain keys with rotated values (each rotation undone on its own side).
PAIRS = [KVPair(Q8, Q4), KVPair(Q4, F32), KVPair(F16, Q8)]
ATTENTION_TOLERANCE = 2e-5  # of the outputs' scale: fp32 sums over up to ~1300 keys


@pytest.fixture(scope="module")
def library():
    choice = cpu_int4_kernel()
    assert choice.native, f"the native library must build and load here: {choice.reason}"
    return choice.library


def _rows(heads, tokens, head_dim, seed=0, scale=3.0):
    """Rows with the shape of real keys: mostly small, a few large channels."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(1, heads, tokens, head_dim, generator=generator) * scale
    x[..., 3] *= 8  # an outlier channel
    x[0, 0, 0, :5] = 0
    if head_dim >= BLOCK:
        x[0, -1, -1, :BLOCK] = 0  # a whole block of zeros: scale 0, codes 0
    return x


@pytest.mark.parametrize("head_dim", [64, 96, 256])
@pytest.mark.parametrize("kind", KINDS, ids=[k.name for k in KINDS])
@pytest.mark.parametrize("rotated", [True, False], ids=["rotated", "as-is"])
def test_the_native_codec_gives_the_torch_references_bits(library, kind, head_dim, rotated):
    native = NativeKVCodec(library)
    x = _rows(3, 37, head_dim)[:, :, 5:]  # a view with the caches' strides
    code = kind.code + (KVCodec.ROTATED if rotated else 0)
    stored = native.encode(code, x, kind.width(head_dim), kv_codec.storage_dtype(kind))
    want = kv_codec.encode(kind, x, rotated)
    assert stored.shape == want.shape == (1, 3, 32, kind.width(head_dim))
    assert torch.equal(stored.view(torch.uint8), want.contiguous().view(torch.uint8))
    poisoned = torch.full((1, 3, 32, head_dim), float("nan"))
    decoded = native.decode(code, stored, head_dim, out=poisoned)
    assert torch.equal(decoded, kv_codec.decode(kind, stored, head_dim, rotated))
    if kind.blocked:  # what the caches do: rotated rows, through the native codec
        codec = KVCodec(kind, head_dim, CPU)
        assert codec.rotated and codec.native is not None
        assert torch.equal(codec.encode(x), kv_codec.encode(kind, x))


@pytest.mark.parametrize("head_dim", [64, 96, 256])
def test_off_the_cpu_the_rotation_is_one_product_with_the_butterflies_values(head_dim):
    x = _rows(3, 37, head_dim, seed=2)
    matrix = kv_codec.rotation_matrix(head_dim, CPU)
    assert torch.allclose(x @ matrix, kv_codec.rotate(x), rtol=1e-6, atol=1e-5)
    assert torch.allclose(matrix @ matrix, torch.eye(head_dim), atol=1e-6)  # its own inverse
    for kind in (Q8, Q4):
        stored = kv_codec.encode(kind, x, matrix=matrix)
        butterflies = kv_codec.decode(kind, kv_codec.encode(kind, x), head_dim)
        by_product = kv_codec.decode(kind, stored, head_dim, matrix=matrix)
        # The same codes but where a value sits on a rounding edge: within one step.
        step = x.abs().amax() / (127 if kind is Q8 else 7.5)
        assert (by_product - butterflies).abs().max() <= step
    # A GPU's codec takes the product, the CPU's the native codec (the same bits as `rotate`).
    assert KVCodec(Q8, head_dim, torch.device("meta")).matrix is not None
    assert KVCodec(Q8, head_dim, CPU).matrix is None
    assert KVCodec(F16, head_dim, torch.device("meta")).matrix is None


@pytest.mark.parametrize("kind", KINDS, ids=[k.name for k in KINDS])
@pytest.mark.parametrize("rotated", [True, False], ids=["rotated", "as-is"])
def test_decoding_is_within_the_types_error_bound(kind, rotated):
    head_dim = 64
    rotated = rotated and kind.blocked
    x = _rows(3, 50, head_dim, seed=4)
    stored = kv_codec.encode(kind, x, rotated)
    error = (kv_codec.decode(kind, stored, head_dim, rotated) - x).double()
    if not kind.blocked:
        relative = {"f32": 0.0, "f16": 2.0**-11, "bf16": 2.0**-8}[kind.name]
        assert bool((error.abs() <= relative * x.abs().double() + 1e-30).all())
        return
    # Per block of the stored (rotated, for keys) values: at most half a step, with the
    # step scale / 127 (q8) or range / 15 (q4), plus the f16 rounding of scale and minimum.
    stored = kv_codec.rotate(x) if rotated else x
    blocks = stored.reshape(1, 3, 50, -1, BLOCK).double()
    if kind is Q8:
        step = blocks.abs().amax(-1) / 127
    else:
        step = (blocks.amax(-1) - blocks.amin(-1)) / 15
    bound = 0.5 * step * (1 + 2.0**-10) + blocks.abs().amax(-1) * 2.0**-10
    per_block = error.reshape(1, 3, 50, -1, BLOCK)
    if rotated:  # the rotation is orthogonal: the error's length per row is the same
        row_bound = (bound.square() * BLOCK).sum(-1).sqrt()
        assert bool((error.norm(dim=-1) <= row_bound * (1 + 1e-5)).all())
    else:
        assert bool((per_block.abs().amax(-1) <= bound).all())
    assert error.abs().max() > 0  # it is quantized: this test would notice it was not


@pytest.mark.parametrize("kind", KINDS + PAIRS, ids=[k.name for k in KINDS + PAIRS])
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "tokens"),
    [(9, 3, 64, 37), (9, 3, 64, 1300), (4, 1, 256, 700), (6, 2, 96, 300)],
)
def test_attention_reads_each_type_as_the_reference_over_its_decoded_rows(
    library, kind, heads, kv_heads, head_dim, tokens
):
    key_codec, value_codec = KVCodec(kind.key, head_dim, CPU), KVCodec(kind.value, head_dim, CPU)
    capacity = tokens + 9  # a view of a larger storage, as caches fetch them
    keys = key_codec.encode(_rows(kv_heads, capacity, head_dim, seed=1))[:, :, :tokens]
    values = value_codec.encode(_rows(kv_heads, capacity, head_dim, seed=2))[:, :, :tokens]
    lengths = [tokens, max(tokens - 3, 1), 1, tokens // 2 + 1]
    queries = torch.randn(len(lengths), heads, head_dim, generator=torch.Generator().manual_seed(3))
    poisoned = torch.full_like(queries, float("nan"))
    got = NativeAttention(library)(
        queries,
        keys[0],
        values[0],
        0.125,
        lengths=torch.tensor(lengths),
        kv_type=(kind.key.code, kind.value.code),
        out=poisoned,
    )
    if kind.key.blocked:  # the kernel dots q8 and q4 keys with the query in 8 bits
        queries = kv_codec.rotate(reference.quantized_query(kv_codec.rotate(queries)))
    want = reference.attend_rows(
        queries, key_codec.decode(keys)[0], value_codec.decode(values)[0], 0.125, lengths=lengths
    )
    assert (got.double() - want).abs().max() < ATTENTION_TOLERANCE * want.abs().max()


@pytest.mark.parametrize("kind", [Q8, Q4, KVPair(Q8, Q4)], ids=["q8", "q4", "q8/q4"])
def test_rows_are_bit_identical_alone_and_in_a_batch_of_mixed_types(library, kind):
    """Verification rows (one call, each its own length) and a batch's decode steps (one call,
    each its own cache and type) come out as each row's call of its own."""
    attend, head_dim = NativeAttention(library), 64
    settings = (kind, F32, KVPair(kind.value, kind.key))
    codecs = [KVCodec(k.key, head_dim, CPU) for k in settings]
    value_codecs = [KVCodec(k.value, head_dim, CPU) for k in settings]
    sizes = (900, 300, 40)
    keys = [c.encode(_rows(3, n, head_dim, seed=n))[0] for c, n in zip(codecs, sizes, strict=True)]
    values = [
        c.encode(_rows(3, n, head_dim, seed=n + 1))[0]
        for c, n in zip(value_codecs, sizes, strict=True)
    ]
    queries = torch.randn(3, 9, head_dim, generator=torch.Generator().manual_seed(7))
    masks = [None, torch.arange(300) % 3 != 0, None]
    codes = [(k.kind.code, v.kind.code) for k, v in zip(codecs, value_codecs, strict=True)]
    batch = attend.sequences(queries, keys, values, 0.125, masks, codes)
    for row in range(3):
        mask = None if masks[row] is None else masks[row][None]
        alone = attend(
            queries[row : row + 1].contiguous(),
            keys[row],
            values[row],
            0.125,
            mask=mask,
            kv_type=codes[row],
        )
        assert torch.equal(batch[row : row + 1], alone)
    lengths = torch.arange(890, 899, dtype=torch.int32)
    rows = torch.randn(9, 9, head_dim, generator=torch.Generator().manual_seed(8))
    together = attend(rows, keys[0], values[0], 0.125, lengths=lengths, kv_type=codes[0])
    one_by_one = [
        attend(
            rows[r : r + 1], keys[0], values[0], 0.125, lengths=lengths[r : r + 1], kv_type=codes[0]
        )
        for r in range(9)
    ]
    assert torch.equal(together, torch.cat(one_by_one))


@pytest.mark.parametrize("kind", [Q8, Q4], ids=["q8", "q4"])
def test_sinks_rotated_through_20_wraps_of_the_ring_do_not_pile_up_error(kind):
    """The frame's sinks are re-rotated from their stored copies at their own positions on
    every step; after 20 wraps their error is still one quantization's, not twenty (q4 keys
    keep their sinks in fp32: only fp32 rounding then)."""
    head_dim, sinks, window, slack = 64, 4, 12, 4
    rope = Rope(head_dim, head_dim, 10000.0, interleaved=True)
    cache = RotatingKVCache(2, head_dim, sinks, window, slack, rope, kv_type=kind)
    rows = _rows(2, sinks + 20 * cache.ring_capacity + 5, head_dim, seed=11)
    with torch.inference_mode():
        cache.update_and_fetch(rows[:, :, :sinks], rows[:, :, :sinks])
        errors = []
        for t in range(sinks, rows.shape[2]):
            cache.update_and_fetch(rows[:, :, t : t + 1], rows[:, :, t : t + 1])
            if cache.key_tiles is not None:  # q4 keys keep their sinks in fp32
                framed = cache.lead[:, :, sinks : 2 * sinks]
            else:
                framed = cache.key_codec.decode(cache.keys[:, :, sinks : 2 * sinks])
            heads = rows[0, :, :sinks].transpose(0, 1)
            truth = _rotated(heads, rope, cache.frame)
            errors.append(float((framed[0].transpose(0, 1) - truth).norm()))
    assert cache.wrapped and cache.offset - sinks >= 20 * cache.ring_capacity
    scale = rows[:, :, :sinks].abs().max()
    if cache.key_tiles is not None:
        assert max(errors) <= 1e-5 * float(scale) * math.sqrt(2 * sinks * head_dim)
        return
    first_wrap = max(errors[: cache.ring_capacity])
    assert max(errors) <= 1.5 * first_wrap, (first_wrap, max(errors))
    # ... and that is one quantization of the frame (twice: own copy, then the framed one).
    per_value = (1 / 127 if kind is Q8 else 2 / 15) * float(scale)
    assert max(errors) <= 2 * per_value * math.sqrt(2 * sinks * head_dim)


def _rotated(heads: torch.Tensor, rope: Rope, delta: int) -> torch.Tensor:
    from miniapp.engine.ops.layers import apply_rope

    return apply_rope(heads, rope.shift_tables(delta))


def test_bytes_per_token_of_each_type():
    # SmolLM2: 30 layers, 3 kv heads of 64.
    per_token = {k.name: bytes_per_token(k, 30, 3, 64) for k in KINDS + PAIRS}
    assert per_token == {
        "f32": 46080,
        "f16": 23040,
        "bf16": 23040,
        "q8": 12240,
        "q4": 7200,
        "q8/q4": 9720,
        "q4/f32": 26640,
        "f16/q8": 17640,
    }


def test_a_bad_name_or_an_unfit_head_size_is_one_line():
    with pytest.raises(MiniappError, match=r"--kv-type 'q9': choose from f32, f16, bf16, q8, q4"):
        kv_type("q9")
    for bad in ("q8/q9", "q8/q4/f16", "/q4"):
        with pytest.raises(MiniappError, match="or KEYS/VALUES such as q8/q4"):
            kv_type(bad)
    assert kv_type(" Q8 ") is Q8
    assert kv_type("q8/q8") is Q8 and kv_type("q8/Q4") == KVPair(Q8, Q4)
    with pytest.raises(MiniappError, match="--kv-type q4 stores blocks of 32"):
        kv_type("f16/q4").check(80)
    with pytest.raises(MiniappError, match="blocks of 32 values; this model's heads have 80"):
        KVCodec(Q4, 80, CPU)
