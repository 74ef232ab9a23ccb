"""The torch engine on a GPU against the same engine on the CPU, in a few minutes.

For each GPU path (the int4 kernel with its step compiled and not, dequantized bf16 weights,
a model split between GPU and CPU) it measures, against the CPU run of the same file:
teacher-forced top-1 agreement and KL divergence, perplexity, and greedy decode tok/s with
speculation off and on, and with the decode step replayed as a graph and taken op by op.
For the int4 path it then measures serving: aggregate tok/s at 1, 4 and 16 sequences, the
TTFT of a 2,000-token prompt and the kernels a decode step launches, beside llama.cpp on the
same GPU where llama-cpp-python has a GPU backend. It ends with Markdown tables (paste them
into docs/BENCHMARKS.md) and writes the numbers as JSON.

    scripts/gpu_check.sh [--model PATH] [--tokens 128] [--runs 3] [--json FILE]

Without a GPU it still runs, on whatever `MINIAPP_SIMULATE_GPU` stands in (the test suite
does this to keep the script working); the numbers then say nothing about a GPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SAMPLE_TEXT = REPO / "assets" / "text" / "garden.txt"
AGREEMENT_CTX = 256
PPL_CTX = 256
QUOTE_ASK = "Quote the first two sentences of the text above exactly."
# The decode prompt stays well inside the 2048-token context: the random-weights model's
# byte-sized tokens made 1,500 characters 2,164 tokens, so its decode ran in a full, sliding
# cache and its phases were mostly prefill.
QUOTE_PROMPT_TOKENS = 512
SPLIT_SHARE = 0.5  # the split path gets room for about this share of the model's layers


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="GGUF (default: the bundled model, else random weights)")
    parser.add_argument("--tokens", type=int, default=128, help="tokens per decode run")
    parser.add_argument("--runs", type=int, default=3, help="decode runs per mode (median)")
    parser.add_argument("--threads", type=int, help="CPU threads (default: all)")
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument(
        "--path",
        action="append",
        dest="paths",
        help="only this GPU path (repeatable), e.g. 'gpu int4'",
    )
    parser.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="N",
        help="also profile N decode steps on the first GPU path",
    )
    args = parser.parse_args(argv)

    import torch

    from miniapp.engine.platform.devices import default_probe

    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="miniapp-gpu-check-") as tmp:
        model, model_note = _model(args.model, Path(tmp))
        probe = default_probe()
        print(_environment(torch, probe, model, model_note), flush=True)
        text = SAMPLE_TEXT.read_text()
        cpu = _open(model, args.threads, device="cpu")
        rows = [_measure("cpu", cpu, None, text, args)]
        serving: list[dict] = []
        profiled = False
        for name, path_probe, kv in _gpu_paths(probe, model, cpu.kv_type):
            if args.paths and name not in args.paths:
                continue
            try:
                loading = time.perf_counter()
                runtime = _open(model, args.threads, probe=path_probe, kv=kv)
                print(f"  {name}: loaded in {time.perf_counter() - loading:.1f} s", flush=True)
            except Exception as exc:  # a GPU path that cannot even load is a result too
                rows.append({"path": name, "error": f"{type(exc).__name__}: {exc}"})
                continue
            rows.append(_measure(name, runtime, cpu, text, args))
            _save(args.json, model_note, rows)  # a run cut short still leaves its numbers
            if args.profile and not profiled:
                print(_profile(runtime, _quote_prompt(runtime, text), args.profile), flush=True)
                profiled = True
            del runtime
            if name == "gpu int4":  # the path a user gets: how it serves, beside llama.cpp
                serving.append(_serving(model, args, path_probe))
                serving.append(_llama_cpp_serving(model, args))
                _save(args.json, model_note, rows, serving)
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    elapsed = time.perf_counter() - started
    print(_table(rows))
    if serving:
        print("\n" + _serving_table(serving))
    print(f"\n{elapsed:.0f} s in all")
    _save(args.json, model_note, rows, serving)
    return 0


def _save(
    path: str | None, model_note: str, rows: list[dict], serving: list[dict] | None = None
) -> None:
    if path:
        results = {"model": model_note, "rows": rows, "serving": serving or []}
        Path(path).write_text(json.dumps(results, indent=2))


# ------------------------------------------------------------------ what runs


def _model(arg: str | None, tmp: Path) -> tuple[Path, str]:
    from miniapp.engine.modelfile.store import DEFAULT_MODEL, bundled_path

    if arg:
        return Path(arg), Path(arg).name
    bundled = bundled_path(DEFAULT_MODEL)
    if bundled.exists():
        return bundled, bundled.name
    # A machine without the bundled model (it is too big to send to a lent GPU): the same
    # shapes with random weights, so kernel correctness and speed are still measured.
    sys.path.insert(0, str(REPO / "tests"))
    from tiny_gguf import TinyModel, write_tiny_model

    shapes = TinyModel(
        n_layers=30, dim=576, n_heads=9, n_kv_heads=3, head_dim=64, ffn_dim=1536, context=2048
    )
    path = write_tiny_model(tmp / "smollm2-shaped-random.gguf", shapes)
    return path, "random weights in SmolLM2-135M's shapes (Q4_1)"


def _open(model: Path, threads: int | None, device: str = "auto", probe=None, kv=None):
    from miniapp.engine.runtimes.torch_runtime import TorchRuntime

    return TorchRuntime(
        model, n_ctx=2048, threads=threads, spec="auto", device=device, probe=probe, kv=kv
    )


def _gpu_paths(probe, model: Path, kv_type):
    """The GPU paths to try, (name, probe, KV cache type or None for the default): the best
    one (a bf16 cache where it fits), the same uncompiled, over q8 rows (the CPU's default,
    where the GPU's is another) and over q4 keys in tiles (their own fixed-shape step), then
    the two fallbacks forced (the split one with room for about half the layers and their
    cache, as `kv_type`, the CPU's default, stores it)."""
    from miniapp.engine.kv.footprint import estimate_footprint
    from miniapp.engine.modelfile.gguf_file import GGUFFile
    from miniapp.engine.platform.devices import MIN_MARGIN_BYTES
    from miniapp.engine.runtimes.torch_runtime import plan_cache_and_device

    if not probe.gpus():
        print("no GPU visible: only the CPU is measured", flush=True)
        return []
    footprint = estimate_footprint(GGUFFile(model), 2048, kv_type)
    # The GPU's default cache (bf16 where it fits; a simulated GPU keeps the CPU's).
    default_kv, _ = plan_cache_and_device(GGUFFile(model), 2048, "auto", probe)
    split_free = MIN_MARGIN_BYTES + int(SPLIT_SHARE * (footprint.int4_bytes + footprint.kv_bytes))
    return [
        ("gpu int4", probe, None),
        ("gpu int4, uncompiled", ForcedProbe(probe, compiled=False), None),
        *([("gpu int4, q8 kv", probe, "q8")] if default_kv != kv_type else []),
        ("gpu int4, q4 kv", probe, "q4"),
        ("gpu bf16", ForcedProbe(probe, int4=False), None),
        ("gpu split", ForcedProbe(probe, free_bytes=split_free), None),
    ]


class ForcedProbe:
    """The real probe with its int4 kernel or its free memory overridden, to force a
    fallback path on a GPU that would not need it."""

    def __init__(
        self, inner, int4: bool = True, free_bytes: int | None = None, compiled: bool = True
    ):
        self.inner, self.int4, self.free_bytes = inner, int4, free_bytes
        self.compiled = compiled  # False: the step captured as written (the fusion's gain)

    def gpus(self):
        found = self.inner.gpus()
        if self.free_bytes is None:
            return found
        return [dataclasses.replace(g, free_bytes=self.free_bytes) for g in found]

    def check_int4(self, gpu):
        from miniapp.engine.platform.devices import KernelCheck

        if gpu is not None and not self.int4:
            return KernelCheck("int4 matmul", False, "switched off by gpu_check")
        return self.inner.check_int4(gpu)

    def versions(self):
        return self.inner.versions()

    def torch_device(self, plan):
        return self.inner.torch_device(plan)

    def watch(self, model, plan):
        self.inner.watch(model, plan)

    def step_runner(self, plan):
        from miniapp.engine.platform.graphs import uncompiled

        runner, note = self.inner.step_runner(plan)
        if self.compiled or runner is None:
            return runner, note
        return uncompiled(runner), f"{note} (compiling switched off by gpu_check)"


# ------------------------------------------------------------------ measuring


def _measure(name: str, runtime, reference, text: str, args) -> dict:
    from miniapp.engine.evaluation.perplexity import agreement, perplexity

    plan = runtime.device_plan
    row = {
        "path": name,
        "device": plan.device,
        "weights": plan.weights,
        "gpu_layers": plan.gpu_layers,
        "kv": getattr(runtime.kv_type, "name", str(runtime.kv_type)),
        "reason": plan.reason,
    }
    timer = _PhaseTimer(name)
    if reference is not None:
        agree = agreement(runtime, reference, text, AGREEMENT_CTX)
        row.update(top1=agree.top1_agreement, kl=agree.mean_kl, max_diff=agree.max_abs_logit_diff)
        timer.lap("agreement with the CPU")
    row["ppl"] = perplexity(runtime, text, PPL_CTX).ppl
    timer.lap("perplexity")
    prompt = _quote_prompt(runtime, text)
    for mode in ("off", "auto"):
        runtime.spec_mode = type(runtime.spec_mode)(mode)
        speeds, tokens = _decode_speeds(runtime, prompt, args.tokens, args.runs)
        row[f"tok_s_spec_{mode}"] = statistics.median(speeds)
        row[f"tokens_spec_{mode}"] = tokens
        timer.lap(f"decode, speculation {mode} ({row[f'tok_s_spec_{mode}']:.1f} tok/s)")
    row["spec_identical"] = row.pop("tokens_spec_off") == row.pop("tokens_spec_auto")
    # Each step queued only once the previous one's token is read: what the overlap of
    # the host's work with the GPU's gives (the same tokens either way).
    runtime.spec_mode = type(runtime.spec_mode)("off")
    scheduler = runtime.scheduler
    overlapping = scheduler.config
    scheduler.config = dataclasses.replace(overlapping, overlap_steps=False)
    speeds, _ = _decode_speeds(runtime, prompt, args.tokens, args.runs)
    scheduler.config = overlapping
    row["tok_s_one_after_another"] = statistics.median(speeds)
    timer.lap(f"decode, steps not overlapped ({row['tok_s_one_after_another']:.1f} tok/s)")
    row["decode_step"] = runtime.decode_step_note
    graphed = runtime.static_step
    runtime.runner.stop_graphs("eager steps (the check's comparison)")  # the same, step by step
    if graphed is not None:
        runtime.spec_mode = type(runtime.spec_mode)("off")
        speeds, tokens = _decode_speeds(runtime, prompt, args.tokens, args.runs)
        row["tok_s_eager_steps"] = statistics.median(speeds)
        row["graphs_captured"] = graphed.captured
        timer.lap(f"decode, eager steps ({row['tok_s_eager_steps']:.1f} tok/s)")
    print(f"  {name}: done", flush=True)
    return row


class _PhaseTimer:
    """Prints how long each phase of a path's measurement took (a slow phase on a new
    machine is a finding too)."""

    def __init__(self, path: str):
        self.path, self.last = path, time.perf_counter()

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        print(f"  {self.path}: {phase} {now - self.last:.1f} s", flush=True)
        self.last = now


def _quote_prompt(runtime, text: str) -> list[int]:
    from miniapp.engine.modelfile.template import ChatTemplate, Message

    template = ChatTemplate.for_model(
        runtime.chat_template, runtime.tokenizer, runtime.architecture
    )
    chars = 1500
    while True:
        rendered = template.render([Message("user", f"{text[:chars]}\n\n{QUOTE_ASK}")])
        prompt = runtime.tokenizer.encode_chat(rendered)
        if len(prompt) <= QUOTE_PROMPT_TOKENS or chars < 100:
            return prompt
        chars //= 2


def _decode_speeds(runtime, prompt: list[int], n_tokens: int, runs: int):
    """Decode tok/s of `runs` greedy runs from an empty cache (after one warm-up)."""
    from miniapp.engine.tokens.sampling import GREEDY

    speeds, tokens = [], []
    for run in range(runs + 1):
        runtime.reset()
        times, tokens = [], []
        generator = runtime.generate_tokens(prompt, GREEDY)
        try:
            for token in generator:
                times.append(time.perf_counter())
                tokens.append(token)
                if len(tokens) == n_tokens:
                    break
        finally:
            generator.close()
        if run and len(times) > 1:
            speeds.append((len(times) - 1) / (times[-1] - times[0]))
    return speeds or [0.0], tokens


def _profile(runtime, prompt: list[int], n_steps: int) -> str:
    """torch.profiler's table of `n_steps` greedy decode steps after the prompt and one
    step (left out), speculation off. `_measure` leaves the runtime taking ordinary steps,
    op by op, so every op shows by name (a graph's replay would show only its kernels)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from miniapp.engine.tokens.sampling import GREEDY

    runtime.spec_mode = type(runtime.spec_mode)("off")
    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    runtime.reset()
    generator = runtime.generate_tokens(prompt, GREEDY)
    try:
        next(generator)
        next(generator)
        with profile(activities=activities) as prof:
            started = time.perf_counter()
            for _ in range(n_steps):
                next(generator)
            elapsed = time.perf_counter() - started
    finally:
        generator.close()
    sort = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    table = prof.key_averages().table(sort_by=sort, row_limit=18, max_name_column_width=48)
    return f"profile of {n_steps} decode steps: {elapsed / n_steps * 1e3:.1f} ms a step\n{table}"


# ------------------------------------------------------------------ serving


BATCHES = (1, 4, 16)
TTFT_PROMPT_TOKENS = 2000
KERNEL_STEPS = 8  # decode steps profiled for the kernel count


def _serving(model: Path, args, probe) -> dict:
    """The GPU path as a server runs it: aggregate decode tok/s with 1, 4 and 16 sequences
    decoding together, the time to the first token of a 2,000-token prompt, and the kernels
    a decode step launches, counted by torch.profiler over graph replays."""
    from miniapp.engine.platform.graphs import BATCH_COMPILE_AFTER
    from miniapp.engine.runtimes.torch_runtime import TorchRuntime

    runtime = TorchRuntime(
        model,
        n_ctx=4096,
        threads=args.threads,
        spec="off",
        probe=probe,
        parallel=max(BATCHES),
    )
    vocab = runtime.tokenizer.n_vocab
    row: dict = {"engine": "miniapp (torch)", "decode_step": runtime.decode_step_note}
    for batch in BATCHES:
        prompts = [_random_prompt(vocab, 64, seed) for seed in range(batch)]
        # Past the steps after which a row count's step is compiled, which is not timed: a
        # server compiles each row count once.
        _together(runtime, prompts, BATCH_COMPILE_AFTER + 8)
        speeds = [_together(runtime, prompts, args.tokens) for _ in range(args.runs)]
        row[f"tok_s_batch_{batch}"] = statistics.median(speeds)
    long_prompt = _random_prompt(vocab, TTFT_PROMPT_TOKENS, seed=99)
    row["ttft_2000_s"] = statistics.median(
        _first_token_s(runtime, long_prompt) for _ in range(max(args.runs, 1))
    )
    row["kernels_per_step"] = _kernels_per_step(runtime, _random_prompt(vocab, 64, 7))
    print(f"  serving: {row}", flush=True)
    return row


def _random_prompt(vocab: int, n: int, seed: int) -> list[int]:
    import random

    rng = random.Random(seed)
    return [rng.randrange(10, min(vocab, 30000)) for _ in range(n)]


def _together(runtime, prompts: list[list[int]], n_tokens: int) -> float:
    """Aggregate tok/s of greedy answers to `prompts` decoding together, from the moment
    every answer has its first token (the prompts' prefill is not decoding)."""
    from miniapp.engine.tokens.sampling import GREEDY

    runtime.reset()
    streams = [runtime.generate_tokens(prompt, GREEDY) for prompt in prompts]
    try:
        for stream in streams:
            next(stream)
        started = time.perf_counter()
        for _ in range(n_tokens - 1):
            for stream in streams:
                next(stream)
        elapsed = time.perf_counter() - started
    finally:
        for stream in streams:
            stream.close()
    return len(prompts) * (n_tokens - 1) / elapsed


def _first_token_s(runtime, prompt: list[int]) -> float:
    from miniapp.engine.tokens.sampling import GREEDY

    runtime.reset()
    started = time.perf_counter()
    stream = runtime.generate_tokens(prompt, GREEDY)
    try:
        next(stream)
        return time.perf_counter() - started
    finally:
        stream.close()


def _kernels_per_step(runtime, prompt: list[int]) -> float | None:
    """GPU kernels (copies apart) a decode step launches, over KERNEL_STEPS steps; None
    without CUDA (a simulated GPU launches nothing)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from miniapp.engine.tokens.sampling import GREEDY

    if not torch.cuda.is_available():
        return None
    runtime.reset()
    stream = runtime.generate_tokens(prompt, GREEDY)
    try:
        for _ in range(4):  # past the prompt, into replayed steps
            next(stream)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(KERNEL_STEPS):
                next(stream)
            torch.cuda.synchronize()
    finally:
        stream.close()
    on_gpu = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    kernels = [e for e in on_gpu if not e.name.lower().startswith(("memcpy", "memset"))]
    return len(kernels) / KERNEL_STEPS


def _llama_cpp_serving(model: Path, args) -> dict:
    """llama.cpp on the same GPU and file, where llama-cpp-python was built with CUDA
    (`CMAKE_ARGS=-DGGML_CUDA=on pip install llama-cpp-python`): batch-1 decode and the
    2,000-token TTFT. Batches of 4 and 16 are llama-server's (`--parallel 16`), not run
    here."""
    row: dict = {"engine": "llama.cpp"}
    try:
        import llama_cpp
    except ImportError as exc:
        return row | {"error": f"llama-cpp-python missing: {exc}"}
    if not llama_cpp.llama_supports_gpu_offload():
        return row | {"error": "llama-cpp-python built without a GPU backend"}
    llm = llama_cpp.Llama(str(model), n_ctx=4096, n_gpu_layers=-1, verbose=False)
    vocab = llm.n_vocab()
    prompt = _random_prompt(vocab, 64, 0)
    speeds = []
    for _ in range(args.runs):
        llm.reset()
        times = []
        for _token in llm.generate(prompt, temp=0.0):
            times.append(time.perf_counter())
            if len(times) == args.tokens:
                break
        speeds.append((len(times) - 1) / (times[-1] - times[0]))
    row["tok_s_batch_1"] = statistics.median(speeds)
    ttfts = []
    for _ in range(max(args.runs, 1)):
        llm.reset()
        started = time.perf_counter()
        next(iter(llm.generate(_random_prompt(vocab, TTFT_PROMPT_TOKENS, 99), temp=0.0)))
        ttfts.append(time.perf_counter() - started)
    row["ttft_2000_s"] = statistics.median(ttfts)
    return row


def _serving_table(serving: list[dict]) -> str:
    head = "| engine | " + " | ".join(f"batch {b} tok/s" for b in BATCHES)
    head += " | TTFT 2,000 tok | kernels/step |"
    lines = [head, "|" + "---|" * (len(BATCHES) + 3)]
    for r in serving:
        if "error" in r:
            lines.append(f"| {r['engine']} | {r['error']} |" + " |" * (len(BATCHES) + 1))
            continue
        speeds = [r.get(f"tok_s_batch_{b}") for b in BATCHES]
        cells = [r["engine"], *("-" if v is None else f"{v:.1f}" for v in speeds)]
        cells.append(f"{r['ttft_2000_s'] * 1e3:.0f} ms" if "ttft_2000_s" in r else "-")
        kernels = r.get("kernels_per_step")
        cells.append("-" if kernels is None else f"{kernels:.0f}")
        lines.append("| " + " | ".join(cells) + " |")
    steps = [f"- {r['engine']}: {r['decode_step']}" for r in serving if r.get("decode_step")]
    return "\n".join(lines + steps)


# ------------------------------------------------------------------ reporting


def _environment(torch, probe, model: Path, model_note: str) -> str:
    lines = [
        f"torch {torch.__version__}, CUDA {torch.version.cuda}, HIP {torch.version.hip}",
        f"model: {model_note}",
    ]
    for gpu in probe.gpus():
        kernel = probe.check_int4(gpu)
        state = "OK" if kernel.ok else "missing"
        lines.append(
            f"{gpu.label}: {gpu.name}, {gpu.total_bytes / 2**30:.0f} GiB, "
            f"int4 kernel {state} ({kernel.reason})"
        )
    return "\n".join(lines)


def _table(rows: list[dict]) -> str:
    head = (
        "| path | device, weights, GPU layers, KV | top-1 vs CPU | KL vs CPU | PPL | decode tok/s"
        " | not overlapped tok/s | eager-step tok/s | spec tok/s | spec/plain | spec identical |"
    )
    lines = [head, "|" + "---|" * 11]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['path']} | failed: {r['error']} |" + " |" * 9)
            continue
        where = f"{r['device']}, {r['weights']}, {r['gpu_layers']}, {r.get('kv', '-')}"
        top1 = f"{r['top1']:.4f}" if "top1" in r else "-"
        kl = f"{r['kl']:.5f}" if "kl" in r else "-"
        plain, spec = r["tok_s_spec_off"], r["tok_s_spec_auto"]
        eager = f"{r['tok_s_eager_steps']:.1f}" if "tok_s_eager_steps" in r else "-"
        serial = r.get("tok_s_one_after_another")
        ratio = spec / plain if plain else 0.0
        cells = [
            r["path"],
            where,
            top1,
            kl,
            f"{r['ppl']:.4f}",
            f"{plain:.1f}",
            "-" if serial is None else f"{serial:.1f}",
            eager,
            f"{spec:.1f}",
            f"{ratio:.2f}x",
            str(r["spec_identical"]),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    notes = [f"- {r['path']}: {r['decode_step']}" for r in rows if r.get("decode_step")]
    return "\n".join(lines + ["", "Decode steps:", *notes])


if __name__ == "__main__":
    sys.exit(main())
