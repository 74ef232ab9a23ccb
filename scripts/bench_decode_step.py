"""Time one decode step on this machine: the ordinary step, the fixed-shape step a GPU
captures as a graph (run eagerly here), and that step compiled by torch.compile.

    .venv/bin/python scripts/bench_decode_step.py [--model PATH] [--steps 200] [--threads 2]
        [--compile]

Each variant decodes greedily from the same 40-token prompt in its own caches and reports the
median milliseconds per step (the first step, which builds or compiles, is reported apart).
`MINIAPP_NATIVE=0` measures torch's int4 op instead of our kernel (torch.compile cannot see
into the native kernel, so compare compiled runs with that setting).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

PROMPT = list(range(300, 340))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="GGUF (default: the bundled model)")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--ctx", type=int, default=512)
    parser.add_argument("--compile", action="store_true", help="also time torch.compile")
    args = parser.parse_args(argv)

    import torch

    from miniapp.engine.modelfile.gguf_file import GGUFFile
    from miniapp.engine.modelfile.store import DEFAULT_MODEL, bundled_path
    from miniapp.engine.models import CachePolicy, build_model
    from miniapp.engine.models.static_step import StaticDecodeStep, eager_runner
    from miniapp.engine.platform.kernels import cpu_int4_kernel

    torch.set_num_threads(args.threads)
    path = Path(args.model) if args.model else bundled_path(DEFAULT_MODEL)
    model = build_model(GGUFFile(path))
    policy = CachePolicy(ctx=args.ctx)
    print(f"{path.name}, {args.threads} threads, int4 matmul: {cpu_int4_kernel().describe()}")

    def prefilled():
        caches = model.make_caches(policy)
        for cache in caches:
            cache.reserve()
        model(torch.tensor(PROMPT), caches)
        return caches

    def ordinary():
        caches = prefilled()
        return lambda token: model(torch.tensor([token]), caches)

    def fixed_shape(runner=eager_runner):
        return StaticDecodeStep(model, prefilled(), runner)

    variants = {"ordinary step": ordinary, "fixed-shape step, eager": fixed_shape}
    if args.compile:
        variants["fixed-shape step, torch.compile"] = lambda: fixed_shape(
            lambda body: torch.compile(body, fullgraph=True)
        )
    with torch.inference_mode():
        for name, make in variants.items():
            step = make()
            token, times = 5, []
            for _ in range(args.steps + 1):
                start = time.perf_counter()
                token = int(step(token).argmax())
                times.append(time.perf_counter() - start)
            first, median = times[0], statistics.median(times[1:])
            print(f"{name}: {median * 1e3:.2f} ms a step (first step {first:.2f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
