"""`miniapp eval`: ppl, compare, asr and json."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from miniapp.engine.api import (
    DEFAULT_SINKS,
    InputFileError,
    MiniappError,
    Runtime,
    RuntimeConfig,
    closing_reserve,
    open_runtime,
    resolve_model,
)
from miniapp.engine.evaluation.perplexity import (
    agreement,
    perplexity,
    recompute_perplexity,
    streaming_perplexity,
)


def read_text(path_arg: str) -> str:
    path = Path(path_arg)
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise InputFileError(f"{path}: file not found") from None
    except UnicodeDecodeError:
        raise InputFileError(f"{path}: not UTF-8 text") from None
    except OSError as exc:
        raise InputFileError(f"{path}: cannot read ({exc.strerror})") from None


def run_ppl(args: argparse.Namespace) -> int:
    """Chunks of --ctx (llama.cpp's method); with --window, a stream through the sliding
    window (sinks + window); with --window and --recompute, the recompute baseline."""
    text = read_text(args.file)
    model = resolve_model(args.model)
    if args.window is None:
        if args.recompute or args.sinks is not None:
            raise MiniappError("--sinks and --recompute need --window")
        runtime = _open(args, model, ctx=args.ctx, logits_all=True)
        result = perplexity(runtime, text, args.ctx)
        how = f"{result.chunks} chunks of {result.ctx}"
    elif args.recompute:
        stride = args.stride or max(1, args.window // 8)
        runtime = _open(args, model, ctx=args.window, logits_all=True)
        result = recompute_perplexity(runtime, text, args.window, stride)
        how = f"each window of {args.window} recomputed, stride {stride}"
    else:
        sinks = DEFAULT_SINKS if args.sinks is None else args.sinks
        runtime = _open(args, model, ctx=sinks + args.window, sinks=sinks, window=args.window)
        result = streaming_perplexity(runtime, text, sinks, args.window)
        how = f"streamed through {sinks} sinks + a window of {args.window}"
    kv = runtime.info().kv_type
    if args.json:
        print(json.dumps({**result.to_dict(), "kv_type": kv}))
    else:
        cache = f", KV {kv}" if kv else ""
        print(
            f"{result.backend}: perplexity {result.ppl:.4f} over {result.tokens} scored tokens "
            f"({how}{cache}) in {result.seconds:.1f} s"
        )
    return 0


def _open(args: argparse.Namespace, model, **options) -> Runtime:
    """The runtime `eval ppl` asked for (no generation, so no speculative decoding), its KV
    cache as --kv-type says (left out: the backend's own default)."""
    if args.backend == "torch":
        options.update(spec="off", device=args.device)
        if getattr(args, "kv_policy", None):
            options.update(kv_policy=args.kv_policy)
    kv = getattr(args, "kv_type", None)
    config = RuntimeConfig(str(model), args.backend, threads=args.threads, kv_type=kv, **options)
    return open_runtime(config)


def run_compare(args: argparse.Namespace) -> int:
    text = read_text(args.file)
    model = resolve_model(args.model)
    ours = open_runtime(
        RuntimeConfig(
            str(model),
            "torch",
            ctx=args.ctx,
            threads=args.threads,
            spec="off",
            device=args.device,
            kv_type=args.kv_type,
        )
    )
    # The oracle keeps llama.cpp's own KV cache (f16) whatever --kv-type says.
    oracle = open_runtime(
        RuntimeConfig(str(model), "llamacpp", ctx=args.ctx, threads=args.threads, logits_all=True)
    )
    result = agreement(ours, oracle, text, args.ctx)
    kv = ours.info().kv_type
    if args.json:
        print(json.dumps({**result.to_dict(), "kv_type": kv}))
    else:
        print(
            f"top-1 agreement with llama.cpp: {result.top1_agreement:.4f} over {result.tokens} "
            f"tokens ({result.chunks} chunks of {result.ctx}, KV {kv}); max |logit diff| "
            f"{result.max_abs_logit_diff:.3f}, mean KL(llama.cpp || ours) {result.mean_kl:.5f}"
        )
    return 0


def run_asr(args: argparse.Namespace) -> int:
    """`miniapp eval asr`: synthetic sentences with known word boundaries through offline and
    streamed recognition (WER, boundary error, commit and partial latency, real-time factor),
    and end of speech to the first answer token. The wide set is scored per condition, and
    always offline as well as streamed: the offline WER is what the stream's is held to."""
    from miniapp.engine.evaluation.asr_benchmark import AsrBenchmark, load_clips
    from miniapp.engine.voice.asr import load_asr

    asr = load_asr(args.asr_model, args.asr_threads or args.threads)
    wide = args.set == "wide"
    if args.offline:
        modes = ("offline",)
    else:
        modes = ("stream",) if args.stream and not wide else ("offline", "stream")
    bench = AsrBenchmark(asr, load_clips(args.set, args.sentences))
    result = {
        "set": args.set,
        "sentences": bench.count,
        "clips": len(bench.clips),
        "asr_threads": asr.threads,
    }
    for mode in modes:
        result[mode] = bench.run(mode, raw=not wide)
    if "stream" in modes and not (args.no_answer or wide):
        runtime = _open(args, resolve_model(args.model), ctx=args.ctx or 2048)
        result["answer"] = bench.answer_latency(runtime)
    if args.json:
        print(json.dumps(result))
    else:
        print(_asr_table(result))
    return 0


def _asr_table(result: dict) -> str:
    lines = [
        f"{result['sentences']} {result['set']} sentences ({result['clips']} clips), ASR on "
        f"{result['asr_threads']} threads (WER and MAE over all words; latencies from a "
        "word's true end)"
    ]
    for mode in ("offline", "stream"):
        if mode in result:
            lines.append(f"{mode:8} " + _asr_line(result[mode], mode))
            for group, scores in result[mode].get("groups", {}).items():
                lines.append(f"  {group:18} " + _asr_line(scores, mode))
    if "answer" in result:
        a = result["answer"]
        lines.append(
            f"end of speech -> first answer token {a['median_speech_end_to_first_token_s']:.2f} s "
            f"(finish {a['median_finish_s']:.2f} s, model TTFT {a['median_ttft_s']:.2f} s)"
        )
    return "\n".join(lines)


def _asr_line(r: dict, mode: str) -> str:
    line = f"WER {r['wer']:.3f}  start/end MAE {_ms(r['start_mae_s'])}/{_ms(r['end_mae_s'])} ms"
    if "raw_start_mae_s" in r:
        line += f" (raw {_ms(r['raw_start_mae_s'])}/{_ms(r['raw_end_mae_s'])} ms)"
    line += f"  RTF {r['rtf']:.3f}"
    if mode == "stream":
        line += (
            f"  commit p50/p90 {_s(r['median_commit_latency_s'])}/"
            f"{_s(r['p90_commit_latency_s'])} s  partial p50 {_s(r['median_partial_latency_s'])} s"
            f"  (audio wait {_s(r['median_audio_wait_s'])}, decode {_s(r['median_decode_s'])}, "
            f"shown to commit {_s(r['median_shown_to_commit_s'])})"
        )
    return line


def _s(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds:.2f}"


def _ms(seconds: float | None, digits: int = 0) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.{digits}f}"


def run_json(args: argparse.Namespace) -> int:
    """`miniapp eval json`: greedy answers to the bundled JSON schemas' prompts, with each
    schema as the constraint and without one: validity, compile and mask times, decode
    speed with and without (issue 22's measured targets)."""
    from miniapp.engine.evaluation.json_validity import evaluate_json_schemas, schema_cases

    model = resolve_model(args.model)
    cases = schema_cases(args.limit)
    # Each prompt is a short user message; its answer needs max_tokens more.
    n_ctx = args.max_tokens + 512
    config = RuntimeConfig(
        str(model), args.backend, ctx=n_ctx, threads=args.threads, spec=args.spec
    )
    runtime = open_runtime(config)
    # Other work on the machine slows both kinds of answer; the load says if there was any.
    load_before = os.getloadavg()[0]
    report = evaluate_json_schemas(runtime, cases, args.max_tokens)
    load = {"before": load_before, "after": os.getloadavg()[0]}
    if args.json:
        print(
            json.dumps(
                {"model": model.name, "threads": args.threads, "load_1m": load, **report.to_dict()}
            )
        )
    else:
        print(_json_eval_table(model.name, args.threads, load, report))
    return 0


def run_rerank(args: argparse.Namespace) -> int:
    """`miniapp eval rerank`: top-1 and MRR of the model's relevance judgements (the scores
    /v1/rerank serves) on the written set, beside chance."""
    from miniapp.engine.evaluation.rerank_eval import evaluate_rerank

    model = resolve_model(args.model)
    runtime = open_runtime(RuntimeConfig(str(model), ctx=1024, threads=args.threads, spec="off"))
    result = evaluate_rerank(runtime, model.name)
    if args.json:
        print(json.dumps(result.to_dict()))
        return 0
    print(
        f"{model.name}: {result.queries} queries, 4 documents each; top-1 {result.top1:.2f} "
        f"(chance 0.25), MRR {result.mrr:.2f} (chance 0.52); mean score of the answering "
        f"documents {result.relevant_score:.3f}, of the others {result.other_score:.3f}; "
        f"{result.seconds:.1f} s"
    )
    return 0


def _json_eval_table(model: str, threads: int | None, load: dict, r) -> str:
    drafts = (
        f", drafts accepted {r.accepted}/{r.drafted} constrained, "
        f"{r.free_accepted}/{r.free_drafted} free"
    )
    spec = f"spec {r.spec}" + (drafts if r.drafted or r.free_drafted else "")
    lines = [
        f"{model}, {r.backend} ({spec}), {threads or 'all'} threads, "
        f"{r.total} schemas, greedy, max {r.max_tokens} tokens; load average "
        f"{load['before']:.1f} before, {load['after']:.1f} after",
        f"  valid / parsed / finished / total   {r.valid} / {r.parsed} / {r.finished} / {r.total}"
        f"   (cut by max tokens: {r.cut_by_max_tokens}; free answers: "
        f"{r.free_cut_by_max_tokens}; steered to close in the budget's last "
        f"{closing_reserve(r.max_tokens)} tokens: {r.steered})",
        f"  compile a schema                    median {_ms(r.compile_median_s, 1)} ms, "
        f"max {_ms(r.compile_max_s, 1)} ms",
        f"  llguidance's vocabulary (once)      {_ms(r.tokenizer_build_s)} ms",
        f"  mask per step (matcher)             median {_ms(r.mask_median_s, 2)} ms, "
        f"p90 {_ms(r.mask_p90_s, 2)} ms  ({r.mask_calls} masks)",
        f"  mask per step (matcher + -inf)      median {_ms(r.whole_mask_median_s, 2)} ms, "
        f"p90 {_ms(r.whole_mask_p90_s, 2)} ms",
        f"  greedy check of the best token      median {_ms(r.check_median_s, 3)} ms  "
        f"({r.check_calls} checks; masks and checks {r.mask_share:.1%} of decode time)",
        f"  decode tok/s with / without schema  {r.decode_tok_s:.1f} / {r.free_decode_tok_s:.1f}"
        f"  ratio {r.ratio:.2f}  (median of per-prompt ratios {r.paired_ratio_median:.2f})",
    ]
    for s in r.failures:
        why = (
            []
            if s.finished
            else [f"ended by {s.constrained.reason} after {s.constrained.generated_tokens} tokens"]
        )
        lines.append(f"  FAILED {s.name}: " + "; ".join(why + [s.problem or "valid"]))
    return "\n".join(lines)


def run_recall(args: argparse.Namespace) -> int:
    """`miniapp eval recall`: facts at chosen depths of generated documents longer than the
    KV cache's budget, asked for inside the prompt, after it in a chat, and second in a
    chat; each KV policy beside the window and a full cache (engine/evaluation/recall.py)."""
    from miniapp.engine.evaluation.recall import RecallSettings, format_report, parse_list
    from miniapp.engine.evaluation.recall import run_recall as run_benchmark

    if args.ctx is not None or args.window is not None:
        raise MiniappError(
            "eval recall sizes the cache from --budgets; leave out --ctx and --window"
        )
    policies = parse_list(args.policies, str, "--policies")
    if args.kv_policy:  # --kv-policy P: P is compared too
        policies += (args.kv_policy,)
    settings = RecallSettings(
        budgets=parse_list(args.budgets, int, "--budgets"),
        depths=parse_list(args.depths, float, "--depths"),
        lengths=parse_list(args.lengths, float, "--lengths"),
        cases=args.cases,
        seed=args.seed,
        sinks=DEFAULT_SINKS if args.sinks is None else args.sinks,
        policies=policies,
        ppl=not args.no_ppl,
    )
    text = read_text(args.text) if args.text else None
    model = resolve_model(args.model)

    def open_condition(ctx: int, sinks: int, window: int, policy: str) -> Runtime:
        config = RuntimeConfig(
            str(model),
            args.backend,
            device=args.device,
            spec="off",
            ctx=ctx,
            sinks=sinks,
            window=window,
            kv_policy=policy,
            threads=args.threads,
            kv_type=args.kv_type,
            cpu_moe=args.cpu_moe,
        )
        return open_runtime(config)

    result = run_benchmark(open_condition, settings, text, args.text or "")
    if args.json:
        print(json.dumps(result.to_dict()))
    else:
        print(format_report(result))
    return 0
