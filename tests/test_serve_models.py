"""Several models in one `miniapp serve`: a request naming another installed model loads
it (503 with Retry-After while it loads), `--max-models` keeps the two resident, and
`--idle-unload` lets both go, after which they load again, each once. Through the official
`openai` client (which honours Retry-After) against a real server, watching its RSS."""

from __future__ import annotations

import re
import threading
import time

import httpx
import openai
import pytest
from test_serve import MODEL, running_server, wait_ready

from miniapp.engine.api import RuntimeConfig, estimate_memory

OTHER = "gemma3-270m"
IDLE_S = 3
CLIENTS, ROUNDS = 4, 3
MIB = 1024 * 1024


def rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


class PeakRss:
    """The process's highest RSS, sampled every 50 ms while it runs."""

    def __init__(self, pid: int):
        self.pid, self.peak, self._stop = pid, 0, threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._stop.wait(0.05):
            self.peak = max(self.peak, rss(self.pid))

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


@pytest.fixture(scope="module")
def two_model_server(miniapp_exe):
    flags = ("--parallel", "2", "--max-models", "2", "--idle-unload", str(IDLE_S))
    with running_server(miniapp_exe, *flags) as (proc, base):
        wait_ready(base)
        yield proc, base


def loads(base: str) -> dict[str, int]:
    text = httpx.get(base + "/metrics").text
    found = re.findall(r'miniapp_model_loads_total\{model="([^"]+)"\} (\d+)', text)
    return {name: int(float(count)) for name, count in found}


def states(base: str) -> dict[str, str]:
    return {m["id"]: m["state"] for m in httpx.get(base + "/v1/models").json()["data"]}


def alternate(base: str) -> list[str]:
    """CLIENTS clients, each asking the two models in turn ROUNDS times; their failures."""
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=20)
    failures: list[str] = []

    def ask(number: int) -> None:
        for turn in range(ROUNDS):
            model = (MODEL, OTHER)[(number + turn) % 2]
            try:
                answer = client.chat.completions.create(
                    model=model,
                    messages=[{"role": "user", "content": f"Say one word. ({number}.{turn})"}],
                    max_tokens=6,
                    temperature=0,
                )
                if answer.model != model:
                    failures.append(f"asked {model}, answered by {answer.model}")
            except openai.OpenAIError as exc:
                failures.append(repr(exc))

    threads = [threading.Thread(target=ask, args=(n,)) for n in range(CLIENTS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return failures


def wait_unloaded(base: str) -> None:
    deadline = time.monotonic() + IDLE_S + 20
    while any(state != "not-loaded" for state in states(base).values()):
        assert time.monotonic() < deadline, states(base)
        time.sleep(0.25)


def settled_rss(pid: int) -> int:
    """The RSS once it stops falling (a model let go gives its memory back a moment after
    /v1/models says so)."""
    previous = rss(pid)
    for _ in range(40):
        time.sleep(0.25)
        now = rss(pid)
        if abs(now - previous) < 4 * MIB:
            return now
        previous = now
    return previous


def test_a_model_not_loaded_is_503_with_retry_after_while_it_loads(two_model_server):
    _, base = two_model_server
    wait_unloaded(base)
    body = {"model": OTHER, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    first = httpx.post(base + "/v1/chat/completions", json=body)
    assert first.status_code == 503, first.text
    assert int(first.headers["Retry-After"]) >= 1
    assert first.json()["error"]["code"] == "model_loading"
    assert states(base)[OTHER] in ("loading", "loaded")
    unknown = httpx.post(base + "/v1/chat/completions", json=body | {"model": "no-such-model"})
    assert unknown.status_code == 404
    # Anthropic's API says the same in its own shape (its clients retry an overloaded_error).
    wait_unloaded(base)
    message = {"model": OTHER, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    refused = httpx.post(base + "/v1/messages", json=message)
    assert refused.status_code == 503 and int(refused.headers["Retry-After"]) >= 1
    assert refused.json()["error"]["type"] == "overloaded_error", refused.text


def test_two_models_asked_in_turn_by_four_clients_load_once_per_idle_period(two_model_server):
    proc, base = two_model_server
    wait_unloaded(base)
    before = loads(base)
    floor = settled_rss(proc.pid)  # both let go
    expected = sum(estimate_memory(RuntimeConfig(m, ctx=1024)) for m in (MODEL, OTHER))
    # Both models' weights and caches, and as much again for the engine's working memory,
    # the tokenizers and the answers' threads.
    bound = floor + 2 * expected
    peaks = []
    for period in range(2):
        watch = PeakRss(proc.pid)
        failures = alternate(base)
        assert failures == [], failures
        assert states(base)[MODEL] == states(base)[OTHER] == "loaded"
        counted = loads(base)
        for model in (MODEL, OTHER):
            assert counted[model] - before.get(model, 0) == period + 1, (counted, before)
        wait_unloaded(base)
        peaks.append(watch.stop())
        assert peaks[-1] <= bound, (peaks[-1] // MIB, bound // MIB)
    # Letting both go gives their memory back: the second period needs no more than the first.
    assert peaks[1] <= peaks[0] + 64 * MIB, [p // MIB for p in peaks]
    assert settled_rss(proc.pid) <= floor + 64 * MIB
