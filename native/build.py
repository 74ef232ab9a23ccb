"""Compiling the native kernels: one shared library, loaded with ctypes (no Python or torch
C++ ABI involved, so any C++17 compiler will do).

Used twice: by `setup.py` when the package is installed, and by `miniapp.native.int4` on
first use when no up-to-date installed library is found (it then builds into the user cache
folder). Neither needs the network. This module imports nothing outside the standard
library, so `setup.py` can load it before anything is installed.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

SOURCE = Path(__file__).with_name("int4_gemm.cpp")
# Compiled with SOURCE into the same library, one file per kernel library: the KV cache's
# codecs, decode attention, the row operations, the fused decode layer, the kernels on
# GGML's own blocks, the LoRA updates and the mixture-of-experts feed-forward.
_OTHERS = (
    "kv_codec.cpp",
    "attention.cpp",
    "row_ops.cpp",
    "decode_layer.cpp",
    "ggml_dot.cpp",
    "lora.cpp",
    "moe.cpp",
)
SOURCES = (SOURCE, *(SOURCE.with_name(name) for name in _OTHERS))
# What the sources include: part of a build too, so an edit to a header rebuilds the library.
HEADERS = tuple(SOURCE.with_name(name) for name in ("common.h", "kv_codec.h"))
LIBRARY_STEM = "_int4_gemm"  # installed as _int4_gemm<python extension suffix>
# The AVX2 and AVX-512 paths carry their own target attributes and are picked at run time,
# so the library is built for the baseline ISA and runs (or declines) on any x86-64 CPU.
# OpenMP: the library then uses the OpenMP runtime torch has already loaded, i.e. torch's
# own thread pool, instead of a second set of threads competing for the same cores.
# -ffp-contract=off: no compiler-chosen fused multiply-adds, whose use could differ between
# the 1-row and 8-row variants and break bit-identical rows.
COMPILE_FLAGS = (
    "-O3",
    "-std=c++17",
    "-fPIC",
    "-fopenmp",
    "-ffp-contract=off",
    "-fno-exceptions",
    "-Wall",
    "-Wextra",
    "-Wno-maybe-uninitialized",  # false positives inside GCC 12's AVX-512 headers
)
LINK_FLAGS = ("-shared", "-fopenmp")
COMPILE_TIMEOUT_S = 300


class BuildError(Exception):
    """The library could not be built; the message says why in one line."""


def source_hash(source: Path = SOURCE) -> str:
    """Identifies a build: the sources (headers too) and the flags they were compiled with."""
    digest = hashlib.sha256(source.read_bytes())
    for other in (*SOURCES[1:], *HEADERS):
        digest.update(other.read_bytes())
    digest.update(" ".join(COMPILE_FLAGS + LINK_FLAGS).encode())
    return digest.hexdigest()[:16]


def hash_define(source: Path = SOURCE) -> str:
    """The -D flag that stamps a build with its source hash (checked at load time)."""
    return f'-DMINIAPP_SOURCE_HASH="{source_hash(source)}"'


def find_compiler() -> str | None:
    """$CXX, else g++, else c++; None when there is none."""
    for name in (os.environ.get("CXX"), "g++", "c++"):
        if name and (path := shutil.which(name)):
            return path
    return None


def build(output: Path, source: Path = SOURCE) -> Path:
    """Compile `source` into the shared library `output` (written atomically, so processes
    building at the same time never load a half-written file)."""
    compiler = find_compiler()
    if compiler is None:
        raise BuildError("no C++ compiler (set CXX or install g++)")
    try:
        output.parent.mkdir(parents=True, exist_ok=True)
        fd, partial = tempfile.mkstemp(suffix=".so.partial", dir=output.parent)
        os.close(fd)
    except OSError as exc:
        raise BuildError(f"cannot write the library to {output.parent}: {exc}") from exc
    sources = [str(source), *(str(other) for other in SOURCES[1:])]
    command = [compiler, *COMPILE_FLAGS, hash_define(source), *sources, *LINK_FLAGS]
    try:
        done = subprocess.run(
            [*command, "-o", partial], capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S
        )
        if done.returncode != 0:
            errors = [line for line in done.stderr.splitlines() if "error" in line]
            raise BuildError(f"compile failed: {(errors or ['see the compiler output'])[0]}")
        os.replace(partial, output)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise BuildError(f"compile failed: {exc}") from exc
    finally:
        if os.path.exists(partial):
            os.unlink(partial)
    return output
