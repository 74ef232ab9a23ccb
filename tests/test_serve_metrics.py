"""`GET /metrics` of a real `miniapp serve` process (the bundled SmolLM2 on the batching
engine), driven by the official `openai` package and scraped with httpx: the counters and
histograms must agree with what the answers' `usage` says."""

from __future__ import annotations

import time
from collections import Counter

import httpx
import openai
import pytest
from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_client.parser import text_string_to_metric_families
from test_serve import MODEL, first_content, running_server, wait_ready

KEY = "metrics-key"
AUTH = {"authorization": f"Bearer {KEY}"}
Samples = dict[tuple[str, tuple], float]


@pytest.fixture(scope="module")
def server(miniapp_exe):
    with running_server(miniapp_exe, "--parallel", "2", "--api-key", KEY) as (_, base):
        wait_ready(base)
        yield base


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0)


def scrape(base: str) -> Samples:
    response = httpx.get(base + "/metrics", headers=AUTH, timeout=30)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == CONTENT_TYPE_LATEST
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(response.text)
        for sample in family.samples
    }


def grown(before: Samples, after: Samples, name: str, **labels: str) -> float:
    key = (name, tuple(sorted(labels.items())))
    return after[key] - before.get(key, 0.0)


def chat(client, content: str, **options):
    return client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": content}], temperature=0, **options
    )


def answer_figures(client) -> list[tuple[object, str]]:
    """Five greedy answers, plain and streamed, chat and text: (usage, finish_reason) each."""
    answers = []
    for response in (
        chat(client, "Name three colours.", max_tokens=8),
        chat(client, "Say OK.", max_tokens=24),
        client.completions.create(
            model=MODEL, prompt="The capital of France is", max_tokens=6, temperature=0
        ),
    ):
        answers.append((response.usage, response.choices[0].finish_reason))
    streamed = [
        chat(
            client,
            "Tell me a story about a dragon.",
            max_tokens=5,
            stream=True,
            stream_options={"include_usage": True},
        ),
        client.completions.create(
            model=MODEL,
            prompt="One, two,",
            max_tokens=4,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        ),
    ]
    for stream in streamed:
        chunks = list(stream)
        [reason] = [
            c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
        ]
        answers.append((chunks[-1].usage, reason))
    return answers


def test_token_counters_and_latency_histograms_match_the_answers(server, client):
    before = scrape(server)
    answers = answer_figures(client)
    after = scrape(server)
    usages = [usage for usage, _ in answers]
    generated = sum(u.completion_tokens for u in usages)
    assert grown(before, after, "miniapp_prompt_tokens_total") == sum(
        u.prompt_tokens for u in usages
    )
    assert grown(before, after, "miniapp_prompt_tokens_cached_total") == sum(
        u.prompt_tokens_details.cached_tokens for u in usages
    )
    assert grown(before, after, "miniapp_generation_tokens_total") == generated
    # Every answer: one first token, one end, and a gap between each two successive tokens.
    assert grown(before, after, "miniapp_time_to_first_token_seconds_count") == len(answers)
    assert grown(before, after, "miniapp_e2e_request_latency_seconds_count") == len(answers)
    assert grown(before, after, "miniapp_inter_token_latency_seconds_count") == (
        generated - len(answers)
    )
    first_tokens_s = grown(before, after, "miniapp_time_to_first_token_seconds_sum")
    assert 0 < first_tokens_s < grown(before, after, "miniapp_e2e_request_latency_seconds_sum")
    reasons = Counter(reason for _, reason in answers)
    assert reasons["length"] > 0
    for reason in ("stop", "length", "cancelled"):
        found = grown(before, after, "miniapp_requests_finished_total", finish_reason=reason)
        assert found == reasons[reason], reason
    # --spec off (the test server's): nothing drafted.
    assert after[("miniapp_spec_decode_draft_tokens_total", ())] == 0


def test_a_streaming_answer_is_running_and_one_whose_client_leaves_ends_cancelled(server):
    essay = [{"role": "user", "content": "Write a very long essay on rivers."}]
    long_answer = {
        "model": MODEL,
        "messages": essay,
        "max_tokens": 400,
        "temperature": 0,
        "stream": True,
    }
    before = scrape(server)
    with httpx.Client(timeout=60, headers=AUTH) as http:
        with http.stream("POST", server + "/v1/chat/completions", json=long_answer) as stream:
            lines = stream.iter_lines()  # kept: a dropped iterator closes the connection
            first_content(lines)  # it is generating
            during = scrape(server)
    assert during[("miniapp_requests_running", ())] == 1
    assert during[("miniapp_requests_waiting", ())] == 0
    reserved = during[("miniapp_kv_cache_reserved_bytes", ())]
    budget = during[("miniapp_kv_cache_budget_bytes", ())]
    assert 0 < reserved <= budget
    assert during[("miniapp_kv_cache_usage_ratio", ())] == pytest.approx(reserved / budget)
    # The client hung up mid-answer: the server cancels it and frees its slot.
    deadline = time.monotonic() + 20
    while True:
        after = scrape(server)
        cancelled = grown(
            before, after, "miniapp_requests_finished_total", finish_reason="cancelled"
        )
        if cancelled == 1 and after[("miniapp_requests_running", ())] == 0:
            break
        assert time.monotonic() < deadline, "the answer was never cancelled"
        time.sleep(0.1)
    assert grown(before, after, "miniapp_requests_finished_total", finish_reason="length") == 0


def test_metrics_need_the_key_but_health_does_not(server):
    assert httpx.get(server + "/health").status_code == 200
    denied = httpx.get(server + "/metrics")
    assert denied.status_code == 401 and denied.json()["error"]["code"] == "invalid_api_key"
