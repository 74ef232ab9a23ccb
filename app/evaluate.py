"""`miniapp eval ppl`."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from miniapp.engine.errors import InputFileError
from miniapp.engine.model_store import resolve_model
from miniapp.engine.perplexity import perplexity
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
