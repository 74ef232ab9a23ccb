"""The one place that imports llama-cpp-python and opens llama.cpp models (`open_model`, with
the GPU-offload plan and its fallback to fewer layers): it routes llama.cpp's native log into
Python logging and decides, from the CPU's features, which CPU weight path every model opened
in this process takes.

The log: llama.cpp prints load and context messages straight to stderr, which would
interleave with a streamed answer; here they go to the `miniapp.llamacpp` logger instead
(shown with -v). Nothing else is silenced: llama-cpp-python's own way, redirecting the
process's stdout and stderr during a load, is turned off (see _LeaveStdStreamsAlone).

The CPU weight path: at load, llama.cpp copies weights into "extra buffer types" laid out for
the CPU's instructions: CPU_REPACK (interleaved blocks for AVX2/AVX-512, part of its speed)
and, in a build compiled with AMX, an AMX buffer. On Sapphire Rapids-class Xeons that AMX path
crashes on the first evaluation (llama.cpp #20824, Ollama #17205, #17249). `make setup`
builds llama-cpp-python without AMX, which keeps CPU_REPACK; for any other build that has an
AMX path, on a CPU with AMX, the extra buffer types are turned off (CPU_REPACK with them,
since llama.cpp offers no finer switch). `MINIAPP_LLAMACPP_REPACK=on` keeps them all, AMX
included (for a machine where it works); `off` turns them off everywhere (A/B measurements).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

import llama_cpp
import llama_cpp._internals
import llama_cpp.llama
import llama_cpp.llama_chat_format
import llama_cpp.llama_cpp as llama_cpp_api

from ..errors import ModelFileError
from ..kv.footprint import estimate_footprint
from ..modelfile.gguf_file import GGUFFile
from ..platform.cpu_features import CpuFeatures, cpu_features
from ..platform.devices import (
    DeviceProbe,
    Fallback,
    OffloadPlan,
    default_probe,
    load_with_fewer_layers,
    plan_llamacpp_offload,
)

log = logging.getLogger("miniapp.llamacpp")

_GGML_LOG_LEVELS = {1: logging.INFO, 2: logging.WARNING, 3: logging.ERROR, 4: logging.DEBUG}
REPACK_ENV = "MINIAPP_LLAMACPP_REPACK"  # auto (default) | on | off
REPACK_SETTINGS = ("auto", "on", "off")
# The flags that build llama-cpp-python without its AMX path (GCC and Clang honour them after
# -march=native); the Makefile passes them as CFLAGS and CXXFLAGS.
NO_AMX_FLAGS = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"


@llama_cpp.llama_log_callback
def _route_native_log(level: int, text: bytes, _user_data: ctypes.c_void_p) -> None:
    message = text.decode("utf-8", "replace").rstrip()
    if message:
        # Even warnings are only interesting when debugging: we report real failures ourselves.
        log.log(min(_GGML_LOG_LEVELS.get(level, logging.DEBUG), logging.DEBUG), message)


llama_cpp.llama_log_set(_route_native_log, ctypes.c_void_p(0))


class _LeaveStdStreamsAlone:
    """Stands in for llama-cpp-python's `suppress_stdout_stderr`, which (with verbose=False)
    points the process's file descriptors 1 and 2 at /dev/null while a model loads. That is
    process-wide: whatever another thread prints meanwhile is lost, and two loads that overlap
    (a tokenizer and a model on different threads) each save the other's /dev/null and
    restore it for good: `miniapp serve`'s URL line vanished that way. llama.cpp's messages
    come to the callback above instead, so the streams can stay as they are."""

    def __init__(self, disable: bool = True):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc_info) -> bool:
        return False


for _module in (llama_cpp.llama, llama_cpp._internals, llama_cpp.llama_chat_format):
    _module.suppress_stdout_stderr = _LeaveStdStreamsAlone

Llama = llama_cpp.Llama


def llama_supports_gpu_offload() -> bool:
    """Whether this llama.cpp build can put layers on a GPU (CUDA, HIP, Metal, Vulkan...)."""
    return bool(llama_cpp.llama_supports_gpu_offload())


@dataclass
class OpenedModel:
    """A model llama.cpp loaded, and where its layers went."""

    llama: Llama
    offload: OffloadPlan  # what the probe planned
    gpu_layers: int  # what loaded: n_gpu_layers after any retries
    fallbacks: list[Fallback]  # the retries with fewer layers, each with its reason


def open_model(
    gguf: GGUFFile, n_ctx: int, probe: DeviceProbe | None = None, **params
) -> OpenedModel:
    """Load `gguf` in llama.cpp with `params` (Llama's keyword arguments): on the GPU as far as
    the probe says it fits, retrying with fewer layers (then none) when a load fails. A file
    llama.cpp cannot load is a ModelFileError naming it."""
    footprint = estimate_footprint(gguf, n_ctx)
    offload = plan_llamacpp_offload(
        llama_supports_gpu_offload(), probe or default_probe(), footprint
    )

    def load(gpu_layers: int) -> Llama:
        return Llama(str(gguf.path), n_ctx=n_ctx, n_gpu_layers=gpu_layers, verbose=False, **params)

    try:
        llama, layers, fallbacks = load_with_fewer_layers(load, offload, footprint.n_layers)
    except ValueError as exc:
        raise ModelFileError(gguf.path, f"llama.cpp could not load it ({exc})") from exc
    for fallback in fallbacks:
        log.warning("llama.cpp: gave up %s: %s", fallback.step, fallback.reason)
    return OpenedModel(llama, offload, layers, fallbacks)


# ------------------------------------------------------------------ the CPU weight path


@dataclass(frozen=True)
class CpuPath:
    """How llama.cpp lays out weights on the CPU in this process."""

    extra_buffers: bool  # llama.cpp's use_extra_bufts: CPU_REPACK (and AMX, if built with it)
    build_amx: bool  # this llama.cpp build has the AMX weight path
    build_repack: bool  # this llama.cpp build has CPU_REPACK
    reason: str

    def describe(self) -> str:
        """One line for `miniapp doctor`."""
        if not self.extra_buffers:
            layout = "plain CPU buffers (no weight repacking)"
        elif self.build_amx:
            layout = "extra buffer types on, AMX included"
        elif self.build_repack:
            layout = "CPU_REPACK"
        else:
            layout = "plain CPU buffers (this build has no repacking)"
        return f"{layout} - {self.reason}"


def build_features(system_info: str | None = None) -> dict[str, str]:
    """What this llama.cpp build was compiled with, from `llama_print_system_info`, e.g.
    {"AVX2": "1", "AVX512": "1", "AMX_INT8": "1", "REPACK": "1", "OPENMP": "1"}."""
    if system_info is None:
        system_info = llama_cpp.llama_print_system_info().decode("utf-8", "replace")
    return dict(re.findall(r"(\w+) = (\w+)", system_info))


def choose_cpu_path(cpu: CpuFeatures, build: Mapping[str, str], setting: str = "auto") -> CpuPath:
    """The CPU weight path for this CPU and this llama.cpp build (see the module docstring)."""
    build_amx = build.get("AMX_INT8") == "1"
    build_repack = build.get("REPACK") == "1"

    def path(extra_buffers: bool, reason: str) -> CpuPath:
        return CpuPath(extra_buffers, build_amx, build_repack, reason)

    if setting == "off":
        return path(False, f"extra buffer types switched off by {REPACK_ENV}=off")
    if setting == "on":
        return path(True, f"every extra buffer type kept by {REPACK_ENV}=on")
    if not build_amx:
        return path(True, "this llama.cpp build has no AMX path")
    if not cpu.amx:
        return path(True, "the CPU has no AMX, so llama.cpp's AMX path stays unused")
    return path(
        False,
        "this CPU has AMX and this llama.cpp build would repack weights for it, which crashes "
        "on many Xeons (llama.cpp #20824); rebuild llama-cpp-python with "
        f'CFLAGS="{NO_AMX_FLAGS}" CXXFLAGS="{NO_AMX_FLAGS}" to keep CPU_REPACK',
    )


def amx_build_on_amx_cpu() -> bool:
    """Whether this llama.cpp build has the AMX path and this CPU would take it (set-up then
    rebuilds llama-cpp-python without it)."""
    return cpu_path().build_amx and cpu_features().amx


def repack_setting() -> str:
    setting = os.environ.get(REPACK_ENV, "auto").strip().lower() or "auto"
    if setting not in REPACK_SETTINGS:
        log.warning(
            "%s=%s is not one of %s: using auto", REPACK_ENV, setting, ", ".join(REPACK_SETTINGS)
        )
        return "auto"
    return setting


@functools.cache
def cpu_path() -> CpuPath:
    """The path for this process, decided once (and logged once when it costs speed)."""
    path = choose_cpu_path(cpu_features(), build_features(), repack_setting())
    if not path.extra_buffers:
        log.info("llama.cpp: weights stay in plain CPU buffers: %s", path.reason)
    return path


_default_model_params = llama_cpp_api.llama_model_default_params


def _model_params_for_this_cpu() -> llama_cpp_api.llama_model_params:
    params = _default_model_params()
    if not cpu_path().extra_buffers:
        params.use_extra_bufts = False
    return params


# `Llama(...)` has no argument for use_extra_bufts: it starts from these defaults, so setting
# them here applies the decision to every model this process opens, by whichever module.
llama_cpp_api.llama_model_default_params = _model_params_for_this_cpu


__all__ = [
    "CpuPath",
    "Llama",
    "OpenedModel",
    "build_features",
    "choose_cpu_path",
    "cpu_path",
    "llama_cpp",
    "llama_supports_gpu_offload",
    "open_model",
]
