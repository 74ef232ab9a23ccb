"""`--kv-policy attention`: a cache of fixed budget that keeps the sinks, the newest tokens
and the ones attention used most (engine/kv/scored.py). Its choice against a float64
reference, roll-back that never brings back an evicted token, and answers that do not
depend on speculation or batching."""

from __future__ import annotations

import threading
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from generation_helpers import first_tokens
from tiny_gguf import GEMMA3, LLAMA, write_tiny_model

from miniapp.engine.errors import MiniappError
from miniapp.engine.kv.cache import RotatingKVCache
from miniapp.engine.kv.scored import POOL, SNAPSHOTS, ScoredKVCache
from miniapp.engine.kv.types import kv_type
from miniapp.engine.ops.layers import Rope, apply_rope
from miniapp.engine.runtimes.torch_runtime import TorchRuntime
from miniapp.engine.tokens.sampling import GREEDY, SamplingParams

HEADS, KV_HEADS, HEAD_DIM = 4, 2, 32
SAMPLED = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)
SCALE = HEAD_DIM**-0.5


def _reference_scores(queries, keys) -> torch.Tensor:
    """float64 scores [kv_heads, tokens] from the definition: the newest rows' causal
    softmax summed over rows, averaged over each KV head's group of query heads, max-pooled
    over POOL neighbouring slots."""
    q, k = queries.double(), keys.double()
    heads, rows, _ = q.shape
    kv_heads, tokens = k.shape[0], k.shape[1]
    group = heads // kv_heads
    scores = torch.zeros(kv_heads, tokens, dtype=torch.float64)
    for h in range(kv_heads):
        for g in range(group):
            for r in range(rows):
                visible = tokens - rows + r + 1
                logits = q[h * group + g, r] @ k[h, :visible].T * SCALE
                scores[h, :visible] += torch.softmax(logits, dim=0) / group
    return F.max_pool1d(scores[:, None], POOL, stride=1, padding=POOL // 2)[:, 0]


def _assert_best_kept(kept: list[list[int]], scores: torch.Tensor, cache: ScoredKVCache) -> None:
    """Each head keeps the sinks, the recent tokens and, between them, the best by the
    float64 scores (a near-tie may go either way: within 1e-6)."""
    tokens = scores.shape[1]
    recent = list(range(tokens - cache.recent, tokens))
    for head, slots in enumerate(kept):
        assert slots[:4] == [0, 1, 2, 3] and slots[-cache.recent :] == recent
        chosen = set(slots[4 : -cache.recent])
        assert len(chosen) == cache.keep - 4 - cache.recent
        left = set(range(4, tokens - cache.recent)) - chosen
        worst_kept = min(scores[head, s].item() for s in chosen)
        best_left = max(scores[head, s].item() for s in left)
        assert worst_kept >= best_left - 1e-6, (head, worst_kept, best_left)


def _cache(window: int = 64, kind: str = "f32") -> ScoredKVCache:
    return ScoredKVCache(
        KV_HEADS, HEAD_DIM, 4, window, max_chunk=64, prompt_capacity=256, kv_type=kv_type(kind)
    )


def _position_values(first: int, n: int) -> torch.Tensor:
    """Values [1, kv_heads, n, head_dim] whose every element is the token's position."""
    positions = torch.arange(first, first + n).float()[:, None]
    return positions.expand(n, HEAD_DIM).expand(1, KV_HEADS, n, HEAD_DIM).contiguous()


def _feed(cache: ScoredKVCache, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """n tokens at once (random keys; values carry each token's position); the queries of
    their rows are observed. Returns (keys before any eviction, queries)."""
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(1, KV_HEADS, n, HEAD_DIM, generator=g)
    values = _position_values(cache.offset, n)
    queries = torch.randn(HEADS, n, HEAD_DIM, generator=g) * 3  # peaked, as real ones are
    held = cache.update_and_fetch(keys, values)[0].clone()  # a view: eviction rewrites it
    cache.observe(queries, SCALE)
    return held, queries


@pytest.mark.parametrize("rows", [1, 40])
def test_the_kept_tokens_are_the_float64_references_choice(rows):
    """A prompt chunk (40 rows: the last 32 score) and a decode row (1) that fill the budget."""
    cache = _cache()
    first = cache.budget - rows  # then the rows fill the budget, or overflow it
    _feed(cache, first, seed=1)
    assert cache.evictions == 0 and cache.held == first  # below the budget: nothing goes
    stored, queries = _feed(cache, rows if rows == 1 else 2 * rows, seed=2)
    assert cache.evictions == 1 and cache.held == cache.keep
    all_keys = cache.key_codec.decode(stored)[0]  # the keys the step saw
    scores = _reference_scores(queries[:, -32:], all_keys)
    _assert_best_kept(cache.held_positions().tolist(), scores, cache)
    # The values moved with their keys: each slot's value is its token's position.
    assert torch.equal(cache.values[0, :, : cache.held, 0].long(), cache.held_positions())


@pytest.mark.parametrize("cuts", [[150], [40, 60, 50], [1] * 150])
def test_a_prompt_is_held_whole_then_its_last_rows_choose(cuts):
    """SnapKV at a prompt's end: the last 32 rows' attention (a question there chooses what
    it needs), whatever passes the prompt came in."""
    cache = _cache()
    cache.open_prompt()
    keys, queries, seed = [], [], 20
    for n in cuts:
        stored, q = _feed(cache, n, seed=seed)
        keys, seed = stored, seed + 1
        queries.append(q)
    assert cache.evictions == 0 and cache.held == 150  # past the budget of 68: held whole
    cache.close_prompt()
    assert cache.evictions == 1 and cache.held == cache.keep
    last_rows = torch.cat(queries, dim=1)[:, -32:]
    scores = _reference_scores(last_rows, cache.key_codec.decode(keys)[0])
    _assert_best_kept(cache.held_positions().tolist(), scores, cache)


def test_heads_choose_their_own_tokens_and_sinks_and_recent_ones_stay():
    cache = _cache()
    _feed(cache, cache.budget + 10, seed=3)
    kept = cache.held_positions()
    offset = cache.offset
    for head in kept.tolist():
        assert head[:4] == [0, 1, 2, 3]
        assert head[-cache.recent :] == list(range(offset - cache.recent, offset))
        assert head == sorted(head)
    assert kept[0].tolist() != kept[1].tolist()  # random keys: heads differ


def test_a_large_window_keeps_its_newest_half_as_the_window_policy_would():
    """Attention chooses only part of a large window: the newest half of what stays after an
    eviction is the window policy's own choice, so a fact the window holds that recently is
    never lost to a choice made before its question came."""
    cache = _cache(window=252)
    assert cache.recent == (cache.keep - 4) // 2
    _feed(cache, cache.budget + 40, seed=5)
    assert cache.evictions >= 1
    for head in cache.held_positions().tolist():
        assert head[-cache.recent :] == list(range(cache.offset - cache.recent, cache.offset))


@pytest.mark.parametrize("kind", ["f16", "q8", "q8/q4", "q4"])
def test_quantized_rows_are_moved_as_stored(kind):
    """q8 and q4 rows are blocks of bytes: an eviction moves them untouched (q4 keys are
    rows here, not tiles of 32 tokens: single tokens go)."""
    cache = _cache(kind=kind)
    stored, _ = _feed(cache, cache.budget + 5, seed=4)
    stored_values = cache.value_codec.encode(_position_values(0, cache.budget + 5))
    kept = cache.held_positions()
    for head in range(KV_HEADS):
        assert torch.equal(cache.keys[0, head, : cache.held], stored[0, head, kept[head]])
        assert torch.equal(cache.values[0, head, : cache.held], stored_values[0, head, kept[head]])


def test_a_roll_back_never_brings_back_an_evicted_token():
    """Drafts after an eviction are trimmed: what went stays gone. A trim that removes the
    token whose row chose an eviction undoes it, as a cache that never saw the token."""
    cache = _cache()
    _feed(cache, cache.budget - 1, seed=5)
    untouched = cache.held_positions()
    _feed(cache, 1, seed=6)  # this row chooses an eviction
    evicted = set(untouched[0].tolist()) - set(cache.held_positions()[0].tolist())
    assert evicted and cache.evictions == 1
    chooser_kept = cache.held_positions()
    for seed in range(7, 11):  # four drafts, then rejected
        _feed(cache, 1, seed=seed)
    assert cache.can_trim(4)
    cache.trim(4)
    assert torch.equal(cache.held_positions(), chooser_kept)
    assert not evicted & set(cache.held_positions()[0].tolist())
    # Trimming the chooser itself: back to the rows before the eviction, as they were.
    cache.trim(1)
    assert torch.equal(cache.held_positions(), untouched)
    assert cache.offset == cache.budget - 1 and cache.evictions == 0


def test_a_trim_undoes_the_last_evictions_it_kept_and_refuses_older_ones():
    cache = _cache(window=32)
    _feed(cache, cache.budget - 1, seed=12)
    seed = 13
    while cache.evictions < 1:
        _feed(cache, 1, seed=seed)
        seed += 1
    after_first, first_kept = cache.offset, cache.held_positions()
    while cache.evictions < SNAPSHOTS + 1:
        _feed(cache, 1, seed=seed)
        seed += 1
    assert not cache.can_trim(cache.offset - after_first + 1)  # the first's undo is gone
    assert cache.can_trim(cache.offset - after_first)
    cache.trim(cache.offset - after_first)  # undoes the other four
    assert cache.offset == after_first and torch.equal(cache.held_positions(), first_kept)


ROPE = Rope(HEAD_DIM, HEAD_DIM, 10000.0, interleaved=False)


def _compact_cache(kind: str = "f32", compact_from: int = 0) -> ScoredKVCache:
    return ScoredKVCache(
        KV_HEADS, HEAD_DIM, 4, 64, 64, 256, ROPE, kv_type(kind), compact_from=compact_from
    )


def _feed_rotated(cache: ScoredKVCache, raw: torch.Tensor, seed: int) -> None:
    """Keys `raw` [kv_heads, n, head_dim] rotated at the positions they come at, as the
    model stores them, with random queries observed."""
    n = raw.shape[1]
    tables = ROPE.tables(cache.offset, n)
    keys = apply_rope(raw.transpose(0, 1), tables).transpose(0, 1)[None]
    cache.update_and_fetch(keys, _position_values(cache.offset, n))
    g = torch.Generator().manual_seed(seed)
    cache.observe(torch.randn(HEADS, n, HEAD_DIM, generator=g) * 3, SCALE)


def _assert_keys_at(cache: ScoredKVCache, raw: torch.Tensor, compact: bool) -> None:
    """Each held key is its token's `raw` key rotated at its own position, or (compact) at
    offset - held + its slot."""
    kept = cache.held_positions()
    for head in range(KV_HEADS):
        if compact:
            tables = ROPE.tables(cache.offset - cache.held, cache.held)
        else:
            tables = ROPE.each_shift_tables(kept[head][:, None])
        want = apply_rope(raw[head, kept[head]][:, None], tables)[:, 0]
        torch.testing.assert_close(cache.keys[0, head, : cache.held], want, atol=3e-5, rtol=0)


@pytest.mark.parametrize("compact_from", [0, 150])
def test_compact_positions_hold_each_survivor_as_if_it_had_come_just_before_the_newest(
    compact_from,
):
    """From `compact_from` on (0: attention-compact; else the trained context less the
    budget), slot j of `held` holds its token's key rotated at position offset - held + j
    after each eviction: contiguous positions ending at the newest token, whatever the heads
    chose. Before it, keys stay at their own positions."""
    cache = _compact_cache(compact_from=compact_from)
    g = torch.Generator().manual_seed(30)
    raw = torch.randn(KV_HEADS, 260, HEAD_DIM, generator=g)
    _feed_rotated(cache, raw[:, :60], seed=31)
    for i in range(60, 260):
        _feed_rotated(cache, raw[:, i : i + 1], seed=i)
        if cache.offset == 140:  # evictions before compact_from keep positions
            assert cache.evictions >= 3
            _assert_keys_at(cache, raw, compact=compact_from == 0)
    _assert_keys_at(cache, raw, compact=True)


@pytest.mark.parametrize("kind", ["f32", "q8"])
def test_a_roll_back_past_a_compacting_eviction_restores_the_keys_as_stored(kind):
    cache = _compact_cache(kind)
    g = torch.Generator().manual_seed(40)
    _feed_rotated(cache, torch.randn(KV_HEADS, cache.budget - 1, HEAD_DIM, generator=g), 41)
    before = cache.keys[:, :, : cache.held].clone()
    _feed_rotated(cache, torch.randn(KV_HEADS, 1, HEAD_DIM, generator=g), 42)
    assert cache.evictions == 1
    assert not torch.equal(cache.keys[:, :, :4], before[:, :, :4])  # the sinks moved
    cache.trim(1)
    assert cache.evictions == 0 and torch.equal(cache.keys[:, :, : cache.held], before)


def _prompts(n: int, length: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(n + length)
    return [[1, *torch.randint(3, 250, (length,), generator=g).tolist()] for _ in range(n)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    # Logits spread as a trained model's, so that answers do not settle into one token.
    spec = replace(LLAMA, output_norm_scale=0.15)
    return write_tiny_model(tmp_path_factory.mktemp("policy") / "tiny.gguf", spec)


def _runtime(path, **options) -> TorchRuntime:
    options = {"n_ctx": 1024, "threads": 1, "sinks": 4, "window": 48, **options}
    return TorchRuntime(path, **{"kv_policy": "attention", **options})


@pytest.mark.parametrize(
    "spec, policy",
    [("lookup", "attention"), ("auto", "attention"), ("lookup", "attention-compact")],
)
def test_a_greedy_answer_is_the_same_with_and_without_speculation(default_model, spec, policy):
    """Verification rows evict exactly where decode steps would, and roll-back undoes an
    eviction a rejected draft chose (re-rotated keys included): drafting leaves the answer
    unchanged."""
    plain = _runtime(default_model, spec="off", window=60, threads=2, kv_policy=policy)
    drafting = _runtime(default_model, spec=spec, window=60, threads=2, kv_policy=policy)
    text = (
        "Here is a list of fruits: apple, banana, cherry, date, elderberry, fig, grape, "
        "honeydew, kiwi, lemon, mango. Repeat the list of fruits twice, separated by commas:"
    )
    prompt = plain.tokenizer.encode(text, parse_special=False)
    want = first_tokens(plain, prompt, 100)
    stream = drafting.generate_tokens(prompt, GREEDY)
    got = [token for token, _ in zip(stream, range(100), strict=False)]
    stream.close()
    assert got == want
    drafted, accepted = stream.speculation.drafted, stream.speculation.accepted
    assert accepted > 0 and drafted > accepted, (drafted, accepted)  # some were rolled back
    _, caches = drafting.scheduler.latest_sequence()
    assert caches[0].evictions >= 5  # every 8 tokens or so once the budget is full


def test_batched_sequences_with_different_policies_equal_their_lone_runs(tiny):
    """Each answer's cache keeps tokens by its own policy (SamplingParams.kv_policy), and
    rows of answers with different policies share steps. Sampled with seeds: the tiny
    model's greedy answers settle into one token whatever the cache holds."""
    prompts = _prompts(4, 120)
    policies = ["attention", "window", "attention", None]  # None: the runtime's (window)
    params = [replace(SAMPLED, seed=i, kv_policy=p) for i, p in enumerate(policies)]
    # Without drafting: sampled drafts keep the distribution, not each draw.
    lone = {p: _runtime(tiny, kv_policy=p, spec="off") for p in ("attention", "window")}
    want = [
        first_tokens(lone[p or "window"], prompt, 60, replace(param, kv_policy=None))
        for prompt, p, param in zip(prompts, policies, params, strict=True)
    ]
    window_first = first_tokens(lone["window"], prompts[0], 60, replace(params[0], kv_policy=None))
    assert want[0] != window_first  # the policy matters
    together = _runtime(tiny, parallel=4, kv_policy="window", spec="off")
    results: dict[int, list[int]] = {}
    all_queued = threading.Barrier(4)

    def caller(i: int) -> None:
        stream = together.generate_tokens(prompts[i], params[i])
        all_queued.wait(timeout=60)  # none reads (and steps) before all are queued
        results[i] = [token for token, _ in zip(stream, range(60), strict=False)]
        stream.close()

    threads = [threading.Thread(target=caller, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert [results[i] for i in range(4)] == want
    assert together.scheduler.peak_batch == 4
    # A finished answer's caches serve a later prompt of its own policy only.
    again = first_tokens(together, prompts[1], 60, replace(params[1], kv_policy="attention"))
    assert again == first_tokens(
        lone["attention"], prompts[1], 60, replace(params[1], kv_policy=None)
    )


def test_an_unknown_policy_in_a_request_is_refused_in_one_line(tiny):
    runtime = _runtime(tiny)
    with pytest.raises(MiniappError, match="unknown --kv-policy 'h2o'"):
        first_tokens(runtime, [1, 5, 6], 1, replace(GREEDY, kv_policy="h2o"))


def test_gemma3_keeps_rings_in_its_local_layers(tmp_path):
    path = write_tiny_model(tmp_path / "gemma.gguf", GEMMA3)
    runtime = _runtime(path)
    caches = runtime.model.make_caches(runtime.policy)
    local = [runtime.model.config.is_local(i) for i in range(len(caches))]
    assert any(local) and not all(local)
    for cache, is_local in zip(caches, local, strict=True):
        assert isinstance(cache, RotatingKVCache if is_local else ScoredKVCache)
    assert len(first_tokens(runtime, _prompts(1, 100)[0], 10)) == 10
