"""Which grammar engine for constrained decoding: llguidance (what we ship) against xgrammar,
on the 50 schemas of assets/schemas and a bundled model's vocabulary.

For each schema: the time to compile it, then the time of each step's token mask along one
valid answer (a random walk through llguidance's allowed tokens, the same tokens fed to both
engines). xgrammar needs transformers and triton, which miniapp does not ship, so it is
looked for on PYTHONPATH:

    pip install --no-deps --target /tmp/xg xgrammar apache-tvm-ffi transformers tokenizers \
        safetensors regex
    PYTHONPATH=/tmp/xg .venv/bin/python scripts/compare_grammar_engines.py [--model M]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from importlib import resources

import numpy as np

from miniapp.engine.modelfile.store import resolve_model
from miniapp.engine.tokens.constraints import (
    JSON_OPTIONS,
    OutputConstraint,
    _ll_tokenizer,
    token_guide,
)
from miniapp.engine.tokens.tokenizer import Tokenizer

MAX_STEPS = 120


def schemas() -> list[dict]:
    text = resources.files("miniapp.assets").joinpath("schemas/json_schemas.json").read_text()
    return json.loads(text)


def walk(guide, rng: random.Random, end_ids: set[int], tokenizer: Tokenizer) -> list[int]:
    """One valid answer: random allowed tokens, preferring ones that are not whitespace."""
    path: list[int] = []
    for _ in range(MAX_STEPS):
        allowed = np.flatnonzero(guide.allowed_after(path))
        if allowed.size == 0 or all(int(t) in end_ids for t in allowed):
            break
        choices = [int(t) for t in allowed if int(t) not in end_ids]
        solid = [t for t in choices if tokenizer.token_bytes(t).strip()]
        path.append(rng.choice(solid or choices))
    return path


def xgrammar_engine(tokenizer: Tokenizer):
    import xgrammar

    vocab = [tokenizer.token_bytes(t, special=True) for t in range(tokenizer.n_vocab)]
    started = time.perf_counter()
    info = xgrammar.TokenizerInfo(
        vocab, vocab_type=xgrammar.VocabType.RAW, stop_token_ids=sorted(tokenizer.eog_ids)
    )
    compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)
    return xgrammar, info, compiler, time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    args = parser.parse_args()
    tokenizer = Tokenizer(resolve_model(args.model))
    started = time.perf_counter()
    _ll_tokenizer(tokenizer)
    ll_setup = time.perf_counter() - started
    xgr, info, compiler, xg_setup = xgrammar_engine(tokenizer)
    rng = random.Random(0)
    figures = {"llguidance": {"compile": [], "mask": []}, "xgrammar": {"compile": [], "mask": []}}
    refused = []
    for entry in schemas():
        constraint = OutputConstraint.json_schema(entry["schema"])
        started = time.perf_counter()
        guide = token_guide(constraint, tokenizer, 0)
        figures["llguidance"]["compile"].append(time.perf_counter() - started)
        path = walk(guide, rng, set(tokenizer.eog_ids), tokenizer)
        guide = token_guide(constraint, tokenizer, 0)
        for n in range(len(path)):
            started = time.perf_counter()
            guide.allowed_after(path[:n])
            figures["llguidance"]["mask"].append(time.perf_counter() - started)
        started = time.perf_counter()
        compiled = compiler.compile_json_schema(
            json.dumps(entry["schema"]), any_whitespace=True, strict_mode=True
        )
        figures["xgrammar"]["compile"].append(time.perf_counter() - started)
        matcher = xgr.GrammarMatcher(compiled)
        bitmask = xgr.allocate_token_bitmask(1, info.vocab_size)
        for token in path:
            started = time.perf_counter()
            matcher.fill_next_token_bitmask(bitmask)
            figures["xgrammar"]["mask"].append(time.perf_counter() - started)
            if not matcher.accept_token(token):
                refused.append(entry["name"])
                break
    print(f"model: {tokenizer.path.name}, vocabulary {tokenizer.n_vocab}")
    print(f"JSON options (llguidance): {JSON_OPTIONS}; xgrammar: any_whitespace")
    print(f"vocabulary setup: llguidance {ll_setup:.2f} s, xgrammar {xg_setup:.2f} s")
    for engine, timings in figures.items():
        compile_ms = [t * 1e3 for t in timings["compile"]]
        mask_us = sorted(t * 1e6 for t in timings["mask"])
        print(
            f"{engine}: compile median {statistics.median(compile_ms):.1f} ms, max "
            f"{max(compile_ms):.1f} ms; mask median {statistics.median(mask_us):.0f} us, "
            f"p90 {mask_us[int(0.9 * len(mask_us))]:.0f} us over {len(mask_us)} steps"
        )
    if refused:
        print(f"xgrammar refused a token llguidance allowed in: {', '.join(refused)}")


if __name__ == "__main__":
    main()
