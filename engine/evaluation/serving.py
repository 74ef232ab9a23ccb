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
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from ..batching import BatchConfig, BatchScheduler
from ..kv.footprint import estimate_footprint
from ..kv.types import KVSetting, default_kv_type, kv_type
from ..modelfile.gguf_file import GGUFFile
from ..models import CachePolicy, build_model
from ..runtimes.base import default_threads
from ..tokens.sampling import GREEDY


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
class ClientRequest:
    """One request as its client saw it."""

    prompt_index: int
    tokens: list[int]
    times: list[float]  # each token's arrival
    sent: float


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0-100), linearly interpolated; 0 for no values."""
    return float(np.percentile(values, q)) if values else 0.0


class ServingBench:
    def __init__(
        self,
        model_path: Path,
        prompts: list[list[int]],
        tokens: int,
        ctx: int,
        threads: int | None = None,
        kv: str | KVSetting | None = None,
    ):
        """`kv`: how every sequence's KV cache stores keys and values (--kv-type; None: the
        default for the model)."""
        asked = None if kv is None else kv_type(kv)  # a bad name is one line, before loading
        torch.set_num_threads(threads or default_threads())
        gguf = GGUFFile(model_path)
        self.model = build_model(gguf)
        self.kv_type = asked or default_kv_type(self.model.config.head_dim)
        self.kv_type.check(self.model.config.head_dim)
        self.prompts, self.tokens = prompts, tokens
        self.policy = CachePolicy(ctx, kv_type=self.kv_type)
        self.kv_bytes_per_token = estimate_footprint(gguf, 1, self.kv_type).kv_bytes
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

        def stream(index: int) -> Iterable[int]:
            return scheduler.submit(self.prompts[index], GREEDY, self.tokens)

        stop = threading.Event()
        outcome: dict[str, object] = {}

        def launch() -> None:
            try:
                while not scheduler.serving:  # the clients wait on their streams, never step
                    time.sleep(0.001)
                count = len(self.prompts)
                outcome["run"] = run_clients(clients, requests_per_client, count, stream)
            except BaseException as exc:  # re-raised on the main thread
                outcome["error"] = exc
            finally:
                stop.set()  # else the main thread would step forever

        launcher = threading.Thread(target=launch)
        launcher.start()
        scheduler.serve(stop)  # the steps, on the main thread
        launcher.join()
        if "error" in outcome:
            raise outcome["error"]
        done, wall = outcome["run"]
        peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return summarize(clients, done, wall, self._lone, peak_kb / 1024)


def run_clients(
    clients: int,
    requests_per_client: int,
    prompt_count: int,
    stream: Callable[[int], Iterable[int]],
) -> tuple[list[ClientRequest], float]:
    """`clients` threads, each sending its requests back to back: `stream(index)` sends prompt
    `index` and yields the answer's tokens as they arrive. Returns the finished requests and
    the wall time of the whole run. The first error in a client is raised here."""
    done: list[ClientRequest] = []
    failures: list[BaseException] = []
    lock = threading.Lock()

    def client(number: int) -> None:
        try:
            for j in range(requests_per_client):
                index = (number * requests_per_client + j) % prompt_count
                request = ClientRequest(index, [], [], time.perf_counter())
                for token in stream(index):
                    request.tokens.append(token)
                    request.times.append(time.perf_counter())
                with lock:
                    done.append(request)
        except BaseException as exc:  # else lost with its thread
            with lock:
                failures.append(exc)

    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - started
    if failures:
        raise failures[0]
    return done, wall


def summarize(
    clients: int,
    done: list[ClientRequest],
    wall: float,
    lone: dict[int, list[int]],
    peak_rss_mb: float,
) -> ServingResult:
    """The figures of one run; `lone` holds each prompt's answer from a lone client."""
    ttfts = [r.times[0] - r.sent for r in done if r.times]
    gaps = [b - a for r in done for a, b in zip(r.times, r.times[1:], strict=False)]
    generated = sum(len(r.tokens) for r in done)
    identical = all(r.tokens == lone.get(r.prompt_index, r.tokens) for r in done)
    return ServingResult(
        clients,
        len(done),
        generated / wall if wall > 0 else 0.0,
        percentile(ttfts, 50),
        percentile(ttfts, 99),
        percentile(gaps, 50),
        percentile(gaps, 99),
        peak_rss_mb,
        identical,
    )
