"""Which int4 matmul (and decode attention) the engine runs on the CPU, and why.

Our own kernel (`miniapp.native.int4`) when its library loads and the CPU has its
instructions; torch's `_weight_int4pack_mm_for_cpu` otherwise. The choice is made once per
process and never fails: every reason not to use the native kernel becomes the fallback's
explanation, which `miniapp doctor` prints. `MINIAPP_NATIVE=0` forces torch's op (A/B
benchmarks, an escape hatch); `MINIAPP_NATIVE=avx2`, `avx512` (BF16) or `avx512vnni` forces
a native path. A CPU simulated by `MINIAPP_SIMULATE_CPU` without AVX-512 BF16 gets the VNNI
path where it has VNNI (and the real CPU too), else the AVX2 path; one without AVX2 gets
torch's op (with `ATEN_CPU_CAPABILITY=avx2`, torch's own kernels follow suit).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
from gguf.constants import GGMLQuantizationType

from ...native import ggml, int4
from ...native.attention import NativeAttention, NativeKVCodec
from ...native.row_ops import NativeRowOps
from .cpu_features import cpu_features

TORCH_OP = "torch _weight_int4pack_mm_for_cpu"
_OFF = frozenset({"0", "off", "no", "false", "torch"})
_FORCED_ISAS = frozenset(int4.ISA_NAMES.values())


@dataclass(frozen=True)
class KernelChoice:
    library: int4.Library | None  # None: torch's op
    reason: str  # why torch's op, or where the native library came from

    @property
    def native(self) -> bool:
        return self.library is not None

    def describe(self) -> str:
        """One line for `miniapp doctor`."""
        if self.library is None:
            return f"{TORCH_OP} (native kernel: {self.reason})"
        threads = torch.get_num_threads()
        return f"native {self.library.isa_name} ({threads} thread{'s' * (threads != 1)})"


def cpu_int4_kernel() -> KernelChoice:
    """The CPU int4 kernel for weights packed now (read at model load)."""
    setting = os.environ.get(int4.ENV_SWITCH, "").strip().lower()
    if setting in _OFF:
        return KernelChoice(None, f"switched off by {int4.ENV_SWITCH}={setting}")
    if setting in _FORCED_ISAS:
        return _load(setting)
    cpu = cpu_features()
    if cpu.simulated and not cpu.avx2:
        return KernelChoice(None, "the CPU lacks AVX2/FMA (simulated)")
    if cpu.simulated and not cpu.avx512_bf16:  # never a path the simulated CPU lacks
        avx2 = int4.ISA_NAMES[int4.ISA_AVX2]
        if cpu.avx512_vnni:
            choice = _load(int4.ISA_NAMES[int4.ISA_AVX512_VNNI])
            return choice if choice.native else _load(avx2)  # the real CPU lacks it
        return _load(avx2)
    return _load(None)


@functools.cache
def _load(isa: str | None) -> KernelChoice:
    try:
        library = int4.load(isa)
    except int4.NativeUnavailable as exc:
        return KernelChoice(None, str(exc))
    except (OSError, AttributeError) as exc:  # the loader refused it, or a symbol is missing
        return KernelChoice(None, f"cannot load the library: {exc}")
    return KernelChoice(library, f"loaded {library.path}")


def cpu_attention_kernel() -> NativeAttention | None:
    """The native decode attention, when the native library is in use (None: torch's)."""
    choice = cpu_int4_kernel()
    return None if choice.library is None else _attention(choice.library)


@functools.cache
def _attention(library: int4.Library) -> NativeAttention:
    return NativeAttention(library)


GGML_ENV = "MINIAPP_GGML_DIRECT"  # "0": every weight goes to the int4 layout; "all": Q4_0/Q4_1 too
# Weights of these types stay in the file's own blocks, read by the GGML kernel (see
# native/ggml_dot.cpp): the int4 layout holds them wider (Q6_K at 10 bits a weight instead of
# 6.56, Q5_0 and Q8_0 at 9) or converts them at load. Q4_0 and Q4_1 are 4.5 and 5 bits either
# way, and the int4 kernel computes them faster, so they keep it.
_Q = GGMLQuantizationType
_GGML_DEFAULT = frozenset({_Q.Q5_0, _Q.Q5_1, _Q.Q8_0, _Q.Q4_K, _Q.Q5_K, _Q.Q6_K})
_GGML_ALL = _GGML_DEFAULT | {_Q.Q4_0, _Q.Q4_1}


def ggml_direct_types() -> frozenset[GGMLQuantizationType]:
    """The GGML types that weights keep in their file blocks on the CPU (read at load)."""
    setting = os.environ.get(GGML_ENV, "").strip().lower()
    if setting in _OFF:
        return frozenset()
    return _GGML_ALL if setting == "all" else _GGML_DEFAULT


INTERLEAVE_ENV = "MINIAPP_GGML_INTERLEAVE"  # "0": keep every GGML weight in the file's layout


def ggml_interleave_enabled() -> bool:
    """Whether weights of a type with an interleaved layout (Q4_K, Q6_K, Q5_0, Q8_0) are
    rewritten into it at load: each 8 rows side by side, the same bytes, so one instruction
    meets 8 rows (1.3-3.5x the kernel's speed for a prompt or a few rows of decoding;
    Q6_K about even)."""
    return os.environ.get(INTERLEAVE_ENV, "").strip().lower() not in _OFF


def describe_ggml_kernel() -> str:
    """One line for `miniapp doctor`: which weights stay in the file's blocks, and the path
    the GGML kernel takes on this CPU."""
    library = cpu_int4_kernel().library
    if library is None:
        return "off (no native library: every weight goes to the int4 layout)"
    types = ggml_direct_types()
    if not types:
        return f"off ({GGML_ENV}=0: every weight goes to the int4 layout)"
    wide = library.isa != int4.ISA_AVX2 and ggml.cpu_has(library, ggml.ISA_AVX512)
    names = ", ".join(t.name for t in sorted(types))
    grouped = ""
    if ggml_interleave_enabled():
        kinds = sorted(GGMLQuantizationType(t) for t in ggml.INTERLEAVED if t in types)
        grouped = f" ({', '.join(t.name for t in kinds)} interleaved 8 rows at a time at load)"
    path = "avx512-vnni" if wide else "avx2"
    return f"native {path}: {names} read from the file's blocks{grouped}"


FUSED_ENV = "MINIAPP_FUSED_LAYERS"  # "0": decode steps call the layer's kernels one by one


def fused_layers_enabled() -> bool:
    """Whether one-token steps may run a whole layer in one native call (read at model load;
    switching it off is for A/B measurements and as an escape hatch)."""
    return os.environ.get(FUSED_ENV, "").strip().lower() not in _OFF


def cpu_row_ops() -> NativeRowOps | None:
    """The native RMS norm and RoPE of a step on the CPU, with the native library (None:
    torch's ops, as under MINIAPP_NATIVE=0, where torch.compile must see every op)."""
    choice = cpu_int4_kernel()
    return None if choice.library is None else _row_ops(choice.library)


@functools.cache
def _row_ops(library: int4.Library) -> NativeRowOps:
    return NativeRowOps(library)


def cpu_kv_codec() -> NativeKVCodec | None:
    """The native codec of quantized KV rows, when the native library is in use (None:
    torch's ops, which give the same bits)."""
    choice = cpu_int4_kernel()
    return None if choice.library is None else _kv_codec(choice.library)


@functools.cache
def _kv_codec(library: int4.Library) -> NativeKVCodec:
    return NativeKVCodec(library)
