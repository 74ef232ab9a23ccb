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
import time
from pathlib import Path

from miniapp.assets import chat_prompts, sample_texts
from miniapp.engine.api import (
    REMOTE_BACKEND,
    ChatTemplate,
    GGUFFile,
    Message,
    MiniappError,
    Tokenizer,
    check_supported,
    installed_models,
    resolve_model,
)

from .evaluate import read_text
from .worker_process import WorkerProcess, worker_arguments

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


TASK_TEXTS = 4  # summarize / quote: one prompt per sample text, this many texts
TASK_TEXT_CHARS = 2200  # about 500 tokens of a sample text
CHAT_QUESTIONS = 8
TASK_ASKS = {
    "summarize": "Summarize the text above.",
    "quote": "Repeat the text above word for word.",
}


def task_questions(task: str) -> list[str]:
    """The user messages of a task: input-grounded (summarize, quote) or open chat."""
    if task == "chat":
        return chat_prompts()[:CHAT_QUESTIONS]
    texts = [t[:TASK_TEXT_CHARS] for t in sample_texts()[:TASK_TEXTS]]
    return [f"{text}\n\n{TASK_ASKS[task]}" for text in texts]


def task_prompts(model: Path, tokenizer: Tokenizer, task: str) -> list[list[int]]:
    """Chat-templated prompts for a task, in the model's own template."""
    return user_prompts(model, tokenizer, task_questions(task))


def user_prompts(model: Path, tokenizer: Tokenizer, messages: list[str]) -> list[list[int]]:
    """Each message as the first user turn of a chat, in the model's own template."""
    gguf = GGUFFile(model)
    template = ChatTemplate.for_model(
        gguf.metadata.get("tokenizer.chat_template"), tokenizer, gguf.architecture
    )
    return [tokenizer.encode_chat(template.render([Message("user", m)])) for m in messages]


def run_bench(args: argparse.Namespace) -> int:
    if args.backend == REMOTE_BACKEND:
        from .bench_remote import run_remote_bench

        return run_remote_bench(args)
    if getattr(args, "models", None):
        return run_models_bench(args)
    model = resolve_model(args.model)
    check_supported(GGUFFile(model))  # report a bad file before any subprocess starts
    results = _bench_model(model, args)
    if args.json:
        print(json.dumps(results))
    else:
        _print_table(model, results)
    return 0


def _bench_model(model: Path, args: argparse.Namespace) -> dict:
    """Our engine and llama.cpp on one model, side by side (with speculation: plain decoding
    beside it too); the results of each, as JSON-ready dicts."""
    tokenizer = Tokenizer(model)
    if args.task:
        prompts = task_prompts(model, tokenizer, args.task)
    else:
        prompts = [bench_prompt(tokenizer, args.prompt_tokens, args.prompt_file)]
    longest = max(len(p) for p in prompts)
    needed = -(-(longest + args.tokens + 16) // CTX_ROUNDING) * CTX_ROUNDING
    # Our engine streams through a --ctx smaller than the run (sliding window); llama.cpp's
    # Python binding cannot, so it gets a context large enough for the whole run.
    contexts = {"torch": args.ctx or needed, "llamacpp": max(args.ctx or needed, needed)}
    if contexts["torch"] <= longest:
        raise MiniappError(f"--ctx {args.ctx} does not leave room after {longest} prompt tokens")
    spec = args.spec or "auto"
    # With speculation on, plain decoding runs beside it: the speed-up is measured, and the
    # greedy output must be the same.
    variants = (
        {"torch": ("torch", "off")}
        if spec == "off"
        else {
            "plain": ("torch", "off"),
            "spec": ("torch", spec),
        }
    )
    variants["llamacpp"] = ("llamacpp", "off")
    with tempfile.TemporaryDirectory(prefix="miniapp-bench-") as tmp:
        prompts_path = Path(tmp) / "prompts.json"
        prompts_path.write_text(json.dumps(prompts))
        # One at a time: a load timed while another process loads is not its own.
        workers = {}
        try:
            for name, (backend, spec_mode) in variants.items():
                workers[name] = _start_worker(
                    backend, model, prompts_path, contexts[backend], args, spec_mode
                )
                workers[name].wait_ready()
            # Alternate single runs so every variant sees the same machine conditions, and
            # judge speed by the median of back-to-back pairs.
            speeds: dict[str, list[float]] = {name: [] for name in workers}
            digests: dict[str, list[str]] = {name: [] for name in workers}
            for run in range(args.repeat):
                for name, worker in workers.items():
                    if not args.json and sys.stderr.isatty():
                        print(f"run {run + 1}/{args.repeat}: {name}", file=sys.stderr)
                    speed, digest = worker.run()
                    speeds[name].append(speed)
                    digests[name].append(digest)
            results = {name: json.loads(w.ask("result")) for name, w in workers.items()}
        finally:
            for worker in workers.values():
                worker.stop()
    ours = "torch" if spec == "off" else "spec"
    results["torch"] = results[ours]
    results["torch"]["decode_vs_llamacpp"] = _pair_ratio(speeds[ours], speeds["llamacpp"])
    if spec != "off":
        results["spec_vs_plain"] = _pair_ratio(speeds["spec"], speeds["plain"])
        results["spec_vs_plain_worst"] = _pair_ratio(speeds["spec"], speeds["plain"], min)
        results["identical_output"] = digests["spec"] == digests["plain"]
    return results


def run_models_bench(args: argparse.Namespace) -> int:
    """`bench --models`: the side-by-side table for several models in one run (plain
    decoding), each beside its bandwidth floor: the weights a decode step reads divided by
    the read bandwidth measured here first."""
    names = [name.strip() for name in args.models.split(",") if name.strip()]
    names = [
        each
        for name in names
        for each in ([str(p) for _, p in installed_models()] if name == "installed" else [name])
    ]
    models = [resolve_model(name) for name in names]
    for model in models:
        check_supported(GGUFFile(model))
    # In its own process: a gigabyte touched here would count in every worker's peak RSS
    # (a forked child starts with its parent's).
    bandwidth = float(
        subprocess.run(
            [
                sys.executable,
                "-c",
                f"from miniapp.app.bench import read_bandwidth as r; print(r({args.threads or 0}))",
            ],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    )
    args.spec = "off"
    rows = []
    for model in models:
        results = _bench_model(model, args)
        ours, theirs = results["torch"], results["llamacpp"]
        file_bytes = step_file_bytes(GGUFFile(model))
        rows.append(
            {
                "model": model.name,
                "torch": ours,
                "llamacpp": theirs,
                "file_bytes_per_token": file_bytes,
                "read_gb_s": bandwidth / 1e9,
                "floor_tok_s": bandwidth / file_bytes,
            }
        )
    if args.json:
        print(json.dumps({"read_gb_s": bandwidth / 1e9, "models": rows}))
        return 0
    print(
        f"read bandwidth {bandwidth / 1e9:.1f} GB/s ({args.threads or 'all'} threads); tok/s "
        "ours / llama.cpp (ratio); floor = bandwidth / weight bytes a step reads"
    )
    header = (
        f"{'model':44}{'decode':>22}{'pairs':>7}{'floor':>7}{'% ours':>8}{'% l.cpp':>8}"
        f"{'prefill':>20}{'load s':>14}{'RSS MB':>13}{'MB/tok ours/file':>18}"
    )
    print(header)
    for row in rows:
        ours, theirs, floor = row["torch"], row["llamacpp"], row["floor_tok_s"]
        read = ours.get("weight_bytes_per_token") or 0
        share_ours = 100 * ours["decode_tok_s"] / floor
        share_theirs = 100 * theirs["decode_tok_s"] / floor
        print(
            f"{row['model'][:43]:44}"
            f"{_pair(ours['decode_tok_s'], theirs['decode_tok_s']):>22}"
            f"{ours['decode_vs_llamacpp']:>7.2f}{floor:>7.1f}"
            f"{share_ours:>7.0f}%{share_theirs:>7.0f}%"
            f"{_pair(ours['prefill_tok_s'], theirs['prefill_tok_s'], '{:.0f}'):>20}"
            f"{ours['load_s']:>7.2f}/{theirs['load_s']:<6.2f}"
            f"{ours['peak_rss_mb']:>6.0f}/{theirs['peak_rss_mb']:<6.0f}"
            f"{read / 1e6:>9.0f}/{row['file_bytes_per_token'] / 1e6:<8.0f}"
        )
    return 0


def _pair(ours: float, theirs: float, fmt: str = "{:.1f}") -> str:
    return f"{fmt.format(ours)}/{fmt.format(theirs)} ({ours / max(theirs, 1e-9):.2f})"


def step_file_bytes(gguf: GGUFFile) -> int:
    """The file's bytes of the weights a decode step reads: every tensor but the embedding
    table, which serves as the output head too where the file has no output.weight; of a
    mixture of experts' expert tensors, the share a token routes to (used of count)."""
    tied = "output.weight" not in gguf.tensors
    count, used = gguf.arch_value("expert_count") or 0, gguf.arch_value("expert_used_count") or 0
    total = 0
    for name, info in gguf.tensors.items():
        if name == "token_embd.weight" and not tied:
            continue
        routed = name.endswith("_exps.weight") and count > 0
        total += info.nbytes * used // count if routed else info.nbytes
    return total


def read_bandwidth(threads: int | None, gib: int = 1, repeats: int = 7) -> float:
    """Bytes a second a plain reduction reads from a buffer far larger than the caches
    (median). The maximum, not the sum: torch's fp32 sum tops out near 35 GB/s on 2 Zen 4
    threads, where the maximum (and our one-row decode kernel) read up to 58. This VM's
    bandwidth also swings between runs (32-58 GB/s for the maximum), so a floor is only as
    good as its run's probe."""
    import torch

    if threads:
        torch.set_num_threads(threads)
    buffer = torch.ones((gib << 30) // 4, dtype=torch.float32)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        buffer.amax()
        times.append(time.perf_counter() - start)
    return buffer.numel() * 4 / statistics.median(times)


def _pair_ratio(ours: list[float], theirs: list[float], summary=statistics.median) -> float:
    return summary(a / max(b, 1e-9) for a, b in zip(ours, theirs, strict=True))


def _start_worker(backend: str, model: Path, prompts: Path, ctx: int, args, spec: str):
    """A worker subprocess holding one loaded backend, with this run's flags."""
    arguments = worker_arguments(model, prompts, args.tokens, ctx, spec)
    if args.task:
        arguments.append("--stop-at-end-of-turn")
    if args.threads:
        arguments += ["--threads", str(args.threads)]
    # The yardstick keeps llama.cpp's own KV cache (f16) unless --llamacpp-kv-type says.
    kv = args.kv_type if backend == "torch" else getattr(args, "llamacpp_kv_type", None)
    if kv:  # else the backend's own default
        arguments += ["--kv-type", kv]
    if backend == "torch":
        arguments += ["--device", args.device]
        for flag in ("sinks", "window"):
            if getattr(args, flag) is not None:
                arguments += [f"--{flag}", str(getattr(args, flag))]
        if args.kv_policy is not None:
            arguments += ["--kv-policy", args.kv_policy]
    return WorkerProcess(backend, arguments)


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
    if "plain" in results:
        plain, spec = results["plain"], results["spec"]
        print(
            f"speculative ({spec['spec']}): {spec['decode_tok_s']:.1f} tok/s vs plain "
            f"{plain['decode_tok_s']:.1f} (pair ratio median {results['spec_vs_plain']:.2f}, "
            f"worst {results['spec_vs_plain_worst']:.2f}); "
            f"acceptance {spec['acceptance_rate']:.0%}, {spec['tokens_per_step']:.2f} tok/step; "
            f"output {'identical' if results['identical_output'] else 'DIFFERENT'}"
        )
        for name, (verifications, drafted, accepted) in spec.get("by_drafter", {}).items():
            share = accepted / drafted if drafted else 0.0
            print(
                f"  {name}: {verifications} verifications, {accepted}/{drafted} drafts "
                f"accepted ({share:.0%})"
            )
    for result in (torch_r, llama_r):
        first, last = result["first_quarter"], result["last_quarter"]
        kv = f", KV {result['kv_type']}" if result.get("kv_type") else ""
        print(
            f"{result['backend']} (ctx {result['ctx']}{kv}): first/last quarter of the tokens "
            f"{first['decode_tok_s']:.1f}/{last['decode_tok_s']:.1f} tok/s, "
            f"peak RSS {first['peak_rss_mb']:.0f}/{last['peak_rss_mb']:.0f} MB"
        )
