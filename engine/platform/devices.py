"""Which device runs the model, and why: the one place that probes devices and kernels and
decides the fallback chain.

Chain per GPU: the int4 kernel on the GPU (torch's int4-packed matmul: CUDA sm80+, ROCm where
it exists), else dequantized bf16 weights on the GPU, else as many layers on the GPU as fit
with the rest on the CPU, else the CPU. Every step down is recorded with its reason.

On a GPU holding the whole model, decode steps run as a captured graph (CUDA graphs; HIP
graphs on ROCm): one replay instead of a few hundred kernel launches from Python per token.

Everything reads devices through a `DeviceProbe`, so tests (and `MINIAPP_SIMULATE_GPU`) can
stand in a CUDA or ROCm device, a missing kernel or a small memory on a CPU-only machine.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from ..errors import DeviceUnavailableError, MiniappError

DEVICE_CHOICES = ("auto", "cuda", "rocm", "cpu")
SIMULATE_ENV = "MINIAPP_SIMULATE_GPU"
NO_GPU = "none"  # MINIAPP_SIMULATE_GPU=none: a machine without a GPU, whatever this one has
COMPILE_ENV = "MINIAPP_COMPILE_STEP"  # 0/off: GPU decode steps captured as written
GRAPH_ENV = "MINIAPP_DECODE_GRAPH"  # "0" runs GPU decode steps eagerly (A/B, an escape hatch)
STORED_ATTENTION_ENV = "MINIAPP_STORED_ATTENTION"  # 0/off: torch's attention on a GPU too
_OFF = frozenset({"0", "off", "no", "false"})
MIN_INT4_CAPABILITY = (8, 0)  # torch's CUDA int4 matmul needs Ampere or newer
MEMORY_MARGIN = 0.10  # of the free memory, left for activations, allocator slack, the driver
MIN_MARGIN_BYTES = 512 * 2**20
GIB = 2**30


@dataclass(frozen=True)
class GpuInfo:
    index: int
    name: str
    backend: str  # "cuda" | "rocm" (ROCm builds of torch report through torch.cuda)
    total_bytes: int
    free_bytes: int
    capability: tuple[int, int] | None = None  # CUDA compute capability
    arch: str | None = None  # ROCm gfx target, e.g. gfx942 for MI300

    @property
    def label(self) -> str:
        return f"{self.backend}:{self.index}"


@dataclass(frozen=True)
class KernelCheck:
    name: str
    ok: bool
    reason: str


class DeviceProbe(Protocol):
    def gpus(self) -> list[GpuInfo]: ...
    def check_int4(self, gpu: GpuInfo | None) -> KernelCheck:
        """The int4 matmul on this GPU (None: on the CPU)."""
        ...

    def versions(self) -> dict[str, str | None]: ...

    def torch_device(self, plan: DevicePlan) -> str:
        """The torch device that runs the plan's GPU part ("cuda:0"; ROCm builds of torch
        name their GPUs "cuda" too)."""
        ...

    def watch(self, model, plan: DevicePlan) -> None:
        """Called once a model is built for the plan: raises torch.OutOfMemoryError (or
        GpuPathUnavailable) if it cannot run there, and may hook the model's passes."""
        ...

    def step_runner(self, plan: DevicePlan) -> tuple[Callable | None, str]:
        """What runs a fixed-shape decode step on the plan's GPU (a graph capturer, see
        `models/static_step.py`), or None for ordinary steps; and why, in a few words."""
        ...


class GpuPathUnavailable(Exception):  # noqa: N818 - a reason to fall back, not a user error
    """The plan's GPU path cannot run here; the message is the reason."""


@dataclass(frozen=True)
class ModelFootprint:
    """Bytes a model needs, estimated before loading it."""

    int4_bytes: int  # weights as the engine keeps them (about the GGUF's size)
    bf16_bytes: int  # weights dequantized to bf16
    kv_bytes: int  # KV cache at the chosen context
    n_layers: int
    # A mixture of experts' expert tensors, within the totals above (0: a dense model): what
    # stays on the CPU when only the rest goes to a GPU (llama.cpp's --cpu-moe).
    expert_int4_bytes: int = 0
    expert_bf16_bytes: int = 0
    # Where the output head is tied to the token table, a GPU holding the whole model keeps
    # the table twice: the head's copy, and the file's blocks its fixed-shape steps look
    # tokens up in (an untied file's table is counted once, in the totals above).
    table_copy_bytes: int = 0


@dataclass(frozen=True)
class Fallback:
    step: str  # what was given up, e.g. "int4 kernel on cuda:0"
    reason: str


@dataclass(frozen=True)
class DevicePlan:
    device: str  # "cpu" or e.g. "cuda:0"
    weights: str  # "int4" | "bf16"
    gpu_layers: int  # layers on the GPU (0 on the CPU; all of them when the model fits)
    reason: str  # why this path, in one line
    fallbacks: list[Fallback] = field(default_factory=list)
    experts_on_cpu: bool = False  # a mixture of experts' experts stay on the CPU

    @property
    def on_gpu(self) -> bool:
        return self.device != "cpu"


def plan_device(
    requested: str, probe: DeviceProbe, footprint: ModelFootprint, cpu_moe: bool = False
) -> DevicePlan:
    """The best path for `--device requested`, walking the fallback chain. A mixture of
    experts whose experts do not fit keeps them on the CPU and the rest of every layer on
    the GPU before it splits layers; `cpu_moe` (--cpu-moe) asks for that from the start."""
    if requested not in DEVICE_CHOICES:
        choices = ", ".join(DEVICE_CHOICES)
        raise MiniappError(f"unknown device '{requested}' (choose from {choices})")
    if requested == "cpu":
        return _cpu_plan("--device cpu", [])
    gpus = probe.gpus()
    if requested != "auto":
        gpus = [g for g in gpus if g.backend == requested]
        if not gpus:
            raise DeviceUnavailableError(_no_such_gpu(requested, probe.versions()))
    if not gpus:
        return _cpu_plan("no GPU visible to torch", [])
    gpu = max(gpus, key=lambda g: g.free_bytes)
    budget = _usable_bytes(gpu)
    fallbacks: list[Fallback] = []
    kernel = probe.check_int4(gpu)
    weights = "int4" if kernel.ok else "bf16"
    moe = footprint.expert_int4_bytes > 0
    if cpu_moe and moe:
        return _experts_on_cpu(gpu, weights, footprint, budget, fallbacks, "--cpu-moe")
    int4_total = footprint.int4_bytes + footprint.kv_bytes + footprint.table_copy_bytes
    bf16_total = footprint.bf16_bytes + footprint.kv_bytes + footprint.table_copy_bytes
    if kernel.ok and int4_total <= budget:
        reason = f"{gpu.name}: int4 kernel probed OK, the model fits"
        return DevicePlan(gpu.label, "int4", footprint.n_layers, reason, fallbacks)
    if kernel.ok:
        fallbacks.append(Fallback(f"int4 weights on {gpu.label}", _no_room(int4_total, budget)))
    else:
        fallbacks.append(Fallback(f"int4 kernel on {gpu.label}", kernel.reason))
    if not kernel.ok and bf16_total <= budget:
        reason = f"{gpu.name}: dequantized bf16 weights"
        return DevicePlan(gpu.label, "bf16", footprint.n_layers, reason, fallbacks)
    if not kernel.ok:
        fallbacks.append(Fallback(f"bf16 weights on {gpu.label}", _no_room(bf16_total, budget)))
    if moe:
        plan = _experts_on_cpu(gpu, weights, footprint, budget, fallbacks, "they do not fit")
        if plan.on_gpu:
            return plan
    weight_bytes = footprint.int4_bytes if kernel.ok else footprint.bf16_bytes
    per_layer = (weight_bytes + footprint.kv_bytes) / footprint.n_layers
    # Fewer than all: the whole model did not fit (with its table's second copy, which
    # only a whole model on the GPU keeps).
    layers = min(int(max(budget, 0) // per_layer), footprint.n_layers - 1)
    if layers > 0:
        reason = f"{gpu.name}: {layers} of {footprint.n_layers} layers fit, the rest on the CPU"
        return DevicePlan(gpu.label, weights, layers, reason, fallbacks)
    fallbacks.append(Fallback(f"any layer on {gpu.label}", _no_room(per_layer, budget)))
    return _cpu_plan(f"{gpu.name} has no room for even one layer", fallbacks)


def _experts_on_cpu(
    gpu: GpuInfo,
    weights: str,
    footprint: ModelFootprint,
    budget: float,
    fallbacks: list[Fallback],
    why: str,
) -> DevicePlan:
    """Every layer's attention, router and shared weights on the GPU, the experts on the CPU
    (each token reads a few of them there); the CPU alone where even the rest does not fit."""
    if weights == "int4":
        experts, total = footprint.expert_int4_bytes, footprint.int4_bytes
    else:
        experts, total = footprint.expert_bf16_bytes, footprint.bf16_bytes
    needed = total - experts + footprint.kv_bytes
    if needed <= budget:
        reason = (
            f"{gpu.name}: attention and shared weights on the GPU ({weights}), the experts "
            f"({experts / GIB:.2f} GiB) on the CPU: {why}"
        )
        return DevicePlan(gpu.label, weights, footprint.n_layers, reason, fallbacks, True)
    fallbacks.append(
        Fallback(f"the weights but the experts on {gpu.label}", _no_room(needed, budget))
    )
    return _cpu_plan(f"{gpu.name} has no room even without the experts", fallbacks)


def _usable_bytes(gpu: GpuInfo) -> int:
    """Free memory less the margin kept for activations, allocator slack and the driver."""
    return gpu.free_bytes - max(int(gpu.free_bytes * MEMORY_MARGIN), MIN_MARGIN_BYTES)


def _cpu_plan(reason: str, fallbacks: list[Fallback]) -> DevicePlan:
    return DevicePlan("cpu", "int4", 0, reason, fallbacks)


def _no_room(needed: float, budget: float) -> str:
    free = max(budget, 0) / GIB
    return f"out of memory at load: needs {needed / GIB:.2f} GiB, {free:.2f} GiB usable"


def _no_such_gpu(requested: str, versions: dict[str, str | None]) -> str:
    return (
        f"--device {requested}: torch {versions.get('torch')} sees no {requested} GPU "
        f"(CUDA {versions.get('cuda') or 'none'}, HIP {versions.get('hip') or 'none'})"
    )


def decode_step_path(probe: DeviceProbe, plan: DevicePlan, n_layers: int, moe: bool = False):
    """How decode steps will run for this plan: (runner or None, reason). `moe`: the model
    is a mixture of experts, whose routing picks each step's weights on the host (a
    captured graph would replay one step's choice)."""
    if not plan.on_gpu:
        return None, "eager steps on the CPU"
    if plan.gpu_layers < n_layers:
        return None, "eager steps: the model is split between the GPU and the CPU"
    if plan.experts_on_cpu:
        return None, "eager steps: each layer's experts run on the CPU"
    if moe:
        return None, "eager steps: a mixture of experts chooses each step's experts on the host"
    setting = os.environ.get(GRAPH_ENV, "").strip().lower()
    if setting in _OFF:
        return None, f"eager steps: graphs switched off by {GRAPH_ENV}={setting}"
    return probe.step_runner(plan)


def step_compile_unavailable() -> str | None:
    """Why a GPU's decode step is not compiled into fused kernels (None: it is). The
    kernels are Triton's, which CUDA and ROCm builds of torch bring; a CPU install has none
    and needs none."""
    setting = os.environ.get(COMPILE_ENV, "").strip().lower()
    if setting in _OFF:
        return f"switched off by {COMPILE_ENV}={setting}"
    from torch.utils._triton import has_triton

    if not has_triton():
        return "no Triton for this GPU (pip install triton)"
    return None


def stored_attention_unavailable(device_type: str) -> str | None:
    """Why attention on a device of this type does not read the KV cache as stored through
    our Triton kernel (None: it does). It runs where torch brings Triton (its CUDA and ROCm
    builds); on the CPU, which has its own native kernel, only under Triton's interpreter
    (`TRITON_INTERPRET=1`), which checks the kernel's numerics."""
    setting = os.environ.get(STORED_ATTENTION_ENV, "").strip().lower()
    if setting in _OFF:
        return f"switched off by {STORED_ATTENTION_ENV}={setting}"
    if device_type == "cpu":
        if os.environ.get("TRITON_INTERPRET") == "1" and _triton_importable():
            return None
        return "the CPU attends through its native kernel"
    if device_type != "cuda" or not _triton_runs_here():
        return "no Triton for this GPU (pip install triton)"
    return None


# What Triton can do here, found once. A plain dict, not functools.cache: the check runs
# inside compiled decode steps, where torch.compile would trace past a cache wrapper (a
# model's prompt, run uncompiled first, has filled it by then).
_TRITON: dict[str, bool] = {}


def _triton_importable() -> bool:
    if "importable" not in _TRITON:
        _TRITON["importable"] = importlib.util.find_spec("triton") is not None
    return _TRITON["importable"]


def _triton_runs_here() -> bool:
    if "runs" not in _TRITON:
        from torch.utils._triton import has_triton

        _TRITON["runs"] = has_triton()
    return _TRITON["runs"]


# ------------------------------------------------------------------------------ probes


class TorchProbe:
    """The real devices, as the installed torch sees them."""

    def gpus(self) -> list[GpuInfo]:
        import torch

        if not torch.cuda.is_available():
            return []
        backend = "rocm" if torch.version.hip else "cuda"
        found = []
        for index in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(index)
            free, total = torch.cuda.mem_get_info(index)
            found.append(
                GpuInfo(
                    index,
                    props.name,
                    backend,
                    total,
                    free,
                    capability=None if torch.version.hip else (props.major, props.minor),
                    arch=getattr(props, "gcnArchName", None) if torch.version.hip else None,
                )
            )
        return found

    def check_int4(self, gpu: GpuInfo | None) -> KernelCheck:
        import torch

        if gpu is not None and gpu.capability and gpu.capability < MIN_INT4_CAPABILITY:
            major, minor = gpu.capability
            return KernelCheck(
                "int4 matmul", False, f"compute capability {major}.{minor} is below 8.0"
            )
        try:
            _run_int4_kernel(torch, "cpu" if gpu is None else f"cuda:{gpu.index}")
        except (RuntimeError, NotImplementedError, AttributeError) as exc:
            where = "on HIP" if gpu is not None and gpu.backend == "rocm" else "here"
            first_line = (
                str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            )
            return KernelCheck("int4 matmul", False, f"kernel missing {where}: {first_line}")
        return KernelCheck("int4 matmul", True, "ran a 64x64 product and matched the reference")

    def versions(self) -> dict[str, str | None]:
        import torch

        return {"torch": torch.__version__, "cuda": torch.version.cuda, "hip": torch.version.hip}

    def torch_device(self, plan: DevicePlan) -> str:
        return "cuda:" + plan.device.split(":")[1] if plan.on_gpu else "cpu"

    def watch(self, model, plan: DevicePlan) -> None:
        model.fault_hook = None  # real failures raise from torch itself

    def step_runner(self, plan: DevicePlan) -> tuple[Callable | None, str]:
        import torch

        from .graphs import CudaGraphRunner, compiled_runner

        if not (plan.on_gpu and torch.cuda.is_available()):
            return None, "eager steps: no GPU"
        kind = "HIP" if torch.version.hip else "CUDA"
        graph = f"{kind} graph of the whole step, captured once per span bucket"
        unfused = step_compile_unavailable()
        if unfused is not None:
            return CudaGraphRunner, f"{graph}; its ops unfused: {unfused}"
        fused = "its ops fused into Triton kernels by torch.compile"
        attention = stored_attention_unavailable("cuda")
        if attention is None:  # the kernel a layer for all rows, which fusion would not give
            fused += "; attention reads the KV cache as stored, one Triton launch a layer"
        return compiled_runner(CudaGraphRunner), f"{graph}, {fused}"


def _run_int4_kernel(torch, device: str) -> None:
    """One small int4 product on `device`, checked against the dequantized reference."""
    generator = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (64, 64), generator=generator, dtype=torch.int32)
    scale = torch.rand(2, 64, generator=generator) / 8 + 0.01  # [groups, rows]
    zero = torch.randn(2, 64, generator=generator) / 8
    x = torch.randn(3, 64, generator=generator)
    weight = (codes.float() - 8) * scale.T.repeat_interleave(32, 1) + zero.T.repeat_interleave(
        32, 1
    )
    expected = x @ weight.T
    scales_zeros = torch.stack([scale, zero], -1).to(torch.bfloat16)
    if device == "cpu":
        packed = torch._convert_weight_to_int4pack_for_cpu(codes, 1)
        got = torch._weight_int4pack_mm_for_cpu(x.bfloat16(), packed, 32, scales_zeros)
    else:
        pairs = (codes[:, ::2] << 4 | codes[:, 1::2]).to(torch.uint8).to(device)
        packed = torch._convert_weight_to_int4pack(pairs, 2)
        got = torch._weight_int4pack_mm(
            x.bfloat16().to(device), packed, 32, scales_zeros.to(device)
        ).cpu()
    if not torch.allclose(got.float(), expected, rtol=0.05, atol=0.05 * expected.abs().max()):
        raise RuntimeError("int4 kernel ran but disagreed with the reference")


class SimulatedProbe:
    """Stand-in GPUs for machines without one (tests, `MINIAPP_SIMULATE_GPU`). Spec, one GPU
    per comma: backend:name:memory_gib[:capability or gfx arch][:no-int4], for example
    "cuda:RTX 4090:24:8.9" or "rocm:MI300X:192:gfx942:no-int4". Failure flags: oom-load,
    oom-pass=N (out of memory on the Nth forward pass). "none" stands in a machine without
    a GPU (what the test suite runs on, whatever the machine has). The CPU is the real one."""

    def __init__(self, spec: str):
        self._gpus: list[GpuInfo] = []
        self._no_int4: set[int] = set()
        self._oom_at_load: set[int] = set()
        self._oom_at_pass: dict[int, int] = {}
        items = [] if spec.strip().lower() == NO_GPU else spec.split(",")
        for index, item in enumerate(p for p in items if p.strip()):
            fields = item.strip().split(":")
            if len(fields) < 3 or fields[0] not in ("cuda", "rocm"):
                raise MiniappError(f"{SIMULATE_ENV}: cannot read '{item}'")
            backend, name, memory = fields[0], fields[1], int(float(fields[2]) * GIB)
            extra = []
            for flag in fields[3:]:
                if flag == "no-int4":
                    self._no_int4.add(index)
                elif flag == "oom-load":
                    self._oom_at_load.add(index)
                elif flag.startswith("oom-pass="):
                    self._oom_at_pass[index] = int(flag.split("=", 1)[1])
                else:
                    extra.append(flag)
            capability = arch = None
            if extra and backend == "cuda":
                major, minor = extra[0].split(".")
                capability = (int(major), int(minor))
            elif extra:
                arch = extra[0]
            if backend == "cuda" and capability is None:
                capability = (8, 0)
            self._gpus.append(GpuInfo(index, name, backend, memory, memory, capability, arch))

    def gpus(self) -> list[GpuInfo]:
        return list(self._gpus)

    def check_int4(self, gpu: GpuInfo | None) -> KernelCheck:
        if gpu is None:
            return TorchProbe().check_int4(None)
        if gpu.capability and gpu.capability < MIN_INT4_CAPABILITY:
            major, minor = gpu.capability
            return KernelCheck(
                "int4 matmul", False, f"compute capability {major}.{minor} is below 8.0"
            )
        if gpu.index in self._no_int4:
            where = "on HIP" if gpu.backend == "rocm" else "in this torch build"
            return KernelCheck("int4 matmul", False, f"kernel missing {where} (simulated)")
        return KernelCheck("int4 matmul", True, "simulated")

    def torch_device(self, plan: DevicePlan) -> str:
        return "cpu"  # a simulated GPU computes on the CPU, with the GPU path's weight format

    def watch(self, model, plan: DevicePlan) -> None:
        """What a simulated GPU adds is its failures: out of memory at load, or at the Nth
        forward pass."""
        import torch

        model.fault_hook = None
        if not plan.on_gpu:
            return
        index = int(plan.device.split(":")[1])
        if index in self._oom_at_load:
            raise torch.OutOfMemoryError(f"simulated: {plan.device} out of memory at load")
        if index in self._oom_at_pass:
            passes = [0]
            limit = self._oom_at_pass[index]

            def count_pass() -> None:
                passes[0] += 1
                if passes[0] == limit:
                    raise torch.OutOfMemoryError(f"simulated: {plan.device} out of memory")

            model.fault_hook = count_pass

    def step_runner(self, plan: DevicePlan) -> tuple[Callable | None, str]:
        """The fixed-shape step a real GPU would capture, run as ordinary code on the CPU."""
        from .graphs import eager_runner

        return eager_runner, "fixed-shape steps, run eagerly (simulated GPU: no graph)"

    def versions(self) -> dict[str, str | None]:
        versions = TorchProbe().versions()
        backends = {g.backend for g in self._gpus}
        return {
            **versions,
            "cuda": "simulated" if "cuda" in backends else None,
            "hip": "simulated" if "rocm" in backends else None,
        }


def default_probe() -> DeviceProbe:
    spec = os.environ.get(SIMULATE_ENV)
    return SimulatedProbe(spec) if spec else TorchProbe()


# ------------------------------------------------------------------------------ llama.cpp

ALL_LAYERS = -1  # llama.cpp's n_gpu_layers for "everything, the output layer included"


@dataclass(frozen=True)
class OffloadPlan:
    gpu_layers: int  # llama.cpp's n_gpu_layers: 0 (CPU), a count, or ALL_LAYERS
    reason: str


def plan_llamacpp_offload(
    offload_supported: bool, probe: DeviceProbe, footprint: ModelFootprint
) -> OffloadPlan:
    """How many layers llama.cpp should put on the GPU, from its build and free memory."""
    if not offload_supported:
        return OffloadPlan(0, "this llama.cpp build has no GPU offload")
    gpus = probe.gpus()
    if not gpus:
        return OffloadPlan(0, "no GPU visible")
    gpu = max(gpus, key=lambda g: g.free_bytes)
    budget = _usable_bytes(gpu)
    if footprint.int4_bytes + footprint.kv_bytes <= budget:
        return OffloadPlan(ALL_LAYERS, f"the whole model fits on {gpu.name}")
    per_layer = (footprint.int4_bytes + footprint.kv_bytes) / footprint.n_layers
    # Fewer than all: the whole model did not fit (with its table's second copy, which
    # only a whole model on the GPU keeps).
    layers = min(int(max(budget, 0) // per_layer), footprint.n_layers - 1)
    if layers == 0:
        return OffloadPlan(0, f"{gpu.name} has no room for one layer")
    return OffloadPlan(layers, f"{layers} of {footprint.n_layers} layers fit on {gpu.name}")


def load_with_fewer_layers(load, plan: OffloadPlan, n_layers: int):
    """Call `load(n_gpu_layers)`; when it fails with layers on the GPU, retry with half as
    many, then with none. Returns (what load returned, layers used, fallbacks taken)."""
    fallbacks: list[Fallback] = []
    layers = n_layers if plan.gpu_layers == ALL_LAYERS else plan.gpu_layers
    attempt = plan.gpu_layers
    while True:
        try:
            return load(attempt), attempt, fallbacks
        except (ValueError, RuntimeError, MemoryError) as exc:
            if attempt == 0:
                raise
            tried = "all" if attempt == ALL_LAYERS else str(attempt)
            step = f"{tried} layers on the GPU"
            fallbacks.append(Fallback(step, f"llama.cpp could not load: {exc}"))
            layers //= 2
            attempt = layers
