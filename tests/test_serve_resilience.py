"""A real `miniapp serve` under the failures a busy server meets: an engine that fails at
every step (the circuit breaker opens, refuses at once, and closes by itself once a probe
succeeds), a request past `--request-timeout`, a client that stops reading its stream
(`--stall-timeout`: the middleware over a send that never completes), and requests with
vLLM's `priority` field."""

from __future__ import annotations

import asyncio
import os
import re
import time
from pathlib import Path

import httpx
import openai
import pytest
from test_serve import MODEL, running_server, wait_ready

from miniapp.app.serve.breaker import BreakerState, CircuitBreaker, Verdict
from miniapp.app.serve.errors import ApiError
from miniapp.app.serve.middleware import DeadlineMiddleware
from miniapp.app.serve.records import CURRENT_RECORD, RequestRecord
from miniapp.engine.platform.faults import FAULT_FILE_VARIABLE

REQUEST_TIMEOUT_S = 4
BREAKER_PAUSE_S = 2


@pytest.fixture(scope="module")
def fault_file(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("faults") / "fail-every-step"


@pytest.fixture(scope="module")
def server(miniapp_exe, fault_file):
    flags = [
        "--parallel", "2",
        "--request-timeout", str(REQUEST_TIMEOUT_S),
        "--breaker-threshold", "2",
        "--breaker-pause", str(BREAKER_PAUSE_S),
    ]  # fmt: skip
    os.environ[FAULT_FILE_VARIABLE] = str(fault_file)  # the server's environment, at its start
    try:
        with running_server(miniapp_exe, *flags) as (_, base):
            wait_ready(base)
            yield base
    finally:
        del os.environ[FAULT_FILE_VARIABLE]


def chat(base: str, max_tokens: int = 2, **options) -> httpx.Response:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}
    body |= {"max_tokens": max_tokens, "temperature": 0, **options}
    return httpx.post(base + "/v1/chat/completions", json=body, timeout=60)


def metric(base: str, name: str, labels: str = "") -> float:
    text = httpx.get(base + "/metrics").text
    match = re.search(rf"^{re.escape(name + labels)} (\S+)$", text, re.MULTILINE)
    assert match, f"{name}{labels} not in /metrics"
    return float(match.group(1))


def wait_until_idle(base: str, within_s: float) -> float:
    """Seconds until no answer runs or waits (failing after `within_s`)."""
    started = time.monotonic()
    while time.monotonic() - started < within_s:
        busy = metric(base, "miniapp_requests_running") + metric(base, "miniapp_requests_waiting")
        if busy == 0:
            return time.monotonic() - started
        time.sleep(0.1)
    raise AssertionError(f"answers still running {within_s} s later")


def test_the_breaker_opens_after_engine_failures_refuses_at_once_and_closes_after_a_probe(
    server, fault_file
):
    fault_file.touch()
    try:
        # The threshold: two that fail in the engine, streamed (once the stream has begun:
        # an error event ends it) and plain (a 500).
        client = openai.OpenAI(base_url=server + "/v1", api_key="none", max_retries=0)
        stream = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2, stream=True
        )
        with pytest.raises(openai.APIError, match="fault was injected"):
            list(stream)
        failed = chat(server)
        assert failed.status_code == 500 and "fault was injected" in failed.text
        started = time.perf_counter()
        refused = chat(server)
        refused_in = time.perf_counter() - started
        assert refused.status_code == 503, refused.text
        error = refused.json()["error"]
        assert error["code"] == "engine_unavailable" and "fault was injected" in error["message"]
        assert 1 <= int(refused.headers["Retry-After"]) <= BREAKER_PAUSE_S
        assert refused_in < 0.5  # no queueing: refused before any work (the target is 10 ms)
        health = httpx.get(server + "/health")
        assert health.status_code == 503 and health.json()["error"]["code"] == "engine_unavailable"
        assert metric(server, "miniapp_breaker_state", '{state="open"}') == 1
        assert metric(server, "miniapp_breaker_trips_total") >= 1
    finally:
        fault_file.unlink()
    time.sleep(int(refused.headers["Retry-After"]))
    probe = chat(server)  # the pause is over: this one goes through, succeeds, and closes it
    assert probe.status_code == 200, probe.text
    assert httpx.get(server + "/health").status_code == 200
    assert metric(server, "miniapp_breaker_state", '{state="closed"}') == 1


def test_a_request_past_the_timeout_gets_504_and_its_slot_is_freed(server):
    started = time.monotonic()
    answer = chat(server, max_tokens=20_000, ignore_eos=True)
    assert answer.status_code == 504, answer.text
    assert answer.json()["error"]["code"] == "request_timeout"
    assert REQUEST_TIMEOUT_S <= time.monotonic() - started < REQUEST_TIMEOUT_S + 3
    wait_until_idle(server, within_s=3)


def test_a_stream_past_the_timeout_ends_with_an_error_event(server):
    client = openai.OpenAI(base_url=server + "/v1", api_key="none", max_retries=0)
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Tell a long story."}],
        max_tokens=20_000,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    chunks = 0
    with pytest.raises(openai.APIError, match="request-timeout"):
        for _ in stream:
            chunks += 1
    assert chunks > 1  # it streamed, then was cut
    wait_until_idle(server, within_s=3)


def test_a_client_that_stops_reading_its_stream_is_dropped_and_its_answers_stopped():
    """The middleware alone, over a connection whose send never completes (a client that
    stopped reading, its socket's buffers full): after the stall timeout the request ends,
    without an error, and its answers are stopped as a disconnect stops them."""
    record = RequestRecord("stalled", "POST", "/v1/chat/completions")
    stopped = []
    record.on_stop(lambda: stopped.append(time.monotonic()))
    sent = []

    async def streaming_app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        for _ in range(1000):
            await send({"type": "http.response.body", "body": b"data: {}\n\n", "more_body": True})

    async def full_socket(message):
        sent.append(message["type"])
        if len(sent) > 3:  # the buffers are full: this send never completes
            await asyncio.Event().wait()

    async def run():
        token = CURRENT_RECORD.set(record)
        try:
            deadline = DeadlineMiddleware(streaming_app, request_timeout=None, stall_timeout=0.2)
            await deadline({"type": "http", "path": "/v1/chat/completions"}, None, full_socket)
        finally:
            CURRENT_RECORD.reset(token)

    started = time.monotonic()
    asyncio.run(asyncio.wait_for(run(), 5))
    assert len(stopped) == 1 and 0.2 <= stopped[0] - started < 1.0
    assert sent[0] == "http.response.start" and len(sent) == 4


def test_priority_is_taken_as_vllms_field_and_must_be_an_integer(server):
    assert chat(server, priority=-5).status_code == 200
    refused = chat(server, priority="high")
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "priority"


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_breaker_counts_only_failures_in_a_row_and_lets_one_probe_through_at_a_time():
    clock = FakeClock()
    breaker = CircuitBreaker(threshold=2, pause=10, clock=clock)
    breaker.failed("oom", probe=False)
    breaker.succeeded(probe=False)  # a success in between: the count starts again
    breaker.failed("oom", probe=False)
    assert breaker.state is BreakerState.CLOSED and breaker.admit() is False
    breaker.failed("native fault", probe=False)
    assert breaker.state is BreakerState.OPEN and breaker.trips == 1
    with pytest.raises(ApiError) as refused:
        breaker.admit()
    assert refused.value.status == 503 and "native fault" in refused.value.message
    assert refused.value.headers == {"Retry-After": "10"}
    clock.now = 10.0
    assert breaker.admit() is True  # the probe
    with pytest.raises(ApiError):
        breaker.admit()  # the others wait for the probe's verdict
    breaker.abandoned(probe=True)  # its client left: the next request probes instead
    assert breaker.admit() is True
    breaker.failed("still failing", probe=True)  # open again, for another pause
    assert breaker.state is BreakerState.OPEN and breaker.trips == 2
    clock.now = 19.5
    assert breaker.retry_after() == 1
    clock.now = 20.0
    assert breaker.admit() is True
    breaker.succeeded(probe=True)
    assert breaker.state is BreakerState.CLOSED and breaker.admit() is False


def test_a_verdict_reaches_the_breaker_once_whatever_follows():
    breaker = CircuitBreaker(threshold=1, pause=10, clock=FakeClock())
    verdict = Verdict(breaker, probe=False)
    verdict.succeeded()
    verdict.failed("late")  # the same request's later report is ignored
    assert breaker.state is BreakerState.CLOSED
    Verdict(breaker, probe=False).failed("oom")
    assert breaker.state is BreakerState.OPEN
