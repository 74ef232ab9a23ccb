"""Measuring one runtime: prefill speed, time to first token, decode speed, peak memory.

`miniapp bench` runs each backend in its own worker process, so that the peak RSS `getrusage`
reports belongs to that backend alone, and alternates single runs between the workers, so
that both see the same machine conditions (this machine is noisy; medians are reported).
"""

from __future__ import annotations

import resource
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from .events import Finished, GenerationStats
from .generation import GenerationRequest, generate
from .runtimes import open_runtime
from .runtimes.base import Runtime
from .sampling import GREEDY

WARMUP_TOKENS = 8  # first calls pay one-time costs (thread pools, kernel selection)


@dataclass(frozen=True)
class BenchResult:
    backend: str
    prompt_tokens: int
    generated_tokens: int
    threads: int | None
    ctx: int
    runs: int
    load_s: float
    prefill_tok_s: float  # medians over runs
    ttft_s: float
    decode_tok_s: float
    peak_rss_mb: float

    def to_dict(self) -> dict:
        return asdict(self)


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


class BenchSession:
    """One loaded runtime that performs measured runs on request."""

    def __init__(
        self,
        backend: str,
        model: Path,
        prompt: list[int],
        n_tokens: int,
        threads: int | None,
        ctx: int,
    ):
        start = time.perf_counter()
        self.runtime: Runtime = open_runtime(backend, model, n_ctx=ctx, threads=threads)
        self.load_s = time.perf_counter() - start
        self.backend, self.prompt, self.threads, self.ctx = backend, prompt, threads, ctx
        self.request = GenerationRequest(
            max_tokens=n_tokens, sampling=GREEDY, ignore_end_of_turn=True
        )
        warmup = GenerationRequest(
            max_tokens=WARMUP_TOKENS, sampling=GREEDY, ignore_end_of_turn=True
        )
        _stats(self.runtime, prompt[::-1], warmup)  # a different prompt: nothing reused below
        self.samples: list[GenerationStats] = []

    def run_once(self) -> GenerationStats:
        self.runtime.reset()
        stats = _stats(self.runtime, self.prompt, self.request)
        self.samples.append(stats)
        return stats

    def result(self) -> BenchResult:
        runs = self.samples
        return BenchResult(
            backend=self.backend,
            prompt_tokens=len(self.prompt),
            generated_tokens=self.request.max_tokens,
            threads=self.threads,
            ctx=self.ctx,
            runs=len(runs),
            load_s=self.load_s,
            prefill_tok_s=statistics.median(s.prefill_tok_s for s in runs),
            ttft_s=statistics.median(s.ttft_s for s in runs),
            decode_tok_s=statistics.median(s.decode_tok_s for s in runs),
            peak_rss_mb=peak_rss_mb(),
        )


def _stats(runtime: Runtime, prompt: list[int], request: GenerationRequest) -> GenerationStats:
    for event in generate(runtime, prompt, request):
        if isinstance(event, Finished):
            return event.stats
    raise AssertionError("generation ended without a Finished event")
