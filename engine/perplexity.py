"""Perplexity, three ways.

* `perplexity` (mode "chunks") is llama.cpp's perplexity tool: the text is split into
  non-overlapping chunks of n_ctx tokens; each chunk is evaluated from a fresh context and
  only its second half is scored, so every scored token sees at least n_ctx/2 tokens of
  context. With a BOS-adding vocabulary, each chunk's first token is BOS.
* `streaming_perplexity` (mode "streaming") runs the whole text through the torch engine's
  sliding-window cache (sinks + window), as a long chat would, and scores every token from
  position `window` on.
* `recompute_perplexity` (mode "recompute") is the baseline StreamingLLM compares against:
  each scored token is predicted from a fresh evaluation of (about) the `window` tokens
  before it. Windows advance `stride` tokens at a time, so contexts range from
  window - stride + 1 to window tokens.
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
    mode: str  # "chunks" | "streaming" | "recompute"
    ctx: int
    backend: str
    model: str
    seconds: float
    chunks: int | None = None  # mode "chunks"
    window: int | None = None  # modes "streaming" and "recompute"
    sinks: int | None = None  # mode "streaming"
    stride: int | None = None  # mode "recompute"

    def to_dict(self) -> dict:
        return {key: value for key, value in asdict(self).items() if value is not None}


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
        mode="chunks",
        ctx=n_ctx,
        backend=runtime.backend,
        model=str(runtime.model_path),
        seconds=time.perf_counter() - started,
        chunks=n_chunks,
    )


def streaming_perplexity(runtime: Runtime, text: str, sinks: int, window: int) -> PerplexityResult:
    """Score tokens window.. of the text, streamed through `runtime`'s sliding-window cache
    (a runtime opened with these sinks and window)."""
    started = time.perf_counter()
    tokens = _tokens_for_window(runtime, text, window)
    nll_sum, scored = 0.0, 0
    for row, logits in runtime.stream_blocks(tokens):
        first, last = max(row, window - 1), min(row + len(logits), len(tokens) - 1)
        if first < last:
            targets = np.asarray(tokens[first + 1 : last + 1])
            nll_sum += float(-token_log_probs(logits[first - row : last - row], targets).sum())
            scored += len(targets)
    return PerplexityResult(
        ppl=math.exp(nll_sum / scored),
        tokens=scored,
        text_tokens=len(tokens),
        mode="streaming",
        ctx=sinks + window,
        backend=runtime.backend,
        model=str(runtime.model_path),
        seconds=time.perf_counter() - started,
        window=window,
        sinks=sinks,
    )


def recompute_perplexity(runtime: Runtime, text: str, window: int, stride: int) -> PerplexityResult:
    """Score tokens window.. of the text, each from a fresh evaluation of the window before it
    (windows move `stride` tokens at a time)."""
    started = time.perf_counter()
    tokens = _tokens_for_window(runtime, text, window)
    nll_sum, scored = 0.0, 0
    ends = list(range(window, len(tokens), stride))
    if ends[-1] != len(tokens) - 1:
        ends.append(len(tokens) - 1)
    previous = window - 1
    for end in ends:
        # Context tokens[end - window : end] predicts targets previous + 1 .. end.
        context = tokens[end - window : end]
        first_row = previous - (end - window)
        previous = end
        for row, logits in runtime.logit_blocks(context, first=first_row):
            positions = range(end - window + row, end - window + row + len(logits))
            targets = np.asarray([tokens[p + 1] for p in positions if p + 1 < len(tokens)])
            nll_sum += float(-token_log_probs(logits[: len(targets)], targets).sum())
            scored += len(targets)
    return PerplexityResult(
        ppl=math.exp(nll_sum / scored),
        tokens=scored,
        text_tokens=len(tokens),
        mode="recompute",
        ctx=window,
        backend=runtime.backend,
        model=str(runtime.model_path),
        seconds=time.perf_counter() - started,
        window=window,
        stride=stride,
    )


def _tokens_for_window(runtime: Runtime, text: str, window: int) -> list[int]:
    tokens = runtime.tokenizer.encode(text, parse_special=False)
    if len(tokens) <= window + 1:
        raise InputFileError(
            f"text has {len(tokens)} tokens; a window of {window} needs more to score any"
        )
    return tokens


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
