"""`miniapp eval ppl`."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from miniapp.engine.errors import InputFileError, MiniappError
from miniapp.engine.model_store import resolve_model
from miniapp.engine.perplexity import (
    agreement,
    perplexity,
    recompute_perplexity,
    streaming_perplexity,
)
from miniapp.engine.runtimes import Runtime, open_runtime


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
        runtime = _open(args, model, n_ctx=args.ctx, logits_all=True)
        result = perplexity(runtime, text, args.ctx)
        how = f"{result.chunks} chunks of {result.ctx}"
    elif args.recompute:
        stride = args.stride or max(1, args.window // 8)
        runtime = _open(args, model, n_ctx=args.window, logits_all=True)
        result = recompute_perplexity(runtime, text, args.window, stride)
        how = f"each window of {args.window} recomputed, stride {stride}"
    else:
        sinks = 4 if args.sinks is None else args.sinks
        runtime = _open(args, model, n_ctx=sinks + args.window, sinks=sinks, window=args.window)
        result = streaming_perplexity(runtime, text, sinks, args.window)
        how = f"streamed through {sinks} sinks + a window of {args.window}"
    if args.json:
        print(json.dumps(result.to_dict()))
    else:
        print(
            f"{result.backend}: perplexity {result.ppl:.4f} over {result.tokens} scored tokens "
            f"({how}) in {result.seconds:.1f} s"
        )
    return 0


def _open(args: argparse.Namespace, model, **options) -> Runtime:
    """The runtime `eval ppl` asked for (no generation, so no speculative decoding)."""
    if args.backend == "torch":
        options.update(spec="off", device=args.device)
    return open_runtime(args.backend, model, threads=args.threads, **options)


def run_compare(args: argparse.Namespace) -> int:
    text = read_text(args.file)
    model = resolve_model(args.model)
    ours = open_runtime(
        "torch", model, n_ctx=args.ctx, threads=args.threads, spec="off", device=args.device
    )
    oracle = open_runtime("llamacpp", model, n_ctx=args.ctx, threads=args.threads, logits_all=True)
    result = agreement(ours, oracle, text, args.ctx)
    if args.json:
        print(json.dumps(result.to_dict()))
    else:
        print(
            f"top-1 agreement with llama.cpp: {result.top1_agreement:.4f} over {result.tokens} "
            f"tokens ({result.chunks} chunks of {result.ctx}); max |logit diff| "
            f"{result.max_abs_logit_diff:.3f}, mean KL(llama.cpp || ours) {result.mean_kl:.5f}"
        )
    return 0
