"""`miniapp bench`: our torch engine and llama.cpp on the same GGUF, prompt and threads.

Each backend runs in its own subprocess, one after the other, so their peak RSS figures are
their own and neither warms the other's caches.
"""

from __future__ import annotations

import argparse
import json
import statistics
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
    needed = -(-(len(prompt) + args.tokens + 16) // CTX_ROUNDING) * CTX_ROUNDING
    # Our engine streams through a --ctx smaller than the run (sliding window); llama.cpp's
    # Python binding cannot, so it gets a context large enough for the whole run.
    contexts = {"torch": args.ctx or needed, "llamacpp": max(args.ctx or needed, needed)}
    if contexts["torch"] <= len(prompt):
        raise MiniappError(
            f"--ctx {args.ctx} does not leave room after {len(prompt)} prompt tokens"
        )
    with tempfile.TemporaryDirectory(prefix="miniapp-bench-") as tmp:
        prompt_path = Path(tmp) / "prompt.json"
        prompt_path.write_text(json.dumps(prompt))
        workers = {b: _Worker(b, model, prompt_path, contexts[b], args) for b in BACKENDS}
        try:
            for worker in workers.values():
                worker.wait_ready()
            # Alternate single runs so both backends see the same machine conditions, and
            # judge speed by the median of back-to-back pairs.
            pair_ratios = []
            for run in range(args.repeat):
                speeds = {}
                for backend, worker in workers.items():
                    if not args.json and sys.stderr.isatty():
                        print(f"run {run + 1}/{args.repeat}: {backend}", file=sys.stderr)
                    speeds[backend] = float(worker.ask("run", expect="done").split()[1])
                pair_ratios.append(speeds["torch"] / max(speeds["llamacpp"], 1e-9))
            results = {b: json.loads(w.ask("result")) for b, w in workers.items()}
        finally:
            for worker in workers.values():
                worker.stop()
    results["torch"]["decode_vs_llamacpp"] = statistics.median(pair_ratios)
    if args.json:
        print(json.dumps(results))
    else:
        _print_table(model, results)
    return 0


class _Worker:
    """A `bench_worker` subprocess holding one loaded backend."""

    def __init__(self, backend: str, model: Path, prompt_path: Path, ctx: int, args):
        self.backend = backend
        command = [
            sys.executable, "-m", "miniapp.app.bench_worker",
            "--backend", backend, "--model", str(model), "--prompt", str(prompt_path),
            "--tokens", str(args.tokens), "--ctx", str(ctx),
        ]  # fmt: skip
        if args.threads:
            command += ["--threads", str(args.threads)]
        if backend == "torch":
            for flag in ("sinks", "window"):
                if getattr(args, flag) is not None:
                    command += [f"--{flag}", str(getattr(args, flag))]
        self._stderr = tempfile.TemporaryFile(mode="w+")
        self._process = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr,
            text=True,
        )  # fmt: skip

    def wait_ready(self) -> None:
        self._read(expect="ready")

    def ask(self, command: str, expect: str | None = None) -> str:
        self._process.stdin.write(command + "\n")
        self._process.stdin.flush()
        return self._read(expect)

    def _read(self, expect: str | None = None) -> str:
        line = self._process.stdout.readline().strip()
        if not line or (expect and line.split()[0] != expect):
            self._fail()
        return line

    def _fail(self) -> None:
        code = self._process.wait()
        self._stderr.seek(0)
        last = (self._stderr.read().strip().splitlines() or ["no output"])[-1]
        if code == EXIT_USAGE:  # the worker's own one-line error
            raise MiniappError(last)
        raise MiniappError(f"{self.backend} benchmark failed: {last}")

    def stop(self) -> None:
        if self._process.poll() is None:
            self._process.kill()
        self._process.wait()
        self._stderr.close()


def _print_table(model: Path, results: dict) -> None:
    torch_r, llama_r = results["torch"], results["llamacpp"]
    print(
        f"{model.name}: prompt {torch_r['prompt_tokens']} tok, generate "
        f"{torch_r['generated_tokens']} tok, threads {torch_r['threads'] or 'all'}, "
        f"median of {torch_r['runs']} runs"
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
    print(f"decode speed ratio, median of back-to-back pairs: {torch_r['decode_vs_llamacpp']:.2f}")
    for result in (torch_r, llama_r):
        first, last = result["first_quarter"], result["last_quarter"]
        print(
            f"{result['backend']} (ctx {result['ctx']}): first/last quarter of the tokens "
            f"{first['decode_tok_s']:.1f}/{last['decode_tok_s']:.1f} tok/s, "
            f"peak RSS {first['peak_rss_mb']:.0f}/{last['peak_rss_mb']:.0f} MB"
        )
