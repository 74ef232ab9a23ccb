"""Continuous batching: many sequences in one forward pass per step, each token for token what
it produces alone (tiny random-weight models, written with gguf's writer)."""

from __future__ import annotations

import random
import threading

import pytest
import torch
from tiny_gguf import GEMMA3, LLAMA, write_tiny_model

from miniapp.engine.batching.scheduler import BatchConfig, BatchScheduler, QueueFullError
from miniapp.engine.gguf_file import GGUFFile
from miniapp.engine.models import CachePolicy, build_model
from miniapp.engine.sampling import GREEDY
from miniapp.engine.torch_sampler import Sampler

POLICY = CachePolicy(ctx=256, sinks=4)
# A small ring: a few dozen tokens wrap it and move the sinks' frame.
SMALL_RING = CachePolicy(ctx=40, sinks=4, window=24)


@pytest.fixture(scope="module", params=[LLAMA, GEMMA3], ids=["llama", "gemma3"])
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
    first.close()
    assert list(second) == _alone(model, [1, 5, 6], 4)
    assert len(list(third)) == 4
    assert second.queued_s > 0 and first.queued_s < second.queued_s


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
    state equals, bit for bit, what feeding its sequence one token at a time gives."""
    prompts = [p for p in _prompts(12, seed=9) if len(p) > 24][:4]
    new = [20, 5, 1, 1]  # two prompt chunks (one past 16 rows), two decode steps
    fed = [p[:-n] for p, n in zip(prompts, new, strict=True)]  # in the caches before
    rows = [p[-n:] for p, n in zip(prompts, new, strict=True)]
    caches = [model.make_caches(POLICY) for _ in prompts]
    for before, own in zip(fed, caches, strict=True):
        model.hidden_segments([(before, own)])
    mixed = model.hidden_segments(list(zip(rows, caches, strict=True)))
    at = 0
    for prompt, n in zip(prompts, new, strict=True):
        alone = model.make_caches(POLICY)
        states = [model.hidden_states(torch.tensor([t]), alone) for t in prompt]
        assert torch.equal(mixed[at : at + n], torch.cat(states[-n:]))
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
