"""Tokens drawn inside the fixed-shape decode step (a GPU's captured graph), run on the CPU
through a simulated GPU: the step draws what the device sampler draws from its logits, only
the token ids come back, a runtime on a GPU decodes through it (greedy answers as on the CPU,
seeded ones reproducible, grammars obeyed), and rows that need the logits on the host
(log-probabilities) still get them."""

from __future__ import annotations

import json
from dataclasses import replace

import jsonschema
import pytest
import torch
from generation_helpers import first_tokens
from test_static_step import _GraphProbe, _HostDataProbe, _prefilled
from tiny_gguf import GEMMA3, LLAMA, write_tiny_model

from miniapp.engine.api import FinishReason, GenerationRequest, TextDelta, generate
from miniapp.engine.batching.scheduler import BatchScheduler
from miniapp.engine.modelfile.gguf_file import GGUFFile
from miniapp.engine.models import build_model, static_step
from miniapp.engine.models.static_step import StaticDecodeStep
from miniapp.engine.runtimes.torch_runtime import TorchRuntime
from miniapp.engine.tokens.constraints import OutputConstraint
from miniapp.engine.tokens.device_sampler import SamplingTensors, sample
from miniapp.engine.tokens.sampling import GREEDY, SamplingParams

PROMPT = list(range(3, 40))
MIXED = [
    GREEDY,
    SamplingParams(temperature=0.8, top_k=40, top_p=0.9, seed=1),
    SamplingParams(temperature=1.2, min_p=0.05, repeat_penalty=1.3, presence_penalty=0.5, seed=2),
]


@pytest.fixture(scope="module", params=[LLAMA, GEMMA3], ids=["llama", "gemma3"])
def tiny_path(request, tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("drawn") / "tiny.gguf", request.param)


@pytest.fixture(scope="module")
def model(tiny_path):
    return build_model(GGUFFile(tiny_path))


def _settings(model, histories):
    return SamplingTensors.build(MIXED, histories, model.config.vocab_size)


@pytest.mark.parametrize("staging", ["in-place", "mirror-apart"])
def test_a_step_draws_what_the_device_sampler_draws_from_its_logits(model, staging, monkeypatch):
    # Three sequences in one batched step, one row each of greedy and two sampled settings:
    # the tokens drawn inside the step are those the sampler draws from the logits the
    # same step gives, for every uniform. Mirror apart: the settings and uniforms reach
    # the step through the staged inputs' one transfer, as on a GPU.
    monkeypatch.setattr(static_step._Staging, "apart", staging == "mirror-apart")
    drawn_caches = [_prefilled(model) for _ in MIXED]
    logit_caches = [_prefilled(model) for _ in MIXED]
    drawing = StaticDecodeStep(model, batch=drawn_caches)
    plain = StaticDecodeStep(model, batch=logit_caches)
    histories = [list(PROMPT) for _ in MIXED]
    generator = torch.Generator().manual_seed(0)
    tokens = [5, 9, 14]
    for _ in range(30):
        uniforms = torch.rand(len(MIXED), generator=generator).tolist()
        settings = _settings(model, histories)
        with torch.inference_mode():
            got = drawing.sampled(tokens, settings, uniforms)
            want = sample(plain.step(tokens), settings, torch.tensor(uniforms)).tolist()
        assert got == want
        for history, token in zip(histories, got, strict=True):
            history.append(token)
        tokens = got
    assert drawing.draws == 30 and drawing.replays == 30
    # Sampled and plain steps are built apart (different bodies), once each span bucket.
    assert drawing.captured == plain.captured


def test_a_batched_step_takes_each_sequence_once(model):
    # A sequence twice in one step would write its caches twice. (Padding a batch with
    # repeated rows, to share a bucket's compilation, saved none: torch compiles a padded
    # batch apart from a full one.)
    caches = [_prefilled(model) for _ in range(2)]
    with pytest.raises(ValueError, match="only one row"):
        StaticDecodeStep(model, batch=[caches[0], caches[1], caches[0]])


def test_a_gpu_runtime_draws_each_token_inside_its_step(tiny_path):
    cpu = TorchRuntime(tiny_path, n_ctx=48, spec="off", device="cpu")
    want = first_tokens(cpu, PROMPT, 60)
    probe = _GraphProbe()
    runtime = TorchRuntime(tiny_path, n_ctx=48, spec="off", probe=probe)
    assert first_tokens(runtime, PROMPT, 60) == want  # greedy: the same answer
    step = runtime.static_step
    assert step is not None and step.draws > 40 and step.draws == step.replays


def test_a_seeded_answer_is_the_same_drawn_on_the_device_or_on_the_host(tiny_path):
    # Both draw by inverse CDF of the sampler's uniforms, so the route a token took (the
    # GPU's step, or the host: the prompt's first token, log-probabilities asked) does not
    # change a seeded answer.
    runtime = TorchRuntime(tiny_path, n_ctx=48, spec="off", probe=_GraphProbe())
    # Hot: a tiny random model is all but sure of its next token at ordinary settings.
    params = replace(MIXED[2], temperature=4.0, seed=7)
    drawn = first_tokens(runtime, PROMPT, 40, params)
    step = runtime.static_step
    assert step is not None and step.draws > 20
    assert first_tokens(runtime, PROMPT, 40, params) == drawn
    draws = step.draws
    assert first_tokens(runtime, PROMPT, 40, replace(params, logprobs=1)) == drawn
    assert step.draws == draws
    if runtime.static_step.model.config.architecture == "llama":  # gemma3's: all one token
        assert len(set(drawn)) > 1


def test_rows_that_want_log_probabilities_are_sampled_on_the_host(tiny_path):
    runtime = TorchRuntime(tiny_path, n_ctx=48, spec="off", probe=_GraphProbe())
    stream = runtime.generate_tokens(PROMPT, replace(GREEDY, logprobs=2))
    try:
        tokens = [token for token, _ in zip(stream, range(40), strict=False)]
    finally:
        stream.close()
    assert len(tokens) == 40 and len(stream.logprobs) >= 40  # the engine may run ahead
    step = runtime.static_step
    assert step is not None and step.replays > 20 and step.draws == 0


def test_a_drawing_step_makes_no_tensor_from_host_data(tiny_path):
    probe = _HostDataProbe()
    runtime = TorchRuntime(tiny_path, n_ctx=48, spec="off", probe=probe)
    first_tokens(runtime, PROMPT, 50, MIXED[2])  # penalties, min-p, a seeded draw
    assert runtime.static_step is not None and runtime.static_step.draws > 20
    assert probe.watch_mode.made == 0


def test_a_grammar_mask_applies_inside_the_step(default_model):
    # The bundled model answering to a JSON schema on a simulated GPU: the mask goes into
    # the step with the other settings. The answer validates, and is the one the host
    # sampler draws over the same logits with the same seed (asking for log-probabilities
    # keeps the sampling there): both draw by inverse CDF of the same uniforms.
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"],
    }
    constraint = OutputConstraint.json_schema(schema)
    sampling = SamplingParams(temperature=0.7, seed=3, constraint=constraint)
    runtime = TorchRuntime(default_model, n_ctx=256, threads=2, spec="off", probe=_GraphProbe())

    def answer(params):
        text = "<|im_start|>user\nA person as JSON.<|im_end|>\n<|im_start|>assistant\n"
        prompt = runtime.tokenizer.encode_chat(text)
        events = list(generate(runtime, prompt, GenerationRequest(60, params)))
        assert events[-1].reason is FinishReason.END_OF_TURN
        return "".join(e.text for e in events if isinstance(e, TextDelta))

    drawn = answer(sampling)
    step = runtime.static_step
    assert step is not None and step.draws > 5
    draws = step.draws
    assert answer(replace(sampling, logprobs=1)) == drawn
    assert step.draws == draws  # the second answer was sampled on the host
    jsonschema.validate(json.loads(drawn), schema)


def test_a_speculating_answer_draws_its_plain_steps_inside_the_step(default_model, monkeypatch):
    # A sequence alone under --spec (auto, the default, drafts by prompt lookup) on a GPU:
    # its steps without drafts draw their token inside the step, as plain decoding does,
    # so only ids come back, and each is queued before the previous token is read. The
    # seeded answer is the one whose plain steps are sampled from the logits on the host
    # (one uniform a token either way), one after the other. The bundled model: a
    # tiny random one repeats a token, which prompt lookup drafts every step.
    prompt = [1, 2, 3, *range(300, 330)]
    params = SamplingParams(temperature=1.2, top_p=0.95, seed=11)

    def speculating():
        probe = _GraphProbe()
        return TorchRuntime(default_model, n_ctx=128, threads=2, spec="lookup", probe=probe)

    runtime = speculating()
    drawn = first_tokens(runtime, prompt, 40, params)
    step, stats = runtime.static_step, runtime.last_speculation
    assert step is not None and stats is not None
    assert stats.steps > 20 and step.draws > 20  # the speculative loop's plain steps
    # Each queued before the token it feeds was read; the one verification took back the
    # step queued ahead of it.
    assert runtime.scheduler.overlapped > 20 and stats.verifications >= 1

    monkeypatch.setattr(BatchScheduler, "_lone_draw", lambda *_: lambda token, history: None)
    host = speculating()
    assert first_tokens(host, prompt, 40, params) == drawn
    assert host.static_step is not None and host.static_step.draws == 0
