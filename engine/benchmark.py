"""Measuring one runtime: prefill speed, time to first token, decode speed, peak memory.

Each backend is measured in its own process (see `miniapp bench`), so the peak RSS that
`getrusage` reports belongs to that backend alone.
"""

from __future__ import annotations

import resource
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from .events import Finished
from .generation import GenerationRequest, generate
from .runtimes import open_runtime
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


def measure(
    backend: str,
    model: Path,
    prompt: list[int],
    n_tokens: int,
    threads: int | None,
    ctx: int,
    runs: int,
) -> BenchResult:
    load_start = time.perf_counter()
    runtime = open_runtime(backend, model, n_ctx=ctx, threads=threads)
    load_s = time.perf_counter() - load_start
    request = GenerationRequest(max_tokens=n_tokens, sampling=GREEDY, ignore_end_of_turn=True)
    warmup = GenerationRequest(max_tokens=WARMUP_TOKENS, sampling=GREEDY, ignore_end_of_turn=True)
    _run(runtime, prompt[::-1], warmup)  # a different prompt, so nothing is reused below
    samples = []
    for _ in range(runs):
        runtime.reset()
        samples.append(_run(runtime, prompt, request))
    return BenchResult(
        backend=backend,
        prompt_tokens=len(prompt),
        generated_tokens=n_tokens,
        threads=threads,
        ctx=ctx,
        runs=runs,
        load_s=load_s,
        prefill_tok_s=statistics.median(s.prefill_tok_s for s in samples),
        ttft_s=statistics.median(s.ttft_s for s in samples),
        decode_tok_s=statistics.median(s.decode_tok_s for s in samples),
        peak_rss_mb=peak_rss_mb(),
    )


def _run(runtime, prompt, request):
    for event in generate(runtime, prompt, request):
        if isinstance(event, Finished):
            return event.stats
    raise AssertionError("generation ended without a Finished event")
