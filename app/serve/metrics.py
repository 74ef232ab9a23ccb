"""`GET /metrics`: the server's figures in Prometheus's text format, named as vLLM and
llama-server name theirs, prefixed `miniapp_`.

Counts and timings are recorded as answers run, by one observer per request that its relay
calls (service.RelayObserver). How busy the engine is (sequences running and waiting, KV
memory) is read at scrape time from the batching scheduler; without one (llama.cpp, or
--parallel 1) answers take turns, and the relays' reports say which runs and which wait. Each
app has a registry of its own, not prometheus-client's global one, so apps in one process
never share figures.

Every figure is per answer: a request with `n` choices, or several prompts, runs that many
sequences, and each counts its own prompt.

LoRA adapters (labelled `adapter`): answers run with each, and, read from the engine's
registry at scrape time, each loaded adapter's bytes in memory, its latest load's seconds
and how often it was read from its file.
"""

from __future__ import annotations

import threading
import time

from fastapi import APIRouter
from fastapi.responses import Response
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from miniapp.engine.api import Finished, FinishReason

from ..host.model_host import LoadState
from .breaker import BreakerState, CircuitBreaker
from .service import RelayObserver, ServedModel, finish_reason

# Seconds, for a CPU engine: a first token comes tens of ms after a short cached prompt, tens
# of seconds after a long prompt queued behind a full batch; tokens follow each other a few ms
# apart (speculative bursts) to a few hundred ms (a full batch of a larger model).
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
INTER_TOKEN_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.15,
    0.25,
    0.5,
    1.0,
    2.5,
)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0, 600.0)
FINISH_REASONS = ("stop", "length", "cancelled")


def metrics_router(metrics: ServeMetrics) -> APIRouter:
    router = APIRouter()

    # A plain function: FastAPI runs it on a worker thread, so the scheduler's lock, which a
    # scrape takes, is never waited for in the event loop.
    @router.get("/metrics")
    def scrape() -> Response:
        return Response(metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    return router


class ServeMetrics:
    """One app's figures, and the observers that record them."""

    def __init__(self, served: ServedModel, breaker: CircuitBreaker | None = None):
        self.served, self.breaker = served, breaker
        self.registry = CollectorRegistry()
        self.turns = _TurnCounts()
        self._define_counters()
        self._define_histograms()
        self._define_gauges()

    def observer(self, jobs: int, adapters: tuple[str, ...] = ()) -> RequestObserver:
        """The observer of one request's relay, started now (its latencies count from here);
        `adapters`: the LoRA adapters its answers run with."""
        return RequestObserver(self, jobs, adapters)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)

    # -- definitions (prometheus-client appends `_total` to a counter's name)

    def _define_counters(self) -> None:
        def counter(name: str, text: str, labels: tuple[str, ...] = ()) -> Counter:
            return Counter(name, text, labels, registry=self.registry)

        self.prompt_tokens = counter("miniapp_prompt_tokens", "Prompt tokens of answers")
        self.cached_prompt_tokens = counter(
            "miniapp_prompt_tokens_cached", "Prompt tokens found already evaluated (reused)"
        )
        self.generation_tokens = counter("miniapp_generation_tokens", "Tokens generated")
        self.requests_finished = counter(
            "miniapp_requests_finished", "Answers finished, by finish_reason", ("finish_reason",)
        )
        for reason in FINISH_REASONS:  # every series exists from the start, at 0
            self.requests_finished.labels(reason)
        self.drafted_tokens = counter(
            "miniapp_spec_decode_draft_tokens", "Tokens drafted by speculative decoding"
        )
        self.accepted_tokens = counter(
            "miniapp_spec_decode_accepted_tokens", "Drafted tokens the model accepted"
        )
        self.adapter_requests = counter(
            "miniapp_lora_requests", "Answers run with each LoRA adapter", ("adapter",)
        )

    def _define_histograms(self) -> None:
        def histogram(name: str, text: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, text, buckets=buckets, registry=self.registry)

        self.ttft = histogram(
            "miniapp_time_to_first_token_seconds",
            "Request received to an answer's first token",
            TTFT_BUCKETS,
        )
        self.inter_token = histogram(
            "miniapp_inter_token_latency_seconds",
            "Gap between successive tokens of an answer",
            INTER_TOKEN_BUCKETS,
        )
        self.e2e = histogram(
            "miniapp_e2e_request_latency_seconds",
            "Request received to an answer's end",
            E2E_BUCKETS,
        )

    def _define_gauges(self) -> None:
        figures = {
            "miniapp_requests_running": (
                "Answers generating (or evaluating their prompt)",
                self._running,
            ),
            "miniapp_requests_waiting": ("Answers waiting for a slot or their turn", self._waiting),
            "miniapp_kv_cache_reserved_bytes": (
                "KV memory reserved by running answers and kept prefixes (batching engine)",
                self._kv_reserved,
            ),
            "miniapp_kv_cache_budget_bytes": (
                "KV memory the batching engine may reserve (0: no bound, or no batching engine)",
                self._kv_budget,
            ),
            "miniapp_kv_cache_usage_ratio": (
                "KV memory reserved / budget (0 without a budget)",
                self._kv_usage,
            ),
        }
        for name, (text, read) in figures.items():
            Gauge(name, text, registry=self.registry).set_function(read)
        self.registry.register(_AdapterFigures(self))
        self.registry.register(_ModelFigures(self))
        if self.breaker is not None:
            self.registry.register(_BreakerFigures(self.breaker))

    # -- what the gauges read at scrape time

    def _scheduler(self):
        """The batching scheduler: the torch engine's with --parallel above 1, else None."""
        return getattr(self.served.host.runtime, "scheduler", None)

    def _running(self) -> int:
        scheduler = self._scheduler()
        return self.turns.running if scheduler is None else scheduler.running_count

    def _waiting(self) -> int:
        scheduler = self._scheduler()
        return self.turns.waiting if scheduler is None else scheduler.waiting_count

    def _kv_reserved(self) -> int:
        scheduler = self._scheduler()
        return 0 if scheduler is None else scheduler.kv_bytes_reserved()

    def _kv_budget(self) -> int:
        scheduler = self._scheduler()
        return 0 if scheduler is None else scheduler.config.kv_budget_bytes or 0

    def _kv_usage(self) -> float:
        budget = self._kv_budget()
        return self._kv_reserved() / budget if budget else 0.0


class _AdapterFigures:
    """The loaded LoRA adapters' gauges, one series each, read from the torch engine's
    registry at the scrape (an unloaded adapter's series go with it)."""

    def __init__(self, metrics: ServeMetrics):
        self.metrics = metrics

    def collect(self):
        families = {
            "bytes": GaugeMetricFamily(
                "miniapp_lora_adapter_bytes",
                "A loaded LoRA adapter's A and B in memory (0 while let go past the budget)",
                labels=("adapter",),
            ),
            "seconds": GaugeMetricFamily(
                "miniapp_lora_adapter_load_seconds",
                "Seconds a LoRA adapter's latest read from its file took",
                labels=("adapter",),
            ),
            "loads": GaugeMetricFamily(
                "miniapp_lora_adapter_loads",
                "Times a loaded LoRA adapter was read from its file (reread past the budget)",
                labels=("adapter",),
            ),
        }
        registry = getattr(self.metrics.served.host.runtime, "lora", None)
        for info in registry.list() if registry is not None else ():
            families["bytes"].add_metric([info.name], info.nbytes if info.resident else 0)
            families["seconds"].add_metric([info.name], info.load_seconds)
            families["loads"].add_metric([info.name], info.loads)
        yield from families.values()


class _ModelFigures:
    """Models loaded on demand: how often each was loaded, and whether it is resident now."""

    def __init__(self, metrics: ServeMetrics):
        self.metrics = metrics

    def collect(self):
        host = self.metrics.served.host
        loads = CounterMetricFamily(
            "miniapp_model_loads",
            "Loads begun of each model, since the server started",
            labels=("model",),
        )
        for label, count in sorted(host.loads.items()):
            loads.add_metric([label], count)
        resident = GaugeMetricFamily(
            "miniapp_models_resident", "Models loaded and kept in memory now"
        )
        states = host.resident_specs().values()
        resident.add_metric([], sum(1 for state in states if state is LoadState.READY))
        yield loads
        yield resident


class _TurnCounts:
    """Answers running and waiting where they take turns (a runtime without a scheduler:
    llama.cpp, or --parallel 1), as their relays report them."""

    def __init__(self):
        self._lock = threading.Lock()
        self.running = 0
        self.waiting = 0

    def add(self, running: int = 0, waiting: int = 0) -> None:
        with self._lock:
            self.running += running
            self.waiting += waiting


class RequestObserver(RelayObserver):
    """Records one request's answers into the app's metrics. Latencies count from the
    observer's creation, so a first token's includes the time waiting for a slot."""

    def __init__(self, metrics: ServeMetrics, jobs: int, adapters: tuple[str, ...] = ()):
        self.metrics, self.adapters = metrics, adapters
        self.started_at = time.perf_counter()
        self._last_token_at: dict[int, float] = {}  # each index is one generation thread's
        self._lock = threading.Lock()
        self._unopened = jobs  # jobs waiting for their turn
        self._closed = False
        metrics.turns.add(waiting=jobs)

    def opened(self, index: int) -> None:
        with self._lock:
            opened = 1 if self._unopened else 0  # one may open after `closed` (a race)
            self._unopened -= opened
        self.metrics.turns.add(running=1, waiting=-opened)
        for name in self.adapters:
            self.metrics.adapter_requests.labels(name).inc()

    def token(self, index: int) -> None:
        now = time.perf_counter()
        last = self._last_token_at.get(index)
        if last is None:
            self.metrics.ttft.observe(now - self.started_at)
        else:
            self.metrics.inter_token.observe(now - last)
        self._last_token_at[index] = now

    def ended(self, index: int) -> None:
        self.metrics.turns.add(running=-1)

    def finished(self, index: int, finished: Finished) -> None:
        metrics, stats = self.metrics, finished.stats
        metrics.e2e.observe(time.perf_counter() - self.started_at)
        metrics.prompt_tokens.inc(stats.prompt_tokens)
        metrics.cached_prompt_tokens.inc(stats.cached_prompt_tokens)
        metrics.generation_tokens.inc(stats.generated_tokens)
        metrics.requests_finished.labels(self._finish_reason(finished)).inc()
        if stats.speculation is not None:
            metrics.drafted_tokens.inc(stats.speculation.drafted)
            metrics.accepted_tokens.inc(stats.speculation.accepted)

    def closed(self) -> None:
        with self._lock:
            unopened, self._unopened, self._closed = self._unopened, 0, True
        self.metrics.turns.add(waiting=-unopened)

    def _finish_reason(self, finished: Finished) -> str:
        """OpenAI's finish_reason, or "cancelled": the relay closes before an answer ends only
        when its client went away (or the request was refused), and a cancelled batched
        sequence may end looking like one that ran out of tokens."""
        if self._closed or finished.reason is FinishReason.CANCELLED:
            return "cancelled"
        return finish_reason(finished)


class _BreakerFigures:
    """The circuit breaker: its state now (one series per state, 1 for the current one) and
    how often it opened."""

    def __init__(self, breaker: CircuitBreaker):
        self.breaker = breaker

    def collect(self):
        current = self.breaker.state
        state = GaugeMetricFamily(
            "miniapp_breaker_state",
            "The circuit breaker's state (1 for the current one): closed, open, half_open",
            labels=("state",),
        )
        for each in BreakerState:
            state.add_metric([each.value], 1.0 if each is current else 0.0)
        yield state
        trips = CounterMetricFamily(
            "miniapp_breaker_trips", "Times the circuit breaker opened since the server started"
        )
        trips.add_metric([], self.breaker.trips)
        yield trips
