"""Speculative verification through one fixed-shape step (`StaticVerifyStep`), run on the
CPU: [pending, *drafts] go through a step a GPU captures as a graph, and each row must give
the logits its own decode step gives, wherever the caches can take the rows at once; where
they cannot (a full ring, q4 keys in tiles), the step says it is not ready and verification
runs op by op."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from tiny_gguf import GEMMA3, LLAMA, write_tiny_model

from miniapp.engine.kv.types import BLOCK, F16, Q4, Q8
from miniapp.engine.modelfile.gguf_file import GGUFFile
from miniapp.engine.models import CachePolicy, build_model, static_step
from miniapp.engine.models.static_step import StaticDecodeStep, StaticVerifyStep
from miniapp.engine.platform.devices import SimulatedProbe
from miniapp.engine.runtimes.torch_runtime import TorchRuntime
from miniapp.engine.tokens.sampling import GREEDY

PROMPT = [1, 72, 101, 108, 108, 111, 44, 32]
# A window long enough for a chat's first hundred tokens: verification rows fit the ring.
POLICY = CachePolicy(ctx=160, sinks=4, window=120)
DRAFTS = [[40, 41, 42], [7], [9, 9, 9, 9, 9, 9, 9]]


@pytest.fixture(scope="module", params=[LLAMA, GEMMA3], ids=["llama", "gemma3"])
def tiny_path(request, tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("verify") / "tiny.gguf", request.param)


@pytest.fixture(scope="module")
def model(tiny_path):
    return build_model(GGUFFile(tiny_path))


@pytest.fixture(scope="module")
def torch_model(tiny_path):
    """The model with torch's attention, as a GPU runs it."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MINIAPP_NATIVE", "0")
        return build_model(GGUFFile(tiny_path))


def _prefilled(model, policy=POLICY):
    caches = model.make_caches(policy)
    for cache in caches:
        cache.reserve()
    with torch.inference_mode():
        model(torch.tensor(PROMPT), caches)
    return caches


def _fitting(model, kind):
    return F16 if kind.blocked and model.config.head_dim % BLOCK else kind


def _fed(model, caches, tokens):
    with torch.inference_mode():
        for token in tokens:
            model(torch.tensor([token]), caches)
    return caches


@pytest.mark.parametrize(
    ("kv", "policy", "fed"),
    [
        (None, POLICY, 0),
        (Q8, POLICY, 0),
        # No sinks: a turned-over ring still takes the rows (they fit its slack).
        (None, CachePolicy(ctx=20, sinks=0, window=12), 90),
    ],
    ids=["f32", "q8-where-it-fits", "ring-without-sinks-past-its-wrap"],
)
@pytest.mark.parametrize("attention", ["native", "torch"])
def test_each_verified_row_gives_its_decode_steps_logits_and_states(
    model, torch_model, attention, kv, policy, fed
):
    # Bit for bit: each row's sums run over its own keys in the same order as its decode
    # step's (our CPU kernel, and torch's one call a row).
    model = model if attention == "native" else torch_model
    _check_rows(model, kv, policy, fed)


def test_verification_inputs_reach_the_step_in_one_transfer(model, monkeypatch):
    monkeypatch.setattr(static_step._Staging, "apart", True)  # as on a GPU
    _check_rows(model, None, POLICY, 0)


def _check_rows(model, kv, policy, fed):
    """Verifies DRAFTS after `fed` tokens through StaticVerifyStep, against decode steps."""
    if kv is not None:
        policy = replace(policy, kv_type=_fitting(model, kv))
    history = [(7 * i) % 200 + 3 for i in range(fed)]
    stepped = _fed(model, _prefilled(model, policy), history)
    verified = _fed(model, _prefilled(model, policy), history)
    assert not fed or any(cache.wrapped for cache in verified)  # the global layers' rings
    decode = StaticDecodeStep(model, stepped)
    steps = {}
    token = PROMPT[-1]
    for drafts in DRAFTS:
        rows = [token, *drafts]
        with torch.inference_mode():
            want = torch.cat([decode(t) for t in rows])
            step = steps.setdefault(len(rows), StaticVerifyStep(model, verified, len(rows)))
            assert step.ready()
            states, got = step.verify(rows)
        assert got.shape == want.shape and states.shape == (len(rows), model.config.dim)
        assert torch.equal(got, want)
        with torch.inference_mode():  # the states are the ones the head projects
            assert torch.equal(model.project(states), got)
        for a, b in zip(stepped, verified, strict=True):
            assert (a.offset, a.ring_head) == (b.offset, b.ring_head)
        token = int(want[-1].argmax())
    assert sorted(steps) == [2, 4, 8] and all(s.replays == 1 for s in steps.values())
    assert all(s._staging.sends == 1 for s in steps.values())


def test_a_rejected_draft_rolls_back_and_the_next_rows_match(model):
    stepped, verified = _prefilled(model), _prefilled(model)
    decode, step = StaticDecodeStep(model, stepped), StaticVerifyStep(model, verified, 3)
    for round_ in range(5):
        rows = [3 + round_, 50, 60]
        with torch.inference_mode():
            want = torch.cat([decode(t) for t in rows])
            _, got = step.verify(rows)
        assert torch.equal(got, want)
        for cache in (*stepped, *verified):
            cache.trim(2)  # both drafts rejected


def test_rows_that_would_move_the_sinks_frame_are_verified_op_by_op(model):
    small = CachePolicy(ctx=20, sinks=4, window=12)
    caches = _prefilled(model, small)  # 8 tokens: 4 sinks and 4 in the ring
    assert StaticVerifyStep(model, caches, 8).ready()
    # Four more would push the ring past its window: the sinks' frame moves between rows.
    assert not StaticVerifyStep(model, caches, 9).ready()


def test_rows_that_straddle_two_span_buckets_are_verified_op_by_op(model):
    # A decode step reads a power-of-two prefix of the cache: rows on both sides of 256
    # would read different lengths, and so round differently, in one step.
    caches = _fed(model, _prefilled(model, CachePolicy(ctx=600, streaming=False)), [5] * 244)
    assert caches[0].offset == 252
    assert StaticVerifyStep(model, caches, 4).ready()  # positions 252-255
    assert not StaticVerifyStep(model, caches, 5).ready()  # 252-256


def test_q4_keys_in_tiles_are_verified_op_by_op(tmp_path):
    # Gemma 3's tiny heads are wide enough for q4 tiles (llama's 16 are not).
    model = build_model(GGUFFile(write_tiny_model(tmp_path / "tiny.gguf", GEMMA3)))
    assert Q4.key.tiled_keys and model.config.head_dim % BLOCK == 0
    caches = _prefilled(model, replace(POLICY, kv_type=Q4))
    assert not StaticVerifyStep(model, caches, 3).ready()
    assert StaticVerifyStep(model, _prefilled(model, replace(POLICY, kv_type=Q8)), 3).ready()


class _CountingProbe(SimulatedProbe):
    """A simulated GPU whose step runner counts the steps it is given."""

    def __init__(self):
        super().__init__("cuda:Sim:24:8.9")
        self.built = 0

    def step_runner(self, plan):
        def runner(body):
            self.built += 1
            return body

        return runner, "counting runner"


def _answer(runtime, prompt, n):
    stream = runtime.generate_tokens(prompt, GREEDY)
    try:
        return [token for token, _ in zip(stream, range(n), strict=False)]
    finally:
        stream.close()


def test_a_gpu_runtime_verifies_prompt_lookup_drafts_in_fixed_shape_steps(tiny_path):
    # A prompt that repeats itself: lookup drafts its continuation, so verification runs.
    prompt = [3, 4, 5, 6, 7, 8, 9, 10, 11] * 6
    cpu = TorchRuntime(tiny_path, n_ctx=256, spec="off", device="cpu")
    want = _answer(cpu, prompt, 40)
    runtime = TorchRuntime(tiny_path, n_ctx=256, spec="lookup", probe=_CountingProbe())
    assert _answer(runtime, prompt, 40) == want
    assert runtime.runner.verifications > 0
    assert runtime.static_step is not None and not isinstance(runtime.static_step, StaticVerifyStep)
