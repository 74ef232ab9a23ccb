"""`miniapp bench serve`: many clients at once on our batching engine (and, later, on
llama-server): aggregate tok/s, TTFT and inter-token latency percentiles, peak RSS, and
whether every greedy answer equals the same prompt's answer from a lone client.

Our engine runs in a worker process of its own (`--worker`), so its peak RSS is its own.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from miniapp.assets import chat_prompts, sample_texts
from miniapp.engine.errors import MiniappError
from miniapp.engine.gguf_file import GGUFFile
from miniapp.engine.model_store import resolve_model
from miniapp.engine.models import check_supported
from miniapp.engine.tokenizer import Tokenizer

from .bench import user_prompts
from .worker_process import EXIT_USAGE, exit_description

SERVE_CTX = 2048
LONG_PROMPT_CHARS = 1600  # about 350 tokens of a sample text


def serve_prompts(model: Path, tokenizer: Tokenizer) -> list[list[int]]:
    """Chat-templated prompts of mixed lengths: short questions, and requests about an
    excerpt of a sample text, alternating."""
    questions = chat_prompts()[:4]
    texts = [text[:LONG_PROMPT_CHARS] for text in sample_texts()[:4]]
    messages = []
    for question, text in zip(questions, texts, strict=False):
        messages.append(question)
        messages.append(f"{text}\n\nWhat is this text about?")
    return user_prompts(model, tokenizer, messages)


def run_bench_serve(args: argparse.Namespace) -> int:
    model = resolve_model(args.model)
    check_supported(GGUFFile(model))
    if args.backend not in (None, "torch"):
        raise MiniappError("bench serve measures --backend torch; llama-server comes next")
    clients = _client_counts(args.clients)
    prompts = serve_prompts(model, Tokenizer(model))
    with tempfile.TemporaryDirectory(prefix="miniapp-bench-serve-") as tmp:
        prompts_path = Path(tmp) / "prompts.json"
        prompts_path.write_text(json.dumps(prompts))
        command = [sys.executable, "-m", "miniapp.app.bench_serve", "--worker",
                   "--model", str(model), "--prompts", str(prompts_path),
                   "--clients", ",".join(map(str, clients)), "--requests", str(args.requests),
                   "--tokens", str(args.tokens), "--ctx", str(args.ctx or SERVE_CTX)]  # fmt: skip
        if args.threads:
            command += ["--threads", str(args.threads)]
        done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        cause = done.stderr.strip().splitlines()[-1:] or [exit_description(done.returncode)]
        raise MiniappError(f"the serving benchmark failed: {cause[0]}")
    measured = json.loads(done.stdout)
    torch_results = measured["results"]
    report = {
        "torch": torch_results,
        "identical_output": all(r["identical_output"] for r in torch_results.values()),
        "kv_bytes_per_token": measured["kv_bytes_per_token"],
        "ctx": args.ctx or SERVE_CTX,
    }
    if args.json:
        print(json.dumps(report))
    else:
        _print_table(report, args)
    return 0


def _client_counts(text: str) -> list[int]:
    try:
        counts = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError:
        counts = []
    if not counts or counts[0] < 1:
        raise MiniappError(f"--clients {text!r}: give client counts like 1,2,4,8")
    return counts


def _print_table(report: dict, args: argparse.Namespace) -> None:
    print(f"torch engine, {args.requests} requests per client, {args.tokens} tokens each")
    print("clients  aggregate tok/s  TTFT p50/p99 (s)  ITL p50/p99 (ms)  peak RSS (MB)  same")
    base = report["torch"].get("1", {}).get("aggregate_tok_s")
    for count, r in report["torch"].items():
        ratio = f" ({r['aggregate_tok_s'] / base:.2f}x)" if base else ""
        same = "yes" if r["identical_output"] else "NO"
        print(f"{count:>7}  {r['aggregate_tok_s']:8.1f}{ratio:9}  "
              f"{r['ttft_p50_s']:.2f} / {r['ttft_p99_s']:.2f}      "
              f"{r['itl_p50_s'] * 1000:5.1f} / {r['itl_p99_s'] * 1000:5.1f}     "
              f"{r['peak_rss_mb']:8.0f}      {same}")  # fmt: skip
    per_token = report["kv_bytes_per_token"]
    print(f"KV cache per sequence: {per_token / 1024:.0f} KiB a token, "
          f"{per_token * report['ctx'] / 2**20:.0f} MiB at {report['ctx']} tokens")  # fmt: skip
    print(f"every greedy answer equals its lone-client answer: {report['identical_output']}")


def _worker(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--model", required=True, type=Path)
    parser.add_argument("--prompts", required=True, type=Path)
    parser.add_argument("--clients", required=True)
    parser.add_argument("--requests", required=True, type=int)
    parser.add_argument("--tokens", required=True, type=int)
    parser.add_argument("--ctx", required=True, type=int)
    parser.add_argument("--threads", type=int)
    args = parser.parse_args(argv)
    from miniapp.engine.evaluation.serving import ServingBench

    try:
        bench = ServingBench(args.model, json.loads(args.prompts.read_text()), args.tokens,
                             args.ctx, args.threads)  # fmt: skip
    except MiniappError as exc:
        print(exc, file=sys.stderr)
        return EXIT_USAGE
    bench.lone_answers()
    results = {str(n): bench.run(n, args.requests).to_dict() for n in _client_counts(args.clients)}
    print(json.dumps({"results": results, "kv_bytes_per_token": bench.kv_bytes_per_token}))
    return 0


if __name__ == "__main__":
    sys.exit(_worker(sys.argv[1:]))
