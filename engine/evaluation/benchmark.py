"""Measuring one runtime: prefill speed, time to first token, decode speed, peak memory.

`miniapp bench` runs each backend in its own worker process, so that the peak RSS `getrusage`
reports belongs to that backend alone, and alternates single runs between the workers, so
that both see the same machine conditions (this machine is noisy; medians are reported).
Each run also reports its first and last quarter of generated tokens separately, to show
whether speed and memory stay flat over a long generation.
"""

from __future__ import annotations

import resource
import statistics
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..kv.policies import WINDOW_POLICY
from ..runtimes import open_local_runtime
from ..runtimes.base import Runtime
from ..tokens.events import SpeculationStats
from ..tokens.sampling import GREEDY


def _import_backend(backend: str) -> None:
    if backend == "torch":
        from ..runtimes import torch_runtime  # noqa: F401
    elif backend == "llamacpp":
        from ..runtimes import llamacpp_runtime  # noqa: F401


WARMUP_TOKENS = 8  # first calls pay one-time costs (thread pools, kernel selection)


@dataclass(frozen=True)
class Quarter:
    """One quarter of a run's generated tokens: speed and memory at its end."""

    decode_tok_s: float
    rss_mb: float  # resident now
    peak_rss_mb: float  # highest so far


@dataclass(frozen=True)
class RunStats:
    prefill_tok_s: float
    ttft_s: float
    decode_tok_s: float
    first_quarter: Quarter
    last_quarter: Quarter
    tokens: tuple[int, ...]  # what was generated (speculation must not change it)
    speculation: SpeculationStats | None


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
    first_quarter: Quarter  # of the median-speed run
    last_quarter: Quarter
    window: int | None = None
    sinks: int | None = None
    kv_policy: str | None = None  # the torch engine's: which tokens a full cache keeps
    spec: str = "off"
    acceptance_rate: float = 0.0  # drafts accepted / drafted, over all runs
    tokens_per_step: float = 1.0  # tokens per full-model pass, over all runs
    # Per drafter, over all runs: verifications, drafted, accepted.
    by_drafter: dict[str, list[int]] = field(default_factory=dict)
    kv_type: str | None = None  # how the KV cache stored keys and values (--kv-type)
    kv_bytes_per_token: int | None = None  # their bytes a token, every layer (if known)
    weight_bytes_per_token: int | None = None  # weights a decode step reads (if known)

    def to_dict(self) -> dict:
        return asdict(self)


def _summed(counts: Iterable[dict[str, list[int]]]) -> dict[str, list[int]]:
    total: dict[str, list[int]] = {}
    for per_drafter in counts:
        for name, values in per_drafter.items():
            into = total.setdefault(name, [0] * len(values))
            for i, value in enumerate(values):
                into[i] += value
    return total


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def current_rss_mb() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * resource.getpagesize() / 2**20


class BenchSession:
    """One loaded runtime that performs measured runs on request."""

    def __init__(
        self,
        backend: str,
        model: Path,
        prompts: list[list[int]],
        n_tokens: int,
        threads: int | None,
        ctx: int,
        sinks: int | None = None,
        window: int | None = None,
        kv_policy: str = WINDOW_POLICY,
        spec: str = "off",
        stop_at_end_of_turn: bool = False,
        device: str = "auto",
        kv: str | None = None,
    ):
        """`kv`: the KV cache type (None: the backend's own default). The load time counts
        opening the model, not importing the backend's code (a process does that once,
        before any model: the first backend measured would otherwise carry it)."""
        _import_backend(backend)
        start = time.perf_counter()
        self.runtime: Runtime = open_local_runtime(
            backend,
            model,
            n_ctx=ctx,
            threads=threads,
            sinks=sinks,
            window=window,
            kv_policy=kv_policy,
            spec=spec,
            device=device,
            kv=kv,
        )
        self.load_s = time.perf_counter() - start
        self.backend, self.prompts, self.threads, self.ctx = backend, prompts, threads, ctx
        self.spec = spec if backend == "torch" else "off"
        self.stop_tokens = self.runtime.tokenizer.eog_ids if stop_at_end_of_turn else frozenset()
        info = self.runtime.info()
        self.sinks, self.window = info.sinks, info.window  # the torch engine's sliding window
        self.kv_policy = info.kv_policy
        self.kv_type, self.kv_bytes_per_token = info.kv_type, info.kv_bytes_per_token
        self.weight_bytes_per_token = info.weight_bytes_per_token
        self.n_tokens = n_tokens
        self._run(prompts[0][::-1], WARMUP_TOKENS)  # a different prompt: nothing reused below
        self.samples: list[RunStats] = []

    def run_once(self) -> RunStats:
        """The next prompt in turn, from an empty cache."""
        self.runtime.reset()
        prompt = self.prompts[len(self.samples) % len(self.prompts)]
        stats = self._run(prompt, self.n_tokens)
        self.samples.append(stats)
        return stats

    def _run(self, prompt: list[int], n_tokens: int) -> RunStats:
        """Greedy generation of n_tokens (or up to end-of-turn, for chat tasks), timed token
        by token."""
        start = time.perf_counter()
        times: list[float] = []
        generated: list[int] = []
        quarter = max(n_tokens // 4, 2)
        first_quarter_memory = (0.0, 0.0)
        tokens = self.runtime.generate_tokens(prompt, GREEDY)
        try:
            for token in tokens:
                times.append(time.perf_counter())
                generated.append(token)
                if len(times) == quarter:
                    first_quarter_memory = (current_rss_mb(), peak_rss_mb())
                if len(times) == n_tokens or token in self.stop_tokens:
                    break
        finally:
            tokens.close()
        ttft = times[0] - start

        def speed(first: int, last: int) -> float:
            return (last - first) / (times[last] - times[first]) if last > first else 0.0

        n = len(times)
        return RunStats(
            prefill_tok_s=len(prompt) / ttft,
            ttft_s=ttft,
            decode_tok_s=speed(0, n - 1),
            first_quarter=Quarter(speed(0, min(quarter, n) - 1), *first_quarter_memory),
            last_quarter=Quarter(
                speed(max(n - quarter, 0), n - 1), current_rss_mb(), peak_rss_mb()
            ),
            tokens=tuple(generated),
            speculation=tokens.speculation,
        )

    def result(self) -> BenchResult:
        runs = self.samples
        median_run = sorted(runs, key=lambda r: r.decode_tok_s)[len(runs) // 2]
        spec = [r.speculation for r in runs if r.speculation is not None]
        drafted = sum(s.drafted for s in spec)
        steps = sum(s.steps for s in spec)
        return BenchResult(
            backend=self.backend,
            prompt_tokens=round(statistics.fmean(len(p) for p in self.prompts)),
            generated_tokens=round(statistics.fmean(len(r.tokens) for r in runs)),
            threads=self.threads,
            ctx=self.ctx,
            runs=len(runs),
            load_s=self.load_s,
            prefill_tok_s=statistics.median(s.prefill_tok_s for s in runs),
            ttft_s=statistics.median(s.ttft_s for s in runs),
            decode_tok_s=statistics.median(s.decode_tok_s for s in runs),
            peak_rss_mb=peak_rss_mb(),
            first_quarter=median_run.first_quarter,
            last_quarter=median_run.last_quarter,
            window=self.window,
            sinks=self.sinks,
            kv_policy=self.kv_policy,
            spec=self.spec,
            acceptance_rate=sum(s.accepted for s in spec) / drafted if drafted else 0.0,
            tokens_per_step=sum(s.emitted for s in spec) / steps if steps else 1.0,
            by_drafter=_summed(s.by_drafter for s in spec),
            kv_type=self.kv_type,
            kv_bytes_per_token=self.kv_bytes_per_token,
            weight_bytes_per_token=self.weight_bytes_per_token,
        )
