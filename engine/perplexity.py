"""Perplexity as llama.cpp's perplexity tool computes it, for either runtime.

The text is split into non-overlapping chunks of n_ctx tokens; each chunk is evaluated from a
fresh context and only its second half is scored, so every scored token sees at least
n_ctx/2 tokens of context. With a BOS-adding vocabulary, each chunk's first token is BOS.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass

import numpy as np

from .errors import InputFileError
from .runtimes.base import Runtime


@dataclass(frozen=True)
class PerplexityResult:
    ppl: float
    tokens: int  # tokens scored
    text_tokens: int
    chunks: int
    ctx: int
    backend: str
    model: str
    seconds: float

    def to_dict(self) -> dict:
        return asdict(self)


def perplexity(runtime: Runtime, text: str, n_ctx: int) -> PerplexityResult:
    started = time.perf_counter()
    tokenizer = runtime.tokenizer
    tokens = tokenizer.encode(text, parse_special=False)
    n_chunks = len(tokens) // n_ctx
    if n_chunks == 0:
        raise InputFileError(
            f"text has {len(tokens)} tokens; perplexity needs at least --ctx ({n_ctx})"
        )
    first = n_ctx // 2
    nll_sum, scored = 0.0, 0
    for chunk in _chunks(tokens, n_ctx, tokenizer):
        for row, logits in runtime.logit_blocks(chunk, first=first):
            targets = np.asarray(chunk[row + 1 : row + 1 + len(logits)])
            # The chunk's last row predicts a token outside it: not scored.
            nll_sum += float(-token_log_probs(logits[: len(targets)], targets).sum())
            scored += len(targets)
    return PerplexityResult(
        ppl=math.exp(nll_sum / scored),
        tokens=scored,
        text_tokens=len(tokens),
        chunks=n_chunks,
        ctx=n_ctx,
        backend=runtime.backend,
        model=str(runtime.model_path),
        seconds=time.perf_counter() - started,
    )


@dataclass(frozen=True)
class AgreementResult:
    top1_agreement: float
    tokens: int
    chunks: int
    ctx: int
    max_abs_logit_diff: float
    mean_kl: float  # KL(oracle || ours) per position, in nats

    def to_dict(self) -> dict:
        return asdict(self)


def agreement(ours: Runtime, oracle: Runtime, text: str, n_ctx: int) -> AgreementResult:
    """Teacher-forced comparison: both runtimes read the same chunks; how often do their
    most likely next tokens agree, and how far apart are their distributions?"""
    tokens = ours.tokenizer.encode(text, parse_special=False)
    chunks = list(_chunks(tokens, n_ctx, ours.tokenizer)) or [tokens]
    same, total, max_diff, kl_sum = 0, 0, 0.0, 0.0
    for chunk in chunks:
        blocks = zip(ours.logit_blocks(chunk), oracle.logit_blocks(chunk), strict=True)
        for (_, a), (_, b) in blocks:
            same += int((a.argmax(-1) == b.argmax(-1)).sum())
            total += len(a)
            max_diff = max(max_diff, float(np.abs(a - b).max()))
            log_a, log_b = _log_softmax(a), _log_softmax(b)
            kl_sum += float((np.exp(log_b) * (log_b - log_a)).sum())
    return AgreementResult(same / total, total, len(chunks), n_ctx, max_diff, kl_sum / total)


def _chunks(tokens: list[int], n_ctx: int, tokenizer) -> Iterator[list[int]]:
    """Whole chunks of n_ctx tokens; each starts with BOS if the model expects one."""
    for start in range(0, len(tokens) - n_ctx + 1, n_ctx):
        chunk = tokens[start : start + n_ctx]
        if tokenizer.add_bos:
            chunk[0] = tokenizer.bos_id
        yield chunk


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    logits = logits.astype(np.float64)
    shifted = logits - logits.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def token_log_probs(logits: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """log softmax(logits)[i, targets[i]], computed stably in float64."""
    logits = logits.astype(np.float64)
    peak = logits.max(axis=-1, keepdims=True)
    log_norm = np.log(np.exp(logits - peak).sum(axis=-1)) + peak[:, 0]
    return logits[np.arange(len(targets)), targets] - log_norm
