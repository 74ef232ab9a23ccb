"""The short run of tests/fuzz_api.py (its long one is `make fuzz-api`): every operation of
`miniapp serve`'s OpenAPI schema gets a few cases that schemathesis generates, valid and
invalid by the schema, the same ones every run, against one real server (the bundled
SmolLM2, with a key from a key file). No status of 500 or above but the bounds' 503s, every
error in its API's shape, no hang; afterwards no answer left running and a plain chat
answered. The checks themselves are tested on made-up responses first, so that a failure of
the fuzz is known to be the server's."""

from __future__ import annotations

import json
import time

import pytest
from fuzz_api import (
    CHOICE_CAP,
    LIST_CAP,
    MODES,
    TOKEN_CAP,
    Fuzzer,
    aftermath,
    bounded,
    fuzz_server,
    response_problems,
    served_model,
)

EXAMPLES = 4  # cases per operation and mode (about 30 s in all on two cores)
BUDGET_S = 70.0  # past this nothing more is sent, and the test fails: something is slow
TIMEOUT_S = 20.0  # an answer slower than this is a hang (they take a second or two)

JSON = "application/json"
STREAM = "text/event-stream"


def _body(value) -> bytes:
    return json.dumps(value).encode()


def _openai_error(code: str | None = None) -> bytes:
    return _body({"error": {"message": "m", "type": "t", "param": None, "code": code}})


ANTHROPIC_ERROR = _body({"type": "error", "error": {"type": "overloaded_error", "message": "m"}})
# The error events a stream ends with when something crashed while it ran.
ENGINE_FAILED = {"message": "the engine failed: RuntimeError: x", "type": "server_error"}
CRASHED = {"type": "api_error", "message": "internal error: KeyError: 0"}
FAILED_RESPONSE = {
    "type": "response.failed",
    "response": {"error": {"code": "server_error", "message": "the engine failed: x"}},
}
# The Responses API says server_error for any error; a refusal's wording is no crash.
REFUSED_RESPONSE = {
    "type": "response.failed",
    "response": {"error": {"code": "server_error", "message": "the context is full"}},
}


def _event(payload: dict) -> bytes:
    return f"data: {json.dumps(payload)}\n\n".encode()


# ------------------------------------------------------------------ the checks, on their own


@pytest.mark.parametrize(
    ("path", "status", "content_type", "content"),
    [
        ("/v1/chat/completions", 200, JSON, _body({"choices": []})),
        ("/v1/chat/completions", 400, JSON, _openai_error("invalid_value")),
        ("/v1/chat/completions", 503, JSON, _openai_error("queue_full")),
        ("/v1/embeddings", 503, JSON, _openai_error("engine_unavailable")),
        ("/tokenize", 503, JSON, _openai_error("model_loading")),
        ("/v1/messages", 503, JSON, ANTHROPIC_ERROR),
        ("/v1/chat/completions", 200, STREAM, b'data: {"choices":[]}\n\ndata: [DONE]\n\n'),
        ("/metrics", 200, "text/plain; version=0.0.4", b"miniapp_requests_running 0.0\n"),
        ("/v1/responses", 200, STREAM, _event(REFUSED_RESPONSE)),
    ],
)
def test_the_checks_pass_answers_and_the_bounds_refusals(path, status, content_type, content):
    assert response_problems(path, status, content_type, content) == []


@pytest.mark.parametrize(
    ("path", "status", "content_type", "content", "problem"),
    [
        ("/v1/chat/completions", 500, JSON, _openai_error(), "a server error (500)"),
        ("/v1/chat/completions", 503, JSON, _openai_error("other"), "a server error (503)"),
        ("/v1/completions", 502, "text/plain", b"Bad Gateway", "a server error (502)"),
        ("/v1/chat/completions", 400, JSON, _body({"detail": "x"}), "not in OpenAI's"),
        ("/v1/messages", 400, JSON, _openai_error(), "not in Anthropic's"),
        ("/v1/responses", 404, "text/plain", b"Not Found", "not in OpenAI's"),
        ("/v1/models", 200, JSON, b"{not json", "does not parse"),
        ("/v1/chat/completions", 200, STREAM, _event({"error": ENGINE_FAILED}), "a crash's"),
        ("/v1/messages", 200, STREAM, _event({"type": "error", "error": CRASHED}), "a crash's"),
        ("/v1/responses", 200, STREAM, _event(FAILED_RESPONSE), "a crash's"),
    ],
)
def test_the_checks_fail_server_errors_shapeless_errors_and_crashed_streams(
    path, status, content_type, content, problem
):
    problems = response_problems(path, status, content_type, content)
    assert any(problem in found for found in problems), problems


def test_generated_bodies_are_bounded_but_keep_their_small_and_invalid_values():
    chat = bounded("/v1/chat/completions", {"messages": [], "n": 8, "max_tokens": 10**9})
    assert chat["max_tokens"] == TOKEN_CAP and chat["n"] == CHOICE_CAP
    unset = bounded("/v1/chat/completions", {"max_completion_tokens": None})
    assert unset["max_tokens"] == TOKEN_CAP  # unset, an answer runs to the end of the context
    kept = {"max_tokens": -3, "n": "two", "max_completion_tokens": 2}
    assert bounded("/v1/chat/completions", kept) == kept
    assert bounded("/v1/responses", {"input": "x"})["max_output_tokens"] == TOKEN_CAP
    assert "max_tokens" not in bounded("/v1/messages", {"messages": []})  # required: a 400
    prompts = bounded("/v1/completions", {"prompt": ["a", "b", "c", "d"], "max_tokens": 1})
    assert prompts["prompt"] == ["a", "b"][:LIST_CAP]
    tokens = bounded("/v1/completions", {"prompt": [1, 2, 3, 4], "max_tokens": 1})
    assert tokens["prompt"] == [1, 2, 3, 4]  # one prompt of token ids
    assert bounded("/v1/chat/completions", b"\x00") == b"\x00"


# ------------------------------------------------------------------ the fuzz


@pytest.fixture(scope="module")
def fuzzed(miniapp_exe, tmp_path_factory):
    """One server, every operation fuzzed; yields the process, its URL, model and fuzzer."""
    log = tmp_path_factory.mktemp("fuzz") / "server.log"  # a 500's traceback is there
    with fuzz_server(miniapp_exe, log) as (proc, base):
        model = served_model(base)
        fuzzer = Fuzzer(base, model, derandomize=True, timeout=TIMEOUT_S)
        fuzzer.until = time.monotonic() + BUDGET_S
        for operation in fuzzer.operations:
            for mode in MODES:
                fuzzer.fuzz(operation, mode, EXAMPLES)
        yield proc, base, model, fuzzer, log


def test_every_operation_answers_without_server_errors_in_its_api_shape(fuzzed):
    *_, fuzzer, log = fuzzed
    figures = fuzzer.figures
    sent = {label for label, _ in figures.by_operation}
    assert sent == {operation.label for operation in fuzzer.operations}
    assert fuzzer.unsent == 0, f"{fuzzer.unsent} cases not sent within {BUDGET_S:.0f} s"
    assert not figures.generation_errors, figures.report()
    assert not figures.failures, f"{figures.report()}\nthe server's log: {log}"


def test_the_server_comes_out_of_the_fuzz_idle_and_answering(fuzzed):
    proc, base, model, *_ = fuzzed
    assert aftermath(proc, base, model) == []
