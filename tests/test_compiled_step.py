"""The decode step compiled by torch.compile before a GPU captures it (platform/graphs.py),
checked on the CPU, where inductor generates C++ kernels from the same fusion decisions it
makes for Triton on a GPU: the compiled step gives the uncompiled step's tokens and logits,
draws its tokens the same way, runs in about ten kernels a layer, counted by the profiler,
and compiles twice in a chat however long it grows. A step that cannot compile runs as
written."""

from __future__ import annotations

import collections
import logging
import os

import pytest
import torch
from tiny_gguf import LLAMA, write_tiny_model
from torch.profiler import ProfilerActivity, profile

from miniapp.engine.modelfile.gguf_file import GGUFFile
from miniapp.engine.models import CachePolicy, build_model
from miniapp.engine.models.static_step import StaticDecodeStep, StaticVerifyStep
from miniapp.engine.platform.devices import COMPILE_ENV, step_compile_unavailable
from miniapp.engine.platform.graphs import (
    BATCH_COMPILE_AFTER,
    VERIFY_COMPILE_AFTER,
    CompiledStep,
    batched_runner,
    compiled_runner,
    uncompiled,
    verifying_runner,
)
from miniapp.engine.tokens.device_sampler import SamplingTensors
from miniapp.engine.tokens.sampling import SamplingParams

PROMPT = [1, 72, 101, 108, 108, 111, 44, 32]
STEPS = 24
# Per layer: the norm with the residual, QKV, RoPE with the KV write, attention, a cast,
# the output projection, the second norm, gate/up, SiLU times up, down.
KERNELS_PER_LAYER = 10
HEAD_KERNELS = 4  # the final norm, the head, copies of the logits and the step's inputs
# Ops that launch no kernel: views, and allocations (a graph's memory pool serves them).
NO_KERNEL = ("empty", "as_strided", "view", "transpose", "expand", "reshape", "select")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    # Our ctypes kernels are opaque to the compiler: a GPU runs torch's ops, so do we here.
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MINIAPP_NATIVE", "0")
        path = write_tiny_model(tmp_path_factory.mktemp("compiled") / "tiny.gguf", LLAMA)
        yield build_model(GGUFFile(path))


@pytest.fixture(scope="module")
def compiled_steps(model):
    """An uncompiled and a compiled static step over twin caches, both fed the prompt;
    compiled once for the module (about 20 s on two cores)."""
    torch._dynamo.reset()

    plain = StaticDecodeStep(model, _prefilled(model))
    compiled = StaticDecodeStep(model, _prefilled(model), runner=compiled_runner())
    yield plain, compiled
    torch._dynamo.reset()


def _prefilled(model):
    caches = model.make_caches(CachePolicy(ctx=128))
    for cache in caches:
        cache.reserve()
    with torch.inference_mode():
        model(torch.tensor(PROMPT), caches)
    return caches


def test_a_compiled_step_gives_the_uncompiled_steps_tokens(compiled_steps):
    plain, compiled = compiled_steps
    token = PROMPT[-1]
    with torch.inference_mode():
        for _ in range(STEPS):
            want, got = plain(token), compiled(token)
            # Casts kept where the model rounds: the same numbers, up to fused reductions.
            assert (got - want).abs().max() < 1e-4
            assert int(got.argmax()) == int(want.argmax())
            token = int(want.argmax())
    settings = SamplingTensors.build(
        [SamplingParams(temperature=0.9, top_p=0.95, repeat_penalty=1.2)],
        [PROMPT],
        compiled.logits.shape[1],
    )
    with torch.inference_mode():
        for uniform in (0.1, 0.5, 0.93):
            assert compiled.sampled([token], settings, [uniform]) == plain.sampled(
                [token], settings, [uniform]
            )
    assert compiled.draws == 3


def _kernels(step, token: int) -> collections.Counter:
    """The kernels one step of the compiled `step` runs, by name, as torch.profiler sees
    them: inductor's generated kernels, and the ops its code calls (a matmul, attention)."""
    return _kernels_of(lambda: step(token))


def _kernels_of(run) -> collections.Counter:
    """The kernels a second `run()` of a compiled step runs (the first compiles it)."""
    import torch._inductor.config as inductor

    with torch.inference_mode(), inductor.patch({"cpp.enable_kernel_profile": True}):
        run()  # compiled with profiling marks
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            run()
    calls = [e for e in prof.events() if e.name.startswith("## Call CompiledFxGraph")]
    assert len(calls) == 1, [e.name for e in prof.events() if e.cpu_parent is None]
    launched = [e.name for e in calls[0].cpu_children]
    return collections.Counter(n for n in launched if not n.endswith(NO_KERNEL))


def test_a_compiled_step_runs_about_ten_kernels_a_layer(model, compiled_steps):
    torch._dynamo.reset()  # compiled again below, with the profiler's marks
    _, compiled = compiled_steps
    compiled._runs.clear()
    kernels = _kernels(compiled, 5)
    layers = model.config.n_layers
    generated = sum(n for name, n in kernels.items() if "cpp_fused" in name)
    matmuls = sum(n for name, n in kernels.items() if "int4" in name or "mm" in name)
    assert matmuls == 4 * layers + 1, kernels  # QKV, output, gate/up, down; the head
    assert generated >= 4 * layers, kernels  # the fused elementwise work
    assert sum(kernels.values()) <= KERNELS_PER_LAYER * layers + HEAD_KERNELS, kernels


def test_a_chat_through_three_span_buckets_compiles_its_step_twice(model):
    # Buckets of 256, 512 and then the whole 600-slot span: the second compilation makes the
    # span length symbolic, and the third bucket reuses it (a recompilation per bucket would
    # stall a GPU chat for the compile's seconds each time it grows past a power of two).
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    caches = model.make_caches(CachePolicy(ctx=600))
    for cache in caches:
        cache.reserve()
    with torch.inference_mode():
        model(torch.tensor(PROMPT), caches)
    step = StaticDecodeStep(model, caches, runner=compiled_runner())
    token = PROMPT[-1]
    with torch.inference_mode():
        for _ in range(560):
            token = int(step(token).argmax())
    assert step.captured == 3  # one graph a bucket, on a GPU
    assert counters["stats"]["unique_graphs"] == 2
    torch._dynamo.reset()


def test_a_compiled_verification_step_gives_the_as_written_steps_rows_in_few_kernels(model):
    # Verification replays [pending, *drafts] as one pass: compiled, like a decode step, it
    # launches about a decode step's kernels, and per extra row and layer two more: the
    # row's own attention call (what keeps it bit for bit its decode step's) and the kernel
    # that prepares that call's query and mask.
    torch._dynamo.reset()
    rows = 4
    written = StaticVerifyStep(model, _prefilled(model), rows)
    compiled = StaticVerifyStep(
        model, _prefilled(model), rows, runner=lambda body: CompiledStep(body, "verification")
    )
    for tokens in ([5, 40, 41, 42], [7, 9, 9, 9], [3, 3, 50, 60]):
        with torch.inference_mode():
            want_states, want = written.verify(tokens)
            states, got = compiled.verify(tokens)
        assert (got - want).abs().max() < 1e-4
        assert (states - want_states).abs().max() < 1e-4
        assert torch.equal(got.argmax(-1), want.argmax(-1))
    torch._dynamo.reset()  # compiled again below, with the profiler's marks
    compiled._runs.clear()
    kernels = _kernels_of(lambda: compiled.verify([5, 6, 7, 8]))
    layers = model.config.n_layers
    matmuls = sum(n for name, n in kernels.items() if "int4" in name or "mm" in name)
    assert matmuls == 4 * layers + 1, kernels
    bound = (KERNELS_PER_LAYER + 2 * (rows - 1)) * layers + HEAD_KERNELS
    assert sum(kernels.values()) <= bound, kernels
    torch._dynamo.reset()


def test_a_verification_step_compiles_once_its_row_count_is_in_use():
    # Until then it is captured as written: a drafter tries many row counts once or twice,
    # and each would be a compilation of its own. The count is the row count's, across the
    # steps of it (a chat's steps are new after each reset).
    torch._dynamo.reset()
    captured = []

    def capture(body):
        captured.append(body)
        return body

    total, one = torch.zeros(3), torch.ones(3)

    def body():
        total.add_(one)

    runner = compiled_runner(capture)
    first = verifying_runner(runner, 4)(body)
    for _ in range(VERIFY_COMPILE_AFTER - 1):
        first()
    assert captured == [body]
    verifying_runner(runner, 3)(body)()  # another row count: counted apart
    assert captured == [body, body]
    second = verifying_runner(runner, 4)(body)  # a new step of 4 rows
    second()
    assert captured == [body, body, body]
    second()
    assert len(captured) == 4 and isinstance(captured[3], CompiledStep)
    assert captured[3].ran and captured[3].body is body
    second()
    first()  # an older step of the same count compiles at its next run too
    assert len(captured) == 5 and isinstance(captured[4], CompiledStep)
    assert torch.equal(total, torch.full((3,), VERIFY_COMPILE_AFTER + 4.0))
    assert verifying_runner(capture, 4) is capture  # no compiler: as written
    torch._dynamo.reset()


def test_a_batched_step_compiles_once_its_row_count_is_in_use():
    # Its attention is unrolled per row, so each row count is a compilation of its own
    # (while every client waits): a count a client's arrival only passes through stays
    # captured as written. The count of steps is the row count's, across the steps of it
    # (the sets of sequences batched together change as clients come and go).
    torch._dynamo.reset()
    captured = []

    def capture(body):
        captured.append(body)
        return body

    total, one = torch.zeros(3), torch.ones(3)

    def body():
        total.add_(one)

    runner = compiled_runner(capture)
    first = batched_runner(runner, 4)(body)
    for _ in range(BATCH_COMPILE_AFTER):
        first()
    batched_runner(runner, 8)(body)()  # another row count: counted apart
    assert captured == [body, body]
    second = batched_runner(runner, 4)(body)  # another set of four sequences
    second()
    assert len(captured) == 3 and isinstance(captured[2], CompiledStep)
    assert captured[2].ran and captured[2].what == "a batched step of 4 rows"
    assert runner.verifications == collections.Counter()  # verifications count apart
    assert batched_runner(capture, 4) is capture  # no compiler: as written
    assert uncompiled(runner) is capture and uncompiled(capture) is capture
    torch._dynamo.reset()


def test_a_compiled_batched_step_gives_the_as_written_rows_in_fewer_kernels(model):
    # Three sequences: compiled, the step gives the rows the step as written gives, and a
    # row beyond the first costs a few kernels a layer (its own attention call and the
    # kernels around it), not the seventeen ops a layer it dispatches as written.
    torch._dynamo.reset()
    sequences = [_prefilled(model) for _ in range(3)]
    twins = [_prefilled(model) for _ in range(3)]
    written = StaticDecodeStep(model, batch=sequences)
    compiled = StaticDecodeStep(
        model, batch=twins, runner=lambda body: CompiledStep(body, "a batch")
    )
    tokens = [PROMPT[-1], 40, 41]
    with torch.inference_mode():
        for _ in range(STEPS):
            want, got = written.step(tokens), compiled.step(tokens)
            assert got.shape == (3, model.config.vocab_size)
            assert (got - want).abs().max() < 1e-4
            assert torch.equal(got.argmax(-1), want.argmax(-1))
            tokens = want.argmax(-1).tolist()
    (run,) = compiled._runs.values()
    assert run.compiled is not None and run.ran  # whole, not fallen back to as written
    torch._dynamo.reset()  # compiled again below, with the profiler's marks
    compiled._runs.clear()
    kernels = _kernels_of(lambda: compiled.step(tokens))
    layers, extra_rows = model.config.n_layers, 2
    bound = (KERNELS_PER_LAYER + 3 * extra_rows) * layers + HEAD_KERNELS
    assert sum(kernels.values()) <= bound, kernels
    torch._dynamo.reset()


def test_a_server_compiles_each_row_count_once_as_clients_come_and_go(model, monkeypatch):
    # Waves of three clients through the scheduler, greedy and sampled answers mixed,
    # ending one after another: every row count from three down to one. Each wave's
    # clients end in another order, so that its batches are other sets of caches. After
    # the first wave every step the later waves take is one already compiled (a
    # compilation is a stall of seconds to minutes on a GPU's host, and torch stops
    # compiling after COMPILED_VARIANTS).
    from torch._dynamo.utils import counters

    from miniapp.engine.batching.runner import ModelRunner
    from miniapp.engine.batching.scheduler import BatchConfig, BatchScheduler
    from miniapp.engine.platform import graphs
    from miniapp.engine.tokens.sampling import GREEDY

    monkeypatch.setattr(graphs, "BATCH_COMPILE_AFTER", 2)
    torch._dynamo.reset()
    counters.clear()
    policy = CachePolicy(ctx=128)
    runner = ModelRunner(model, policy, graphs=compiled_runner())
    scheduler = BatchScheduler(model, policy, BatchConfig(slots=3), runner=runner)
    params = [GREEDY, SamplingParams(temperature=0.8, top_p=0.9)]
    params.append(SamplingParams(temperature=1.0, top_k=20, repeat_penalty=1.1))
    graphs_after = []
    for wave in range(3):
        prompts = [[1, *range(3 + 7 * wave + i, 20 + 5 * i)] for i in range(3)]
        streams = [
            scheduler.submit(prompt, settings, 12 + 4 * ((i + wave) % 3))
            for i, (prompt, settings) in enumerate(zip(prompts, params, strict=True))
        ]
        for stream in streams:
            assert len(list(stream)) > 0
        graphs_after.append(counters["stats"]["unique_graphs"])
    assert graphs_after[0] >= 3  # the lone step and the batches of 2 and 3 rows
    assert graphs_after[2] == graphs_after[0]
    torch._dynamo.reset()


def test_a_step_that_cannot_compile_runs_as_written(caplog):
    torch._dynamo.reset()
    ran = []

    def body():
        ran.append(len(ran))
        if torch.ones(1).item() > 0:  # a value read on the host: no whole graph
            ran.append(-1)

    step = CompiledStep(body)
    with caplog.at_level(logging.WARNING, logger="miniapp.engine"):
        step()
        step()
    assert step.compiled is None
    assert "runs uncompiled" in caplog.text
    assert ran.count(-1) == 2  # it ran, as written, each time
    torch._dynamo.reset()


def test_compiled_kernels_are_kept_in_miniapps_cache_folder(monkeypatch, tmp_path):
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.setenv("MINIAPP_CACHE_DIR", str(tmp_path))
    CompiledStep(lambda: None)
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "inductor")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/elsewhere")  # a setting of the user's
    CompiledStep(lambda: None)
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == "/elsewhere"


def test_a_cpu_install_brings_no_triton_and_the_setting_switches_compiling_off(monkeypatch):
    assert step_compile_unavailable() == "no Triton for this GPU (pip install triton)"
    monkeypatch.setenv(COMPILE_ENV, "0")
    assert step_compile_unavailable() == f"switched off by {COMPILE_ENV}=0"
