"""`miniapp bench embeddings`: texts a second through `miniapp serve`'s /v1/embeddings beside
llama-server's on the same GGUF, threads and pooling (engine/evaluation/embedding_bench.py
measures), and how close the two servers' vectors are."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from miniapp.engine.api import GGUFFile, check_supported, default_threads, resolve_model
from miniapp.engine.evaluation.embedding_bench import compare_servers

from .bench_lora import _cpu
from .bench_serve import find_llama_server

BATCHES = [1, 16]  # texts a request: one at a time, and a RAG tool's indexing batch
TEXTS = 64
CTX = 512  # every sample text fits (160 words at most)


def run_bench_embeddings(args: argparse.Namespace) -> int:
    model = Path(resolve_model(args.model))
    check_supported(GGUFFile(model))  # a bad file is one line before anything starts
    binary = find_llama_server()
    threads = args.threads or default_threads()
    pooling = getattr(args, "pooling", None) or "mean"
    report = compare_servers(
        binary, model, threads, CTX, pooling, BATCHES, TEXTS, min(args.repeat, 5)
    )
    report |= {"model": model.name, "cpu": _cpu()}
    if args.json:
        print(json.dumps(report))
        return 0
    print(
        f"{model.name}: {TEXTS} texts, {pooling} pooling, {threads} threads, {_cpu()}; "
        "medians of the passes"
    )
    print("texts/request   miniapp texts/s   llama-server texts/s   ratio")
    ours, theirs = report["runs"]["miniapp"], report["runs"]["llama-server"]
    for batch in map(str, BATCHES):
        mine, other = ours[batch]["texts_per_s"], theirs[batch]["texts_per_s"]
        print(f"{batch:>13}{mine:18.1f}{other:23.1f}{mine / other:8.2f}x")
    print(
        f"cosine, miniapp against llama-server: min {report['cosine_min']:.4f}, "
        f"median {report['cosine_median']:.4f}"
    )
    print(
        f"peak RSS: miniapp {report['miniapp_peak_rss_mb']:.0f} MB, llama-server "
        f"{report['llama-server_peak_rss_mb']:.0f} MB"
    )
    return 0
