"""Our native int4 kernel against torch's, side by side in one run, on the default model.

Sections (all by default):
  kernels  Int4Linear.forward on each of the model's weights at M = 1, 4, 8, 9, 16 rows,
           built for our kernel and for torch's op from the same GGUF data, alternating call
           by call. "hot": one weight called again and again (it stays in cache); "streamed":
           cycling through copies that together exceed the L3 cache, as a decode step reads
           every weight once from memory.
  verify   full-model decode-exact passes (speculative verification) over 1 and 1 + 8 rows
           with each kernel: what verifying 8 drafts costs, in decode steps.
  decode   greedy decode tok/s of the torch engine with each kernel and of llama.cpp (with
           and without its extra buffer types, CPU_REPACK), each in its own `miniapp bench`
           worker process, alternating runs; medians, and the median ratio of back-to-back
           pairs.

    .venv/bin/python scripts/bench_kernels.py --threads 2 [--section kernels] [--json FILE]
    ATEN_CPU_CAPABILITY=avx2 MINIAPP_NATIVE=avx2 .venv/bin/python scripts/bench_kernels.py \
        --section kernels          # both kernels' AVX2 code on an AVX-512 machine
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from miniapp.app.worker_process import WorkerProcess, worker_arguments
from miniapp.engine.llamacpp.library import REPACK_ENV
from miniapp.engine.modelfile.gguf_file import GGUFFile
from miniapp.engine.modelfile.store import resolve_model
from miniapp.engine.ops.layers import linear_from_raw
from miniapp.engine.platform.kernels import cpu_int4_kernel
from miniapp.native.int4 import ENV_SWITCH

# MINIAPP_NATIVE for each; a path forced in the environment (MINIAPP_NATIVE=avx2) is kept.
# With ATEN_CPU_CAPABILITY=avx2 too, both kernels run their AVX2 code.
_FORCED = os.environ.get(ENV_SWITCH, "") if os.environ.get(ENV_SWITCH) in ("avx2", "avx512") else ""
KERNELS = {"native": _FORCED, "torch": "0"}
M_VALUES = (1, 4, 8, 9, 16)
STREAM_BYTES = 96 << 20  # copies per weight for the streamed regime: 3x this CPU's L3
HOT_CALLS = 300
STREAM_CALLS = 300
VERIFY_ROWS = (1, 2, 4, 9, 16)
VERIFY_CONTEXT = 300  # tokens in the cache before timing (as in BENCHMARKS.md, issue 5)
VERIFY_REPEAT = 30
DECODE_PROMPT_TOKENS = 128


def with_kernel(kernel: str):
    """Context: MINIAPP_NATIVE set for `kernel` while weights are packed."""

    class _Env:
        def __enter__(self):
            self.saved = os.environ.get(ENV_SWITCH)
            os.environ[ENV_SWITCH] = KERNELS[kernel]

        def __exit__(self, *exc):
            if self.saved is None:
                os.environ.pop(ENV_SWITCH, None)
            else:
                os.environ[ENV_SWITCH] = self.saved

    return _Env()


# ------------------------------------------------------------------------------ kernels


def weight_groups(gguf: GGUFFile) -> dict[str, tuple[list[str], bool]]:
    """The first layer's linears and the output head: name -> (tensors, gated)."""
    head = "output.weight" if "output.weight" in gguf.tensors else "token_embd.weight"
    qkv = ["blk.0.attn_q.weight", "blk.0.attn_k.weight", "blk.0.attn_v.weight"]
    gate_up = ["blk.0.ffn_gate.weight", "blk.0.ffn_up.weight"]
    return {
        "attn qkv": (qkv, False),
        "attn out": (["blk.0.attn_output.weight"], False),
        "ffn gate|up": (gate_up, False),
        "ffn gate|up + silu*up": (gate_up, True),
        "ffn down": (["blk.0.ffn_down.weight"], False),
        "output head": ([head], False),
    }


def build_linears(gguf: GGUFFile, names: list[str], gated: bool, kernel: str, copies: int):
    infos = [gguf.tensor(n) for n in names]
    parts = [(gguf.raw(i), i.ggml_type) for i in infos]
    with with_kernel(kernel):
        return [linear_from_raw(parts, infos[0].shape[-1], gated=gated) for _ in range(copies)]


def packed_bytes(linear) -> int:
    sizes = [linear.packed.numel() * linear.packed.element_size()]
    if linear.scales_zeros is not None:
        sizes.append(linear.scales_zeros.numel() * linear.scales_zeros.element_size())
    return sum(sizes)


def gated_by_torch(linear, ffn: int):
    """torch's op for gate|up, then what the engine does with it: silu(gate) * up."""

    def forward(x):
        gate_up = linear.forward(x)
        return torch.nn.functional.silu(gate_up[:, :ffn]).mul_(gate_up[:, ffn:])

    return forward


def time_calls(calls: dict[str, list], x: torch.Tensor, n: int) -> dict[str, float]:
    """Median µs per call; the kernels alternate call by call, each cycling its copies."""
    times: dict[str, list[float]] = {name: [] for name in calls}
    for i in range(n):
        for name, fns in calls.items():
            fn = fns[i % len(fns)]
            start = time.perf_counter()
            fn(x)
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) * 1e6 for name, t in times.items()}


def bench_kernels(model: Path) -> list[dict]:
    gguf = GGUFFile(model)
    rows = []
    for label, (names, gated) in weight_groups(gguf).items():
        one = {k: build_linears(gguf, names, gated, k, 1)[0] for k in KERNELS}
        size = packed_bytes(one["torch"])
        copies = max(2, -(-STREAM_BYTES // size))
        for regime, n_copies, calls in (("hot", 1, HOT_CALLS), ("streamed", copies, STREAM_CALLS)):
            linears = {k: build_linears(gguf, names, gated, k, n_copies) for k in KERNELS}
            fns = {"native": [lin.forward for lin in linears["native"]]}
            if gated:
                ffn = linears["torch"][0].out_features // 2
                fns["torch"] = [gated_by_torch(lin, ffn) for lin in linears["torch"]]
            else:
                fns["torch"] = [lin.forward for lin in linears["torch"]]
            for m in M_VALUES:
                x = torch.randn(m, one["torch"].in_features)
                for fn_list in fns.values():  # warm-up: thread pools, first-touch pages
                    fn_list[0](x)
                us = time_calls(fns, x, calls)
                rows.append(
                    dict(
                        weight=label,
                        shape=_shape(one["torch"], gated),
                        bytes=size,
                        regime=regime,
                        m=m,
                        **us,
                    )
                )
                print(_kernel_line(rows[-1]), file=sys.stderr, flush=True)
            del linears, fns
    return rows


def _shape(linear, gated: bool) -> str:
    return f"{linear.out_features}x{linear.in_features}" + (" (gated)" if gated else "")


def _kernel_line(row: dict) -> str:
    return (
        f"{row['weight']:<22} {row['regime']:<8} M={row['m']:<2} native {row['native']:8.1f} us"
        f"  torch {row['torch']:8.1f} us"
    )


# ------------------------------------------------------------------------------- verify


def bench_verify(model: Path, threads: int) -> dict:
    from miniapp.engine.runtimes.torch_runtime import TorchRuntime

    runtimes = {}
    for kernel in KERNELS:
        with with_kernel(kernel):
            runtimes[kernel] = TorchRuntime(model, n_ctx=1024, threads=threads, spec="off")
    context = torch.arange(1000, 1000 + VERIFY_CONTEXT)
    for rt in runtimes.values():
        rt.model.forward(context, rt.caches)
    times: dict[str, dict[int, list[float]]] = {k: {n: [] for n in VERIFY_ROWS} for k in KERNELS}
    for _ in range(VERIFY_REPEAT):
        for n in VERIFY_ROWS:
            rows = torch.arange(2000, 2000 + n)
            for kernel, rt in runtimes.items():
                start = time.perf_counter()
                hidden = rt.model.hidden_states(rows, rt.caches, exact_rows=n > 1)
                rt.model.logits(hidden)
                times[kernel][n].append(time.perf_counter() - start)
                for cache in rt.caches:
                    cache.trim(n)
    return {
        kernel: {str(n): statistics.median(t) * 1e3 for n, t in by_rows.items()}
        for kernel, by_rows in times.items()
    }


# ------------------------------------------------------------------------------- decode


def start_worker(backend: str, env: dict, model: Path, prompts: Path, args) -> WorkerProcess:
    """A `miniapp bench` worker process, loaded and ready."""
    arguments = worker_arguments(model, prompts, args.tokens, 512, "off")
    worker = WorkerProcess(backend, [*arguments, "--threads", str(args.threads)], env)
    worker.wait_ready()
    return worker


def bench_decode(model: Path, args) -> dict:
    from miniapp.app.bench import bench_prompt
    from miniapp.engine.tokens.tokenizer import Tokenizer

    prompt = bench_prompt(Tokenizer(model), DECODE_PROMPT_TOKENS, None)
    with tempfile.TemporaryDirectory() as tmp:
        prompts = Path(tmp) / "prompts.json"
        prompts.write_text(json.dumps([prompt]))
        workers = {
            "native": start_worker("torch", {ENV_SWITCH: KERNELS["native"]}, model, prompts, args),
            "torch": start_worker("torch", {ENV_SWITCH: KERNELS["torch"]}, model, prompts, args),
            "llamacpp": start_worker("llamacpp", {}, model, prompts, args),
            # The same llama.cpp with its extra buffer types (CPU_REPACK) off: what the
            # AMX guard costs where it has to turn them off (engine/llamacpp/library.py).
            "llamacpp-plain": start_worker("llamacpp", {REPACK_ENV: "off"}, model, prompts, args),
        }
        speeds: dict[str, list[float]] = {name: [] for name in workers}
        digests: dict[str, set[str]] = {name: set() for name in workers}
        try:
            for _ in range(args.repeat):
                for name, worker in workers.items():
                    speed, digest = worker.run()
                    speeds[name].append(speed)
                    digests[name].add(digest)
            prefill = {  # medians over the runs, from each worker's own result
                name: json.loads(worker.ask("result"))["prefill_tok_s"]
                for name, worker in workers.items()
            }
        finally:
            for worker in workers.values():
                worker.stop()

    def pairs(a: str, b: str) -> float:
        return statistics.median(x / y for x, y in zip(speeds[a], speeds[b], strict=True))

    return {
        "tok_s": {name: statistics.median(s) for name, s in speeds.items()},
        "prefill_tok_s": prefill,
        "native_vs_llamacpp": pairs("native", "llamacpp"),
        "torch_vs_llamacpp": pairs("torch", "llamacpp"),
        "native_vs_torch": pairs("native", "torch"),
        "llamacpp_vs_plain": pairs("llamacpp", "llamacpp-plain"),
        "native_and_torch_same_tokens": digests["native"] == digests["torch"],
    }


# ------------------------------------------------------------------------------ report


def print_report(results: dict) -> None:
    print(
        f"kernel: {results['kernel']}; torch's op: {results['torch_cpu_capability']}; "
        f"threads {results['threads']}; model {results['model']}"
    )
    if "kernels" in results:
        print("\n| weight | shape | regime | M | native µs | torch µs | torch / native |")
        print("|---|---|---|---|---|---|---|")
        for r in results["kernels"]:
            print(
                f"| {r['weight']} | {r['shape']} | {r['regime']} | {r['m']} | "
                f"{r['native']:.1f} | {r['torch']:.1f} | {r['torch'] / r['native']:.2f} |"
            )
        print("\n| weight | regime | native M=8 / M=1 | torch M=8 / M=1 |")
        print("|---|---|---|---|")
        by_key = {(r["weight"], r["regime"], r["m"]): r for r in results["kernels"]}
        for weight, regime, m in by_key:
            if m == 1:
                one, eight = by_key[(weight, regime, 1)], by_key[(weight, regime, 8)]
                print(
                    f"| {weight} | {regime} | {eight['native'] / one['native']:.2f} | "
                    f"{eight['torch'] / one['torch']:.2f} |"
                )
    if "verify" in results:
        header = " | ".join(f"M={n}" for n in VERIFY_ROWS)
        print(f"\n| kernel | {header} | verify 8 drafts / one step |")
        print("|---|" + "---|" * (len(VERIFY_ROWS) + 1))
        for kernel, ms in results["verify"].items():
            cells = " | ".join(f"{ms[str(n)]:.2f}" for n in VERIFY_ROWS)
            print(f"| {kernel} | {cells} | {ms['9'] / ms['1']:.2f} |")
    if "decode" in results:
        d = results["decode"]
        speeds = ", ".join(f"{name} {v:.1f}" for name, v in d["tok_s"].items())
        print(f"\ndecode tok/s (medians): {speeds}")
        prefill = ", ".join(f"{name} {v:.1f}" for name, v in d["prefill_tok_s"].items())
        print(f"prefill tok/s (medians, {DECODE_PROMPT_TOKENS} tokens): {prefill}")
        print(
            f"pair ratios: native/llama.cpp {d['native_vs_llamacpp']:.2f}, torch op/llama.cpp "
            f"{d['torch_vs_llamacpp']:.2f}, native/torch op {d['native_vs_torch']:.2f}, "
            f"llama.cpp with/without extra buffer types {d['llamacpp_vs_plain']:.2f}; "
            f"native and torch op tokens identical: {d['native_and_torch_same_tokens']}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="GGUF (default: the bundled default model)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--section", choices=("kernels", "verify", "decode"), action="append")
    parser.add_argument("--repeat", type=int, default=7, help="decode runs per worker")
    parser.add_argument("--tokens", type=int, default=128, help="tokens per decode run")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = resolve_model(args.model)
    sections = args.section or ["kernels", "verify", "decode"]
    with with_kernel("native"):
        described = cpu_int4_kernel().describe()
    results: dict = {
        "kernel": described,
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "threads": args.threads,
        "model": model.name,
    }
    if "kernels" in sections:
        results["kernels"] = bench_kernels(model)
    if "verify" in sections:
        results["verify"] = bench_verify(model, args.threads)
    if "decode" in sections:
        results["decode"] = bench_decode(model, args)
    print_report(results)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
