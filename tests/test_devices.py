"""Device choice and its fallback chain, through an injectable probe (this machine has no
GPU): simulated CUDA and ROCm devices, missing kernels, too little memory."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from miniapp.engine.devices import (
    GIB,
    ModelFootprint,
    SimulatedProbe,
    TorchProbe,
    estimate_footprint,
    plan_device,
)
from miniapp.engine.errors import DeviceUnavailableError, MiniappError
from miniapp.engine.gguf_file import GGUFFile

# A 7B-like model: 4 GiB packed, 13 GiB as bf16, 1 GiB of KV, 32 layers.
BIG = ModelFootprint(int4_bytes=4 * GIB, bf16_bytes=13 * GIB, kv_bytes=1 * GIB, n_layers=32)


def test_cpu_only_machine_chooses_the_cpu_and_says_why():
    plan = plan_device("auto", TorchProbe(), BIG)
    assert plan.device == "cpu" and plan.reason == "no GPU visible to torch"
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
        plan_device("cuda", TorchProbe(), BIG)
    with pytest.raises(DeviceUnavailableError, match="sees no rocm GPU"):
        plan_device("rocm", SimulatedProbe("cuda:RTX 4090:24:8.9"), BIG)
    with pytest.raises(MiniappError, match="unknown device"):
        plan_device("tpu", TorchProbe(), BIG)


def test_footprint_comes_from_the_file(default_model):
    footprint = estimate_footprint(GGUFFile(default_model), ctx=1024)
    size = default_model.stat().st_size
    assert 0.8 * size < footprint.int4_bytes <= size
    assert footprint.bf16_bytes > 2 * footprint.int4_bytes  # 4-5 bits a weight vs 16
    # SmolLM2-135M: 30 layers, 3 KV heads of 64, fp32 K and V.
    assert footprint.kv_bytes == 2 * 30 * 3 * 64 * 1024 * 4 and footprint.n_layers == 30


def _doctor(miniapp_exe, *args, simulate=None):
    env = dict(os.environ)
    env.pop("MINIAPP_SIMULATE_GPU", None)
    if simulate:
        env["MINIAPP_SIMULATE_GPU"] = simulate
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
    assert report["llama_cpp"]["gpu_offload"] is False  # this build has no GPU backend
    assert "devices" in report["audio_inputs"]


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
