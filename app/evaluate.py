"""`miniapp eval ppl`."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from miniapp.engine.errors import InputFileError
from miniapp.engine.model_store import resolve_model
from miniapp.engine.perplexity import agreement, perplexity
from miniapp.engine.runtimes import open_runtime


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
    text = read_text(args.file)
    runtime = open_runtime(
        args.backend,
        resolve_model(args.model),
        n_ctx=args.ctx,
        threads=args.threads,
        logits_all=True,
    )
    result = perplexity(runtime, text, args.ctx)
    if args.json:
        print(json.dumps(result.to_dict()))
    else:
        print(
            f"{result.backend}: perplexity {result.ppl:.4f} over {result.tokens} scored tokens "
            f"({result.chunks} chunks of {result.ctx}) in {result.seconds:.1f} s"
        )
    return 0


def run_compare(args: argparse.Namespace) -> int:
    text = read_text(args.file)
    model = resolve_model(args.model)
    ours = open_runtime("torch", model, n_ctx=args.ctx, threads=args.threads)
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
