"""What the CPU offers: the instruction sets that decide which kernels run (ours and
llama.cpp's), read once from /proc/cpuinfo.

Machines differ (an AMD EPYC with AVX-512, an Intel Xeon with AMX, an AVX2-only laptop), and a
test or `miniapp doctor` must be able to stand in one it is not running on:
`MINIAPP_SIMULATE_CPU` replaces the flags with a preset (`intel-amx`, `amd-avx512`,
`avx2-only`) or a comma-separated list of /proc/cpuinfo flags. A simulation can only take
instructions away from our own kernels, never add them: each kernel still checks the real CPU
before it runs.
"""

from __future__ import annotations

import functools
import os
import platform
from dataclasses import dataclass
from pathlib import Path

SIMULATE_ENV = "MINIAPP_SIMULATE_CPU"
CPUINFO = Path("/proc/cpuinfo")

_AVX2 = frozenset({"avx2", "fma", "f16c"})
_AVX512 = frozenset({"avx512f", "avx512bw", "avx512vl"})
_AMX = frozenset({"amx_tile", "amx_int8"})
PRESETS = {
    # A Sapphire Rapids-class Xeon, as a KVM guest that passes AMX through.
    "intel-amx": _AVX2 | _AVX512 | _AMX | {"avx512_bf16", "avx512_vnni", "amx_bf16"},
    # An EPYC of the Zen 4 class: AVX-512 with BF16 and VNNI, no AMX.
    "amd-avx512": _AVX2 | _AVX512 | {"avx512_bf16", "avx512_vnni"},
    "avx2-only": _AVX2,
}
# The features reported, as CpuFeatures' property names and as people write them.
REPORTED = (
    ("avx2", "AVX2"),
    ("avx512", "AVX-512"),
    ("avx512_bf16", "AVX-512 BF16"),
    ("avx512_vnni", "AVX-512 VNNI"),
    ("amx", "AMX"),
)


@dataclass(frozen=True)
class CpuFeatures:
    model: str  # "Intel(R) Xeon(R) Platinum 8480+", as the OS names it
    flags: frozenset[str]  # /proc/cpuinfo's names: avx2, avx512_bf16, amx_int8, ...
    simulated: bool = False

    @property
    def avx2(self) -> bool:
        return _AVX2 <= self.flags

    @property
    def avx512(self) -> bool:
        return _AVX512 <= self.flags

    @property
    def avx512_bf16(self) -> bool:
        return self.avx512 and "avx512_bf16" in self.flags

    @property
    def avx512_vnni(self) -> bool:
        return self.avx512 and "avx512_vnni" in self.flags

    @property
    def amx(self) -> bool:
        """AMX tiles with int8 products: what llama.cpp's AMX weight path needs."""
        return _AMX <= self.flags

    def summary(self) -> dict:
        """The features that matter here, for `miniapp doctor --json`."""
        features = {key: getattr(self, key) for key, _ in REPORTED}
        return {"model": self.model, "simulated": self.simulated, **features}

    def describe(self) -> str:
        """One line: the model and the instruction sets it has."""
        names = [label for key, label in REPORTED if getattr(self, key)]
        tag = " (simulated)" if self.simulated else ""
        return f"{self.model}{tag}: {', '.join(names) or 'none of AVX2, AVX-512, AMX'}"


def parse_cpuinfo(text: str) -> CpuFeatures:
    """The first processor's model name and flags in /proc/cpuinfo's format."""
    model, flags = "", frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and not model:
            model = value.strip()
        elif key == "flags" and not flags:
            flags = frozenset(value.split())
    return CpuFeatures(model or platform.processor() or "unknown CPU", flags)


def simulated(spec: str, model: str) -> CpuFeatures:
    """A preset name or a comma-separated list of flags (see the module's docstring)."""
    spec = spec.strip()
    flags = PRESETS.get(spec)
    if flags is None:
        flags = frozenset(part.strip() for part in spec.split(",") if part.strip())
    return CpuFeatures(model, frozenset(flags), simulated=True)


@functools.cache
def cpu_features() -> CpuFeatures:
    """This machine's CPU (or the one `MINIAPP_SIMULATE_CPU` stands in), read once."""
    try:
        real = parse_cpuinfo(CPUINFO.read_text())
    except OSError:  # not Linux: no flags to read, so nothing is taken away below
        real = CpuFeatures(platform.processor() or "unknown CPU", frozenset())
    spec = os.environ.get(SIMULATE_ENV)
    return simulated(spec, real.model) if spec else real
