"""Compile our Triton kernels (engine/ops/stored_attention.py) for GPUs without one: for
NVIDIA's sm_90 (H100, H200) and AMD's gfx942 (MI300), from Triton's own code generator
down to machine code, as the first call on such a GPU would. The interpreter the tests
run the kernels under checks their numbers, not this: a branch leaving a variable of two
types, a pointer cast the backend refuses, or an atomic it cannot lower fail here.

    PYTHONPATH=.venv/triton .venv/bin/python scripts/compile_kernels.py [--target cuda:90]
        [--shape smollm2] [--kind q8] [--warps 4]

Prints each kernel and shape with its compile time and, for NVIDIA, its registers and
spilled bytes a thread (from cuobjdump, shipped with Triton). Exit code 1 if any fails.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# Shapes: SmolLM2-135M (9 heads over 3, head 64), Qwen2.5-1.5B (12 over 2, head 128),
# Gemma 3 270M (4 over 1, head 256).
SHAPES = {"smollm2": (9, 3, 64), "qwen2.5-1.5b": (12, 2, 128), "gemma3-270m": (4, 1, 256)}
KINDS = {"bf16": 2, "q8": 3, "q4": 4}
TARGETS = ("cuda:90", "hip:gfx942")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", action="append", choices=TARGETS, help="default: both")
    parser.add_argument("--shape", action="append", choices=SHAPES, help="default: all")
    parser.add_argument("--kind", action="append", choices=KINDS, help="default: all")
    parser.add_argument("--warps", type=int, default=4, help="warps a program (Triton's 4)")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("run without TRITON_INTERPRET: the interpreter compiles nothing")
        return 2
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from miniapp.engine.kv.types import BF16, Q4, Q8
    from miniapp.engine.ops import stored_attention as kernels

    row_bytes = {2: BF16.row_bytes, 3: Q8.row_bytes, 4: Q4.row_bytes}
    failed = 0
    for target_name in args.target or TARGETS:
        backend, arch = target_name.split(":")
        target = GPUTarget(
            backend, int(arch) if arch.isdigit() else arch, 32 if backend == "cuda" else 64
        )
        for shape_name in args.shape or SHAPES:
            heads, kv_heads, d = SHAPES[shape_name]
            for kind_name in args.kind or KINDS:
                kind = KINDS[kind_name]
                row = row_bytes[kind](d)
                for fn, signature, constants in _launches(kernels, heads, kv_heads, d, kind, row):
                    label = f"{target_name} {shape_name} {kind_name} {fn.__name__}"
                    full = {
                        n: "constexpr" if n in constants else signature[n] for n in fn.arg_names
                    }
                    started = time.perf_counter()
                    try:
                        source = ASTSource(fn, full, constants)
                        options = {"num_warps": args.warps}
                        compiled = triton.compile(source, target=target, options=options)
                    except Exception as error:  # noqa: BLE001 - report every kernel's failure
                        failed += 1
                        print(f"{label}: FAILED {_reason(error)}")
                        continue
                    seconds = time.perf_counter() - started
                    usage = _usage(compiled) if backend == "cuda" else ""
                    print(f"{label}: ok in {seconds:.1f} s{usage}")
    return 1 if failed else 0


def _launches(kernels, heads, kv_heads, d, kind, row):
    """(kernel, argument types, constants) of each launch a static step makes."""
    group = heads // kv_heads
    attention = dict(
        queries="*bf16", table="*i64", part_max="*fp32", part_sum="*fp32", part_out="*fp32",
        out="*bf16", counters="*i32", rope_cos="*fp32", rope_sin="*fp32",
        rope_stride="i64", query_row_stride="i64", query_head_stride="i64",
        scale_log2="fp32", splits="i32",
    )  # fmt: skip
    attention_constants = dict(
        HEADS=heads, GROUP=group, GROUP_PAD=max(kernels.MIN_DOT, 1 << (group - 1).bit_length()),
        D=d, KEY_KIND=kind, VALUE_KIND=kind, KEY_ROW=row, VALUE_ROW=row,
        TOKENS=kernels.TOKENS_PER_SPLIT, BLOCK=kernels.attention_block(d), ROPE=True,
        INTERLEAVED=False, ROTARY=d,
    )  # fmt: skip
    write = dict(
        new_keys="*bf16", new_values="*bf16", table="*i64", rope_cos="*fp32",
        rope_sin="*fp32", rope_stride="i64", key_entry_stride="i64", key_head_stride="i64",
        value_entry_stride="i64", value_head_stride="i64",
    )  # fmt: skip
    write_constants = dict(
        D=d, KEY_KIND=kind, VALUE_KIND=kind, KEY_ROW=row, VALUE_ROW=row, SINKS=4,
        INTERLEAVED=False, ROTARY=d, KEY_ROPE=True,
    )  # fmt: skip
    yield kernels._split_partials, attention, attention_constants
    yield kernels._write_rows, write, write_constants


def _reason(error: Exception) -> str:
    """A compile error in one line: Triton's message ends with the failing source line and
    a caret, its cause sits in the chained exception."""
    cause = error.__cause__ or error
    lines = [line.strip() for line in str(cause).splitlines() if line.strip(" ^")]
    return f"{type(cause).__name__}: {lines[-1] if lines else ''}"


def _usage(compiled) -> str:
    """Registers and spilled bytes a thread of an NVIDIA kernel, read off its cubin."""
    cuobjdump = Path(sys.modules["triton"].__file__).parent / "backends/nvidia/bin/cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        report = subprocess.run(
            [str(cuobjdump), "--dump-resource-usage", cubin.name],
            capture_output=True, text=True, check=False,
        ).stdout  # fmt: skip
    registers = re.search(r"REG:(\d+)", report)
    stack = re.search(r"STACK:(\d+)", report)
    local = re.search(r"LOCAL:(\d+)", report)
    if registers is None:
        return ""
    spilled = int(stack.group(1) if stack else 0) + int(local.group(1) if local else 0)
    return f", {registers.group(1)} registers, {spilled} bytes spilled a thread"


if __name__ == "__main__":
    sys.exit(main())
