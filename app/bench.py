"""`miniapp bench`: our torch engine and llama.cpp on the same GGUF, prompt and threads.

Each backend runs in its own subprocess, one after the other, so their peak RSS figures are
their own and neither warms the other's caches.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from miniapp.assets import sample_texts
from miniapp.engine.errors import MiniappError
from miniapp.engine.gguf_file import GGUFFile
from miniapp.engine.model_store import resolve_model
from miniapp.engine.models import check_supported
from miniapp.engine.tokenizer import Tokenizer

from .bench_worker import EXIT_USAGE
from .evaluate import read_text

BACKENDS = ("torch", "llamacpp")
CTX_ROUNDING = 256


def bench_prompt(tokenizer: Tokenizer, n_tokens: int | None, prompt_file: str | None) -> list[int]:
    if prompt_file:
        tokens = tokenizer.encode(read_text(prompt_file), parse_special=False)
        if not tokens:
            raise MiniappError(f"{prompt_file}: no tokens in prompt file")
        return tokens
    corpus = "\n\n".join(sample_texts())
    tokens = tokenizer.encode(corpus, parse_special=False)
    while len(tokens) < n_tokens:
        tokens += tokens
    return tokens[:n_tokens]


def run_bench(args: argparse.Namespace) -> int:
    model = resolve_model(args.model)
    check_supported(GGUFFile(model))  # report a bad file before any subprocess starts
    tokenizer = Tokenizer(model)
    prompt = bench_prompt(tokenizer, args.prompt_tokens, args.prompt_file)
    needed = len(prompt) + args.tokens + 16
    ctx = args.ctx or -(-needed // CTX_ROUNDING) * CTX_ROUNDING
    if ctx < needed:
        raise MiniappError(f"--ctx {ctx} is too small for {len(prompt)} + {args.tokens} tokens")
    results = {}
    with tempfile.TemporaryDirectory(prefix="miniapp-bench-") as tmp:
        prompt_path = Path(tmp) / "prompt.json"
        prompt_path.write_text(json.dumps(prompt))
        for backend in BACKENDS:
            if not args.json and sys.stderr.isatty():
                print(f"running {backend}...", file=sys.stderr, flush=True)
            results[backend] = _run_worker(backend, model, prompt_path, ctx, args)
    ratio = results["torch"]["decode_tok_s"] / max(results["llamacpp"]["decode_tok_s"], 1e-9)
    results["torch"]["decode_vs_llamacpp"] = ratio
    if args.json:
        print(json.dumps(results))
    else:
        _print_table(model, results)
    return 0


def _run_worker(backend: str, model: Path, prompt_path: Path, ctx: int, args) -> dict:
    command = [
        sys.executable, "-m", "miniapp.app.bench_worker",
        "--backend", backend, "--model", str(model), "--prompt", str(prompt_path),
        "--tokens", str(args.tokens), "--ctx", str(ctx), "--runs", str(args.repeat),
    ]  # fmt: skip
    if args.threads:
        command += ["--threads", str(args.threads)]
    done = subprocess.run(command, capture_output=True, text=True)
    last = (done.stderr.strip().splitlines() or ["no output"])[-1]
    if done.returncode == EXIT_USAGE:  # the worker's own one-line error
        raise MiniappError(last)
    if done.returncode != 0:
        raise MiniappError(f"{backend} benchmark failed: {last}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _print_table(model: Path, results: dict) -> None:
    torch_r, llama_r = results["torch"], results["llamacpp"]
    print(
        f"{model.name}: prompt {torch_r['prompt_tokens']} tok, generate "
        f"{torch_r['generated_tokens']} tok, threads {torch_r['threads'] or 'all'}, "
        f"ctx {torch_r['ctx']}, median of {torch_r['runs']} runs"
    )
    rows = [
        ("prefill tok/s", "prefill_tok_s", 1.0, "{:.1f}"),
        ("TTFT ms", "ttft_s", 1000.0, "{:.1f}"),
        ("decode tok/s", "decode_tok_s", 1.0, "{:.1f}"),
        ("peak RSS MB", "peak_rss_mb", 1.0, "{:.0f}"),
    ]
    print(f"{'':16}{'torch':>12}{'llamacpp':>12}{'ratio':>10}")
    for label, key, scale, fmt in rows:
        ours, theirs = torch_r[key] * scale, llama_r[key] * scale
        ratio = ours / theirs if theirs else float("nan")
        print(f"{label:16}{fmt.format(ours):>12}{fmt.format(theirs):>12}{ratio:>10.2f}")
