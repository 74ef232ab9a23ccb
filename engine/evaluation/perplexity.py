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

from ..errors import InputFileError
from ..runtimes.base import Runtime


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


class _Scorer:
    """Sums -log p(target) over scored positions; builds the result."""

    def __init__(self, runtime: Runtime, text_tokens: int):
        self.runtime, self.text_tokens = runtime, text_tokens
        self.started = time.perf_counter()
        self.nll, self.scored = 0.0, 0

    def add(self, logits: np.ndarray, targets: list[int]) -> None:
        """logits [n, vocab] whose rows predict the first len(targets) <= n targets."""
        if not targets:
            return
        targets = np.asarray(targets, dtype=np.int64)
        self.nll -= float(token_log_probs(logits[: len(targets)], targets).sum())
        self.scored += len(targets)

    def result(self, mode: str, ctx: int, **settings) -> PerplexityResult:
        return PerplexityResult(
            ppl=math.exp(self.nll / self.scored),
            tokens=self.scored,
            text_tokens=self.text_tokens,
            mode=mode,
            ctx=ctx,
            backend=self.runtime.backend,
            model=str(self.runtime.model_path),
            seconds=time.perf_counter() - self.started,
            **settings,
        )


def perplexity(runtime: Runtime, text: str, n_ctx: int) -> PerplexityResult:
    tokenizer = runtime.tokenizer
    tokens = tokenizer.encode(text, parse_special=False)
    n_chunks = len(tokens) // n_ctx
    if n_chunks == 0:
        raise InputFileError(
            f"text has {len(tokens)} tokens; perplexity needs at least --ctx ({n_ctx})"
        )
    scorer = _Scorer(runtime, len(tokens))
    for chunk in _chunks(tokens, n_ctx, tokenizer):
        for row, logits in runtime.logit_blocks(chunk, first=n_ctx // 2):
            # The chunk's last row predicts a token outside it: not scored.
            scorer.add(logits, chunk[row + 1 : row + 1 + len(logits)])
    return scorer.result("chunks", n_ctx, chunks=n_chunks)


def streaming_perplexity(runtime: Runtime, text: str, sinks: int, window: int) -> PerplexityResult:
    """Score tokens window.. of the text, streamed through `runtime`'s sliding-window cache
    (a runtime opened with these sinks and window)."""
    tokens = _tokens_for_window(runtime, text, window)
    scorer = _Scorer(runtime, len(tokens))
    for row, logits in runtime.stream_blocks(tokens):
        first = max(row, window - 1)  # the first position whose prediction is scored
        if first < row + len(logits):
            scorer.add(logits[first - row :], tokens[first + 1 : row + len(logits) + 1])
    return scorer.result("streaming", sinks + window, window=window, sinks=sinks)


def recompute_perplexity(runtime: Runtime, text: str, window: int, stride: int) -> PerplexityResult:
    """Score tokens window.. of the text, each from a fresh evaluation of the window before it
    (windows move `stride` tokens at a time)."""
    tokens = _tokens_for_window(runtime, text, window)
    scorer = _Scorer(runtime, len(tokens))
    ends = list(range(window, len(tokens), stride))
    if ends[-1] != len(tokens) - 1:
        ends.append(len(tokens) - 1)
    previous = window - 1
    for end in ends:
        # Context tokens[end - window : end] predicts targets previous + 1 .. end.
        start = end - window
        for row, logits in runtime.logit_blocks(tokens[start:end], first=previous - start):
            scorer.add(logits, tokens[start + row + 1 : start + row + 1 + len(logits)])
        previous = end
    return scorer.result("recompute", window, window=window, stride=stride)


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
