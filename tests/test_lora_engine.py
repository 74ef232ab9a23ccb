"""LoRA adapters applied unmerged by the torch engine (issue 51): the same logits as llama.cpp
(the oracle) with the same adapter on every architecture; a zero B leaves the base exactly;
rows of one batch with different adapters come out as they do alone; the prefix pool never
hands one adapter's keys and values to another; the native kernel agrees with torch."""

from __future__ import annotations

import dataclasses
import gc
import threading
import weakref

import numpy as np
import pytest
import torch
from gguf.constants import GGMLQuantizationType as Q
from tiny_gguf import GEMMA3, LLAMA, PHI3, QWEN2, QWEN3, write_tiny_adapter, write_tiny_model

from miniapp.engine.lora.adapter import read_adapter
from miniapp.engine.lora.registry import LoraSpec, UnknownAdapterError
from miniapp.engine.modelfile.gguf_file import GGUFFile
from miniapp.engine.runtimes.llamacpp_runtime import LlamaCppRuntime
from miniapp.engine.runtimes.torch_runtime import TorchRuntime
from miniapp.engine.tokens.sampling import GREEDY, LoraChoice
from miniapp.native.lora import (
    LoraCallStruct,
    LoraGroupStruct,
    LoraUpdateStruct,
    ProjectionUpdate,
    UpdatePart,
    reference_delta,
)

TOKENS = [1, *np.random.default_rng(0).integers(3, 259, 127).tolist()]
ARCHITECTURES = {"llama": LLAMA, "qwen2": QWEN2, "qwen3": QWEN3, "phi3": PHI3, "gemma3": GEMMA3}
FUSED_TARGETS = ("attn_qkv", "attn_output", "ffn_up", "ffn_down")  # Phi-3's tensors
# The base oracle tests' bounds (test_oracle_tiny.py): float and quantized files.
FLOAT_BOUND, QUANT_BOUND, MIN_AGREEMENT = 0.005, 0.03, 0.99


def _adapter(path, base, arch="llama", **options):
    targets = FUSED_TARGETS if arch == "phi3" else None
    extra = {} if targets is None else {"targets": targets}
    return write_tiny_adapter(path, base, **extra, **options)


def _merged(path, base_path, adapter_path, spec):
    """The base with W + s B A written into its weights: what the adapter should compute."""
    base = GGUFFile(base_path)
    adapter = read_adapter(adapter_path, base)
    merged = {}
    for name, pair in adapter.pairs.items():
        info = base.tensors[name]
        weight = base.raw(info).view(torch.float32).reshape(info.shape).double()
        merged[name] = (
            weight + adapter.scaling(pair) * (pair.b.double() @ pair.a.double())
        ).numpy()
    base.close()
    return write_tiny_model(path, spec, weights=merged)


@pytest.mark.parametrize("arch", ARCHITECTURES)
@pytest.mark.parametrize("weights", [Q.F32, Q.Q4_0])
def test_adapter_logits_match_llama_cpp_on_every_architecture(tmp_path, arch, weights):
    spec = dataclasses.replace(ARCHITECTURES[arch], weight_type=weights, embed_type=weights)
    base = write_tiny_model(tmp_path / "base.gguf", spec)
    # s = alpha / rank = 0.25: the logits move by about a quarter of their range.
    adapter = _adapter(tmp_path / "a.gguf", base, arch, rank=4, alpha=1.0, seed=3)
    ours = TorchRuntime(base, n_ctx=256, lora=[LoraSpec("a", adapter)])
    theirs = LlamaCppRuntime(base, n_ctx=256, logits_all=True, lora=[LoraSpec("a", adapter)])
    adapted = _logits(ours, "a")
    oracle = theirs.logits(TOKENS)
    assert np.abs(adapted - ours.logits(TOKENS)).max() > 0.1 * np.abs(oracle).max()
    agreement = (adapted.argmax(-1) == oracle.argmax(-1)).mean()
    relative = np.abs(adapted - oracle).max() / np.abs(oracle).max()
    assert agreement >= MIN_AGREEMENT, agreement
    assert relative <= (FLOAT_BOUND if weights == Q.F32 else QUANT_BOUND), relative
    if weights == Q.F32:  # and, unmerged, what the merged weights compute, to fp32 rounding
        merged = TorchRuntime(_merged(tmp_path / "m.gguf", base, adapter, spec), n_ctx=256)
        expected = merged.logits(TOKENS)
        assert np.abs(adapted - expected).max() / np.abs(expected).max() < 1e-4


def _logits(runtime, *names):
    blocks = runtime.logit_blocks(TOKENS, lora=[LoraChoice(name) for name in names])
    return np.concatenate([rows for _, rows in blocks])


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("lora_engine")
    base = write_tiny_model(folder / "base.gguf", dataclasses.replace(LLAMA, weight_type=Q.Q4_0))
    adapters = {
        "a": write_tiny_adapter(folder / "a.gguf", base, rank=4, alpha=8.0, seed=1),
        "b": write_tiny_adapter(folder / "b.gguf", base, rank=8, alpha=4.0, seed=2),
        "c": write_tiny_adapter(
            folder / "c.gguf", base, rank=4, seed=3, targets=("attn_q", "attn_v"), dtype=np.float16
        ),
        "zero": write_tiny_adapter(folder / "zero.gguf", base, zero_b=True),
    }
    return base, adapters


def _runtime(tiny, parallel=1, spec="off"):
    base, adapters = tiny
    specs = [LoraSpec(name, path) for name, path in adapters.items()]
    return TorchRuntime(base, n_ctx=256, parallel=parallel, spec=spec, lora=specs)


def _greedy(runtime, prompt, lora=(), n=16):
    stream = runtime.generate_tokens(prompt, dataclasses.replace(GREEDY, lora=tuple(lora)))
    try:
        return [next(stream) for _ in range(n)]
    finally:
        stream.close()


def test_a_zero_b_gives_the_bases_logits_exactly(tiny):
    runtime = _runtime(tiny)
    plain = runtime.logits(TOKENS)
    np.testing.assert_array_equal(_logits(runtime, "zero"), plain)
    assert np.abs(_logits(runtime, "a") - plain).max() > 0.05


def test_the_scale_scales_the_update_and_zero_scale_is_the_base(tiny):
    runtime = _runtime(tiny)
    plain = runtime.logits(TOKENS)

    def logits(scale):
        blocks = runtime.logit_blocks(TOKENS, lora=[LoraChoice("a", scale)])
        return np.concatenate([r for _, r in blocks])

    np.testing.assert_array_equal(logits(0.0), plain)
    assert np.abs(logits(0.5) - plain).max() < np.abs(logits(1.0) - plain).max()


MIXES = [(), ("a",), ("b",), ("c",), ("a", "b"), ("zero",)]


def test_rows_of_one_batch_with_different_adapters_equal_their_lone_runs(tiny):
    prompts = [list(range(5 + 3 * i, 30 + 5 * i)) for i in range(len(MIXES))]
    lone_runtime = _runtime(tiny)
    lone = [
        _greedy(lone_runtime, prompt, [LoraChoice(n) for n in mix])
        for prompt, mix in zip(prompts, MIXES, strict=True)
    ]
    batched_runtime = _runtime(tiny, parallel=len(MIXES))
    results: list = [None] * len(MIXES)
    start = threading.Barrier(len(MIXES))

    def run(i):
        start.wait()
        results[i] = _greedy(batched_runtime, prompts[i], [LoraChoice(n) for n in MIXES[i]])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(MIXES))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert batched_runtime.scheduler.peak_batch > 1
    assert results == lone
    assert len({tuple(r) for r in lone}) > 3  # the adapters make a difference


def test_speculative_decoding_keeps_the_adapters_greedy_answer(tiny):
    prompt = list(range(5, 40)) * 2
    plain = _greedy(_runtime(tiny), prompt, [LoraChoice("a")], n=24)
    drafted = _greedy(_runtime(tiny, spec="lookup"), prompt, [LoraChoice("a")], n=24)
    assert drafted == plain


def test_the_prefix_pool_reuses_keys_only_under_the_same_adapters_and_scales(tiny):
    """llama.cpp #26207: a prompt cached under one adapter was reused under another."""
    prompt = list(range(5, 60))
    runtime = _runtime(tiny)
    fresh = {
        mix: _greedy(_runtime(tiny), prompt, [LoraChoice(*mix)] if mix else [])
        for mix in [(), ("a",), ("a", 0.5)]
    }
    assert _greedy(runtime, prompt, [LoraChoice("a")]) == fresh[("a",)]
    assert runtime.reusable_prefix(prompt) == 0  # the base finds nothing of adapter a's
    assert _greedy(runtime, prompt) == fresh[()]
    assert runtime.scheduler.reusable_prefix(prompt, runtime.lora.resolve([LoraChoice("a")])) == 0
    assert _greedy(runtime, prompt, [LoraChoice("a", 0.5)]) == fresh[("a", 0.5)]
    again = runtime.generate_tokens(
        prompt, dataclasses.replace(GREEDY, lora=(LoraChoice("a", 0.5),))
    )
    next(again)
    again.close()
    assert again.cached_prompt_tokens > 0  # the same adapter at the same scale reuses


def test_an_unknown_adapter_fails_the_request_not_the_runtime(tiny):
    runtime = _runtime(tiny)
    with pytest.raises(UnknownAdapterError, match="'nope'"):
        runtime.generate_tokens([5, 6, 7], dataclasses.replace(GREEDY, lora=(LoraChoice("nope"),)))
    assert len(_greedy(runtime, [5, 6, 7], n=3)) == 3


def test_an_unloaded_adapter_lets_running_answers_finish(tiny):
    runtime = _runtime(tiny)
    prompt = list(range(5, 30))
    expected = _greedy(_runtime(tiny), prompt, [LoraChoice("a")], n=12)
    stream = runtime.generate_tokens(prompt, dataclasses.replace(GREEDY, lora=(LoraChoice("a"),)))
    tokens = [next(stream) for _ in range(4)]
    held = weakref.ref(runtime.lora.resolve([LoraChoice("a")]).entries[0][0])
    runtime.lora.unload("a")
    tokens += [next(stream) for _ in range(8)]
    stream.close()
    assert tokens == expected
    _greedy(runtime, [5, 6, 7], n=2)  # a step after the answer ended
    del stream
    gc.collect()
    assert held() is None  # the adapter's memory is freed once its last answer is over
    with pytest.raises(UnknownAdapterError):
        runtime.generate_tokens(prompt, dataclasses.replace(GREEDY, lora=(LoraChoice("a"),)))


def test_past_the_budget_the_least_recently_used_adapter_is_let_go_and_read_again(tiny):
    base, adapters = tiny
    runtime = TorchRuntime(base, n_ctx=128, spec="off")
    first = runtime.lora.load("a", adapters["a"])
    runtime.lora.budget_bytes = first.nbytes + 1
    runtime.lora.load("b", adapters["b"])
    assert not runtime.lora.get("a").resident and runtime.lora.get("b").resident
    assert runtime.lora.resident_bytes == runtime.lora.get("b").nbytes
    expected = _greedy(_runtime(tiny), [5, 6, 7, 8], [LoraChoice("a")], n=6)
    assert _greedy(runtime, [5, 6, 7, 8], [LoraChoice("a")], n=6) == expected
    assert runtime.lora.get("a").loads == 2 and not runtime.lora.get("b").resident


def test_adapters_given_at_open_keep_within_the_budget_too(tiny):
    base, adapters = tiny
    specs = [LoraSpec("a", adapters["a"]), LoraSpec("b", adapters["b"])]
    runtime = TorchRuntime(base, n_ctx=128, spec="off", lora=specs, lora_budget_mb=0)
    assert [info.resident for info in runtime.lora.list()] == [False, True]
    assert len(_greedy(runtime, [5, 6, 7], [LoraChoice("a")], n=3)) == 3


def test_a_loaded_adapter_costs_its_own_bytes_and_no_copy_of_the_base(tiny):
    base, adapters = tiny
    runtime = TorchRuntime(base, n_ctx=128, spec="off")
    info = runtime.lora.load("b", adapters["b"])
    assert info.nbytes == read_adapter(adapters["b"], runtime.gguf).nbytes


# -- the kernel against its torch reference -----------------------------------------------


def _update(generator, k, parts, rank, dtype):
    """A random update of `parts` [(out_offset, out_count)], each of `rank`."""
    a = torch.randn(rank * len(parts), k, generator=generator).to(dtype)
    made = []
    for p, (offset, count) in enumerate(parts):
        b = torch.randn(count, rank, generator=generator).to(dtype)
        made.append(UpdatePart.blocked(offset, p * rank, b, 0.5 + p))
    return ProjectionUpdate(a, tuple(made))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_the_native_kernel_agrees_with_torch_and_rows_are_their_own(dtype):
    from miniapp.engine.lora.rows import cpu_lora_kernel

    kernel = cpu_lora_kernel()
    assert kernel is not None
    generator = torch.Generator().manual_seed(0)
    k, n_out, m = 96, 80, 7
    first = _update(generator, k, [(0, 48), (48, 16), (64, 16)], 4, dtype)
    second = _update(generator, k, [(8, 40)], 8, dtype)
    groups = [  # row 2 carries two adapters: the second group is its second
        (first, 1.5, torch.tensor([0, 2, 3])),
        (second, -0.5, torch.tensor([2, 5])),
        (first, 0.25, torch.tensor([6])),
    ]
    positions = [0, 1, 1]
    keep = []
    structs = (LoraGroupStruct * len(groups))()
    for struct, (update, scale, rows), position in zip(structs, groups, positions, strict=True):
        table = (LoraUpdateStruct * 4)()
        update.fill(table[2])  # as projection 2 of layer 0
        keep += [table, rows]
        struct.updates = __import__("ctypes").addressof(table)
        struct.scale, struct.rows, struct.n_rows = scale, rows.data_ptr(), rows.numel()
        struct.position = position
    call = LoraCallStruct(__import__("ctypes").addressof(structs), len(groups), 0)
    x = torch.randn(m, k, generator=generator)
    native = kernel.delta(call, 2, x, n_out)
    torch.testing.assert_close(native, reference_delta(groups, x, n_out), rtol=1e-4, atol=1e-4)
    assert torch.equal(native[[1, 4]], torch.full((2, n_out), -0.0))  # rows without any
    assert torch.signbit(native[1]).all()  # -0.0, which leaves W x bit for bit as it is
    assert kernel.delta(call, 0, x, n_out) is None  # no group updates projection 0
    # A row's update is its own: alone, it is computed bit for bit the same.
    alone_structs = (LoraGroupStruct * 1)()
    row = torch.tensor([0])
    alone_structs[0].updates, alone_structs[0].scale = structs[0].updates, 1.5
    alone_structs[0].rows, alone_structs[0].n_rows = row.data_ptr(), 1
    alone = LoraCallStruct(__import__("ctypes").addressof(alone_structs), 1, 0)
    assert torch.equal(kernel.delta(alone, 2, x[3:4], n_out)[0], native[3])


def _kl(log_p: np.ndarray, log_q: np.ndarray) -> float:
    """Mean KL(p || q) over rows, from log-softmaxed rows."""
    return float((np.exp(log_p) * (log_p - log_q)).sum(-1).mean())


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits.astype(np.float64) - logits.max(-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))


def test_smollm2_with_a_rank_8_adapter_on_every_projection_matches_llama_cpp(
    default_model, tmp_path
):
    """The bundled model and a rank-8 adapter on q, k, v, o, gate, up and down: llama.cpp's
    logits as closely as the base model's (test_default_model.py's bounds)."""
    from miniapp.assets import sample_texts
    from miniapp.engine.evaluation.lora_bench import write_random_adapter

    adapter = write_random_adapter(default_model, tmp_path / "r8.gguf", rank=8, seed=5)
    ours = TorchRuntime(default_model, n_ctx=512, lora=[LoraSpec("r8", adapter)])
    theirs = LlamaCppRuntime(
        default_model, n_ctx=512, logits_all=True, lora=[LoraSpec("r8", adapter)]
    )
    tokens = ours.tokenizer.encode("\n\n".join(sample_texts()), parse_special=False)[:512]
    adapted = np.concatenate([r for _, r in ours.logit_blocks(tokens, lora=[LoraChoice("r8")])])
    oracle = theirs.logits(tokens)
    log_ours, log_oracle = _log_softmax(adapted), _log_softmax(oracle)
    assert (adapted.argmax(-1) == oracle.argmax(-1)).mean() >= 0.945
    assert _kl(log_oracle, log_ours) < 0.01
    # The adapter moves the distribution well past that disagreement.
    assert _kl(_log_softmax(ours.logits(tokens)), log_ours) > 0.05


def test_doctor_reports_an_adapters_bytes_and_load_time_or_why_not(
    default_model, miniapp_exe, tmp_path
):
    import json
    import subprocess

    from miniapp.engine.evaluation.lora_bench import write_random_adapter

    good = write_random_adapter(default_model, tmp_path / "r4.gguf", rank=4)
    other = write_tiny_adapter(tmp_path / "other.gguf", write_tiny_model(tmp_path / "t.gguf"))
    done = subprocess.run(
        [miniapp_exe, "doctor", "--json", "--lora", str(good), "--lora", str(other)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    first, second = json.loads(done.stdout)["lora"]
    assert first["rank"] == 4 and first["weights"] == 7 * 30  # every projection, 30 layers
    assert first["bytes"] > 0 and first["read_seconds"] > 0 and first["llama_cpp_reads_it"]
    assert "other.gguf" in second["error"] and "\n" not in second["error"]


def test_many_rows_split_across_threads_come_out_as_each_row_alone():
    """A prompt chunk's rows go to threads row by row; a decode row's ranks and outputs are
    split instead. Either way a row's update is the same bits as the row alone."""
    import ctypes

    from miniapp.engine.lora.rows import cpu_lora_kernel

    kernel = cpu_lora_kernel()
    generator = torch.Generator().manual_seed(1)
    k, n_out, m = 256, 320, 40
    update = _update(generator, k, [(0, 256), (256, 64)], 16, torch.float16)
    table = (LoraUpdateStruct * 4)()
    update.fill(table[3])

    def call(rows):
        groups = (LoraGroupStruct * 1)()
        groups[0].updates, groups[0].scale = ctypes.addressof(table), 0.75
        groups[0].rows, groups[0].n_rows = rows.data_ptr(), rows.numel()
        return LoraCallStruct(ctypes.addressof(groups), 1, 0), groups, rows

    x = torch.randn(m, k, generator=generator)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        every = call(torch.arange(m))  # kept: the structures point into each other
        together = kernel.delta(every[0], 3, x, n_out)
        one = call(torch.tensor([0]))
        for row in (0, 17, 39):
            alone = kernel.delta(one[0], 3, x[row : row + 1], n_out)
            assert torch.equal(alone[0], together[row])
    finally:
        torch.set_num_threads(threads)
    reference = reference_delta([(update, 0.75, torch.arange(m))], x, n_out)
    torch.testing.assert_close(together, reference, rtol=1e-4, atol=1e-4)


def test_without_the_native_library_torch_applies_the_same_update(tiny, monkeypatch):
    """The path a GPU (or a CPU without our library) takes: torch's ops, the same maths.

    Torch's int4 matmul runs in bf16, so the two paths' logits differ by its rounding even
    without adapters (how much depends on the CPU's kernels); these adapters move the logits
    by about twice their size, which scales that rounding up with them. A missing, doubled
    or wrongly scaled update would be off by a large part of the adapters' effect."""
    native_base, native = _logits(_runtime(tiny)), _logits(_runtime(tiny), "a", "b")
    monkeypatch.setenv("MINIAPP_NATIVE", "0")
    torch_base, plain_torch = _logits(_runtime(tiny)), _logits(_runtime(tiny), "a", "b")
    size = np.abs(native).max()
    assert np.abs(torch_base - native_base).max() / np.abs(native_base).max() < 0.02
    effect = np.abs(native - native_base).max()
    assert effect > 0.5 * size  # the adapters matter
    update_error = np.abs((plain_torch - torch_base) - (native - native_base)).max()
    assert update_error < 0.05 * effect, (update_error, effect)
    assert (plain_torch.argmax(-1) == native.argmax(-1)).mean() >= 0.9


def test_an_f64_adapter_runs_on_torch_and_never_reaches_llama_cpp(tiny, tmp_path):
    """llama.cpp segfaults on F64 adapter tensors (llama-cpp-python 0.3.36 and llama-server
    alike): our engine reads them as f32, and the llama.cpp backend refuses the file in one
    line instead of handing it over."""
    from miniapp.engine.lora.adapter import AdapterError

    base, _ = tiny
    double = write_tiny_adapter(tmp_path / "d.gguf", base, seed=1, dtype=np.float64)
    single = write_tiny_adapter(tmp_path / "s.gguf", base, seed=1, dtype=np.float32)
    runtime = TorchRuntime(base, n_ctx=256, lora=[LoraSpec("d", double), LoraSpec("s", single)])
    np.testing.assert_array_equal(_logits(runtime, "d"), _logits(runtime, "s"))
    with pytest.raises(AdapterError, match=r"d\.gguf: it holds F64 tensors") as raised:
        LlamaCppRuntime(base, n_ctx=128, lora=[LoraSpec("d", double)])
    assert "\n" not in str(raised.value)
