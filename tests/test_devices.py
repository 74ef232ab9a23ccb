"""Device choice and its fallback chain, through an injectable probe: simulated CUDA and ROCm
devices, missing kernels, too little memory, and a machine without a GPU (`SimulatedProbe
("none")`), so every test holds on a machine with a GPU as well as on one without."""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import replace

import pytest
from generation_helpers import first_tokens

from miniapp.engine.errors import DeviceUnavailableError, MiniappError
from miniapp.engine.kv.footprint import estimate_footprint
from miniapp.engine.kv.types import DEFAULT_KV_TYPE, KV_SETTING_NAMES
from miniapp.engine.modelfile.gguf_file import GGUFFile
from miniapp.engine.platform.devices import (
    ALL_LAYERS,
    GIB,
    ModelFootprint,
    OffloadPlan,
    SimulatedProbe,
    TorchProbe,
    load_with_fewer_layers,
    plan_device,
    plan_llamacpp_offload,
)

# A 7B-like model: 4 GiB packed, 13 GiB as bf16, 1 GiB of KV, 32 layers.
BIG = ModelFootprint(int4_bytes=4 * GIB, bf16_bytes=13 * GIB, kv_bytes=1 * GIB, n_layers=32)
NO_GPU = SimulatedProbe("none")


def test_cpu_only_machine_chooses_the_cpu_and_says_why():
    plan = plan_device("auto", NO_GPU, BIG)
    assert plan.device == "cpu" and plan.reason == "no GPU visible to torch"
    assert NO_GPU.check_int4(None).ok  # the real CPU int4 kernel runs (through TorchProbe)


def test_the_real_probe_reports_what_torch_sees():
    import torch

    gpus = TorchProbe().gpus()
    assert len(gpus) == (torch.cuda.device_count() if torch.cuda.is_available() else 0)
    assert all(g.total_bytes >= g.free_bytes > 0 for g in gpus)
    assert TorchProbe().check_int4(None).ok  # the CPU int4 kernel really runs here


def test_ampere_gpu_with_room_runs_int4_on_the_gpu():
    plan = plan_device("auto", SimulatedProbe("cuda:RTX 4090:24:8.9"), BIG)
    assert (plan.device, plan.weights, plan.gpu_layers) == ("cuda:0", "int4", 32)
    assert plan.fallbacks == []


def test_old_cuda_gpu_falls_back_to_bf16_weights():
    plan = plan_device("auto", SimulatedProbe("cuda:V100:32:7.0"), BIG)
    assert (plan.device, plan.weights) == ("cuda:0", "bf16")
    assert "compute capability 7.0 is below 8.0" in plan.fallbacks[0].reason


def test_mi300_without_the_hip_int4_kernel_falls_back_to_bf16():
    plan = plan_device("rocm", SimulatedProbe("rocm:MI300X:192:gfx942:no-int4"), BIG)
    assert (plan.device, plan.weights) == ("rocm:0", "bf16")
    assert "kernel missing on HIP" in plan.fallbacks[0].reason


def test_a_model_too_big_for_the_gpu_is_split_by_layers():
    plan = plan_device("auto", SimulatedProbe("cuda:RTX 3060:8:8.6:no-int4"), BIG)
    assert plan.weights == "bf16" and 0 < plan.gpu_layers < 32
    per_layer = (BIG.bf16_bytes + BIG.kv_bytes) / 32
    assert plan.gpu_layers * per_layer <= 8 * GIB * 0.9  # the margin is kept
    assert "out of memory at load" in plan.fallbacks[-1].reason


def test_no_room_for_one_layer_means_the_cpu():
    plan = plan_device("auto", SimulatedProbe("cuda:tiny:0.5"), BIG)
    assert plan.device == "cpu" and plan.fallbacks
    assert "no room" in plan.reason


def test_the_gpu_with_most_free_memory_is_chosen():
    plan = plan_device("auto", SimulatedProbe("cuda:small:8:8.6,cuda:big:48:8.9"), BIG)
    assert plan.device == "cuda:1"


def test_asking_for_a_missing_device_is_a_one_line_error():
    with pytest.raises(DeviceUnavailableError, match="sees no cuda GPU"):
        plan_device("cuda", NO_GPU, BIG)
    with pytest.raises(DeviceUnavailableError, match="sees no rocm GPU"):
        plan_device("rocm", SimulatedProbe("cuda:RTX 4090:24:8.9"), BIG)
    with pytest.raises(MiniappError, match="unknown device"):
        plan_device("tpu", NO_GPU, BIG)


def test_footprint_comes_from_the_file(default_model):
    footprint = estimate_footprint(GGUFFile(default_model), ctx=1024)
    size = default_model.stat().st_size
    assert 0.8 * size < footprint.int4_bytes <= size
    assert footprint.bf16_bytes > 2 * footprint.int4_bytes  # 4-5 bits a weight vs 16
    # SmolLM2-135M: 30 layers, 3 KV heads of 64, fp32 K and V.
    assert footprint.kv_bytes == 2 * 30 * 3 * 64 * 1024 * 4 and footprint.n_layers == 30


def test_a_tied_token_table_counts_twice_where_the_gpu_holds_the_whole_model(default_model):
    # SmolLM2 ties its head to the table: on a GPU the head's packed copy and the blocks the
    # fixed-shape steps look tokens up in. A model that fits only without the second copy
    # splits its layers instead of running out of memory.
    gguf = GGUFFile(default_model)
    assert "output.weight" not in gguf.tensors
    footprint = estimate_footprint(gguf, ctx=1024)
    assert footprint.table_copy_bytes == gguf.tensors["token_embd.weight"].nbytes > 0
    tied = replace(BIG, table_copy_bytes=3 * GIB)
    gpu = SimulatedProbe("cuda:RTX 4070:8:8.9")
    assert plan_device("auto", gpu, BIG).gpu_layers == 32
    assert plan_device("auto", gpu, tied).gpu_layers < 32


def _doctor(miniapp_exe, *args, simulate="none"):
    env = {**os.environ, "MINIAPP_SIMULATE_GPU": simulate}
    return subprocess.run(
        [miniapp_exe, "doctor", *args], capture_output=True, text=True, timeout=120, env=env
    )


def test_doctor_reports_this_machine(miniapp_exe):
    done = _doctor(miniapp_exe, "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["versions"]["torch"].startswith("2.13.0")
    assert report["gpus"] == [] and report["kernels"]["cpu"]["ok"] is True
    assert report["plan"]["device"] == "cpu"
    assert isinstance(report["llama_cpp"]["gpu_offload"], bool)  # what this build can do
    assert "devices" in report["audio_inputs"]


def test_doctor_reports_the_kv_cache_of_the_chosen_type(miniapp_exe):
    done = _doctor(miniapp_exe, "--json", "--kv-type", "f16", "--ctx", "1000")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    kv, per_type = report["kv_cache"], report["kv_cache"]["per_type"]
    assert kv["type"] == "f16" and kv["bytes_per_token"] == 2 * 30 * 3 * 64 * 2  # SmolLM2
    assert kv["bytes_at_ctx"] == 1000 * kv["bytes_per_token"] == report["footprint"]["kv_bytes"]
    assert set(per_type) == set(KV_SETTING_NAMES)  # every type, and keys apart from values
    assert per_type["q4"] < per_type["q8/q4"] < per_type["q8"] < per_type["f16"]
    assert per_type["f16"] == per_type["bf16"] < per_type["f32"]
    apart = json.loads(_doctor(miniapp_exe, "--json", "--kv-type", "q8/q4").stdout)["kv_cache"]
    assert apart["type"] == "q8/q4" and apart["bytes_per_token"] == 30 * 3 * (68 + 40)
    text = _doctor(miniapp_exe, "--ctx", "4096")  # the default type, in words
    assert text.returncode == 0, text.stderr
    per_token = per_type[DEFAULT_KV_TYPE]
    assert (
        f"KV cache: {DEFAULT_KV_TYPE}, {per_token / 1024:.1f} KiB a token, "
        f"{per_token * 4096 / 2**20:.1f} MiB at 4096 tokens"
    ) in text.stdout
    if DEFAULT_KV_TYPE != "f32":
        assert f"(f32: {per_type['f32'] / 1024:.1f} KiB a token)" in text.stdout


def test_doctor_explains_a_fallback_on_a_simulated_mi300(miniapp_exe):
    done = _doctor(miniapp_exe, simulate="rocm:MI300X:192:gfx942:no-int4")
    assert done.returncode == 0, done.stderr
    assert "MI300X gfx942" in done.stdout
    assert "chosen path: rocm:0 with bf16 weights" in done.stdout
    assert "fell back from int4 kernel on rocm:0: kernel missing on HIP" in done.stdout


def test_doctor_with_a_device_that_is_not_there_exits_2(miniapp_exe):
    done = _doctor(miniapp_exe, "--device", "cuda")
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and "sees no cuda GPU" in done.stderr


# ------------------------------------------------------------------ falling back at run time


def _greedy(runtime, prompt, n=40):
    return first_tokens(runtime, prompt, n)


PROMPT = list(range(300, 340))


@pytest.fixture(scope="module")
def cpu_answer(default_model):
    from miniapp.engine.runtimes.torch_runtime import TorchRuntime

    return _greedy(TorchRuntime(default_model, n_ctx=512, spec="off"), PROMPT)


@pytest.mark.parametrize("spec", ["off", "lookup"])
def test_out_of_memory_mid_decode_goes_on_on_the_cpu_with_the_same_answer(
    default_model, cpu_answer, spec
):
    from miniapp.engine.runtimes.torch_runtime import TorchRuntime

    probe = SimulatedProbe("cuda:Sim:24:8.9:oom-pass=6")
    runtime = TorchRuntime(default_model, n_ctx=512, spec=spec, probe=probe)
    assert runtime.device_plan.device == "cuda:0"
    assert _greedy(runtime, PROMPT) == cpu_answer
    assert runtime.device_plan.device == "cpu"
    assert "out of memory during decode" in runtime.device_plan.fallbacks[-1].reason
    assert _greedy(runtime, PROMPT) == cpu_answer  # and keeps working afterwards


def test_a_gpu_that_holds_the_model_keeps_a_bf16_cache_unless_told_or_short_of_room(
    default_model, monkeypatch
):
    """On a GPU torch's attention reads bf16 rows as they are stored, where quantized rows
    are decoded into a copy in every layer and step; the CPU's attention reads q8 directly.
    A simulated GPU computes on the CPU, so here it stands in for a real one."""
    from miniapp.engine.kv.types import BF16, Q4, Q8
    from miniapp.engine.models import attention_backends
    from miniapp.engine.runtimes.torch_runtime import TorchRuntime

    gguf, ctx = GGUFFile(default_model), 32768
    assert (
        TorchRuntime(default_model, n_ctx=ctx, probe=SimulatedProbe("cuda:Sim:24:8.9")).kv_type
        is Q8
    )
    monkeypatch.setattr(attention_backends, "reduced_precision", lambda device: True)
    roomy = TorchRuntime(default_model, n_ctx=ctx, probe=SimulatedProbe("cuda:Sim:24:8.9"))
    assert roomy.kv_type is BF16 and roomy.device_plan.device == "cuda:0"
    assert roomy.policy.kv_type is BF16
    told = TorchRuntime(default_model, n_ctx=ctx, probe=SimulatedProbe("cuda:Sim:24:8.9"), kv=Q4)
    assert told.kv_type is Q4
    assert TorchRuntime(default_model, n_ctx=ctx, device="cpu").kv_type is Q8
    # Room for the model with a q8 cache, not with a bf16 one: q8, every layer on the GPU.
    q8, bf16 = (estimate_footprint(gguf, ctx, kind) for kind in (Q8, BF16))
    assert bf16.kv_bytes > 1.8 * q8.kv_bytes
    between = 512 * 2**20 + q8.int4_bytes + (q8.kv_bytes + bf16.kv_bytes) / 2
    tight = TorchRuntime(
        default_model, n_ctx=ctx, probe=SimulatedProbe(f"cuda:Sim:{between / GIB}")
    )
    assert tight.kv_type is Q8 and tight.device_plan.gpu_layers == q8.n_layers


def test_caches_rebuilt_after_running_out_of_memory_hold_what_was_lost(default_model):
    """The rebuild feeds every token again as exact rows, as the steps that first fed them
    computed them (prompt chunks too): the rebuilt caches equal, bit for bit, caches that
    were never lost, and the answer goes on the same (a single ordinary pass over everything
    would round differently and flip near-ties)."""
    import torch

    from miniapp.engine.runtimes.torch_runtime import TorchRuntime
    from miniapp.engine.tokens.sampling import GREEDY

    kept, rebuilt = (TorchRuntime(default_model, n_ctx=512, spec="off") for _ in range(2))
    streams, begun = [], []
    for runtime in (kept, rebuilt):  # two turns, the second one stopped mid-answer
        answer = _greedy(runtime, PROMPT, n=6)
        streams.append(runtime.generate_tokens(PROMPT + answer + list(range(500, 530)), GREEDY))
        begun.append([next(streams[-1]) for _ in range(6)])
    assert begun[0] == begun[1]
    lost = [cache.keys.clone() for cache in rebuilt.caches]
    with rebuilt.scheduler._lock:  # what a recovery does once the model is on the CPU
        rebuilt.scheduler._rebuild_caches()
    for before, cache in zip(lost, rebuilt.caches, strict=True):
        assert torch.equal(before[:, :, : cache.offset], cache.keys[:, :, : cache.offset])
    assert [next(streams[1]) for _ in range(12)] == [next(streams[0]) for _ in range(12)]
    for stream in streams:
        stream.close()


def test_out_of_memory_at_load_falls_back_to_the_cpu(default_model, cpu_answer):
    from miniapp.engine.runtimes.torch_runtime import TorchRuntime

    probe = SimulatedProbe("rocm:MI300X:192:gfx942:oom-load")
    runtime = TorchRuntime(default_model, n_ctx=512, spec="off", probe=probe)
    assert runtime.device_plan.device == "cpu"
    assert "out of memory at load" in runtime.device_plan.fallbacks[-1].reason
    assert _greedy(runtime, PROMPT) == cpu_answer


def _teacher_forced(runtime, tokens):
    import torch

    return torch.cat([torch.from_numpy(block) for _, block in runtime.logit_blocks(tokens)])


@pytest.fixture(scope="module")
def sample_tokens(torch_runtime):
    from pathlib import Path

    text = (Path(__file__).parents[1] / "assets" / "text" / "garden.txt").read_text()
    return torch_runtime.tokenizer.encode(text)[:160]


def test_a_gpu_without_the_int4_kernel_runs_dequantized_bf16_weights(
    default_model, torch_runtime, sample_tokens
):
    import torch

    from miniapp.engine.ops.layers import DenseLinear
    from miniapp.engine.runtimes.torch_runtime import TorchRuntime

    runtime = TorchRuntime(
        default_model, n_ctx=512, spec="off", probe=SimulatedProbe("cuda:V100:32:7.0")
    )
    assert (runtime.device_plan.weights, runtime.device_plan.gpu_layers) == ("bf16", 30)
    wqkv = runtime.model.layers[0].attention.wqkv
    assert isinstance(wqkv, DenseLinear) and wqkv.weight.dtype is torch.bfloat16
    dense, packed = (_teacher_forced(r, sample_tokens) for r in (runtime, torch_runtime))
    # The same weights, rounded once to bf16 instead of through the int4 kernel's groups.
    spread = (packed.max(-1).values - packed.min(-1).values).mean()
    assert (dense - packed).abs().max() < 0.05 * spread
    # Near-ties flip between any two roundings: on these 160 tokens the CPU's native int4
    # kernel (its activations rounded to int8, as llama.cpp rounds them) and these bf16
    # weights agree on 0.956 (7 tokens); each of them agrees with llama.cpp on about 0.96.
    assert (dense.argmax(-1) == packed.argmax(-1)).float().mean() >= 0.95


def _split_runtime(default_model, spec: str):
    from miniapp.engine.runtimes.torch_runtime import TorchRuntime

    # 0.6 GiB free leaves ~107 MB after the margin: most, not all, of the 122 MB model and
    # its fp32 cache (a q8 cache is small enough for all of it to fit).
    runtime = TorchRuntime(
        default_model, n_ctx=512, spec=spec, kv="f32", probe=SimulatedProbe("cuda:Small:0.6:8.6")
    )
    plan = runtime.device_plan
    assert plan.weights == "int4" and 0 < plan.gpu_layers < 30
    assert runtime.model.placement.gpu_layers == plan.gpu_layers
    return runtime


def test_a_model_split_between_gpu_and_cpu_scores_as_the_cpu_does(
    default_model, torch_runtime, sample_tokens
):
    split, packed = (
        _teacher_forced(r, sample_tokens)
        for r in (_split_runtime(default_model, "off"), torch_runtime)
    )
    # The GPU's layers take torch's int4 op, the CPU's our kernel: two roundings of the same
    # int4 weights, so the logits agree closely and their top tokens but for near-ties.
    spread = (packed.max(-1).values - packed.min(-1).values).mean()
    assert (split - packed).abs().max() < 0.05 * spread
    assert (split.argmax(-1) == packed.argmax(-1)).float().mean() >= 0.95


def test_a_split_model_drafts_without_changing_its_answer(default_model):
    answers = [_greedy(_split_runtime(default_model, spec), PROMPT) for spec in ("off", "lookup")]
    assert answers[0] == answers[1]


def test_a_split_model_keeps_dense_gpu_layers_and_packed_cpu_layers(default_model):
    from miniapp.engine.ops.layers import DenseLinear, GgmlLinear, Int4Linear
    from miniapp.engine.runtimes.torch_runtime import TorchRuntime

    runtime = TorchRuntime(
        default_model, n_ctx=512, spec="off", probe=SimulatedProbe("cuda:Small:0.7:7.5")
    )
    split = runtime.device_plan.gpu_layers
    assert runtime.device_plan.weights == "bf16" and 0 < split < 30
    layers = runtime.model.layers
    assert isinstance(layers[split - 1].feed_forward.w_down, DenseLinear)
    assert isinstance(layers[split].feed_forward.w_down, Int4Linear)
    # The head stays with the CPU layers, its Q8_0 blocks read from the file as they are.
    assert isinstance(runtime.model.output, GgmlLinear)
    assert len(_greedy(runtime, PROMPT, n=8)) == 8


def test_cuda_int4_packing_input_holds_two_codes_a_byte():
    import torch

    from miniapp.engine.ops.layers import code_pairs, cuda_inner_k_tiles

    codes = torch.randint(0, 16, (16, 96), generator=torch.Generator().manual_seed(1))
    pairs = code_pairs(codes)
    assert pairs.dtype is torch.uint8 and pairs.shape == (16, 48)
    unpacked = torch.stack([pairs >> 4, pairs & 15], dim=-1).reshape(16, 96)
    assert torch.equal(unpacked, codes.to(torch.uint8))
    # SmolLM2's widths: 576 tiles by 4 x 16, 1536 by 8 x 16; 40 does not tile at all.
    assert (cuda_inner_k_tiles(576), cuda_inner_k_tiles(1536)) == (4, 8)
    with pytest.raises(ValueError):
        cuda_inner_k_tiles(40)


def test_chat_keeps_answering_through_an_out_of_memory(miniapp_exe):
    def chat(simulate="none"):
        env = {**os.environ, "MINIAPP_SIMULATE_GPU": simulate}
        return subprocess.run(
            [miniapp_exe, "chat", "--temperature", "0", "--max-tokens", "24", "--spec", "off"],
            input="Name three colours.",
            capture_output=True,
            text=True,
            timeout=120,
            env=env,
        )

    on_cpu, interrupted = chat(), chat("cuda:Sim:24:8.9:oom-pass=4")
    assert interrupted.returncode == 0, interrupted.stderr
    assert interrupted.stdout == on_cpu.stdout
    assert "falling back to the CPU" in interrupted.stderr
    assert "out of memory during decode" in interrupted.stderr


def test_device_flag_is_for_the_torch_engine(miniapp_exe):
    done = subprocess.run(
        [miniapp_exe, "chat", "--backend", "llamacpp", "--device", "cpu"],
        input="hi",
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and "--device applies to the torch backend" in done.stderr


# ------------------------------------------------------------------ llama.cpp offload


def test_llamacpp_offload_follows_the_build_and_free_memory():
    roomy, small = SimulatedProbe("cuda:RTX 4090:24:8.9"), SimulatedProbe("cuda:RTX 3060:3:8.6")
    assert plan_llamacpp_offload(False, roomy, BIG).gpu_layers == 0  # a CPU-only build
    assert plan_llamacpp_offload(True, NO_GPU, BIG).gpu_layers == 0  # no GPU
    assert plan_llamacpp_offload(True, roomy, BIG).gpu_layers == ALL_LAYERS
    partial = plan_llamacpp_offload(True, small, BIG)
    assert 0 < partial.gpu_layers < 32 and "layers fit" in partial.reason


def test_llamacpp_load_retries_with_fewer_layers_then_the_cpu():
    tried = []

    def load(layers):
        tried.append(layers)
        if layers == ALL_LAYERS or layers > 6:
            raise ValueError("failed to create context (out of memory)")
        return f"model with {layers} layers"

    model, used, fallbacks = load_with_fewer_layers(load, OffloadPlan(ALL_LAYERS, "fits"), 32)
    assert tried == [ALL_LAYERS, 16, 8, 4] and used == 4 and model == "model with 4 layers"
    assert [f.step for f in fallbacks] == [
        "all layers on the GPU",
        "16 layers on the GPU",
        "8 layers on the GPU",
    ]

    def never(layers):
        tried.append(layers)
        raise ValueError("bad file")

    tried.clear()
    with pytest.raises(ValueError, match="bad file"):
        load_with_fewer_layers(never, OffloadPlan(3, "3 fit"), 32)
    assert tried == [3, 1, 0]  # down to the CPU, whose failure is the file's


def test_doctor_json_reports_llamacpp_offload(miniapp_exe):
    report = json.loads(_doctor(miniapp_exe, "--json").stdout)
    llama = report["llama_cpp"]
    assert llama["n_gpu_layers"] == 0  # no GPU (simulated), or a build without offload
    assert llama["reason"] == (
        "no GPU visible" if llama["gpu_offload"] else "this llama.cpp build has no GPU offload"
    )


def test_runtimes_say_what_they_are(torch_runtime, llamacpp_runtime):
    ours = torch_runtime.info()
    assert ours.backend == "torch" and ours.device_plan is torch_runtime.device_plan
    assert ours.placement == "cpu (int4)" and ours.spec == "auto"
    assert (ours.sinks, ours.window) == (4, 1024 - 4)
    theirs = llamacpp_runtime.info()
    assert theirs.backend == "llamacpp" and theirs.device_plan is None
    assert theirs.placement == "llamacpp" and theirs.model_path == llamacpp_runtime.model_path
