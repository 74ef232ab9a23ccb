"""Decode attention on the CPU: torch's scaled_dot_product_attention (one call per row, as
decode steps and exact verification rows use it) against the native kernel (one call for all
rows), over SmolLM2's head shapes and caches of several lengths.

    .venv/bin/python scripts/bench_attention.py [--threads 2] [--repeat 300] [--kv-type q8]

Each call reads another of 30 caches (one per layer), so the keys come from memory as in a
real decode step, not from a warm cache. Prints microseconds per layer. With --kv-type the
native kernel reads the cache stored as that type (torch reads the same rows in fp32).
"""

from __future__ import annotations

import argparse
import sys
import time

HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64  # SmolLM2-135M
LAYERS = 30


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=300)
    parser.add_argument("--kv-type", default="f32", help="the native kernel's cache type")
    args = parser.parse_args(argv)

    import torch
    import torch.nn.functional as F

    from miniapp.engine.kv import codec as kv_codec
    from miniapp.engine.kv.types import kv_type
    from miniapp.engine.platform.kernels import cpu_attention_kernel

    torch.set_num_threads(args.threads)
    native = cpu_attention_kernel()
    if native is None:
        print("the native library is not in use here (see `miniapp doctor`)")
        return 1

    def timed(step) -> float:
        for layer in range(20):
            step(layer % LAYERS)
        start = time.perf_counter()
        for i in range(args.repeat):
            step(i % LAYERS)
        return (time.perf_counter() - start) / args.repeat * 1e6

    kind = kv_type(args.kv_type)
    codes = (kind.key.code, kind.value.code)
    print(f"native kernel over a {kind.name} cache")
    print("keys  rows  torch us  native us  speed-up")
    for tokens in (300, 1000, 3000):
        keys = [torch.randn(1, KV_HEADS, tokens, HEAD_DIM) for _ in range(LAYERS)]
        values = [torch.randn(1, KV_HEADS, tokens, HEAD_DIM) for _ in range(LAYERS)]
        stored_keys = [kv_codec.encode(kind.key, k)[0].contiguous() for k in keys]
        stored_values = [kv_codec.encode(kind.value, v)[0].contiguous() for v in values]
        for rows in (1, 2, 8):
            queries = torch.randn(1, HEADS, rows, HEAD_DIM)
            by_row = queries[0].transpose(0, 1).contiguous()
            lengths = torch.arange(tokens - rows + 1, tokens + 1)

            def torch_rows(layer, q=queries, rows=rows, tokens=tokens, keys=keys, values=values):
                for r in range(rows):
                    seen = tokens - rows + r + 1
                    F.scaled_dot_product_attention(
                        q[:, :, r : r + 1],
                        keys[layer][:, :, :seen],
                        values[layer][:, :, :seen],
                        enable_gqa=True,
                        scale=HEAD_DIM**-0.5,
                    )

            def native_rows(layer, q=by_row, lengths=lengths, k=stored_keys, v=stored_values):
                native(q, k[layer], v[layer], HEAD_DIM**-0.5, lengths=lengths, kv_type=codes)

            ours, theirs = timed(native_rows), timed(torch_rows)
            print(f"{tokens:5d} {rows:5d} {theirs:9.1f} {ours:10.1f} {theirs / ours:8.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
