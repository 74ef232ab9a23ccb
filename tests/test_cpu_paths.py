"""Which path each engine takes on the CPU it finds: the CPU-feature probe, llama.cpp's weight
layout (its AMX path crashes on Sapphire Rapids-class Xeons, so it must never be taken), and
our kernels' AVX2 path as an AVX2-only machine runs it. Machines without AMX test the AMX
decision through simulated CPUs and the real llama.cpp with its extra buffer types off."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import subprocess
import sys

import pytest
from gguf.constants import GGMLQuantizationType as Q
from test_oracle_tiny import MIN_AGREEMENT, QUANT_BOUND, TOKENS
from tiny_gguf import GEMMA3, LLAMA, write_tiny_model

from miniapp.engine.llamacpp import library as llamacpp_lib
from miniapp.engine.llamacpp.library import REPACK_ENV, build_features, choose_cpu_path
from miniapp.engine.platform.cpu_features import CpuFeatures, cpu_features, parse_cpuinfo, simulated
from miniapp.native.ggml import ISA_AVX2

# /proc/cpuinfo as a KVM guest on a Sapphire Rapids Xeon shows it (flags shortened).
SAPPHIRE_RAPIDS = """processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz
flags\t\t: fpu sse sse2 avx f16c fma avx2 avx512f avx512dq avx512bw avx512vl avx512_vnni \
avx512_bf16 amx_bf16 avx512_fp16 amx_tile amx_int8 hypervisor

processor\t: 1
model name\t: Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz
flags\t\t: fpu sse
"""
ZEN3 = "model name\t: AMD EPYC 7B13 64-Core Processor\nflags\t\t: sse avx f16c fma avx2 bmi2\n"
BUILD_WITH_AMX = (
    "CPU : SSE3 = 1 | AVX = 1 | AVX2 = 1 | F16C = 1 | FMA = 1 | AVX512 = 1 | "
    "AVX512_VNNI = 1 | AVX512_BF16 = 1 | AMX_INT8 = 1 | LLAMAFILE = 1 | OPENMP = 1 | REPACK = 1 |"
)
BUILD_WITHOUT_AMX = BUILD_WITH_AMX.replace("AMX_INT8 = 1 | ", "")


def test_cpuinfo_names_the_instruction_sets_of_the_first_processor():
    xeon = parse_cpuinfo(SAPPHIRE_RAPIDS)
    assert xeon.model == "Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz"
    assert (xeon.avx2, xeon.avx512, xeon.avx512_bf16, xeon.avx512_vnni, xeon.amx) == (
        True,
        True,
        True,
        True,
        True,
    )
    epyc = parse_cpuinfo(ZEN3)
    assert (epyc.avx2, epyc.avx512, epyc.amx) == (True, False, False)
    assert epyc.describe() == "AMD EPYC 7B13 64-Core Processor: AVX2"


def test_simulated_cpus_from_presets_and_flag_lists():
    amx = simulated("intel-amx", "test CPU")
    assert amx.simulated and amx.amx and amx.avx512_bf16
    zen4 = simulated("amd-avx512", "test CPU")
    assert zen4.avx512_bf16 and not zen4.amx
    assert simulated("avx2-only", "x").summary()["avx512"] is False
    assert simulated("avx2,fma,f16c", "x").avx2 and not simulated("avx2", "x").avx2


def test_this_machine_is_read_from_proc_cpuinfo():
    cpu = cpu_features()
    assert not cpu.simulated and cpu.model
    if os.path.exists("/proc/cpuinfo"):
        assert cpu.flags == parse_cpuinfo(open("/proc/cpuinfo").read()).flags


def test_build_features_come_from_llama_cpps_system_info():
    assert build_features(BUILD_WITH_AMX)["AMX_INT8"] == "1"
    assert "AMX_INT8" not in build_features(BUILD_WITHOUT_AMX)
    real = build_features()
    assert real and all(value.isalnum() for value in real.values())
    # make setup builds llama.cpp without AMX (the Makefile's NO_AMX), and rebuilds a cached
    # build that has it where the CPU would take it.
    assert not llamacpp_lib.amx_build_on_amx_cpu()


# ------------------------------------------------------------------ llama.cpp's weight path

XEON, EPYC = parse_cpuinfo(SAPPHIRE_RAPIDS), parse_cpuinfo(ZEN3)
WITH_AMX, WITHOUT_AMX = build_features(BUILD_WITH_AMX), build_features(BUILD_WITHOUT_AMX)


def test_an_amx_build_on_an_amx_cpu_never_takes_the_amx_path():
    path = choose_cpu_path(XEON, WITH_AMX)
    assert path.extra_buffers is False and path.build_amx
    assert "AMX" in path.reason and "#20824" in path.reason
    assert llamacpp_lib.NO_AMX_FLAGS in path.reason  # how to get CPU_REPACK back
    assert path.describe().startswith("plain CPU buffers")


def test_cpu_repack_is_kept_wherever_amx_cannot_be_taken():
    without = choose_cpu_path(XEON, WITHOUT_AMX)  # what make setup builds
    assert without.extra_buffers and without.describe().startswith("CPU_REPACK")
    assert without.reason == "this llama.cpp build has no AMX path"
    on_amd = choose_cpu_path(EPYC, WITH_AMX)  # an AMX build copied to a CPU without AMX
    assert on_amd.extra_buffers and "no AMX" in on_amd.reason


def test_the_setting_overrides_the_choice_both_ways():
    assert choose_cpu_path(XEON, WITH_AMX, "on").extra_buffers  # a Xeon where AMX works
    assert choose_cpu_path(XEON, WITH_AMX, "on").describe().startswith("extra buffer types on")
    off = choose_cpu_path(EPYC, WITHOUT_AMX, "off")
    assert not off.extra_buffers and REPACK_ENV in off.reason


def _load_log(monkeypatch, caplog, setting: str, open_model) -> str:
    """What llama.cpp logs while `open_model()` loads a model under REPACK_ENV=setting."""
    monkeypatch.setenv(REPACK_ENV, setting)
    llamacpp_lib.cpu_path.cache_clear()
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="miniapp.llamacpp"):
        model = open_model()
        text = caplog.text
    model.close()
    llamacpp_lib.cpu_path.cache_clear()
    return text


@pytest.fixture(scope="module")
def gemma_model():
    from miniapp.engine.modelfile.store import resolve_model

    return resolve_model("gemma3-270m")  # Q4_K_M: some of its weights are repacked


def test_the_decision_reaches_every_llama_cpp_load(monkeypatch, caplog, gemma_model):
    """With the extra buffer types off, no weight goes to CPU_REPACK (nor AMX), whether the
    model is opened by our runtime or by llama-cpp-python directly."""
    from miniapp.engine.runtimes.llamacpp_runtime import LlamaCppRuntime

    def runtime():
        return LlamaCppRuntime(gemma_model, n_ctx=256)

    def bare():
        return llamacpp_lib.Llama(str(gemma_model), n_ctx=256, verbose=False)

    for open_model in (runtime, bare):
        kept = _load_log(monkeypatch, caplog, "auto", open_model)
        plain = _load_log(monkeypatch, caplog, "off", open_model)
        assert "CPU_Mapped model buffer" in kept and "CPU_Mapped model buffer" in plain
        if build_features().get("REPACK") == "1" and cpu_features().avx2:
            assert "CPU_REPACK model buffer" in kept
        assert "CPU_REPACK model buffer" not in plain and "AMX model buffer" not in plain
        assert "weights stay in plain CPU buffers" in plain  # the reason, logged once


def test_a_model_opened_without_extra_buffers_still_answers(monkeypatch, default_model):
    from miniapp.engine.runtimes.llamacpp_runtime import LlamaCppRuntime

    monkeypatch.setenv(REPACK_ENV, "off")
    llamacpp_lib.cpu_path.cache_clear()
    try:
        runtime = LlamaCppRuntime(default_model, n_ctx=256, logits_all=True)
        logits = runtime.logits(TOKENS[:16])
        runtime.close()
    finally:
        llamacpp_lib.cpu_path.cache_clear()
    assert logits.shape[0] == 16 and abs(logits).max() > 0


def test_loading_leaves_the_process_output_where_it_was(tmp_path):
    """llama-cpp-python silences a load by pointing file descriptors 1 and 2 at /dev/null,
    process-wide; two overlapping loads then left them there for good (the server's URL line
    was lost). Every message llama.cpp logs during our loads must see the streams unmoved."""
    from miniapp.engine.runtimes.llamacpp_runtime import LlamaCppRuntime
    from miniapp.engine.tokens.tokenizer import Tokenizer

    def stream_ids() -> tuple:
        return tuple((os.fstat(fd).st_dev, os.fstat(fd).st_ino) for fd in (1, 2))

    before, seen = stream_ids(), []

    class Watch(logging.Handler):
        def emit(self, record):
            seen.append(stream_ids())

    path = write_tiny_model(tmp_path / "tiny.gguf", LLAMA)
    logger, watch = logging.getLogger("miniapp.llamacpp"), Watch(logging.DEBUG)
    logger.addHandler(watch)
    level = logger.level
    logger.setLevel(logging.DEBUG)
    try:
        Tokenizer(path)
        LlamaCppRuntime(path, n_ctx=64).close()
    finally:
        logger.removeHandler(watch)
        logger.setLevel(level)
    assert len(seen) > 10  # llama.cpp said plenty while loading
    assert set(seen) == {before} and stream_ids() == before


# ------------------------------------------------------------------ doctor, on several CPUs


def _doctor_json(miniapp_exe, **env) -> dict:
    done = subprocess.run(
        [miniapp_exe, "doctor", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **env},
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_doctor_reports_this_cpu_and_each_engines_path(miniapp_exe):
    from miniapp.engine.platform.kernels import cpu_int4_kernel

    report = _doctor_json(miniapp_exe)
    cpu = report["cpu"]
    assert {k: cpu[k] for k in cpu_features().summary()} == cpu_features().summary()
    kernel = cpu_int4_kernel()
    assert cpu["native_int4"] == (kernel.library.isa_name if kernel.native else None)
    weights = report["llama_cpp"]["cpu_weights"]
    assert weights["extra_buffers"] is True  # make setup's build has no AMX path
    assert report["llama_cpp"]["build"] == build_features()


@pytest.mark.parametrize(
    ("preset", "native_int4", "amx"),
    [("intel-amx", None, True), ("amd-avx512", None, False), ("avx2-only", "avx2", False)],
)
def test_doctor_on_simulated_cpus(miniapp_exe, preset, native_int4, amx):
    report = _doctor_json(miniapp_exe, MINIAPP_SIMULATE_CPU=preset)
    cpu = report["cpu"]
    assert cpu["simulated"] and cpu["amx"] is amx and cpu["avx2"]
    if native_int4:
        assert cpu["native_int4"] == native_int4
        # The GGML kernel follows the int4 kernel down to AVX2, with the same weights.
        assert report["cpu_ggml_kernel"].startswith(f"native {native_int4}: ")
        assert "Q4_K, Q5_K, Q6_K read from the file's blocks" in report["cpu_ggml_kernel"]
    else:  # AVX-512 (BF16, else VNNI) where the real CPU has it too, else AVX2
        real = CpuFeatures("", cpu_features().flags)
        best = "avx512" if real.avx512_bf16 else "avx512vnni" if real.avx512_vnni else "avx2"
        assert cpu["native_int4"] == best
    # Our build has no AMX path, so even a CPU with AMX keeps CPU_REPACK.
    assert report["llama_cpp"]["cpu_weights"]["extra_buffers"] is True


def test_a_simulated_cpu_with_vnni_but_no_bf16_gets_the_vnni_path(miniapp_exe):
    """As an AVX-512 Xeon without BF16: the VNNI int4 path (the AVX2 path's bits, faster),
    where the real CPU has VNNI too; never BF16, which the simulated CPU lacks."""
    flags = "avx,avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512_vnni"
    report = _doctor_json(miniapp_exe, MINIAPP_SIMULATE_CPU=flags)
    real = CpuFeatures("", cpu_features().flags)
    assert report["cpu"]["native_int4"] == ("avx512vnni" if real.avx512_vnni else "avx2")


def test_doctor_prints_the_cpu_line(miniapp_exe):
    done = subprocess.run(
        [miniapp_exe, "doctor"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "MINIAPP_SIMULATE_CPU": "intel-amx"},
    )
    assert done.returncode == 0, done.stderr
    assert "(simulated): AVX2, AVX-512, AVX-512 BF16, AVX-512 VNNI, AMX" in done.stdout
    assert "weights on the CPU: CPU_REPACK - this llama.cpp build has no AMX path" in done.stdout


# ------------------------------------------------------------------ an AVX2-only machine

_AVX2_CHECK = """
import json, sys
import numpy as np, torch
from miniapp.engine.platform.kernels import cpu_int4_kernel
from miniapp.engine.runtimes.llamacpp_runtime import LlamaCppRuntime
from miniapp.engine.runtimes.torch_runtime import TorchRuntime
path, tokens = sys.argv[1], json.loads(sys.argv[2])
ours = TorchRuntime(path, n_ctx=256).logits(tokens)
oracle = LlamaCppRuntime(path, n_ctx=256, logits_all=True).logits(tokens)
kernel = cpu_int4_kernel()
runtime = TorchRuntime(path, n_ctx=256)
linears = [l for b in runtime.model.layers for l in (b.attention.wqkv, b.feed_forward.w_down)]
ggml_paths = sorted({l.native.isa for l in linears if type(l).__name__ == "GgmlLinear"})
print(json.dumps({
    "ggml_paths": ggml_paths,
    "native": kernel.library.isa_name if kernel.native else None,
    "aten": torch.backends.cpu.get_cpu_capability(),
    "agreement": float((ours.argmax(-1) == oracle.argmax(-1)).mean()),
    "relative": float(np.abs(ours - oracle).max() / np.abs(oracle).max()),
}))
"""


# Q4_K_M's mix: its weights are read from the file's blocks by the GGML kernel.
LLAMA_Q4_K_M = dataclasses.replace(
    LLAMA,
    dim=256,
    ffn_dim=256,
    head_dim=64,
    n_kv_heads=4,
    weight_type=Q.Q4_K,
    value_type=Q.Q6_K,
    down_type=Q.Q6_K,
    embed_type=Q.Q6_K,
)


@pytest.mark.parametrize(
    "spec", [LLAMA, GEMMA3, LLAMA_Q4_K_M], ids=["llama-q4_1", "gemma3-q4_1", "llama-q4_k_m"]
)
def test_an_avx2_only_machine_runs_the_avx2_paths_and_matches_llama_cpp(tmp_path, spec):
    """What an AVX2-only CPU runs, on any machine that has AVX2: our kernel's AVX2 path and
    torch's AVX2 kernels, checked against llama.cpp with the bounds of test_oracle_tiny."""
    if not cpu_features().avx2:
        pytest.fail("every machine this project runs on has AVX2; this one does not")
    model = write_tiny_model(tmp_path / "tiny.gguf", spec)
    env = {**os.environ, "MINIAPP_SIMULATE_CPU": "avx2-only", "ATEN_CPU_CAPABILITY": "avx2"}
    done = subprocess.run(
        [sys.executable, "-c", _AVX2_CHECK, str(model), json.dumps(TOKENS)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout)
    assert result["native"] == "avx2" and result["aten"] == "AVX2"
    if spec is LLAMA_Q4_K_M:
        assert result["ggml_paths"] == [ISA_AVX2], result
    assert result["agreement"] >= MIN_AGREEMENT, result
    assert result["relative"] <= QUANT_BOUND, result
