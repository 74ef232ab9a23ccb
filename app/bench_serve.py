"""`miniapp bench serve`: many clients at once on our batching engine, then on llama-server
(llama.cpp's own HTTP server) with the same GGUF, threads, prompts and answer length:
aggregate tok/s, TTFT and inter-token latency percentiles, peak RSS, and whether every greedy
answer equals the same prompt's answer from a lone client of the same engine.

Our engine runs in a worker process of its own (`--worker`), so its peak RSS is its own;
llama-server's is its process's. llama-server is a benchmark dependency, built by
`make llama-server`; `--backend torch` measures our engine alone, `--backend llamacpp`
llama-server alone.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path

from miniapp.assets import chat_prompts, sample_texts
from miniapp.engine.api import (
    DEFAULT_KV_TYPE,
    GGUFFile,
    MiniappError,
    Tokenizer,
    check_supported,
    default_threads,
    resolve_model,
)

from .bench import user_prompts
from .worker_process import EXIT_USAGE, exit_description

SERVE_CTX = 2048
LONG_PROMPT_CHARS = 1600  # about 350 tokens of a sample text
LLAMA_SERVER_ENV = "MINIAPP_LLAMA_SERVER"
# Where `make llama-server` puts it, in this checkout.
BUILT_LLAMA_SERVER = Path(__file__).resolve().parent.parent / "build/llama-server/bin/llama-server"
HOW_TO_GET_LLAMA_SERVER = (
    f"run `make llama-server` (or set {LLAMA_SERVER_ENV}), or pass --backend torch"
)
# --backend for bench serve: both engines by default; llama.cpp's side is llama-server.
MEASURED = {None: ("torch", "llama-server"), "torch": ("torch",), "llamacpp": ("llama-server",)}


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


def find_llama_server(
    environ: Mapping[str, str] = os.environ, built: Path = BUILT_LLAMA_SERVER
) -> Path:
    """$MINIAPP_LLAMA_SERVER, else `make llama-server`'s output, else llama-server on PATH.
    A path set in the environment is the one wanted: a missing one is an error, not a
    reason to measure some other llama-server."""
    configured = environ.get(LLAMA_SERVER_ENV)
    if configured:
        if _executable(Path(configured)):
            return Path(configured)
        raise MiniappError(
            f"llama-server not found at {LLAMA_SERVER_ENV}={configured}: point it at one "
            "(`make llama-server` builds one), or pass --backend torch"
        )
    if _executable(built):
        return built
    on_path = shutil.which("llama-server", path=environ.get("PATH", os.defpath))
    if on_path:
        return Path(on_path)
    raise MiniappError(f"llama-server not found: {HOW_TO_GET_LLAMA_SERVER}")


def _executable(path: Path) -> bool:
    return path.is_file() and os.access(path, os.X_OK)


def run_bench_serve(args: argparse.Namespace) -> int:
    model = resolve_model(args.model)
    check_supported(GGUFFile(model))
    clients = _client_counts(args.clients)
    measured = MEASURED[args.backend]
    if args.kv_type and "torch" not in measured:
        raise MiniappError(
            "--kv-type applies to our engine here: llama-server keeps its own KV cache (f16); "
            "pass --backend torch, or leave --backend out"
        )
    # Before the torch run: a missing server should not cost minutes of measuring first.
    server_binary = find_llama_server() if "llama-server" in measured else None
    prompts = serve_prompts(model, Tokenizer(model))
    ctx, threads = args.ctx or SERVE_CTX, args.threads or default_threads()
    report: dict = {}
    extras: dict = {"ctx": ctx, "threads": threads}
    if "torch" in measured:
        worker = _measure_torch(model, prompts, clients, args, ctx, threads)
        report["torch"] = worker["results"]
        extras["kv_type"] = worker["kv_type"]
        extras["kv_bytes_per_token"] = worker["kv_bytes_per_token"]
        if args.http:
            report["torch-http"] = _measure_api(
                model, prompts, clients, args, ctx, threads, worker["kv_type"]
            )
    if server_binary is not None:
        report["llama-server"], server_extras = _measure_llama_server(
            server_binary, model, prompts, clients, args, ctx, threads
        )
        extras.update(server_extras)
    report["identical_output"] = all(
        row["identical_output"] for rows in report.values() for row in rows.values()
    )
    report.update(extras)
    if args.json:
        print(json.dumps(report))
    else:
        _print_table(report, args)
    return 0


def _measure_torch(
    model: Path,
    prompts: list[list[int]],
    clients: list[int],
    args: argparse.Namespace,
    ctx: int,
    threads: int,
) -> dict:
    """Our engine's figures, from a worker process (its peak RSS is the engine's own)."""
    with tempfile.TemporaryDirectory(prefix="miniapp-bench-serve-") as tmp:
        prompts_path = Path(tmp) / "prompts.json"
        prompts_path.write_text(json.dumps(prompts))
        command = [
            sys.executable,
            "-m",
            "miniapp.app.bench_serve",
            "--worker",
            "--model",
            str(model),
            "--prompts",
            str(prompts_path),
            "--clients",
            ",".join(map(str, clients)),
            "--requests",
            str(args.requests),
            "--tokens",
            str(args.tokens),
            "--ctx",
            str(ctx),
            "--threads",
            str(threads),
            "--kv-type",
            args.kv_type or DEFAULT_KV_TYPE,
        ]
        done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        cause = done.stderr.strip().splitlines()[-1:] or [exit_description(done.returncode)]
        raise MiniappError(f"the serving benchmark failed: {cause[0]}")
    return json.loads(done.stdout)


def _measure_api(
    model: Path,
    prompts: list[list[int]],
    clients: list[int],
    args: argparse.Namespace,
    ctx: int,
    threads: int,
    kv: str,
) -> dict:
    """Our engine through `miniapp serve` (a process of its own per client count)."""
    from miniapp.engine.evaluation.api_server_bench import ApiServerBench

    bench = ApiServerBench(model, prompts, args.tokens, ctx, threads, kv)
    bench.lone_answers()
    return {str(n): bench.run(n, args.requests).to_dict() for n in clients}


def _measure_llama_server(
    binary: Path,
    model: Path,
    prompts: list[list[int]],
    clients: list[int],
    args: argparse.Namespace,
    ctx: int,
    threads: int,
) -> tuple[dict, dict]:
    """llama-server's figures, one server per client count, and how it was run."""
    from miniapp.engine.evaluation.llama_server_bench import (
        LlamaServerBench,
        LlamaServerExited,
        llama_server_version,
    )

    bench = LlamaServerBench(binary, model, prompts, args.tokens, ctx, threads)
    try:
        bench.lone_answers()
        results = {str(n): bench.run(n, args.requests).to_dict() for n in clients}
    except LlamaServerExited as exc:
        how = exit_description(exc.returncode)
        message = f"llama-server stopped ({how}) while {exc.doing}: {exc.last_line}"
        raise MiniappError(message) from None
    command = bench.commands[clients[-1]]
    extras = {
        "llama_server_version": llama_server_version(binary),
        "llama_server_command": " ".join(command),
    }
    return results, extras


def _client_counts(text: str) -> list[int]:
    try:
        counts = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError:
        counts = []
    if not counts or counts[0] < 1:
        raise MiniappError(f"--clients {text!r}: give client counts like 1,2,4,8")
    return counts


ENGINE_TITLES = {
    "torch": "torch engine",
    "torch-http": "torch engine through miniapp serve",
    "llama-server": "llama-server",
}


def _print_table(report: dict, args: argparse.Namespace) -> None:
    print(
        f"{args.requests} requests per client, {args.tokens} tokens each, "
        f"{report['threads']} threads, {report['ctx']} tokens of context a client"
    )
    for engine, title in ENGINE_TITLES.items():
        if engine in report:
            _print_rows(title, report[engine])
    if "torch" in report and "llama-server" in report:
        _print_comparison(report["torch"], report["llama-server"])
    if "torch-http" in report:
        _print_http_cost(report["torch"], report["torch-http"], report.get("llama-server"))
    if "kv_bytes_per_token" in report:
        per_token = report["kv_bytes_per_token"]
        print(
            f"torch KV cache per sequence ({report['kv_type']}): {per_token / 1024:.1f} KiB a "
            f"token, {per_token * report['ctx'] / 2**20:.0f} MiB at {report['ctx']} "
            "tokens"
        )
    if "llama_server_command" in report:
        print(f"llama-server ({report['llama_server_version']}): {report['llama_server_command']}")
    print(f"every greedy answer equals its lone-client answer: {report['identical_output']}")


def _print_rows(title: str, rows: dict) -> None:
    print(title)
    print("clients  aggregate tok/s  TTFT p50/p99 (s)  ITL p50/p99 (ms)  peak RSS (MB)  same")
    base = rows.get("1", {}).get("aggregate_tok_s")
    for count, r in rows.items():
        ratio = f" ({r['aggregate_tok_s'] / base:.2f}x)" if base else ""
        same = "yes" if r["identical_output"] else "NO"
        print(
            f"{count:>7}  {r['aggregate_tok_s']:8.1f}{ratio:9}  "
            f"{r['ttft_p50_s']:.2f} / {r['ttft_p99_s']:.2f}      "
            f"{r['itl_p50_s'] * 1000:5.1f} / {r['itl_p99_s'] * 1000:5.1f}     "
            f"{r['peak_rss_mb']:8.0f}      {same}"
        )


def _print_comparison(torch_rows: dict, server_rows: dict) -> None:
    print("torch vs llama-server")
    print("clients  aggregate tok/s ratio  ITL p99 torch / llama-server (ms)")
    for count, ours in torch_rows.items():
        theirs = server_rows[count]
        ratio = ours["aggregate_tok_s"] / max(theirs["aggregate_tok_s"], 1e-9)
        print(
            f"{count:>7}  {ratio:20.2f}x  "
            f"{ours['itl_p99_s'] * 1000:7.1f} / {theirs['itl_p99_s'] * 1000:.1f}"
        )


def _print_http_cost(inside: dict, http: dict, server: dict | None) -> None:
    print("miniapp serve vs in-process" + (" (and llama-server's TTFT)" if server else ""))
    print(
        "clients  aggregate tok/s HTTP / in-process  TTFT p50/p99 (s) HTTP"
        + ("  llama-server" if server else "")
    )
    for count, ours in http.items():
        ratio = ours["aggregate_tok_s"] / max(inside[count]["aggregate_tok_s"], 1e-9)
        line = f"{count:>7}  {ratio:33.3f}x  {ours['ttft_p50_s']:.2f} / {ours['ttft_p99_s']:.2f}"
        if server:
            theirs = server[count]
            line += f"         {theirs['ttft_p50_s']:.2f} / {theirs['ttft_p99_s']:.2f}"
        print(line)


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
    parser.add_argument("--kv-type", default=DEFAULT_KV_TYPE)
    args = parser.parse_args(argv)
    from miniapp.engine.evaluation.serving import ServingBench

    try:
        bench = ServingBench(
            args.model,
            json.loads(args.prompts.read_text()),
            args.tokens,
            args.ctx,
            args.threads,
            kv=args.kv_type,
        )
    except MiniappError as exc:
        print(exc, file=sys.stderr)
        return EXIT_USAGE
    bench.lone_answers()
    results = {str(n): bench.run(n, args.requests).to_dict() for n in _client_counts(args.clients)}
    print(
        json.dumps(
            {
                "results": results,
                "kv_type": bench.kv_type.name,
                "kv_bytes_per_token": bench.kv_bytes_per_token,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(_worker(sys.argv[1:]))
