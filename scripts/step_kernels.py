"""Count the work in one fixed-shape decode step (the step a GPU captures as a graph): the ops
it dispatches as written, and the kernels it runs once torch.compile has fused it, as
torch.profiler sees them.

    MINIAPP_NATIVE=0 .venv/bin/python scripts/step_kernels.py [--model NAME_OR_PATH] [--sampled]
        [--verify ROWS] [--batch N] [--kv-type TYPE] [--host]

On a CPU, inductor generates C++ kernels, from the same fusion decisions it makes for Triton
on a GPU, so the count here is the count a GPU's compiled step launches, give or take the
matmul and attention ops each device has. Views and allocations launch nothing and are not
counted. Attention runs in the precision a GPU's does (16 bits over 16-bit and quantized
rows, attention_backends.attention_dtype), and a projection's parts whose types want
different kernel layouts make one product, as on a GPU (layers.one_product_across_layouts).
`--kv-type bf16` is a GPU's default cache, q8 the CPU's. `--sampled`: the step that also
draws the token on the device. `--verify ROWS`: also speculative verification's step over
ROWS rows ([pending, *drafts]): its ops as a GPU captures them until that row count is in
use, and its kernels once compiled. `--batch N`: the same for a batched decode step of N
sequences, and the time a step of N other sequences then takes to start (clients come and
go: it reuses the compiled code). `--host`: the host's own time a step (cache bookkeeping,
staging the inputs), the step's body skipped: on a GPU it stands between two steps.
Compiling a 30-layer model takes one to two minutes on two cores.

Where Triton's interpreter runs (`TRITON_INTERPRET=1 PYTHONPATH=.venv/triton`), attention
goes through our Triton kernel over the stored cache, as on a GPU whose torch brings Triton
(one launch, `miniapp::stored_attention` in the counts).
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import time

PROMPT = [1, 72, 101, 108, 108, 111, 44, 32]
NO_KERNEL = ("empty", "empty_strided", "empty_like", "as_strided", "view", "_unsafe_view")
NO_KERNEL += ("transpose", "t", "expand", "reshape", "select", "slice", "unsqueeze", "squeeze")
NO_KERNEL += ("permute", "detach", "alias", "_reshape_alias", "split", "unbind", "lift_fresh")
NO_KERNEL += ("unflatten", "flatten", "chunk", "split_with_sizes", "narrow")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a bundled model's name or a GGUF (default: bundled)")
    parser.add_argument("--ctx", type=int, default=512)
    parser.add_argument("--kv-type", default="f32", help="the caches' type (a GPU's default: bf16)")
    parser.add_argument("--sampled", action="store_true", help="the step that draws tokens")
    parser.add_argument("--verify", type=int, default=0, help="rows of a verification step")
    parser.add_argument("--batch", type=int, default=0, help="sequences of a batched step")
    parser.add_argument("--names", action="store_true", help="list the generated kernels")
    parser.add_argument(
        "--host",
        action="store_true",
        help="also time the host's work between two steps (the step's body skipped)",
    )
    parser.add_argument(
        "--host-only", action="store_true", help="only the host's time (--host), no counts"
    )
    parser.add_argument(
        "--apart",
        type=int,
        default=0,
        metavar="N",
        help="each batched sequence's prompt N tokens longer than the one before (a server's "
        "sequences sit at positions far apart); needs --ctx above batch x N",
    )
    args = parser.parse_args(argv)
    if os.environ.get("MINIAPP_NATIVE") != "0":
        print("run with MINIAPP_NATIVE=0: the compiler cannot see into our CPU kernels")
        return 2

    import torch
    import torch._inductor.config as inductor
    from torch.profiler import ProfilerActivity, profile
    from torch.utils._python_dispatch import TorchDispatchMode

    from miniapp.engine.kv.types import kv_type
    from miniapp.engine.modelfile.gguf_file import GGUFFile
    from miniapp.engine.modelfile.store import resolve_model
    from miniapp.engine.models import CachePolicy, build_model
    from miniapp.engine.models.static_step import StaticDecodeStep, StaticVerifyStep
    from miniapp.engine.platform.graphs import CompiledStep, compiled_runner
    from miniapp.engine.tokens.device_sampler import SamplingTensors
    from miniapp.engine.tokens.sampling import SamplingParams

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops: collections.Counter = collections.Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            if name not in NO_KERNEL:
                self.ops[name] += 1
            return func(*args, **(kwargs or {}))

    from miniapp.engine.models import attention_backends
    from miniapp.engine.ops import layers as linear_layers

    attention_backends.reduced_precision = lambda device: True  # as off the CPU
    linear_layers.one_product_across_layouts = lambda target: True  # products as a GPU's
    model = build_model(GGUFFile(resolve_model(args.model)))
    layers = model.config.n_layers

    def step_over_prefilled_caches(runner=None, extra: int = 0) -> StaticDecodeStep:
        """A step over caches that hold PROMPT and `extra` tokens more."""
        caches = model.make_caches(CachePolicy(ctx=args.ctx, kv_type=kv_type(args.kv_type)))
        for cache in caches:
            cache.reserve()
        prompt = PROMPT + [(7 * i) % 500 + 3 for i in range(extra)]
        with torch.inference_mode():
            for start in range(0, len(prompt), 256):
                model(torch.tensor(prompt[start : start + 256]), caches)
        return StaticDecodeStep(model, caches, **({"runner": runner} if runner else {}))

    settings = SamplingTensors.build(
        [SamplingParams(temperature=0.8, top_p=0.95)], [PROMPT], model.config.vocab_size
    )

    def run(step, token):
        if args.sampled:
            step.sampled([token], settings, [0.5])
        else:
            step(token)

    if args.host or args.host_only:
        skipped = step_over_prefilled_caches(lambda body: lambda: None)
        print(f"host: {_host_ms(lambda: run(skipped, 5)):.3f} ms a step (median of 200)")
        if args.host_only:
            if args.batch:
                _batched_host(args, model, step_over_prefilled_caches)
            return 0

    counter = Ops()
    plain = step_over_prefilled_caches(lambda body: lambda: _watched(counter, body))
    ops = _ops_of_second(counter, lambda token: run(plain, token))
    print(f"{layers} layers; as written: {ops} ops a step ({ops / layers:.1f} a layer)")
    print("  most frequent:", ", ".join(f"{n} {c}" for n, c in counter.ops.most_common(8)))
    if args.verify:
        counter.ops.clear()
        caches = step_over_prefilled_caches().sequences[0]
        verify = StaticVerifyStep(
            model, caches, args.verify, lambda body: lambda: _watched(counter, body)
        )
        with torch.inference_mode():
            verify.verify([5] * args.verify)
        ops = sum(counter.ops.values())
        print(
            f"verification of {args.verify} rows, as captured: {ops} ops "
            f"({ops / layers:.1f} a layer)"
        )

    with inductor.patch({"cpp.enable_kernel_profile": True}):
        started = time.perf_counter()
        compiled = step_over_prefilled_caches(compiled_runner())
        with torch.inference_mode():
            run(compiled, 5)
        print(f"compiled in {time.perf_counter() - started:.0f} s")
        with torch.inference_mode(), profile(activities=[ProfilerActivity.CPU]) as prof:
            run(compiled, 6)
    launched = _launched(prof)
    if args.names:
        for name, count in sorted(launched.items(), key=lambda item: -item[1]):
            print(f"  {count:4d} {name}")
    kernels = sum(launched.values())
    generated = sum(n for name, n in launched.items() if "cpp_fused" in name)
    print(
        f"compiled: {kernels} kernels a step ({kernels / layers:.1f} a layer): "
        f"{generated} generated, {kernels - generated} torch ops "
        f"({', '.join(f'{n} {c}' for n, c in launched.items() if 'cpp_fused' not in n)})"
    )
    if args.batch:
        _count_batched(args, model, step_over_prefilled_caches, Ops)
    if args.verify:
        with inductor.patch({"cpp.enable_kernel_profile": True}):
            caches = step_over_prefilled_caches().sequences[0]
            verify = StaticVerifyStep(
                model, caches, args.verify, lambda body: CompiledStep(body, "verification")
            )
            with torch.inference_mode():
                verify.verify([5] * args.verify)
                with profile(activities=[ProfilerActivity.CPU]) as prof:
                    verify.verify([6] * args.verify)
        kernels = sum(_launched(prof).values())
        print(f"verification of {args.verify} rows, compiled: {kernels} kernels")
    return 0


def _batched_host(args, model, prefilled) -> None:
    """The host's time a batched decode step of `args.batch` sequences (the body
    skipped)."""
    from miniapp.engine.models.static_step import StaticDecodeStep

    sequences = [prefilled(extra=row * args.apart).sequences[0] for row in range(args.batch)]
    skipped = StaticDecodeStep(model, runner=lambda body: lambda: None, batch=sequences)
    tokens = [5] * args.batch
    where = f", {args.apart} tokens apart" if args.apart else ""
    print(f"batch of {args.batch}{where}, host: {_host_ms(lambda: skipped.step(tokens)):.3f} ms")


def _count_batched(args, model, prefilled, ops_counter) -> None:
    """A batched decode step of `args.batch` sequences: its ops as written, and its kernels
    compiled (as a row count in use is)."""
    import torch
    import torch._inductor.config as inductor
    from torch.profiler import ProfilerActivity, profile

    from miniapp.engine.models.static_step import StaticDecodeStep
    from miniapp.engine.platform.graphs import CompiledStep

    def batch(runner):
        sequences = [prefilled().sequences[0] for _ in range(args.batch)]
        return StaticDecodeStep(model, runner=runner, batch=sequences)

    tokens, layers = [5] * args.batch, model.config.n_layers
    if args.host:
        _batched_host(args, model, prefilled)
    counter = ops_counter()
    written = batch(lambda body: lambda: _watched(counter, body))
    ops = _ops_of_second(counter, lambda token: written.step([token] * args.batch))
    print(f"batch of {args.batch}, as written: {ops} ops ({ops / layers:.1f} a layer)")
    started = time.perf_counter()
    with inductor.patch({"cpp.enable_kernel_profile": True}):
        compiled = batch(lambda body: CompiledStep(body, "a batched step"))
        with torch.inference_mode():
            compiled.step(tokens)
            print(f"compiled in {time.perf_counter() - started:.0f} s")
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                compiled.step(tokens)
        # Clients come and go: the same count over other sequences' caches reuses the
        # compiled code (the first step of it only checks torch's guards).
        started = time.perf_counter()
        other = batch(lambda body: CompiledStep(body, "a batched step"))
        with torch.inference_mode():
            other.step(tokens)
        print(f"the same count over new sequences: {time.perf_counter() - started:.1f} s")
    kernels = sum(_launched(prof).values())
    print(f"batch of {args.batch}, compiled: {kernels} kernels ({kernels / layers:.1f} a layer)")


def _ops_of_second(counter, step) -> int:
    """The ops a step as written dispatches, counted on its second run (`step(token)`)."""
    import torch

    with torch.inference_mode():
        step(5)
        counter.ops.clear()
        step(6)
    return sum(counter.ops.values())


def _host_ms(step) -> float:
    """Median milliseconds of `step()` over 200 calls after 50 (a step whose body is
    skipped: the host's own work)."""
    import torch

    timings = []
    with torch.inference_mode():
        for _ in range(250):
            started = time.perf_counter()
            step()
            timings.append(time.perf_counter() - started)
    return 1000 * statistics.median(timings[50:])


def _launched(prof) -> collections.Counter:
    """The kernels a compiled graph's calls ran, by name, as the profiler recorded them."""
    calls = [e for e in prof.events() if e.name.startswith("## Call CompiledFxGraph")]
    return collections.Counter(
        e.name for call in calls for e in call.cpu_children if not e.name.endswith(NO_KERNEL)
    )


def _watched(counter, body) -> None:
    with counter:
        body()


if __name__ == "__main__":
    sys.exit(main())
