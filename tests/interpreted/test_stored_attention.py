"""The Triton attention over the cache as stored (engine/ops/stored_attention.py), run by
Triton's interpreter: each stored type read as its codec decodes it, every row of a batch
in one launch with its own bits whatever the batch, verification rows equal to their
decode steps, the hand-over to torch for what it does not read, a batched static step of a
real model, and torch.compile taking the kernel as one op."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from tiny_gguf import GEMMA3, write_tiny_model

from miniapp.engine.kv.codec import KVCodec
from miniapp.engine.kv.types import BF16, F16, F32, Q4, Q8, KVPair
from miniapp.engine.modelfile.gguf_file import GGUFFile
from miniapp.engine.models import CachePolicy, build_model
from miniapp.engine.models.attention_backends import (
    STORED_ATTENTION_ROWS,
    StoredAttention,
    TorchAttention,
    stored_attention_runs,
)
from miniapp.engine.models.static_step import StaticDecodeStep, StaticVerifyStep
from miniapp.engine.ops import stored_attention as kernel
from miniapp.engine.ops.layers import Rope, apply_rope
from miniapp.engine.platform.graphs import CompiledStep

CPU = torch.device("cpu")
LENGTHS = [5, 300, 129]  # one split, three splits and a ragged one, one row each


def _stored(codec: KVCodec, kv_heads: int, tokens: int, seed: int) -> torch.Tensor:
    """Rows as a cache stores them, a view into a larger storage (its head stride is the
    storage's, and it starts past the storage's first slots)."""
    generator = torch.Generator().manual_seed(seed)
    rows = torch.randn(1, kv_heads, tokens + 9, codec.head_dim, generator=generator) * 2
    return codec.encode(rows)[:, :, 4 : 4 + tokens]


def _reference(queries, keys, values, mask, key_codec, value_codec, scale):
    """One row, fp64: the codecs' decode, then softmax attention."""
    k, v = key_codec.decode(keys).double(), value_codec.decode(values).double()
    return F.scaled_dot_product_attention(
        queries.double()[None, :, None],
        k,
        v,
        attn_mask=None if mask is None else mask[None, None, None],
        enable_gqa=True,
        scale=scale,
    )[0, :, 0]


@pytest.mark.parametrize(
    ("key_type", "value_type", "head_dim"),
    [(F32, F32, 32), (F16, F16, 64), (BF16, BF16, 32), (Q8, Q8, 64), (Q4, Q4, 32), (Q8, Q4, 64)],
    ids=["f32", "f16", "bf16", "q8", "q4-rows", "q8/q4"],
)
def test_the_kernel_reads_each_stored_type_as_its_codec_decodes_it(key_type, value_type, head_dim):
    heads, kv_heads, scale = 6, 2, head_dim**-0.5
    key_codec = KVCodec(key_type, head_dim, CPU)
    value_codec = KVCodec(value_type, head_dim, CPU)
    generator = torch.Generator().manual_seed(7)
    queries = torch.randn(len(LENGTHS), heads, head_dim, generator=generator)
    keys = [_stored(key_codec, kv_heads, n, seed=n) for n in LENGTHS]
    values = [_stored(value_codec, kv_heads, n, seed=n + 1) for n in LENGTHS]
    masks = [None] + [torch.rand(n, generator=generator) > 0.3 for n in LENGTHS[1:]]
    for mask in masks[1:]:
        mask[-1] = True  # a row always sees its own key
    rotation = key_codec.rotation if key_codec.rotated else value_codec.rotation
    got = kernel.stored_attention(
        queries,
        keys,
        values,
        masks,
        [key_type.code, value_type.code],
        scale,
        torch.float32,
        rotation,
    )
    for row in range(len(LENGTHS)):
        want = _reference(
            queries[row], keys[row], values[row], masks[row], key_codec, value_codec, scale
        )
        assert (got[row].double() - want).abs().max() < 1e-5


@pytest.mark.parametrize(
    ("key_type", "value_type", "head_dim"),
    [(F32, F32, 32), (F16, F16, 64), (BF16, BF16, 32), (Q8, Q8, 64), (Q4, Q4, 128), (Q8, Q4, 32)],
    ids=["f32", "f16", "bf16", "q8", "q4-rows", "q8/q4"],
)
def test_the_write_kernel_stores_rows_as_the_codecs_encode_them(key_type, value_type, head_dim):
    # Two caches in one launch, each at its own slots: every written row has the codec's
    # bytes (rotation, scales and codes rounded alike), and no other slot is touched.
    key_codec = KVCodec(key_type, head_dim, CPU)
    value_codec = KVCodec(value_type, head_dim, CPU)
    generator = torch.Generator().manual_seed(11)
    stores = [(key_codec.empty(2, 12), value_codec.empty(2, 12)) for _ in range(2)]
    slots = [torch.tensor([4, 9, 0]), torch.tensor([7])]
    new_keys = torch.randn(4, 2, head_dim, generator=generator) * 3
    new_values = torch.randn(4, 2, head_dim, generator=generator)
    new_keys[1, 0] = 0.0  # a block of zeros: scale 0, codes 0
    rotation = key_codec.rotation if key_codec.rotated else value_codec.rotation
    kernel.write_stored(
        new_keys,
        new_values,
        [k for k, _ in stores],
        [v for _, v in stores],
        slots,
        [key_type.code, value_type.code],
        rotation,
        [],
        [],
        0,
        False,
        0,
    )
    first = 0
    for (keys, values), at in zip(stores, slots, strict=True):
        rows = slice(first, first + len(at))
        first += len(at)
        want_keys = key_codec.encode(new_keys[rows].transpose(0, 1)[None])
        want_values = value_codec.encode(new_values[rows].transpose(0, 1)[None])
        assert torch.equal(keys[:, :, at], want_keys)
        assert torch.equal(values[:, :, at], want_values)
        others = [s for s in range(12) if s not in at.tolist()]
        assert not keys[:, :, others].any() and not values[:, :, others].any()


@pytest.mark.parametrize(
    ("kind", "interleaved", "rotary", "slots"),
    [
        (Q8, False, 64, [[12], [2]]),
        (Q4, True, 64, [[12], [2]]),
        (Q8, True, 32, [[12], [2]]),
        (BF16, False, 48, [[12], [2]]),
        (Q8, False, 64, [[12, 13], [9, 10]]),
    ],
    ids=["q8-neox", "q4-interleaved", "q8-partial", "bf16-neox-partial", "q8-several-keys"],
)
def test_the_write_launch_turns_sinks_into_the_frame_as_decode_rope_and_encode(
    kind, interleaved, rotary, slots
):
    # Two caches in one launch, each by its own shift, as the static step's torch path
    # turns them (the codec's decode, apply_rope, the codec's encode). With one new key a
    # cache, the second cache is fresh: its new key is a sink, turned as just written.
    head_dim, sinks = 64, 4
    codec = KVCodec(kind, head_dim, CPU)
    rope = Rope(head_dim, rotary, 10000.0, interleaved)
    generator = torch.Generator().manual_seed(5)
    shifts = [rope.shift_tables(37), rope.shift_tables(-200)]
    entries = sum(len(at) for at in slots)
    new_keys = torch.randn(entries, 2, head_dim, generator=generator) * 2
    new_values = torch.randn(entries, 2, head_dim, generator=generator)
    stores, wants, first = [], [], 0
    for at, shift in zip(slots, shifts, strict=True):
        keys = codec.empty(2, 16)
        own = torch.randn(1, 2, sinks, head_dim, generator=generator) * 2
        keys[:, :, :sinks] = codec.encode(own)
        values = codec.empty(2, 16)
        stores.append((keys, values))
        expected = (keys.clone(), values.clone())
        rows = slice(first, first + len(at))
        first += len(at)
        expected[0][:, :, at] = codec.encode(new_keys[rows].transpose(0, 1)[None])
        expected[1][:, :, at] = codec.encode(new_values[rows].transpose(0, 1)[None])
        own = codec.decode(expected[0][:, :, :sinks])[0].transpose(0, 1)
        expected[0][:, :, sinks : 2 * sinks] = codec.encode(
            apply_rope(own, shift).transpose(0, 1)[None]
        )
        wants.append(expected)
    kernel.write_stored(
        new_keys.transpose(0, 1).contiguous().transpose(0, 1),  # read by its strides
        new_values,
        [k for k, _ in stores],
        [v for _, v in stores],
        [torch.tensor(at) for at in slots],
        [kind.code, kind.code],
        codec.rotation,
        [shift.cos.reshape(-1) for shift in shifts],
        [shift.signed_sin.reshape(-1) for shift in shifts],
        sinks,
        interleaved,
        rotary,
    )
    framed = slice(sinks, 2 * sinks)
    for (keys, values), (want_keys, want_values), at in zip(stores, wants, slots, strict=True):
        assert torch.equal(values, want_values)
        assert torch.equal(keys[:, :, :sinks], want_keys[:, :, :sinks])
        assert torch.equal(keys[:, :, at], want_keys[:, :, at])
        got = keys[:, :, framed]
        assert (got != want_keys[:, :, framed]).float().mean() < 0.02  # but for rounding edges
        assert (codec.decode(got) - codec.decode(want_keys[:, :, framed])).abs().max() < 0.05
        untouched = [s for s in range(2 * sinks, 16) if s not in at]
        assert not keys[:, :, untouched].any()


@pytest.mark.parametrize(
    ("interleaved", "rotary", "dtype"),
    [(False, 64, torch.bfloat16), (True, 32, torch.float32)],
    ids=["neox-bf16", "interleaved-partial-f32"],
)
def test_queries_and_keys_straight_from_the_projection_are_turned_as_apply_rope_does(
    interleaved, rotary, dtype
):
    # The static step hands both kernels the projection's output (any float type, heads
    # strided as projected) with each row's RoPE tables: the kernels turn queries and new
    # keys themselves, as apply_rope would have before them.
    head_dim, heads, kv_heads = 64, 4, 2
    codec = KVCodec(Q8, head_dim, CPU)
    rope = Rope(head_dim, rotary, 10000.0, interleaved)
    tables = rope.tables(40, len(LENGTHS))  # one position a row
    generator = torch.Generator().manual_seed(3)
    projected = torch.randn(len(LENGTHS), heads + 2 * kv_heads, head_dim, generator=generator)
    projected = projected.to(dtype)
    queries, new_keys = projected[:, :heads], projected[:, heads : heads + kv_heads]
    keys = [_stored(codec, kv_heads, n, seed=n) for n in LENGTHS]
    values = [_stored(codec, kv_heads, n, seed=n + 1) for n in LENGTHS]
    common = (keys, values, [None] * len(LENGTHS), [Q8.code, Q8.code], 0.125, torch.float32)
    got = kernel.stored_attention(
        queries, *common, codec.rotation, tables.cos, tables.signed_sin, interleaved, rotary
    )
    turned = apply_rope(queries.float(), tables)
    want = kernel.stored_attention(turned, *common, codec.rotation)
    assert (got - want).abs().max() < 1e-5

    stores = [(codec.empty(kv_heads, 8), codec.empty(kv_heads, 8)) for _ in LENGTHS]
    kernel.write_stored(
        new_keys,
        projected[:, heads + kv_heads :],
        [k for k, _ in stores],
        [v for _, v in stores],
        [torch.tensor([3]) for _ in LENGTHS],
        [Q8.code, Q8.code],
        codec.rotation,
        [],
        [],
        0,
        interleaved,
        rotary,
        tables.cos,
        tables.signed_sin,
    )
    for row, (stored_keys, _) in enumerate(stores):
        want = codec.encode(apply_rope(new_keys.float(), tables)[row][None, :, None])
        got = stored_keys[:, :, 3:4]
        assert (got != want).float().mean() < 0.02  # but for rounding edges, the same bytes
        assert (codec.decode(got) - codec.decode(want)).abs().max() < 0.05


def test_a_row_is_the_same_bits_alone_as_in_a_batch_of_longer_rows():
    # The splits fall at fixed key positions and a longer neighbour's extra splits add exact
    # zeros to this row's: batching never changes a sequence's answer.
    codec = KVCodec(Q8, 64, CPU)
    generator = torch.Generator().manual_seed(3)
    queries = torch.randn(3, 4, 64, generator=generator)
    keys = [_stored(codec, 2, n, seed=n) for n in (40, 700, 260)]
    values = [_stored(codec, 2, n, seed=n + 1) for n in (40, 700, 260)]
    turn = codec.rotation
    f32 = torch.float32
    batch = kernel.stored_attention(queries, keys, values, [None] * 3, [3, 3], 0.125, f32, turn)
    for row in range(3):
        alone = kernel.stored_attention(
            queries[row : row + 1],
            keys[row : row + 1],
            values[row : row + 1],
            [None],
            [3, 3],
            0.125,
            f32,
            turn,
        )
        assert torch.equal(batch[row], alone[0])


def test_a_table_a_capture_used_outlives_any_number_of_other_tables(monkeypatch):
    # A CUDA graph reads its address tables at every replay: once a capture has used one
    # (the table its warm-up built), no later table may push it out and free it.
    tables = kernel._AddressTables()
    entry = (1, 2, 3, 4, 0, 6)
    warmed_up = tables.table(entry, CPU)
    monkeypatch.setattr(kernel, "_capturing", lambda device: True)
    assert tables.table(entry, CPU) is warmed_up
    monkeypatch.setattr(kernel, "_capturing", lambda device: False)
    for n in range(kernel._TABLES_KEPT + 5):
        tables.table((n, 0, 0, 0, 0, 1), CPU)
    assert len(tables.kept) == kernel._TABLES_KEPT  # the uncaptured ones are bounded
    assert tables.table(entry, CPU) is warmed_up
    assert tables.table(entry, CPU).tolist() == [list(entry)]


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("stored") / "tiny.gguf", GEMMA3)


@pytest.fixture(scope="module")
def model(tiny_path):
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MINIAPP_NATIVE", "0")  # the CPU's native kernel would attend instead
        return build_model(GGUFFile(tiny_path))


def _prefilled(model, policy: CachePolicy, tokens: int) -> list:
    """The model's caches under `policy`, reserved in full, after a prompt of `tokens`."""
    caches = model.make_caches(policy)
    for cache in caches:
        cache.reserve()
    with torch.inference_mode():
        model(torch.tensor([(5 * i) % 40 + 3 for i in range(tokens)]), caches)
    return caches


def _filled_cache(model, kind, tokens: int):
    """A global layer's cache of `kind` holding `tokens` random keys and values; returns
    it with the stored rows its last update returned."""
    config = model.config
    cache = model.make_caches(CachePolicy(ctx=512, kv_type=kind))[1]
    cache.reserve()
    generator = torch.Generator().manual_seed(tokens)
    shape = (1, config.n_kv_heads, tokens, config.head_dim)
    keys, values = cache.update_and_fetch(
        torch.randn(shape, generator=generator), torch.randn(shape, generator=generator)
    )
    return cache, keys, values


@pytest.mark.parametrize("kind", [Q8, F16], ids=["q8", "f16"])
def test_verification_rows_are_their_decode_steps_bit_for_bit(model, kind):
    # Verifying drafts attends several rows over one storage, row r seeing `before + r + 1`
    # keys (or what its mask row says): each is the single decode step's result exactly, so
    # speculation on a GPU gives plain decoding's tokens.
    config = model.config
    backend = StoredAttention(0.2, TorchAttention(0.2), config.head_dim)
    cache, keys, values = _filled_cache(model, kind, 140)
    generator = torch.Generator().manual_seed(1)
    queries = torch.randn(config.n_heads, 4, config.head_dim, generator=generator)
    before = 136
    prefixes = backend.attend_prefixes(queries, keys, values, cache, before)
    masks = torch.rand(4, 140, generator=generator) > 0.5
    masked = backend.attend_rows(queries, keys, values, cache, masks)
    for row in range(4):
        seen = before + row + 1
        step = backend.attend(
            queries[:, row : row + 1], keys[:, :, :seen], values[:, :, :seen], cache
        )
        assert torch.equal(prefixes[:, :, row : row + 1], step)
        own = backend.attend(queries[:, row : row + 1], keys, values, cache, masks[row : row + 1])
        assert torch.equal(masked[:, :, row : row + 1], own)


def test_what_the_kernel_does_not_read_goes_to_torch(model, monkeypatch):
    config = model.config
    torch_attention = TorchAttention(0.2)
    backend = StoredAttention(0.2, torch_attention, config.head_dim)
    launches = []
    monkeypatch.setattr(kernel, "stored_attention", lambda *a: launches.append(a) or 1 / 0)
    generator = torch.Generator().manual_seed(2)

    def queries(rows):
        return torch.randn(config.n_heads, rows, config.head_dim, generator=generator)

    # q4 keys in tiles (their own layout), a float mask, a prompt chunk of many rows
    tiled, keys, values = _filled_cache(model, KVPair(Q4, Q4), 40)
    q = queries(1)
    assert torch.equal(
        backend.attend(q, keys, values, tiled), torch_attention.attend(q, keys, values, tiled)
    )
    cache, keys, values = _filled_cache(model, Q8, 40)
    additive = torch.zeros(1, 40)
    assert torch.equal(
        backend.attend(q, keys, values, cache, additive),
        torch_attention.attend(q, keys, values, cache, additive),
    )
    chunk = queries(STORED_ATTENTION_ROWS + 1)
    assert torch.equal(
        backend.attend(chunk, keys, values, cache),
        torch_attention.attend(chunk, keys, values, cache),
    )
    assert not StoredAttention(0.2, None, 48).takes_heads  # heads of 48: not a power of two
    assert launches == []


def test_a_batched_static_step_reads_q8_caches_in_one_launch_a_layer(model, monkeypatch):
    # Three sequences at different lengths decode together as a GPU serves them: each layer
    # attends all their rows in one launch, each row's logits are its own step's bit for
    # bit, and close to torch's attention over the decoded caches.
    launches, writes = [], []
    launch, write = kernel.stored_attention, kernel.write_stored
    monkeypatch.setattr(kernel, "stored_attention", lambda *a: launches.append(1) or launch(*a))
    monkeypatch.setattr(kernel, "write_stored", lambda *a: writes.append(a) or write(*a))
    policy = CachePolicy(ctx=64, sinks=4, window=40, kv_type=Q8)

    def prefilled(n):
        with monkeypatch.context() as prompt:
            prompt.setenv("MINIAPP_STORED_ATTENTION", "0")  # the prompts by torch: quicker here
            return _prefilled(model, policy, n)

    lengths, tokens = [10, 47, 17], [5, 9, 14]  # 47: past the window, its sinks in a frame
    batch = StaticDecodeStep(model, batch=[prefilled(n) for n in lengths])
    alone = [StaticDecodeStep(model, prefilled(n)) for n in lengths]
    monkeypatch.setenv("MINIAPP_STORED_ATTENTION", "0")
    by_torch = StaticDecodeStep(model, batch=[prefilled(n) for n in lengths])
    monkeypatch.delenv("MINIAPP_STORED_ATTENTION")
    with torch.inference_mode():
        for _ in range(2):
            launches.clear(), writes.clear()
            rows = batch.step(tokens).clone()
            assert len(launches) == model.config.n_layers
            # The rows' new keys and values written as stored by one launch a layer too,
            # which turns their sinks into the frame where the layer has sinks (the local
            # ones).
            assert len(writes) == model.config.n_layers
            # Straight from the projection: the write kernel applies the keys' RoPE.
            assert all(len(call) > 12 and call[12] is not None for call in writes)
            with_sinks = [call[9] for call in writes if call[9] > 0]
            assert len(with_sinks) == sum(cache.sinks > 0 for cache in batch.sequences[0]) > 0
            assert torch.equal(rows, torch.cat([a(t) for a, t in zip(alone, tokens, strict=True)]))
            monkeypatch.setenv("MINIAPP_STORED_ATTENTION", "0")
            assert (by_torch.step(tokens) - rows).abs().max() < 1e-4
            monkeypatch.delenv("MINIAPP_STORED_ATTENTION")
            tokens = rows.argmax(-1).tolist()
    # What the kernel wrote is what torch's encode wrote (at most a rounding edge apart).
    pairs = zip(sum(batch.sequences, []), sum(by_torch.sequences, []), strict=True)
    for ours, theirs in pairs:
        for a, b in ((ours.keys, theirs.keys), (ours.values, theirs.values)):
            assert (a != b).float().mean() < 0.01
            codec = ours.key_codec
            assert (codec.decode(a) - codec.decode(b)).abs().max() < 0.1


def test_sixteen_bit_rows_are_written_by_torch_where_the_cast_fuses(model, monkeypatch):
    # bf16 rows need only a cast, which inductor fuses into the kernel making the keys: the
    # write kernel would add launches there, so it writes quantized rows only.
    writes = []
    write = kernel.write_stored
    monkeypatch.setattr(kernel, "write_stored", lambda *a: writes.append(1) or write(*a))
    caches = model.make_caches(CachePolicy(ctx=64, kv_type=BF16))
    for cache in caches:
        cache.reserve()
    with torch.inference_mode():
        model(torch.tensor([3, 8, 13]), caches)
        StaticDecodeStep(model, batch=[caches]).step([5])
    assert writes == []


def test_a_static_step_over_q4_keys_reads_their_decoded_tiles_through_the_kernel(
    model, monkeypatch
):
    # A GPU's static step decodes q4 key tiles into fp32 rows (the query's own tile exact);
    # the kernel reads those as f32 rows and the q4 values as stored.
    launches = []
    launch = kernel.stored_attention
    monkeypatch.setattr(kernel, "stored_attention", lambda *a: launches.append(1) or launch(*a))
    policy = CachePolicy(ctx=64, sinks=4, window=40, kv_type=Q4)

    def step():
        return StaticDecodeStep(model, _prefilled(model, policy, 20))

    stored = step()
    monkeypatch.setenv("MINIAPP_STORED_ATTENTION", "0")
    by_torch = step()
    token = 7
    with torch.inference_mode():
        for _ in range(2):
            monkeypatch.delenv("MINIAPP_STORED_ATTENTION")
            launches.clear()
            logits = stored(token).clone()
            assert len(launches) == model.config.n_layers
            monkeypatch.setenv("MINIAPP_STORED_ATTENTION", "0")
            assert (by_torch(token) - logits).abs().max() < 1e-4
            token = int(logits.argmax())


def test_torch_compile_takes_the_kernel_as_one_op(model):
    config = model.config
    backend = StoredAttention(0.2, TorchAttention(0.2), config.head_dim)
    filled = [_filled_cache(model, Q8, n) for n in (20, 150)]
    stored = [(keys, values, None, cache) for cache, keys, values in filled]
    queries = torch.randn(config.n_heads, 2, config.head_dim)
    compiled = torch.compile(lambda q: backend.attend_one_each(q, stored), fullgraph=True)
    eager = backend.attend_one_each(queries, stored)
    assert (compiled(queries) - eager).abs().max() < 1e-6


def test_the_kernel_runs_on_the_cpu_only_under_the_interpreter(monkeypatch):
    assert stored_attention_runs(CPU)
    monkeypatch.setenv("MINIAPP_STORED_ATTENTION", "0")
    assert not stored_attention_runs(CPU)


def test_verification_over_q8_caches_with_sinks_is_its_decode_steps_bit_for_bit(model, monkeypatch):
    # Verification writes several keys into one cache in one launch, which turns its
    # sinks once. Each row's logits, and the caches after, are its decode steps', which
    # wrote one key each.
    writes = []
    write = kernel.write_stored
    monkeypatch.setattr(kernel, "write_stored", lambda *a: writes.append(a) or write(*a))
    policy = CachePolicy(ctx=64, sinks=4, window=40, kv_type=Q8)

    rows = [11, 4, 29, 8]
    stepped, verified = _prefilled(model, policy, 9), _prefilled(model, policy, 9)
    decode, step = StaticDecodeStep(model, stepped), StaticVerifyStep(model, verified, len(rows))
    with torch.inference_mode():
        want = torch.cat([decode(t) for t in rows])
        writes.clear()
        assert step.ready()
        _, got = step.verify(rows)
    # Every row's keys in one call a layer, straight from the projection (the kernel
    # applies their RoPE, as the decode steps' did).
    assert len(writes) == model.config.n_layers
    assert all(len(call) > 12 and call[12] is not None for call in writes)
    assert torch.equal(got, want)
    for a, b in zip(stepped, verified, strict=True):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


def test_a_compiled_q8_batch_step_over_new_sequences_reuses_its_compiled_code(model, monkeypatch):
    # The kernels' path through a batched step: clients come and go, and each new set of
    # sequences is a step over other caches. Told apart by their ids, the caches would
    # make torch compile the bucket's step again for every set (seconds on a GPU's host
    # while every client waits).
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    policy = CachePolicy(ctx=64, sinks=4, window=40, kv_type=Q8)
    monkeypatch.setenv("MINIAPP_STORED_ATTENTION", "0")  # the prompts by torch: quicker here
    sets = [[_prefilled(model, policy, n) for n in (10, 47)] for _ in range(2)]
    monkeypatch.delenv("MINIAPP_STORED_ATTENTION")
    for sequences in sets:
        step = StaticDecodeStep(model, batch=sequences, runner=lambda body: CompiledStep(body))
        with torch.inference_mode():
            step.step([5, 9])
        (run,) = step._runs.values()
        assert run.ran and run.compiled is not None  # compiled, not fallen back
    assert counters["stats"]["unique_graphs"] == 1
    torch._dynamo.reset()
