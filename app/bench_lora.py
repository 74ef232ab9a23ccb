"""`miniapp bench lora`: what a LoRA adapter costs our engine, beside llama.cpp's cost for the
same adapter on the same file and threads (engine/evaluation/lora_bench.py measures)."""

from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path

from miniapp.engine.api import GGUFFile, check_supported, default_threads, resolve_model
from miniapp.engine.evaluation.lora_bench import bench_lora


def run_bench_lora(args: argparse.Namespace) -> int:
    model = Path(resolve_model(args.model))
    check_supported(GGUFFile(model))  # a bad file is one line before anything runs
    clients = int(str(args.clients).split(",")[-1])
    threads = args.threads or default_threads()
    result = bench_lora(
        model,
        rank=args.lora_rank,
        threads=threads,
        tokens=args.tokens,
        repeat=args.repeat,
        clients=clients,
        adapters=args.adapters,
    )
    if args.json:
        print(json.dumps({**result.to_dict(), "threads": threads, "cpu": _cpu()}))
        return 0
    cost, llama_cost = result.decode_cost, result.llamacpp_cost
    print(
        f"{result.model}: one rank-{result.rank} adapter on every projection (f16, "
        f"{result.adapter_mb:.1f} MB), {threads} threads, {_cpu()}"
    )
    print(f"  load            {result.load_ms:8.1f} ms (median of 5)")
    print(
        f"  decode, base    {result.base_tok_s:8.1f} tok/s    llama.cpp "
        f"{result.llamacpp_base_tok_s or 0:8.1f}"
    )
    print(
        f"  decode, adapter {result.adapted_tok_s:8.1f} tok/s    llama.cpp "
        f"{result.llamacpp_adapted_tok_s or 0:8.1f}"
    )
    llama = "" if llama_cost is None else f"   llama.cpp +{llama_cost:.1%}"
    print(f"  cost a token    +{cost:.1%}{llama}")
    print(f"  {result.clients} clients on the base        {result.batch_base_tok_s:8.1f} tok/s")
    print(
        f"  {result.clients} clients on {result.adapters} adapters    "
        f"{result.batch_mixed_tok_s:8.1f} tok/s ({result.mixed_ratio:.2f}x the base); "
        f"every answer equals its lone run: {result.identical}"
    )
    return 0


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"
