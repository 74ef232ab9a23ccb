"""`miniapp bench moe`: a mixture-of-experts model's steps, what they read and cost
(engine/evaluation/moe_bench.py measures): decode steps of several sequences at once and a
verification's rows, each beside the bytes it reads and its bandwidth floor."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from miniapp.engine.api import (
    GGUFFile,
    MiniappError,
    check_supported,
    default_threads,
    resolve_model,
)
from miniapp.engine.evaluation.moe_bench import bench_moe

from .bench_lora import _cpu


def run_bench_moe(args: argparse.Namespace) -> int:
    model = Path(resolve_model(args.model))
    config = check_supported(GGUFFile(model))  # a bad file is one line before anything runs
    if config.experts is None:
        raise MiniappError(f"{model.name} is not a mixture of experts (no expert_count)")
    threads = args.threads or default_threads()
    # In its own process, as `bench --models` measures it: a gigabyte touched here would stay.
    probe = f"from miniapp.app.bench import read_bandwidth as r; print(r({threads}))"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    bandwidth = float(done.stdout)
    result = bench_moe(model, threads, bandwidth)
    if args.json:
        print(json.dumps({**result.to_dict(), "cpu": _cpu()}))
        return 0
    print(
        f"{result.model}: {result.used} of {result.experts} experts a token, {threads} threads, "
        f"{_cpu()}, read bandwidth {result.read_gb_s:.1f} GB/s"
    )
    print(
        "step             rows  ms/step   tok/s  x 1 row  experts/layer  MB read  "
        "MB ungrouped  floor ms  % of floor"
    )
    single = next(s for s in result.steps if s.kind == "decode" and s.rows == 1)
    for step in result.steps:
        print(
            f"{step.kind:16}{step.rows:5}{step.step_ms:9.1f}{step.tok_s:8.1f}"
            f"{step.tok_s / single.tok_s:8.2f}x{step.experts_per_layer:14.1f}"
            f"{step.bytes_per_step / 1e6:9.0f}{step.bytes_ungrouped / 1e6:14.0f}"
            f"{step.floor_ms:10.1f}{100 * step.floor_share:11.0f}%"
        )
    return 0
