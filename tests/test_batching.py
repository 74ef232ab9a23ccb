"""Continuous batching: many sequences in one forward pass per step, each token for token what
it produces alone (tiny random-weight models, written with gguf's writer)."""

from __future__ import annotations

import random
import threading
import time
from dataclasses import replace

import pytest
import torch
from tiny_gguf import GEMMA3, LLAMA, QWEN3MOE, write_tiny_model

from miniapp.engine.batching.scheduler import BatchConfig, BatchScheduler, QueueFullError
from miniapp.engine.chat.generation import GenerationRequest, generate
from miniapp.engine.kv.types import (
    F32,
    KV_TYPES,
    Q4,
    Q8,
    KVPair,
    bytes_per_token,
    storable_kv_types,
)
from miniapp.engine.modelfile.gguf_file import GGUFFile
from miniapp.engine.models import CachePolicy, build_model
from miniapp.engine.platform.compute_thread import ComputeThread
from miniapp.engine.runtimes.torch_runtime import TorchRuntime
from miniapp.engine.speculative import DraftController, EarlyExitDrafter, SpeculativeDecoder
from miniapp.engine.speculative.lookup import LookupDrafter
from miniapp.engine.tokens.events import Finished, GenerationStats, TextDelta
from miniapp.engine.tokens.sampler import Sampler
from miniapp.engine.tokens.sampling import GREEDY

POLICY = CachePolicy(ctx=256, sinks=4)
# A small ring: a few dozen tokens wrap it and move the sinks' frame.
SMALL_RING = CachePolicy(ctx=40, sinks=4, window=24)


@pytest.fixture(scope="module", params=[LLAMA, GEMMA3, QWEN3MOE], ids=["llama", "gemma3", "moe"])
def model(request, tmp_path_factory):
    path = write_tiny_model(tmp_path_factory.mktemp("batching") / "tiny.gguf", request.param)
    return build_model(GGUFFile(path))


def _prompts(count: int, seed: int = 0) -> list[list[int]]:
    """Random byte-token prompts of different lengths (3 to 70 tokens)."""
    rng = random.Random(seed)
    return [
        [1] + [rng.randrange(3, 259) for _ in range(rng.randrange(2, 70))] for _ in range(count)
    ]


@torch.inference_mode()
def _alone(model, prompt: list[int], n: int, policy=POLICY) -> list[int]:
    """Plain decoding of one sequence, one token per forward pass (prompt included)."""
    caches = model.make_caches(policy)
    sampler, history = Sampler(GREEDY), list(prompt)
    for token in prompt[:-1]:
        model.hidden_states(torch.tensor([token]), caches)
    token, out = prompt[-1], []
    for _ in range(n):
        logits = model.logits(model.hidden_states(torch.tensor([token]), caches))[0]
        token = sampler(logits, history)
        history.append(token)
        out.append(token)
    return out


def _take(stream, n: int) -> list[int]:
    return [next(stream) for _ in range(n)]


def test_eight_staggered_sequences_match_their_lone_runs(model):
    prompts = _prompts(8)
    tokens = 24
    expected = [_alone(model, p, tokens) for p in prompts]
    scheduler = BatchScheduler(model, POLICY, BatchConfig(slots=4))
    streams = {}
    got: dict[int, list[int]] = {}
    for i in range(3):  # three at once, then the others while those decode
        streams[i] = scheduler.submit(prompts[i], GREEDY, tokens)
    got[0] = _take(streams[0], 5)
    for i in range(3, 6):
        streams[i] = scheduler.submit(prompts[i], GREEDY, tokens)
    got[1] = _take(streams[1], 2)
    cancelled = streams[2]
    got[2] = _take(cancelled, 4)
    cancelled.close()  # Stop midway: its slot goes, the others are untouched
    for i in range(6, 8):
        streams[i] = scheduler.submit(prompts[i], GREEDY, tokens)
    for i, stream in streams.items():
        if i != 2:
            got[i] = got.get(i, []) + list(stream)
    assert got[2] == expected[2][:4]
    for i in range(8):
        if i != 2:
            assert got[i] == expected[i], f"sequence {i} differs under batching"
    assert scheduler.peak_batch >= 3  # they really shared steps
    assert scheduler.steps < sum(len(p) + tokens for p in prompts)


def test_a_waiting_sequence_knows_its_place_and_the_queue_has_a_bound(model):
    scheduler = BatchScheduler(model, POLICY, BatchConfig(slots=1, max_queue=2))
    first = scheduler.submit(_prompts(1)[0], GREEDY, 10_000)
    next(first)  # running now
    second = scheduler.submit([1, 5, 6], GREEDY, 4)
    third = scheduler.submit([1, 7, 8], GREEDY, 4)
    assert (first.queue_position, second.queue_position, third.queue_position) == (0, 1, 2)
    with pytest.raises(QueueFullError, match="2 requests are already waiting for one of 1 slots"):
        scheduler.submit([1, 9], GREEDY, 4)
    idle = BatchScheduler(model, POLICY, BatchConfig(slots=2, max_queue=1))
    submitted = [idle.submit([1, 5 + i], GREEDY, 2) for i in range(3)]  # two of them for slots
    with pytest.raises(QueueFullError, match="1 requests are already waiting for one of 2"):
        idle.submit([1, 9], GREEDY, 2)
    assert [len(list(s)) for s in submitted] == [2, 2, 2]
    _take(first, 3)  # the waiting ones wait through these steps
    first.close()
    assert list(second) == _alone(model, [1, 5, 6], 4)
    assert len(list(third)) == 4
    assert second.queued_s > 0 and first.queued_s < second.queued_s


def test_free_slots_go_to_the_most_urgent_priority_then_to_clients_in_turn(model):
    scheduler = BatchScheduler(model, POLICY, BatchConfig(slots=1))
    first = scheduler.submit(_prompts(1)[0], GREEDY, 10_000)
    next(first)  # it holds the one slot while the others queue

    def submit(name: str, client: str, priority: int = 0):
        params = replace(GREEDY, client=client, priority=priority)
        return name, scheduler.submit([1, 5, len(name)], params, 2)

    # Client a's burst arrives first; b's one request and an urgent one of c's after it.
    queued = [submit("a1", "a"), submit("a2", "a"), submit("a3", "a"), submit("b1", "b")]
    queued.append(submit("c1", "c", priority=-1))
    first.close()
    for _, stream in queued:
        assert len(list(stream)) == 2
    admitted = [name for name, stream in sorted(queued, key=lambda item: item[1].queued_s)]
    assert admitted == ["c1", "a1", "b1", "a2", "a3"]


def test_a_prefix_left_by_a_finished_sequence_is_reused_exactly(model):
    prompt = _prompts(1, seed=3)[0]
    scheduler = BatchScheduler(model, POLICY)
    answer = list(scheduler.submit(prompt, GREEDY, 6))
    follow_up = [*prompt, *answer, 40, 41, 42]  # the next turn of the chat
    stream = scheduler.submit(follow_up, GREEDY, 8)
    got = list(stream)
    assert stream.cached_prompt_tokens == len(prompt) + len(answer) - 1  # the last was not fed
    assert got == _alone(model, follow_up, 8)


def test_a_sequence_past_its_context_goes_on_while_others_run(model):
    long_prompt, short_prompt = _prompts(2, seed=5)
    scheduler = BatchScheduler(model, SMALL_RING)
    runs = 90  # prompt and answer wrap the ring (window + slack = 88 slots)
    long_stream = scheduler.submit(long_prompt, GREEDY, runs)
    short_stream = scheduler.submit(short_prompt, GREEDY, 10)
    assert list(short_stream) == _alone(model, short_prompt, 10, SMALL_RING)
    assert list(long_stream) == _alone(model, long_prompt, runs, SMALL_RING)


@torch.inference_mode()
def test_every_row_of_a_mixed_pass_is_bit_identical_to_decoding_alone(model):
    """Decode rows and prompt chunks of different sequences in one pass: each row's hidden
    state equals, bit for bit, what feeding its sequence one token at a time gives, for
    caches of every storage type the model's heads fit."""
    prompts = [p for p in _prompts(12, seed=9) if len(p) > 24][:4]
    new = [20, 5, 1, 1]  # two prompt chunks (one past 16 rows), two decode steps
    fed = [p[:-n] for p, n in zip(prompts, new, strict=True)]  # in the caches before
    rows = [p[-n:] for p, n in zip(prompts, new, strict=True)]
    kinds = storable_kv_types(model.config.head_dim)
    assert len(kinds) >= 3  # f32, f16, bf16 (and q8, q4, q8/q4 for heads of 32)
    if Q8 in kinds:
        kinds.append(KVPair(Q8, Q4))
    for kind in kinds:
        policy = replace(POLICY, kv_type=kind)
        caches = [model.make_caches(policy) for _ in prompts]
        for before, own in zip(fed, caches, strict=True):
            model.hidden_segments([(before, own)])
        mixed = model.hidden_segments(list(zip(rows, caches, strict=True)))
        at = 0
        for prompt, n in zip(prompts, new, strict=True):
            alone = model.make_caches(policy)
            states = [model.hidden_states(torch.tensor([t]), alone) for t in prompt]
            assert torch.equal(mixed[at : at + n], torch.cat(states[-n:])), kind.name
            at += n


def test_an_engine_loop_serves_consumers_on_other_threads(model):
    """A server's shape: one thread runs the steps, each client waits on its own stream."""
    scheduler = BatchScheduler(model, POLICY)
    stop = threading.Event()
    loop = threading.Thread(target=scheduler.serve, args=(stop,))
    loop.start()
    try:
        prompts = _prompts(3, seed=11)
        results: dict[int, list[int]] = {}

        def client(i: int) -> None:
            results[i] = list(scheduler.submit(prompts[i], GREEDY, 12))

        clients = [threading.Thread(target=client, args=(i,)) for i in range(3)]
        for thread in clients:
            thread.start()
        for thread in clients:
            thread.join(timeout=120)
        assert scheduler.serving
        assert [results[i] for i in range(3)] == [_alone(model, p, 12) for p in prompts]
    finally:
        stop.set()
        loop.join(timeout=30)
    assert not loop.is_alive() and not scheduler.serving


def _drafting(model):
    """A decoder factory that drafts on every step it may: prompt lookup, then an exit after
    the first layer (a controller that never declines)."""

    def factory(caches, fed, sampler):
        drafters = [LookupDrafter(model), EarlyExitDrafter(model, 1, max_draft=3)]
        controller = DraftController(max_draft=3, min_gain=0.0)
        return SpeculativeDecoder(model, caches, fed, sampler, controller, drafters, "auto")

    return factory


def test_a_sequence_alone_drafts_and_batched_steps_do_not_change_its_tokens(model):
    """Alone, a sequence decodes speculatively; once a second arrives both take batched
    steps; alone again, it drafts again. Every token is still the one plain decoding gives."""
    repetitive = [1] + [40, 41, 42, 43, 44] * 6  # prompt lookup finds drafts in it
    other = _prompts(1, seed=13)[0]
    scheduler = BatchScheduler(model, POLICY, decoder_factory=_drafting(model))
    first = scheduler.submit(repetitive, GREEDY, 40)
    got = _take(first, 12)
    drafted_alone = first.speculation.drafted
    second = scheduler.submit(other, GREEDY, 10)
    assert list(second) == _alone(model, other, 10)
    got += list(first)
    assert got == _alone(model, repetitive, 40)
    assert drafted_alone > 0 and second.speculation is None  # never alone
    assert first.speculation.drafted > drafted_alone  # it drafted again once alone


def test_a_compute_thread_runs_every_step_while_clients_wait_on_their_streams(model):
    """The GUI's shape: the main thread serves a ComputeThread, the scheduler posts its step
    loop there, and client threads only read their streams."""
    compute = ComputeThread()
    scheduler = BatchScheduler(model, POLICY, decoder_factory=_drafting(model))
    scheduler.driver = compute
    stepped_on: set[str] = set()
    step = scheduler.step

    def recording_step():
        stepped_on.add(threading.current_thread().name)
        step()

    scheduler.step = recording_step
    prompts = _prompts(3, seed=17)
    results: dict[int, list[int]] = {}
    stop = threading.Event()

    def client(i: int) -> None:
        results[i] = list(scheduler.submit(prompts[i], GREEDY, 12))

    def clients() -> None:
        while not compute.serving:
            time.sleep(0.01)
        threads = [threading.Thread(target=client, args=(i,), name=f"c{i}") for i in range(3)]
        for thread in threads:
            thread.start()
            time.sleep(0.05)  # staggered arrivals
        for thread in threads:
            thread.join(timeout=120)
        stop.set()

    threading.Thread(target=clients).start()
    compute.serve(stop)
    assert [results[i] for i in range(3)] == [_alone(model, p, 12) for p in prompts]
    assert stepped_on == {threading.current_thread().name}


def _answer(runtime, prompt, request, on_tokens=None) -> tuple[str, GenerationStats]:
    events = list(generate(runtime, prompt, request, on_tokens=on_tokens))
    finished = events[-1]
    assert isinstance(finished, Finished)
    return "".join(e.text for e in events if isinstance(e, TextDelta)), finished.stats


def test_the_torch_runtime_with_parallel_answers_several_callers_at_once(tmp_path):
    """`--parallel 2`: three callers on threads of their own; the third waits for a slot.
    Each answer equals the one-at-a-time runtime's, and the stats say what was queued and
    what a pooled prefix gave."""
    path = write_tiny_model(tmp_path / "tiny.gguf", LLAMA)
    one_at_a_time = TorchRuntime(path, n_ctx=256, threads=1, spec="off")
    together = TorchRuntime(path, n_ctx=256, threads=1, spec="auto", parallel=2)
    prompts = _prompts(3, seed=21)
    request = GenerationRequest(max_tokens=16, ignore_end_of_turn=True)
    expected = [_answer(one_at_a_time, p, request)[0] for p in prompts]
    results: dict[int, tuple[str, GenerationStats]] = {}
    all_queued = threading.Barrier(3)  # no one reads (and steps) before all three are queued

    def caller(i: int) -> None:
        queued = lambda _stream: all_queued.wait(timeout=120)  # noqa: E731
        results[i] = _answer(together, prompts[i], request, on_tokens=queued)

    callers = [threading.Thread(target=caller, args=(i,)) for i in range(3)]
    for thread in callers:
        thread.start()
    for thread in callers:
        thread.join(timeout=120)
    assert [results[i][0] for i in range(3)] == expected
    assert all(results[i][1].generated_tokens == 16 for i in range(3))
    assert max(results[i][1].queued_s for i in range(3)) > 0  # two slots, three callers
    last = list(results)[-1]  # the last to finish: its caches are in the prefix pool
    again, stats = _answer(together, prompts[last], request)
    assert again == expected[last] and stats.cached_prompt_tokens == len(prompts[last]) - 1
    assert together.scheduler.peak_batch == 2


def test_the_kv_budget_counts_bytes_of_the_policys_kv_type(model):
    c = model.config
    fp32 = BatchScheduler(model, replace(POLICY, kv_type=F32)).kv_bytes_per_token
    assert fp32 == 2 * c.n_layers * c.n_kv_heads * c.head_dim * 4
    for kind in [*KV_TYPES.values(), KVPair(Q8, Q4)]:
        per_token = BatchScheduler(model, replace(POLICY, kv_type=kind)).kv_bytes_per_token
        assert per_token == bytes_per_token(kind, c.n_layers, c.n_kv_heads, c.head_dim)


def test_the_kv_budget_decides_how_many_run_and_pooled_prefixes_go_first(model):
    """Room for two sequences' KV, four slots: the third waits for memory, not a slot, and
    a finished sequence's pooled prefix is let go when a new one needs its room."""
    prompts = _prompts(3, seed=23)
    per_token = BatchScheduler(model, POLICY).kv_bytes_per_token
    reservation = max(len(p) for p in prompts) + 8
    budget = 2 * reservation * per_token
    scheduler = BatchScheduler(model, POLICY, BatchConfig(slots=4, kv_budget_bytes=budget))
    streams = [scheduler.submit(p, GREEDY, reservation - len(p)) for p in prompts]
    first = next(streams[0])
    assert [s.queue_position for s in streams] == [0, 0, 1]
    assert scheduler.kv_bytes_reserved() <= budget
    outputs = [list(s) for s in streams]
    outputs[0].insert(0, first)
    assert outputs == [_alone(model, p, reservation - len(p)) for p in prompts]
    assert scheduler.peak_batch == 2
    assert len(scheduler._pool) == 2 and scheduler.kv_bytes_reserved() <= budget
    fresh = scheduler.submit([1, 9, 9, 9], GREEDY, 2 * reservation - 4)  # needs all the room
    assert list(fresh) == _alone(model, [1, 9, 9, 9], 2 * reservation - 4)
    assert len(scheduler._pool) == 1  # the others went to make room (its own came back)
