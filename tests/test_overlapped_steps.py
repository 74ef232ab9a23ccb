"""Decode steps queued before the previous step's tokens are read, run on a simulated GPU.

On a GPU the host queues step n+1, fed on the device the tokens step n draws, and only then
waits for step n's ids: its work for the next step overlaps the GPU's. These tests check
that nothing a user sees depends on it: the answers, seeded ones too, are those of steps
taken one after the other, when a sequence stops, reaches its limit or is cancelled while a
step is queued ahead, and the caches a finished answer leaves for the next prompt hold just
what it was fed."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from test_static_step import _GraphProbe, _prefilled

from miniapp.engine.modelfile.gguf_file import GGUFFile
from miniapp.engine.models import build_model, static_step
from miniapp.engine.models.static_step import StaticDecodeStep
from miniapp.engine.runtimes.torch_runtime import TorchRuntime
from miniapp.engine.tokens.device_sampler import SamplingTensors
from miniapp.engine.tokens.sampling import GREEDY, SamplingParams

# The bundled model: a tiny random one repeats its last token at any temperature, which
# would hide a draw taken out of turn.
HOT = SamplingParams(temperature=1.2, top_p=0.95, seed=11)
PENALISED = replace(HOT, repeat_penalty=1.3, seed=12)


@pytest.fixture(scope="module")
def model(default_model):
    return build_model(GGUFFile(default_model))


@pytest.mark.parametrize("staging", ["in-place", "mirror-apart"])
def test_a_step_fed_the_tokens_still_on_the_device_draws_what_a_step_fed_them_draws(
    model, staging, monkeypatch
):
    # Two batches of the same three sequences: one is fed each step's tokens by the host,
    # the other is queued before they are read, fed them on the device. Mirror apart: the
    # staged inputs reach the step in one transfer, as on a GPU, and the queued step's
    # ids are not overwritten by that transfer.
    monkeypatch.setattr(static_step._Staging, "apart", staging == "mirror-apart")
    params = [GREEDY, HOT, replace(HOT, temperature=1.5)]
    settings = SamplingTensors.build(params, [[]] * 3, model.config.vocab_size)
    fed = StaticDecodeStep(model, batch=[_prefilled(model) for _ in params])
    ahead = StaticDecodeStep(model, batch=[_prefilled(model) for _ in params])
    generator = torch.Generator().manual_seed(0)
    tokens, first = [5, 9, 14], [0.5] * 3
    with torch.inference_mode():
        queued = ahead.launch(tokens, settings, first)
        want = fed.sampled(tokens, settings, first)
        for _ in range(12):
            uniforms = torch.rand(3, generator=generator).tolist()
            following = ahead.launch(None, settings, uniforms)  # before reading `queued`
            assert queued.ids() == want
            want = fed.sampled(want, settings, uniforms)
            queued = following
        assert queued.ids() == want
        # A step queued ahead whose tokens are not wanted: taking it back leaves the caches
        # as the other batch's, and the next step, given its tokens, agrees with it.
        ahead.launch(None, settings, first)
        ahead.take_back()
        offsets = [[c.offset for c in one] for one in ahead.sequences]
        assert offsets == [[c.offset for c in one] for one in fed.sequences]
        assert ahead.sampled(want, settings, first) == fed.sampled(want, settings, first)


def _runtime(path, overlap: bool) -> TorchRuntime:
    runtime = TorchRuntime(path, n_ctx=128, threads=2, spec="off", probe=_GraphProbe(), parallel=3)
    scheduler = runtime.scheduler
    scheduler.config = replace(scheduler.config, overlap_steps=overlap)
    return runtime


def _answers(runtime: TorchRuntime, requests, cancel_after: dict[int, int] | None = None):
    """Every request (prompt, params, max_new, stop ids) submitted at once, the streams read
    in turn to their ends (or closed by their reader after `cancel_after[i]` tokens)."""
    cancel_after = cancel_after or {}
    streams = [
        runtime.scheduler.submit(prompt, params, max_new, frozenset(stops))
        for prompt, params, max_new, stops in requests
    ]
    answers: list[list[int]] = [[] for _ in streams]
    live = set(range(len(streams)))
    while live:
        for i in sorted(live):
            if len(answers[i]) == cancel_after.get(i, -1):
                streams[i].close()
                live.discard(i)
                continue
            token = next(streams[i], None)
            if token is None:
                live.discard(i)
            else:
                answers[i].append(token)
    return answers


def _prompt(i: int) -> list[int]:
    return [1, 2, 3] + list(range(300 + 50 * i, 330 + 50 * i))


def test_answers_and_the_caches_they_leave_do_not_depend_on_steps_queued_ahead(default_model):
    # Three sequences decoding together: two seeded samplers and a greedy one. The first
    # ends on a stop token while the others go on (taken from its answer without one). Each ends
    # with a step queued ahead that must be undone: a stop, a limit, the last one.
    def requests(stops):
        return [
            (_prompt(0), replace(HOT, seed=3), 40, stops),
            (_prompt(1), GREEDY, 33, ()),
            (_prompt(2), HOT, 50, ()),
        ]

    plain = _runtime(default_model, overlap=False)
    unstopped = _answers(plain, requests(()))
    stop = next(t for t in unstopped[0][8:] if t not in unstopped[0][:8])
    want = _answers(plain, requests((stop,)))
    assert len(want[0]) < 40 and want[0][-1] == stop
    assert plain.scheduler.overlapped == 0

    overlapped = _runtime(default_model, overlap=True)
    assert _answers(overlapped, requests((stop,))) == want
    scheduler = overlapped.scheduler
    assert scheduler.overlapped > 20 and scheduler.overlapped < scheduler.steps
    # What each finished answer left for a chat's next turn: its caches hold exactly what
    # it was fed, as steps one after the other leave them.
    for i, answer in enumerate(want):
        follow_up = _prompt(i) + answer + [7, 8]
        reused = plain.scheduler.reusable_prefix(follow_up)
        assert reused > len(_prompt(i))
        assert scheduler.reusable_prefix(follow_up) == reused


def test_a_cancelled_answer_leaves_the_others_as_they_were(default_model):
    # The reader of the second stream closes it while a step is queued ahead for all
    # three: the step is undone, and the others' seeded answers carry on unchanged (their
    # samplers draw again what the undone step drew).
    requests = [(_prompt(i), replace(HOT, seed=20 + i), 30, ()) for i in range(3)]
    want = _answers(_runtime(default_model, overlap=False), requests, cancel_after={1: 9})
    runtime = _runtime(default_model, overlap=True)
    assert _answers(runtime, requests, cancel_after={1: 9}) == want
    assert len(want[1]) == 9 and len(want[0]) == len(want[2]) == 30
    assert runtime.scheduler.overlapped > 10


def test_only_steps_whose_settings_do_not_follow_the_tokens_are_queued_ahead(default_model):
    # Penalties count the tokens drawn so far: a batch with such a row is fed by the host
    # each step, and its answers are the same either way.
    requests = [(_prompt(0), HOT, 20, ()), (_prompt(1), PENALISED, 20, ())]
    want = _answers(_runtime(default_model, overlap=False), requests)
    runtime = _runtime(default_model, overlap=True)
    assert _answers(runtime, requests) == want
    assert runtime.scheduler.overlapped == 0
    assert runtime.static_step is not None and runtime.static_step.draws > 10
