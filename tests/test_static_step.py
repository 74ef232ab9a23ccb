"""The fixed-shape decode step a GPU captures as a graph (`models/static_step.py`), run on the
CPU: it must give the ordinary decode step's logits across window wraps, sink rotation,
sliding-window layers and speculative roll-backs, and it must be capturable - traced whole,
with nothing in it that changes from one step to the next (checked with torch.compile, which
errors on a graph break or a recompilation)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from cache_snapshots import restore, snapshot
from generation_helpers import first_tokens
from tiny_gguf import GEMMA3, LLAMA, write_tiny_model
from torch.utils._python_dispatch import TorchDispatchMode

from miniapp.engine.kv.types import BLOCK, F16, F32, Q4, Q8, KVPair
from miniapp.engine.modelfile.gguf_file import GGUFFile
from miniapp.engine.models import CachePolicy, build_model, static_step
from miniapp.engine.models.static_step import StaticDecodeStep, span_bucket
from miniapp.engine.platform.devices import SimulatedProbe
from miniapp.engine.runtimes.torch_runtime import TorchRuntime
from miniapp.engine.tokens.sampling import GREEDY

# A small streaming cache, so a few dozen tokens wrap the ring and move the sinks' frame.
POLICY = CachePolicy(ctx=20, sinks=4, window=12)
PROMPT = [1, 72, 101, 108, 108, 111, 44, 32]
STEPS = 90  # past the ring of window + slack (76), so it wraps
TILED_STEPS = 150  # q4 keys: past a ring of whole tiles (128)


@pytest.fixture(scope="module", params=[LLAMA, GEMMA3], ids=["llama", "gemma3"])
def tiny_path(request, tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("static") / "tiny.gguf", request.param)


@pytest.fixture(scope="module")
def model(tiny_path):
    return build_model(GGUFFile(tiny_path))


@pytest.fixture(scope="module")
def torch_model(tiny_path):
    """The model with torch's attention, as a GPU runs eager steps. Over q4 keys the CPU's
    native kernel quantizes the query per tile (tests/test_kv_tiles.py), where a GPU's
    attention - eager or static - reads the decoded keys with the fp32 query."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MINIAPP_NATIVE", "0")
        return build_model(GGUFFile(tiny_path))


@pytest.fixture
def model_for(model, torch_model):
    """The model whose eager steps a static step over caches of `kind` must match."""
    return lambda kind: torch_model if kind.key.tiled_keys else model


def _prefilled(model, policy=POLICY):
    caches = model.make_caches(policy)
    for cache in caches:
        cache.reserve()
    with torch.inference_mode():
        model(torch.tensor(PROMPT), caches)
    return caches


def _eager_step(model, caches, token):
    with torch.inference_mode():
        return model(torch.tensor([token]), caches)


def _tokens(step_logits, n=STEPS):
    """Greedy tokens and their logits from a step function token -> logits [1, vocab]."""
    token, tokens, logits = PROMPT[-1], [], []
    for _ in range(n):
        row = step_logits(token)
        logits.append(row)
        token = int(row.argmax())
        tokens.append(token)
    return tokens, torch.cat(logits)


def _static_logits(step):
    def run(token):
        assert step.ready()
        with torch.inference_mode():
            return step(token)

    return run


def _fitting(model, kind):
    """The kind, or f16 where the tiny model's heads are too narrow for blocks (llama's 16)."""
    return F16 if kind.blocked and model.config.head_dim % BLOCK else kind


@pytest.mark.parametrize(
    "kind",
    [F32, F16, Q8, KVPair(Q8, Q4), Q4],
    ids=["f32", "f16", "q8-where-it-fits", "q8/q4-where", "q4-tiled-keys-where"],
)
def test_static_steps_give_the_ordinary_steps_logits(model_for, kind):
    model = model_for(kind)
    kind = _fitting(model, kind)
    policy = replace(POLICY, kv_type=kind)  # q8: keys rotated and quantized in the step too
    # q4 keys round the ring up to whole tiles (128 slots): more steps to wrap it.
    steps = STEPS if not kind.key.tiled_keys else TILED_STEPS
    eager_caches, static_caches = _prefilled(model, policy), _prefilled(model, policy)
    want, want_logits = _tokens(lambda t: _eager_step(model, eager_caches, t), n=steps)
    step = StaticDecodeStep(model, static_caches)
    got, got_logits = _tokens(_static_logits(step), n=steps)
    assert got == want
    # Masked-out keys add exact zeros; only the length of the reductions differs.
    assert (got_logits - want_logits).abs().max() < 1e-4
    # A global layer's ring did turn over (the sliding-window layers' rings are bigger).
    assert any(c.wrapped for c in eager_caches) and any(c.wrapped for c in static_caches)
    for eager, static in zip(eager_caches, static_caches, strict=True):
        assert (eager.offset, eager.ring_head, eager.frame) == (
            static.offset,
            static.ring_head,
            static.frame,
        )


@pytest.mark.parametrize("kind", [F32, Q4], ids=["f32", "q4-where-it-fits"])
def test_every_input_reaches_the_step_in_one_transfer(model_for, kind, monkeypatch):
    # As on a GPU: the host writes the step's inputs into a mirror and sends it whole once a
    # step; an input written anywhere else would leave the step reading a stale value.
    monkeypatch.setattr(static_step._Staging, "apart", True)
    model = model_for(kind)
    policy = replace(POLICY, kv_type=_fitting(model, kind))
    steps = STEPS if not policy.kv_type.key.tiled_keys else TILED_STEPS
    eager_caches, static_caches = _prefilled(model, policy), _prefilled(model, policy)
    want, want_logits = _tokens(lambda t: _eager_step(model, eager_caches, t), n=steps)
    step = StaticDecodeStep(model, static_caches)
    assert step._staging.mirror is not step._staging.buffer
    got, got_logits = _tokens(_static_logits(step), n=steps)
    assert got == want
    assert (got_logits - want_logits).abs().max() < 1e-4
    assert step._staging.sends == step.replays == steps


@pytest.mark.parametrize("kind", [F32, Q4], ids=["f32", "q4-where-it-fits"])
def test_static_and_ordinary_steps_share_caches_through_roll_backs(model_for, kind):
    """Speculative decoding mixes them: drafts fed eagerly, trimmed, then static steps
    (q4 keys: across tile boundaries, which the host encodes after either kind of step)."""
    model = model_for(kind)
    policy = replace(POLICY, kv_type=_fitting(model, kind))
    eager_caches, mixed_caches = _prefilled(model, policy), _prefilled(model, policy)
    step = StaticDecodeStep(model, mixed_caches)
    token = PROMPT[-1]
    for round_ in range(40 if kind is Q4 else 8):
        drafts = [token, (token * 7 + round_) % 250 + 3, (token * 11) % 250 + 3]
        for caches in (eager_caches, mixed_caches):
            with torch.inference_mode():
                model(torch.tensor(drafts), caches)
            for cache in caches:
                cache.trim(2)  # two drafts rejected
        want = _eager_step(model, eager_caches, drafts[1])
        assert step.ready()
        with torch.inference_mode():
            got = step(drafts[1])
        assert (got - want).abs().max() < 1e-4
        token = int(want.argmax())


@pytest.mark.parametrize("kind", [F32, Q4], ids=["f32", "q4-where-it-fits"])
def test_a_fixed_context_cache_takes_static_steps(model_for, kind):
    model = model_for(kind)
    # 70: q4 keys' storage is rounded up to whole tiles (96), past the span.
    policy = CachePolicy(ctx=70, streaming=False, kv_type=_fitting(model, kind))
    eager_caches, static_caches = _prefilled(model, policy), _prefilled(model, policy)
    want, want_logits = _tokens(lambda t: _eager_step(model, eager_caches, t), n=60)
    got, got_logits = _tokens(_static_logits(StaticDecodeStep(model, static_caches)), n=60)
    assert got == want
    assert (got_logits - want_logits).abs().max() < 1e-4


def test_the_host_builds_the_sinks_rotation_only_for_a_frame_not_yet_written(model, monkeypatch):
    """Between two steps of a GPU the host writes the sinks' rotation into the step's inputs
    only when the frame moves: never again for caches without sinks, and with sinks not
    while the window is still filling. The steps still match the ordinary ones."""
    from miniapp.engine.ops.layers import Rope

    built = []
    shift_tables = Rope.shift_tables
    monkeypatch.setattr(
        Rope, "shift_tables", lambda rope, frame: built.append(frame) or shift_tables(rope, frame)
    )
    kinds = len({model.config.is_local(i) for i in range(model.config.n_layers)})
    fixed = CachePolicy(ctx=70, streaming=False)
    step = StaticDecodeStep(model, _prefilled(model, fixed))
    _tokens(_static_logits(step), n=40)
    assert len(built) == kinds  # once a kind's buffer: frame 0
    eager_caches, static_caches = _prefilled(model), _prefilled(model)
    want, _ = _tokens(lambda t: _eager_step(model, eager_caches, t), n=STEPS)
    built.clear()  # the eager steps' rotations of the sinks are their own
    got, _ = _tokens(_static_logits(StaticDecodeStep(model, static_caches)), n=STEPS)
    assert got == want
    window_fills = POLICY.window - len(PROMPT)  # steps before the frame starts to move
    assert kinds <= len(built) <= kinds * (STEPS - window_fills + 1)


def test_a_cleared_cache_answers_as_a_new_one(model):
    """A new chat clears the caches in place (their storage, and a GPU's graphs, stay)."""
    used = _prefilled(model)
    _tokens(lambda t: _eager_step(model, used, t))  # wraps the ring, moves the frame
    for cache in used:
        cache.clear()
    fresh = model.make_caches(POLICY)
    with torch.inference_mode():
        want = model(torch.tensor(PROMPT * 3), fresh, all_logits=True)
        got = model(torch.tensor(PROMPT * 3), used, all_logits=True)
    assert torch.equal(got, want)
    want_next, _ = _tokens(lambda t: _eager_step(model, fresh, t))
    got_next, _ = _tokens(lambda t: _eager_step(model, used, t))
    assert got_next == want_next


def test_new_storage_means_the_step_is_not_ready(model):
    caches = _prefilled(model)
    step = StaticDecodeStep(model, caches)
    assert step.ready()
    restore(caches[0], snapshot(caches[0]))  # restore copies into new tensors
    assert not step.ready()
    fresh = model.make_caches(POLICY)  # not reserved, sinks empty
    assert not StaticDecodeStep(model, fresh).ready()


@pytest.mark.parametrize("kind", [F32, Q4], ids=["f32", "q4-where-it-fits"])
def test_the_static_step_traces_whole_without_recompiling(tiny_path, monkeypatch, kind):
    """What a CUDA graph needs, checked where there is no GPU: torch.compile with
    fullgraph=True fails on any graph break, and a recompile limit of 1 on any value the
    step would bake in (a Python int that changes from step to step)."""
    import torch._dynamo

    monkeypatch.setenv("MINIAPP_NATIVE", "0")  # our ctypes kernel is opaque to the tracer
    traced_model = build_model(GGUFFile(tiny_path))
    policy = replace(POLICY, kv_type=_fitting(traced_model, kind))
    eager_caches = _prefilled(traced_model, policy)
    static_caches = _prefilled(traced_model, policy)
    # 40 steps: past the first complete tile of q4 keys, which the host encodes.
    want, want_logits = _tokens(lambda t: _eager_step(traced_model, eager_caches, t), n=40)
    torch._dynamo.reset()

    def compiled(body):
        return torch.compile(body, fullgraph=True, backend="aot_eager")

    step = StaticDecodeStep(traced_model, static_caches, runner=compiled)
    # One compiled graph allowed: a second (a recompilation) is an error.
    with torch._dynamo.config.patch(recompile_limit=1, fail_on_recompile_limit_hit=True):
        got, got_logits = _tokens(_static_logits(step), n=40)
    torch._dynamo.reset()
    assert got == want
    assert (got_logits - want_logits).abs().max() < 1e-4


# ------------------------------------------------------------------ in the runtime


class _GraphProbe(SimulatedProbe):
    """A simulated GPU whose step runner records what it is given, or fails to capture."""

    def __init__(self, fail: bool = False):
        super().__init__("cuda:Sim:24:8.9")
        self.fail, self.built = fail, 0

    def step_runner(self, plan):
        def runner(body):
            self.built += 1
            if not self.fail:
                return body

            def broken():
                raise RuntimeError("operation not permitted when stream is capturing")

            return broken

        return runner, "test runner"


def _answer(runtime, n=60):
    return first_tokens(runtime, list(range(3, 40)), n)


@pytest.fixture(scope="module")
def cpu_tokens(tiny_path):
    return _answer(TorchRuntime(tiny_path, n_ctx=48, spec="off", device="cpu"))


@pytest.mark.parametrize("spec", ["off", "lookup"])
def test_a_gpu_runtime_decodes_through_the_static_step(tiny_path, cpu_tokens, spec):
    probe = _GraphProbe()
    runtime = TorchRuntime(tiny_path, n_ctx=48, spec=spec, probe=probe)
    assert runtime.decode_step_note == "test runner"
    assert _answer(runtime) == cpu_tokens
    assert runtime.static_step is not None  # the steps went through it
    assert probe.built >= 1 and _captured(runtime) == probe.built
    runtime.reset()  # a new chat keeps the caches' storage, so the built steps stay valid
    assert _answer(runtime) == cpu_tokens
    assert _captured(runtime) == probe.built


def _captured(runtime):
    """Graphs built by the sequence's decode step and its verification steps (drafts)."""
    step = runtime.static_step
    verify_steps = step.sequences[0].verify_steps or {}
    return step.captured + sum(verify.captured for verify in verify_steps.values())


def test_batched_decode_rows_replay_one_captured_step(tiny_path):
    # Three sequences decoding together on a GPU: their rows go through one fixed-shape step
    # built over all their caches, through the same graph runner as a lone step (captured
    # once per span bucket, then replayed), and each answer is the one it gets alone. The
    # step has three rows, one a sequence.
    prompts = [list(range(3 + i, 40 + i)) for i in range(3)]
    cpu = TorchRuntime(tiny_path, n_ctx=48, spec="off", device="cpu")
    alone = [first_tokens(cpu, prompt, 60) for prompt in prompts]
    probe = _GraphProbe()
    runtime = TorchRuntime(tiny_path, n_ctx=48, spec="off", probe=probe, parallel=3)
    streams = [runtime.generate_tokens(prompt, GREEDY) for prompt in prompts]
    together = [[next(stream) for stream in streams] for _ in range(60)]
    for stream in streams:
        stream.close()
    assert [list(answer) for answer in zip(*together, strict=True)] == alone
    step = runtime.static_step
    assert step is not None and step.batched and len(step.sequences) == 3
    assert 1 <= step.captured <= probe.built and step.replays > 10 * step.captured


def test_a_batch_over_rows_in_different_span_buckets_takes_one_graph(model):
    # A server's sequences sit at different lengths: the batched step reads every row's
    # caches as far as the longest row's span bucket (each row's mask hides the rest), so
    # one graph serves the batch while a row crosses into its next bucket, where a graph per
    # combination of buckets would be captured (on a GPU, compiled) again. Each row's
    # logits are still its own decode step's, bit for bit.
    policy = CachePolicy(ctx=1024)

    def prefilled(n):
        caches = model.make_caches(policy)
        for cache in caches:
            cache.reserve()
        tokens = [(7 * i) % 50 + 3 for i in range(n)]
        with torch.inference_mode():
            for start in range(0, n, 200):
                model(torch.tensor(tokens[start : start + 200]), caches)
        return caches

    lengths = [254, 300, 600]  # the first crosses from the 256 bucket into 512
    batch = StaticDecodeStep(model, batch=[prefilled(n) for n in lengths])
    alone = [StaticDecodeStep(model, prefilled(n)) for n in lengths]
    tokens = [5, 9, 14]
    with torch.inference_mode():
        for _ in range(4):
            rows = batch.step(tokens)
            assert torch.equal(rows, torch.cat([a(t) for a, t in zip(alone, tokens, strict=True)]))
    assert batch.captured == 1 and alone[0].captured == 2


def _logprobs(runtime, n):
    """The greedy answer, and each step's top 3 log-probabilities: a tiny random model's
    tokens repeat, with a probability near 1, but the runners-up's show the logits."""
    stream = runtime.generate_tokens(list(range(3, 40)), replace(GREEDY, logprobs=3))
    try:
        tokens = [token for token, _ in zip(stream, range(n), strict=False)]
    finally:
        stream.close()
    return tokens, torch.tensor([[lp for _, lp in entry.top] for entry in stream.logprobs])


def test_a_gpu_runtime_takes_static_steps_over_q4_keys(tiny_path, model, monkeypatch):
    kind = _fitting(model, Q4)
    monkeypatch.setenv("MINIAPP_NATIVE", "0")  # eager attention as a GPU's: decoded keys
    cpu = TorchRuntime(tiny_path, n_ctx=48, spec="off", device="cpu", kv=kind)
    want, want_logprobs = _logprobs(cpu, 90)  # past whole tiles, through the ring's wrap
    probe = _GraphProbe()
    runtime = TorchRuntime(tiny_path, n_ctx=48, spec="off", probe=probe, kv=kind)
    assert runtime.decode_step_note == "test runner" and runtime.kv_type == kind
    got, got_logprobs = _logprobs(runtime, 90)
    assert runtime.static_step is not None
    assert got == want and probe.built >= 1
    assert (got_logprobs - want_logprobs).abs().max() < 1e-4


class _HostData(TorchDispatchMode):
    """Notes each tensor made from Python data: inside a captured step, that is a copy from
    the host in every replay, which a CUDA graph refuses at capture (seen on an H200)."""

    def __init__(self):
        super().__init__()
        self.made = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten.lift_fresh.default, torch.ops.aten.lift_fresh_copy.default):
            self.made += 1
        return func(*args, **(kwargs or {}))


class _HostDataProbe(SimulatedProbe):
    """A simulated GPU whose step runner watches the step for tensors made from host data."""

    def __init__(self):
        super().__init__("cuda:Sim:24:8.9")
        self.watch_mode = _HostData()

    def step_runner(self, plan):
        def runner(body):
            def watched():
                with self.watch_mode:
                    body()

            return watched

        return runner, "watched runner"


@pytest.mark.parametrize("kv", [None, Q4])
def test_the_static_step_makes_no_tensor_from_host_data(tiny_path, model, monkeypatch, kv):
    if kv is not None:
        kv = _fitting(model, kv)
        monkeypatch.setenv("MINIAPP_NATIVE", "0")  # a GPU's attention over decoded keys
    probe = _HostDataProbe()
    runtime = TorchRuntime(tiny_path, n_ctx=48, spec="off", probe=probe, kv=kv)
    assert runtime.decode_step_note == "watched runner"
    _logprobs(runtime, 60)  # through the ring's wrap
    assert runtime.static_step is not None and runtime.static_step.captured >= 1
    assert probe.watch_mode.made == 0


def test_a_failed_capture_falls_back_to_ordinary_steps(tiny_path, cpu_tokens):
    runtime = TorchRuntime(tiny_path, n_ctx=48, spec="off", probe=_GraphProbe(fail=True))
    assert _answer(runtime) == cpu_tokens  # the failed step is taken again, eagerly
    assert runtime.static_step is None
    assert runtime.device_plan.fallbacks[-1].step == "graph of the decode step"
    assert "stream is capturing" in runtime.decode_step_note


def test_graphs_can_be_switched_off_and_a_cpu_never_takes_static_steps(tiny_path, monkeypatch):
    assert TorchRuntime(tiny_path, n_ctx=48, device="cpu").static_step is None
    monkeypatch.setenv("MINIAPP_DECODE_GRAPH", "0")
    runtime = TorchRuntime(tiny_path, n_ctx=48, probe=_GraphProbe())
    assert runtime.static_step is None and "MINIAPP_DECODE_GRAPH=0" in runtime.decode_step_note


def test_span_buckets_grow_by_powers_of_two():
    assert [span_bucket(n, 5000) for n in (1, 256, 257, 1000, 4097)] == [256, 256, 512, 1024, 5000]
    assert span_bucket(10, 76) == 76


def test_the_cuda_graph_runner_warms_up_captures_once_and_replays(monkeypatch):
    """The capture sequence, with torch.cuda's stream and graph objects simulated (this
    machine has no GPU): warm-up runs, one capture in thread-local mode, then replays."""
    from contextlib import contextmanager

    from miniapp.engine.platform import graphs

    events = []

    class FakeStream:
        def wait_stream(self, other):
            events.append("wait")

    class FakeGraph:
        def replay(self):
            events.append("replay")

    @contextmanager
    def on_stream(stream):
        events.append("side stream")
        yield

    @contextmanager
    def capturing(graph, capture_error_mode):
        events.append(f"capture ({capture_error_mode})")
        yield

    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    monkeypatch.setattr(torch.cuda, "current_stream", FakeStream)
    monkeypatch.setattr(torch.cuda, "stream", on_stream)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph", capturing)
    runner = graphs.CudaGraphRunner(lambda: events.append("body"))
    runner()
    runner()
    warm = ["body"] * graphs.WARMUP_STEPS
    assert events == [
        "wait",
        "side stream",
        *warm,
        "wait",
        "capture (thread_local)",
        "body",
        "replay",
        "replay",
    ]
