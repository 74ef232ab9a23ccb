"""`miniapp serve`, through real clients: the official `openai` package and raw HTTP (httpx)
against a real server process on a loopback port, answering with the bundled SmolLM2 on the
batching engine."""

from __future__ import annotations

import json
import os
import queue
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import openai
import pytest

MODEL = "smollm2-135m-instruct"
START_TIMEOUT_S = 120.0
KEY = "sekret-123"


@contextmanager
def running_server(miniapp_exe: str, *flags: str) -> Iterator[tuple[subprocess.Popen, str]]:
    """A `miniapp serve` process on a free loopback port; yields it and its base URL."""
    proc = subprocess.Popen(
        [miniapp_exe, "serve", "--port", "0", "--ctx", "1024", "--spec", "off", *flags],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=os.environ.copy(),
    )
    try:
        line = read_line(proc, START_TIMEOUT_S)
        assert line.startswith("miniapp serve: http://127.0.0.1:"), line + proc.stdout.read()
        base = line.split()[2].removesuffix("/v1")
        threading.Thread(target=proc.stdout.read, daemon=True).start()  # keep the pipe drained
        yield proc, base
    finally:
        stop_server(proc)


def stop_server(proc: subprocess.Popen) -> None:
    """Ask the server to stop; kill it if it has not within 15 s."""
    proc.terminate()
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()


def read_line(proc: subprocess.Popen, timeout_s: float) -> str:
    """The process's next line of output, failing after `timeout_s` rather than waiting for
    ever on a line that never comes."""
    line: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: line.put(proc.stdout.readline()), daemon=True).start()
    try:
        return line.get(timeout=timeout_s)
    except queue.Empty:
        raise AssertionError(f"no line from {proc.args[:2]} within {timeout_s:.0f} s") from None


def wait_ready(base: str) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if httpx.get(base + "/health").status_code == 200:
            return
        time.sleep(0.2)
    raise AssertionError("the server never became ready")


@pytest.fixture(scope="module")
def server(miniapp_exe):
    with running_server(miniapp_exe, "--parallel", "4", "--queue", "8") as (_, base):
        wait_ready(base)
        yield base


@pytest.fixture(scope="module")
def guarded(miniapp_exe):
    """Two slots, one waiting place, a key and a 1 MB body limit."""
    flags = (
        "--parallel",
        "2",
        "--queue",
        "1",
        "--api-key",
        KEY,
        "--max-body-mb",
        "1",
        "--cors-origin",
        "http://editor.example",
    )
    with running_server(miniapp_exe, *flags) as (_, base):
        wait_ready(base)
        yield base


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0)


# Greedy answers long enough to have parted between the terminal (once its own path) and the
# server: the first did at its 14th token on the q8 cache.
SAME_ANSWER_QUESTIONS = ("Name three colours.", "Why is the sky blue?")


def test_the_terminal_and_the_server_give_the_same_greedy_answers(miniapp_exe, client):
    for question in SAME_ANSWER_QUESTIONS:
        served = chat(client, question, temperature=0, max_tokens=48)
        local = subprocess.run(
            [
                miniapp_exe,
                "chat",
                "--ctx",
                "1024",
                "--spec",
                "off",
                "--temperature",
                "0",
                "--max-tokens",
                "48",
            ],
            input=question + "\n",
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert local.returncode == 0, local.stderr
        assert local.stdout.strip() == served.choices[0].message.content.strip()


def chat(client, content: str, **options):
    return client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": content}], **options
    )


def first_content(lines: Iterator[str]) -> str:
    """Read a chat stream's lines up to its first piece of answer text. (Keep the iterator:
    one dropped half-way closes the connection, and the server then cancels the answer.)"""
    for line in lines:
        if line.startswith("data: {"):
            delta = json.loads(line.removeprefix("data: "))["choices"][0]["delta"]
            if delta.get("content"):
                return delta["content"]
    raise AssertionError("the stream ended without text")


# ------------------------------------------------------------------ the openai package


def test_plain_and_streamed_chat_give_the_same_greedy_answer(client):
    plain = chat(client, "Name three colours.", temperature=0, max_tokens=24)
    assert plain.object == "chat.completion" and plain.model == MODEL
    [choice] = plain.choices
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    usage = plain.usage
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert 0 < usage.completion_tokens <= 24

    chunks = list(
        chat(
            client,
            "Name three colours.",
            temperature=0,
            max_tokens=24,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert len({c.id for c in chunks}) == 1
    assert chunks[0].choices[0].delta.role == "assistant"
    *body, last_choice, usage_chunk = chunks
    assert last_choice.choices[0].finish_reason == choice.finish_reason
    assert all(c.choices[0].finish_reason is None for c in body)
    assert (
        usage_chunk.choices == [] and usage_chunk.usage.completion_tokens == usage.completion_tokens
    )
    assert usage_chunk.usage.prompt_tokens_details.cached_tokens > 0  # the same prompt again
    text = "".join(c.choices[0].delta.content or "" for c in body)
    assert text == choice.message.content


def test_max_tokens_ends_with_length_and_stop_strings_cut_the_answer(client):
    short = chat(client, "Tell me a long story about a dragon.", temperature=0, max_tokens=3)
    assert short.choices[0].finish_reason == "length" and short.usage.completion_tokens == 3
    brief = chat(client, "Say hello in five words.", temperature=0, max_tokens=40)
    assert brief.choices[0].finish_reason == "stop" and brief.usage.completion_tokens < 40
    forced = chat(
        client,
        "Say hello in five words.",
        temperature=0,
        max_tokens=40,
        extra_body={"ignore_eos": True},
    )
    assert forced.choices[0].finish_reason == "length" and forced.usage.completion_tokens == 40
    limited = chat(
        client, "Tell me a long story about a dragon.", temperature=0, max_completion_tokens=40
    )
    full = limited.choices[0].message.content
    words = full.split()
    assert len(words) > 6, full
    stop = " " + words[5]
    cut = chat(
        client,
        "Tell me a long story about a dragon.",
        temperature=0,
        max_tokens=40,
        stop=[stop, "never-appears"],
    )
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].message.content == full[: full.index(stop)]


def test_a_seed_reproduces_a_sampled_answer_and_n_gives_that_many(client):
    options = {"temperature": 1.0, "top_p": 1.0, "max_tokens": 16, "seed": 1234}
    first = chat(client, "Write a word.", **options).choices[0].message.content
    again = chat(client, "Write a word.", **options).choices[0].message.content
    assert first == again
    several = chat(client, "Write a word.", n=2, **options)
    assert [c.index for c in several.choices] == [0, 1]
    assert several.choices[0].message.content == first  # choice 0 draws from the seed itself
    alone = chat(client, "Write a word.", **options)
    assert several.usage.completion_tokens > alone.usage.completion_tokens  # both counted
    assert several.usage.prompt_tokens == alone.usage.prompt_tokens  # the prompt once


def test_logprobs_join_to_the_answer_plain_and_streamed(client):
    plain = chat(
        client, "Name a fruit.", temperature=0, max_tokens=12, logprobs=True, top_logprobs=2
    )
    choice = plain.choices[0]
    content = choice.logprobs.content
    assert "".join(t.token for t in content) == choice.message.content
    assert all(t.logprob <= 0 and len(t.top_logprobs) == 2 for t in content)
    assert all(t.top_logprobs[0].token == t.token for t in content)  # greedy: the best one
    assert all(bytes(t.bytes).decode() == t.token for t in content)
    chunks = chat(
        client,
        "Name a fruit.",
        temperature=0,
        max_tokens=12,
        logprobs=True,
        top_logprobs=2,
        stream=True,
    )
    streamed = [
        t
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for t in c.choices[0].logprobs.content
    ]
    assert [(t.token, t.logprob) for t in streamed] == [(t.token, t.logprob) for t in content]
    text = client.completions.create(
        model=MODEL, prompt="One, two,", max_tokens=5, temperature=0, logprobs=2
    )
    lp = text.choices[0].logprobs
    assert "".join(lp.tokens) == text.choices[0].text and len(lp.top_logprobs[0]) == 2
    assert lp.text_offset == [sum(map(len, lp.tokens[:i])) for i in range(len(lp.tokens))]
    assert all(v <= 0 for v in lp.token_logprobs)


def test_completions_plain_streamed_and_several_prompts(client):
    plain = client.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=6, temperature=0
    )
    assert plain.object == "text_completion" and plain.choices[0].text
    streamed = client.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=6, temperature=0, stream=True
    )
    pieces = list(streamed)
    assert "".join(p.choices[0].text for p in pieces) == plain.choices[0].text
    assert pieces[-1].choices[0].finish_reason == plain.choices[0].finish_reason
    both = client.completions.create(
        model=MODEL,
        prompt=["One, two,", "The capital of France is"],
        max_tokens=6,
        temperature=0,
        n=2,
    )
    assert [c.index for c in both.choices] == [0, 1, 2, 3]
    assert both.choices[2].text == both.choices[3].text == plain.choices[0].text
    echoed = client.completions.create(
        model=MODEL, prompt="One, two,", max_tokens=6, temperature=0, echo=True
    )
    assert echoed.choices[0].text == "One, two," + both.choices[0].text


def test_eight_clients_at_once_each_get_the_answer_they_get_alone(client):
    prompts = [f"Give one fact about the number {n}." for n in range(8)]
    alone = [
        chat(client, p, temperature=0, max_tokens=20).choices[0].message.content for p in prompts
    ]
    together: dict[int, str] = {}

    def ask(i: int) -> None:
        together[i] = (
            chat(client, prompts[i], temperature=0, max_tokens=20).choices[0].message.content
        )

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert [together.get(i) for i in range(8)] == alone


def test_a_request_may_choose_its_kv_policy_and_a_bad_one_is_a_400(client):
    """Our extension (torch engine): which tokens the answer's cache keeps once full."""
    chosen = chat(
        client, "Say hi.", temperature=0, max_tokens=8, extra_body={"kv_policy": "attention"}
    )
    assert chosen.choices[0].message.content
    with pytest.raises(openai.BadRequestError, match="kv_policy"):
        chat(client, "hi", extra_body={"kv_policy": "h2o"})


def test_unsupported_and_bad_requests_are_400s_naming_the_field(client):
    with pytest.raises(openai.BadRequestError, match="top_logprobs needs logprobs: true"):
        chat(client, "hi", top_logprobs=2)
    with pytest.raises(
        openai.BadRequestError, match="Unrecognized request argument supplied: tools_extra"
    ):
        chat(client, "hi", extra_body={"tools_extra": 1})
    with pytest.raises(openai.BadRequestError, match="temperature"):
        chat(client, "hi", temperature=5)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}])
    long = "word " * 1500
    too_long = r"maximum context length is 1024 tokens\. However, your messages resulted in \d+"
    with pytest.raises(openai.BadRequestError, match=too_long):
        chat(client, long)


def test_the_models_list_names_the_loaded_model_with_its_context(client):
    models = client.models.list().data
    assert models[0].id == MODEL
    assert models[0].model_extra["context_length"] == 1024 and models[0].model_extra["loaded"]


# ------------------------------------------------------------------ raw HTTP


def test_the_event_stream_framing_and_done(server):
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 4,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with httpx.stream("POST", server + "/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    payloads = [json.loads(e.removeprefix("data: ")) for e in events[:-2]]
    assert all(e.startswith("data: ") for e in events[:-1])
    assert all(p["object"] == "chat.completion.chunk" for p in payloads)
    assert all(p["usage"] is None for p in payloads[:-1])
    assert payloads[-1]["choices"] == [] and payloads[-1]["usage"]["completion_tokens"] == 4


def test_error_bodies_have_openais_shape(server):
    def error(response, status):
        assert response.status_code == status, response.text
        found = response.json()["error"]
        assert set(found) == {"message", "type", "param", "code"} and found["message"]
        return found

    url = server + "/v1/chat/completions"
    bad_json = httpx.post(url, content=b"{not json", headers={"content-type": "application/json"})
    assert error(bad_json, 400)["code"] == "invalid_json"
    assert error(httpx.post(url, json={"model": MODEL}), 400)["param"] == "messages"
    wrong_type = httpx.post(url, json={"model": MODEL, "messages": "hi"})
    assert error(wrong_type, 400)["param"].startswith("messages")
    assert error(httpx.post(url, json=[1, 2]), 400)["message"]
    unknown = httpx.post(
        url, json={"model": "nope", "messages": [{"role": "user", "content": "x"}]}
    )
    assert error(unknown, 404)["code"] == "model_not_found"
    assert error(httpx.get(server + "/v1/nothing-here"), 404)["message"] == "no such endpoint"


def test_tokenize_and_detokenize_speak_llama_servers_and_vllms_shapes(server):
    from miniapp.engine.api import Tokenizer, resolve_model

    tokenizer = Tokenizer(resolve_model(MODEL))
    text = "<|im_start|>user\nHéllo, wörld!<|im_end|>"
    expected = tokenizer.encode(text, add_bos=False)

    def post(path, body):
        response = httpx.post(server + path, json=body)
        assert response.status_code == 200, response.text
        return response.json()

    assert post("/tokenize", {"content": text}) == {"tokens": expected}
    literal = post("/tokenize", {"content": text, "parse_special": False})["tokens"]
    assert len(literal) > len(expected)  # the markers spelt out, not read as control tokens
    pieces = post("/tokenize", {"content": text, "with_pieces": True})["tokens"]
    assert [p["id"] for p in pieces] == expected
    spelt = b"".join(
        bytes(p["piece"]) if isinstance(p["piece"], list) else p["piece"].encode() for p in pieces
    )
    assert spelt.decode() == text
    vllm = post("/tokenize", {"model": MODEL, "prompt": "Hello"})
    assert vllm["count"] == len(vllm["tokens"]) and vllm["max_model_len"] == 1024
    back = post("/detokenize", {"tokens": expected})
    assert back["content"] == back["prompt"] == text
    for path, body, param in (
        ("/detokenize", {"tokens": [10**9]}, "tokens"),
        ("/tokenize", {}, "content"),
        ("/tokenize", {"content": "a", "prompt": "b"}, "content"),
    ):
        response = httpx.post(server + path, json=body)
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == param


EMBEDDED = [
    "The cat sat on the mat.",
    "Paris is the capital of France.",
    "def add(a, b): return a + b",
    "hello",
    "Embeddings map text to vectors.",
    "Ünïcödé ✓",
    "A long text. " * 40,
    "x",
]


def test_embeddings_are_unit_vectors_the_same_alone_in_a_batch_and_as_base64(client):
    import base64

    import numpy as np

    batch = client.embeddings.create(model=MODEL, input=EMBEDDED)
    vectors = np.array([item.embedding for item in batch.data], dtype=np.float32)
    assert [item.index for item in batch.data] == list(range(len(EMBEDDED)))
    assert np.allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    alone = client.embeddings.create(model=MODEL, input=EMBEDDED[6])
    assert np.array_equal(np.array(alone.data[0].embedding, dtype=np.float32), vectors[6])
    packed = client.embeddings.create(model=MODEL, input=EMBEDDED[1], encoding_format="base64")
    decoded = np.frombuffer(base64.b64decode(packed.data[0].embedding), dtype="<f4")
    assert np.array_equal(decoded, vectors[1])
    tokens = httpx.post(server_of(client) + "/tokenize", json={"content": EMBEDDED[3]}).json()
    by_ids = client.embeddings.create(model=MODEL, input=tokens["tokens"])
    assert np.array_equal(np.array(by_ids.data[0].embedding, dtype=np.float32), vectors[3])
    assert batch.usage.prompt_tokens > len(EMBEDDED)
    assert len({v.tobytes() for v in vectors}) == len(EMBEDDED)  # each text its own vector


def server_of(client: openai.OpenAI) -> str:
    return str(client.base_url).rstrip("/").removesuffix("/v1")


def test_bad_embedding_requests_are_400s_naming_the_field(client):
    for options, param in (
        ({"input": "hi", "dimensions": 8}, "dimensions"),
        ({"input": ""}, "input"),
        ({"input": []}, "input"),
        ({"input": "word " * 2000}, "input"),
        ({"input": "hi", "encoding_format": "int8"}, "encoding_format"),
    ):
        with pytest.raises(openai.BadRequestError) as raised:
            client.embeddings.create(model=MODEL, **options)
        assert raised.value.body["param"] == param, raised.value.body
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="no-such-model", input="hi")


def test_rerank_scores_each_document_alone_and_sorts_them(server):
    query = "What is the capital of France?"
    documents = [
        "Bananas are a yellow fruit rich in potassium.",
        "Paris is the capital and largest city of France.",
        "The stock market fell on Tuesday.",
    ]

    def rerank(docs, **options):
        body = {"model": MODEL, "query": query, "documents": docs, **options}
        response = httpx.post(server + "/v1/rerank", json=body, timeout=60)
        assert response.status_code == 200, response.text
        return response.json()

    answer = rerank(documents)
    results = answer["results"]
    scores = [r["relevance_score"] for r in results]
    assert sorted(r["index"] for r in results) == [0, 1, 2]
    assert scores == sorted(scores, reverse=True) and all(0 < s < 1 for s in scores)
    assert all(r["document"]["text"] == documents[r["index"]] for r in results)
    assert answer["usage"]["prompt_tokens"] > 0
    # A document's score does not depend on the others, or on its place among them.
    alone = rerank([documents[2]], return_documents=False)["results"]
    assert alone == [
        {"index": 0, "relevance_score": scores[[r["index"] for r in results].index(2)]}
    ]
    top = httpx.post(
        server + "/rerank", json={"query": query, "documents": documents, "top_n": 1}
    ).json()["results"]
    assert [r["index"] for r in top] == [results[0]["index"]]
    missing = httpx.post(server + "/v1/rerank", json={"query": query, "documents": []})
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "documents"


def test_a_request_id_is_echoed_or_made_on_every_answer(server, guarded):
    given = {"x-request-id": "client-id-42"}
    answer = httpx.post(server + "/tokenize", json={"content": "hi"}, headers=given)
    assert answer.headers["x-request-id"] == "client-id-42"
    made = httpx.get(server + "/v1/models").headers["x-request-id"]
    assert len(made) == 32 and made != httpx.get(server + "/v1/models").headers["x-request-id"]
    refused = httpx.get(guarded + "/v1/models", headers=given)  # no key: still named
    assert refused.status_code == 401 and refused.headers["x-request-id"] == "client-id-42"
    odd = httpx.get(server + "/v1/models", headers={"x-request-id": "no spaces <allowed>"})
    assert odd.headers["x-request-id"] != "no spaces <allowed>"


def test_a_key_guards_the_api_but_not_health(guarded):
    assert httpx.get(guarded + "/health").status_code == 200
    denied = openai.OpenAI(base_url=guarded + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError, match="Incorrect API key"):
        denied.models.list()
    response = httpx.get(guarded + "/v1/models")
    assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"
    allowed = openai.OpenAI(base_url=guarded + "/v1", api_key=KEY, max_retries=0)
    assert allowed.models.list().data[0].id == MODEL


def test_cors_answers_only_the_origins_named(guarded, server):
    preflight = {
        "origin": "http://editor.example",
        "access-control-request-method": "POST",
        "access-control-request-headers": "authorization, content-type",
    }
    allowed = httpx.options(guarded + "/v1/chat/completions", headers=preflight)
    assert allowed.status_code == 200
    assert allowed.headers["access-control-allow-origin"] == "http://editor.example"
    other = httpx.options(
        guarded + "/v1/chat/completions", headers=preflight | {"origin": "http://elsewhere.example"}
    )
    assert "access-control-allow-origin" not in other.headers
    plain = httpx.get(server + "/v1/models", headers={"origin": "http://editor.example"})
    assert "access-control-allow-origin" not in plain.headers  # off unless named


def test_a_body_over_the_limit_is_413(guarded):
    headers = {"authorization": f"Bearer {KEY}"}
    big = {"model": MODEL, "messages": [{"role": "user", "content": "x" * (2 << 20)}]}
    response = httpx.post(guarded + "/v1/chat/completions", json=big, headers=headers)
    assert response.status_code == 413 and "over the limit" in response.json()["error"]["message"]

    def chunked():
        yield b'{"model": "' + MODEL.encode() + b'", "messages": [{"role": "user", "content": "'
        for _ in range(40):
            yield b"y" * 65536
        yield b'"}]}'

    streamed = httpx.post(
        guarded + "/v1/chat/completions",
        content=chunked(),
        headers=headers | {"content-type": "application/json"},
    )
    assert streamed.status_code == 413


def test_a_full_queue_is_503_and_a_client_that_leaves_frees_its_slot(guarded):
    headers = {"authorization": f"Bearer {KEY}"}
    long_answer = {
        "model": MODEL,
        "max_tokens": 400,
        "temperature": 0,
        "stream": True,
        "messages": [{"role": "user", "content": "Write a very long essay on rivers."}],
    }
    clients = [httpx.Client(timeout=120, headers=headers) for _ in range(3)]
    streams = []
    try:
        for c in clients:  # two slots busy, one request waiting
            request = c.build_request("POST", guarded + "/v1/chat/completions", json=long_answer)
            streams.append(c.send(request, stream=True))
        assert [s.status_code for s in streams] == [200, 200, 200]
        lines = [s.iter_lines() for s in streams]
        for stream_lines in lines[:2]:
            first_content(stream_lines)  # both are generating
        full = httpx.post(guarded + "/v1/chat/completions", json=long_answer, headers=headers)
        assert full.status_code == 503, full.text
        assert full.headers["retry-after"] == "1" and full.json()["error"]["code"] == "queue_full"
        # The first client hangs up mid-answer: the waiting request takes its slot at once.
        streams[0].close()
        clients[0].close()
        started = time.monotonic()
        first_content(lines[2])
        assert time.monotonic() - started < 10, "the freed slot was not reused at once"
    finally:
        for s in streams:
            s.close()
        for c in clients:
            c.close()


def test_health_is_503_while_the_model_loads_and_answers_slide_past_the_context(miniapp_exe):
    with running_server(miniapp_exe, "--ctx", "128") as (_, base):
        first = httpx.get(base + "/health")
        assert first.status_code == 503 and first.json()["error"]["code"] == "model_loading"
        wait_ready(base)
        assert httpx.get(base + "/health").json() == {"status": "ok"}
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
        # The torch engine's sliding window: an answer asked for more than the context holds
        # goes on past it, as in the terminal.
        long = chat(
            client,
            "Count from one to a thousand.",
            temperature=0,
            max_tokens=200,
            extra_body={"ignore_eos": True},
        )
        assert long.usage.prompt_tokens + long.usage.completion_tokens > 128
        assert long.usage.completion_tokens == 200 and long.choices[0].finish_reason == "length"


def test_binding_beyond_loopback_needs_a_key(miniapp_exe):
    done = subprocess.run(
        [miniapp_exe, "serve", "--host", "0.0.0.0", "--port", "0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert done.stderr.strip().endswith("or bind 127.0.0.1") and "--api-key" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


def test_the_gui_serves_the_api_beside_it_on_the_same_model(miniapp_exe):
    command = [
        miniapp_exe,
        "gui",
        "--no-browser",
        "--port",
        str(_free_port()),
        "--ctx",
        "1024",
        "--api",
        "--api-port",
        "0",
    ]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        lines = [read_line(proc, START_TIMEOUT_S) for _ in range(2)]
        api = next(line for line in lines if line.startswith("miniapp serve: "))
        gui = next(line for line in lines if line.startswith("miniapp GUI: "))
        threading.Thread(target=proc.stdout.read, daemon=True).start()
        base = api.split()[2].removesuffix("/v1")
        wait_ready(base)
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
        answer = chat(client, "Say hi.", temperature=0, max_tokens=4)
        assert answer.model == MODEL and answer.usage.completion_tokens > 0
        assert httpx.get(gui.split()[2]).status_code == 200  # the GUI is up beside it
    finally:
        proc.terminate()
        proc.wait(timeout=20)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
