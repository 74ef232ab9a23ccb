"""Serving many clients at once on our batching engine: aggregate speed, latencies, memory,
and whether batching changed any greedy answer (`miniapp bench serve`).

Each client sends its requests back to back; the scheduler's steps run on this process's
main thread (`BatchScheduler.serve`), the clients on threads of their own, as a server's
would. Every answer is compared with the same prompt's answer from a lone client.
"""

from __future__ import annotations

import resource
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from ..batching import BatchConfig, BatchScheduler
from ..devices import estimate_footprint
from ..gguf_file import GGUFFile
from ..models import CachePolicy, build_model
from ..runtimes.base import default_threads
from ..sampling import GREEDY


@dataclass(frozen=True)
class ServingResult:
    clients: int
    requests: int
    aggregate_tok_s: float
    ttft_p50_s: float
    ttft_p99_s: float
    itl_p50_s: float
    itl_p99_s: float
    peak_rss_mb: float
    identical_output: bool

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class _Request:
    prompt_index: int
    tokens: list[int]
    times: list[float]  # each token's arrival
    sent: float


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0-100), linearly interpolated; 0 for no values."""
    return float(np.percentile(values, q)) if values else 0.0


class ServingBench:
    def __init__(self, model_path: Path, prompts: list[list[int]], tokens: int, ctx: int,
                 threads: int | None = None):  # fmt: skip
        torch.set_num_threads(threads or default_threads())
        gguf = GGUFFile(model_path)
        self.model = build_model(gguf)
        self.prompts, self.tokens = prompts, tokens
        self.policy = CachePolicy(ctx)
        self.kv_bytes_per_token = estimate_footprint(gguf, ctx=1).kv_bytes  # fp32 keys, values
        self._lone: dict[int, list[int]] = {}

    def lone_answers(self) -> None:
        """Each prompt's greedy answer alone (one slot), the reference for `identical`."""
        scheduler = BatchScheduler(self.model, self.policy, BatchConfig(slots=1))
        for index, prompt in enumerate(self.prompts):
            self._lone[index] = list(scheduler.submit(prompt, GREEDY, self.tokens))

    def run(self, clients: int, requests_per_client: int) -> ServingResult:
        scheduler = BatchScheduler(
            self.model, self.policy, BatchConfig(slots=clients, max_queue=clients * 2)
        )
        done: list[_Request] = []
        lock = threading.Lock()

        def client(number: int) -> None:
            for j in range(requests_per_client):
                index = (number * requests_per_client + j) % len(self.prompts)
                request = _Request(index, [], [], time.perf_counter())
                for token in scheduler.submit(self.prompts[index], GREEDY, self.tokens):
                    request.tokens.append(token)
                    request.times.append(time.perf_counter())
                with lock:
                    done.append(request)

        stop = threading.Event()
        timing: dict[str, float] = {}

        def launch() -> None:
            while not scheduler.serving:  # the clients wait on their streams, never step
                time.sleep(0.001)
            threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
            timing["started"] = time.perf_counter()
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            timing["ended"] = time.perf_counter()
            stop.set()

        launcher = threading.Thread(target=launch)
        launcher.start()
        scheduler.serve(stop)  # the steps, on the main thread
        launcher.join()
        return self._result(clients, done, timing["ended"] - timing["started"])

    def _result(self, clients: int, done: list[_Request], wall: float) -> ServingResult:
        ttfts = [r.times[0] - r.sent for r in done if r.times]
        gaps = [b - a for r in done for a, b in zip(r.times, r.times[1:], strict=False)]
        generated = sum(len(r.tokens) for r in done)
        identical = all(r.tokens == self._lone.get(r.prompt_index, r.tokens) for r in done)
        peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return ServingResult(
            clients, len(done), generated / wall if wall > 0 else 0.0,
            percentile(ttfts, 50), percentile(ttfts, 99), percentile(gaps, 50),
            percentile(gaps, 99), peak_kb / 1024, identical,
        )  # fmt: skip
