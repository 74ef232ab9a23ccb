"""Each request's OpenTelemetry span tree and JSON log line (app/serve/tracing.py): a real
`miniapp serve --otlp-endpoint ... --log-format json` process, driven by the official `openai`
client and httpx, sends its spans to a loopback OTLP/HTTP receiver in this process and its log
lines to its stderr; and the spans of hand-built records, through an in-memory exporter."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
import threading
import time
from datetime import datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace

import httpx
import openai
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode
from test_serve import MODEL, stop_server, wait_ready

from miniapp.app.serve.records import AnswerTiming, AnswerTimings, RequestRecord
from miniapp.app.serve.tracing import log_fields, outcome, span_sink, tracer_provider
from miniapp.engine.api import Finished, FinishReason, GenerationStats
from miniapp.engine.platform.faults import FAULT_FILE_VARIABLE

ARRIVAL_TIMEOUT_S = 15.0  # spans are exported every 0.5 s; a log line is written at once
SERVER_KIND, ERROR_CODE = 2, 2  # OTLP's SPAN_KIND_SERVER and STATUS_CODE_ERROR
STAGES = {"receive", "queue", "prefill", "decode", "stream"}


# ------------------------------------------------------------------ the collector


class OtlpReceiver:
    """An OTLP/HTTP trace collector on a loopback port: keeps every span it is sent, with
    its resource's attributes."""

    def __init__(self):
        self.spans: list[SimpleNamespace] = []
        self.lock = threading.Lock()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}/v1/traces"

    def _handler(self):
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                if self.headers.get("content-encoding") == "gzip":
                    body = gzip.decompress(body)
                if self.path != "/v1/traces":
                    self.send_error(404)
                    return
                receiver.keep(ExportTraceServiceRequest.FromString(body))
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args):  # quiet: the test's output is about the server
                pass

        return Handler

    def keep(self, export: ExportTraceServiceRequest) -> None:
        for resource_spans in export.resource_spans:
            resource = attributes(resource_spans.resource.attributes)
            for scope_spans in resource_spans.scope_spans:
                with self.lock:
                    self.spans += [received(span, resource) for span in scope_spans.spans]

    def trace_of(self, request_id: str) -> list[SimpleNamespace]:
        """The spans of the request with this id, once its root (ended last) has come."""
        deadline = time.monotonic() + ARRIVAL_TIMEOUT_S
        while time.monotonic() < deadline:
            with self.lock:
                roots = [s for s in self.spans if is_root_of(s, request_id)]
                if roots:
                    return [s for s in self.spans if s.trace_id == roots[0].trace_id]
            time.sleep(0.1)
        raise AssertionError(f"no trace of request {request_id} within {ARRIVAL_TIMEOUT_S} s")

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def received(span, resource: dict) -> SimpleNamespace:
    return SimpleNamespace(
        name=span.name,
        trace_id=span.trace_id,
        span_id=span.span_id,
        parent=span.parent_span_id,
        kind=span.kind,
        start=span.start_time_unix_nano,
        end=span.end_time_unix_nano,
        status=span.status.code,
        description=span.status.message,
        attributes=attributes(span.attributes),
        resource=resource,
    )


def attributes(pairs) -> dict:
    return {pair.key: any_value(pair.value) for pair in pairs}


def any_value(value):
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [any_value(v) for v in value.array_value.values]
    return getattr(value, kind) if kind else None


def is_root_of(span: SimpleNamespace, request_id: str) -> bool:
    return not span.parent and span.attributes.get("miniapp.request_id") == request_id


# ------------------------------------------------------------------ the server


@pytest.fixture(scope="module")
def receiver():
    collector = OtlpReceiver()
    yield collector
    collector.close()


@pytest.fixture(scope="module")
def fault_file(tmp_path_factory) -> Path:
    """While this file exists, every step of the server's engine fails (platform/faults.py)."""
    return tmp_path_factory.mktemp("faults") / "fail-every-step"


@pytest.fixture(scope="module")
def server(miniapp_exe, receiver, fault_file):
    """Two slots and one waiting place (a fourth request is refused by the engine); its
    stderr kept line by line."""
    flags = ["--threads", "1", "--parallel", "2", "--queue", "1"]
    flags += ["--otlp-endpoint", receiver.endpoint, "--log-format", "json"]
    proc = subprocess.Popen(
        [miniapp_exe, "serve", "--port", "0", "--ctx", "1024", "--spec", "off", *flags],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=os.environ | {FAULT_FILE_VARIABLE: str(fault_file)},
    )
    stderr: list[str] = []
    threading.Thread(target=keep_lines, args=(proc.stderr, stderr), daemon=True).start()
    try:
        line = proc.stdout.readline()  # the address, or nothing if it failed to start
        assert line.startswith("miniapp serve: http://127.0.0.1:"), line + "".join(stderr)
        threading.Thread(target=proc.stdout.read, daemon=True).start()  # keep it drained
        base = line.split()[2].removesuffix("/v1")
        wait_ready(base)
        yield SimpleNamespace(base=base, stderr=stderr)
    finally:
        stop_server(proc)


def keep_lines(stream, lines: list[str]) -> None:
    for line in stream:
        lines.append(line)


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base + "/v1", api_key="unused", max_retries=0)


def log_line(server, request_id: str) -> dict:
    """The server's JSON log line for the request with this id."""
    deadline = time.monotonic() + ARRIVAL_TIMEOUT_S
    while time.monotonic() < deadline:
        for line in list(server.stderr):
            if line.startswith("{") and json.loads(line).get("request_id") == request_id:
                assert line.count("\n") == 1 and line.endswith("\n"), line  # one line each
                return json.loads(line)
        time.sleep(0.1)
    raise AssertionError(f"no log line for {request_id}:\n" + "".join(server.stderr[-20:]))


def tree(spans: list[SimpleNamespace]) -> tuple[SimpleNamespace, dict[str, list]]:
    """The root, and its children by name, checked to hang from it within its times."""
    roots = [s for s in spans if not s.parent]
    assert len(roots) == 1, [s.name for s in spans]
    root = roots[0]
    children: dict[str, list] = {}
    for span in spans:
        if span is root:
            continue
        assert span.parent == root.span_id, span.name
        assert root.start <= span.start <= span.end <= root.end, span.name
        children.setdefault(span.name, []).append(span)
    assert set(children) <= STAGES, set(children)
    return root, children


def has_words(event_line: str) -> bool:
    """Whether a streamed event carries some of the answer (the first carries only the role)."""
    return '"content":"' in event_line and '"content":""' not in event_line


def question(content: str, max_tokens: int) -> dict:
    return {
        "model": MODEL,
        "max_tokens": max_tokens,
        "temperature": 0,
        "messages": [{"role": "user", "content": content}],
    }


# ------------------------------------------------------------------ through the server


def test_a_plain_chat_is_one_span_tree_and_one_log_line(client, server, receiver):
    raw = client.chat.completions.with_raw_response.create(
        **question("Name three colours.", 8), extra_headers={"X-Request-Id": "plain-1"}
    )
    assert raw.headers["x-request-id"] == "plain-1"
    completion = raw.parse()

    root, children = tree(receiver.trace_of("plain-1"))
    assert root.name == "POST /v1/chat/completions" and root.kind == SERVER_KIND
    assert root.resource["service.name"] == "miniapp"
    assert root.attributes == {
        "http.request.method": "POST",
        "url.path": "/v1/chat/completions",
        "http.response.status_code": 200,
        "miniapp.request_id": "plain-1",
        "gen_ai.request.model": MODEL,
        "gen_ai.usage.input_tokens": completion.usage.prompt_tokens,
        "gen_ai.usage.output_tokens": completion.usage.completion_tokens,
        "miniapp.stream": False,
        "miniapp.outcome": "ok",
    }
    assert root.status != ERROR_CODE
    assert sorted(children) == sorted(STAGES)
    assert all(len(spans) == 1 for spans in children.values())
    receive, queue, prefill, decode = (
        children[name][0] for name in ("receive", "queue", "prefill", "decode")
    )
    assert receive.start == root.start and receive.end == queue.start
    assert queue.end == prefill.start and prefill.end == decode.start < decode.end
    assert decode.attributes == {
        "miniapp.answer.index": 0,
        "gen_ai.usage.input_tokens": completion.usage.prompt_tokens,
        "miniapp.cached_tokens": completion.usage.prompt_tokens_details.cached_tokens,
        "gen_ai.usage.output_tokens": completion.usage.completion_tokens,
        "gen_ai.response.finish_reasons": [completion.choices[0].finish_reason],
    }

    logged = log_line(server, "plain-1")
    assert {k: logged[k] for k in ("method", "path", "status", "model", "stream")} == {
        "method": "POST",
        "path": "/v1/chat/completions",
        "status": 200,
        "model": MODEL,
        "stream": False,
    }
    assert logged["prompt_tokens"] == completion.usage.prompt_tokens
    assert logged["completion_tokens"] == completion.usage.completion_tokens
    assert logged["outcome"] == "ok" and logged["error"] is None and logged["key"] is None
    assert 0 < logged["ttft_ms"] <= logged["duration_ms"]
    assert abs(logged["duration_ms"] - (root.end - root.start) / 1e6) < 0.1
    started = datetime.fromisoformat(logged["time"]).timestamp()
    assert abs(started - root.start / 1e9) < 0.001


def test_a_streamed_chat_has_its_stream_stage(client, server, receiver):
    stream = client.chat.completions.create(
        **question("Name three rivers.", 12),
        stream=True,
        stream_options={"include_usage": True},
        extra_headers={"X-Request-Id": "streamed-1"},
    )
    assert stream.response.headers["x-request-id"] == "streamed-1"
    usage = [chunk.usage for chunk in stream if chunk.usage is not None][0]

    root, children = tree(receiver.trace_of("streamed-1"))
    assert root.attributes["miniapp.stream"] is True
    assert root.attributes["miniapp.outcome"] == "ok"
    assert root.attributes["gen_ai.usage.output_tokens"] == usage.completion_tokens
    assert sorted(children) == sorted(STAGES)
    # The response begins before the answer's last token: the stream outlasts the decoding.
    assert children["stream"][0].start <= children["decode"][0].end <= children["stream"][0].end

    logged = log_line(server, "streamed-1")
    assert logged["stream"] is True and logged["outcome"] == "ok"
    assert logged["completion_tokens"] == usage.completion_tokens


def test_a_client_that_leaves_mid_stream_is_cancelled(server, receiver):
    body = question("Write a very long essay on rivers.", 400) | {"stream": True}
    headers = {"X-Request-Id": "left-1"}
    with httpx.Client(timeout=60) as http:
        with http.stream(
            "POST", server.base + "/v1/chat/completions", json=body, headers=headers
        ) as response:
            assert response.headers["x-request-id"] == "left-1"
            words = (line for line in response.iter_lines() if has_words(line))
            next(words)  # the first words: then the client hangs up

    root, children = tree(receiver.trace_of("left-1"))
    assert root.attributes["miniapp.outcome"] == "cancelled"
    assert root.status != ERROR_CODE
    assert {"queue", "prefill"} <= set(children)
    for stage in children.get("decode", []):
        assert "gen_ai.response.finish_reasons" not in stage.attributes

    logged = log_line(server, "left-1")
    assert logged["outcome"] == "cancelled" and logged["error"] is None


def test_bad_requests_are_refused_with_an_error_status(client, server, receiver):
    missing = httpx.post(
        server.base + "/v1/chat/completions",
        json={"model": MODEL},
        headers={"X-Request-Id": "bad-body-1"},
    )
    assert missing.status_code == 400
    root, children = tree(receiver.trace_of("bad-body-1"))
    assert root.attributes["miniapp.outcome"] == "refused"
    assert root.attributes["http.response.status_code"] == 400
    assert root.status == ERROR_CODE and "messages" in root.description
    assert set(children) == {"receive", "stream"}  # nothing ran
    assert "gen_ai.request.model" not in root.attributes  # refused before a model was picked
    logged = log_line(server, "bad-body-1")
    assert logged["status"] == 400 and logged["outcome"] == "refused"
    assert "messages" in logged["error"] and logged["ttft_ms"] is None

    with pytest.raises(openai.NotFoundError) as refused:
        client.chat.completions.create(**question("Hi", 4) | {"model": "no-such-model"})
    made_id = refused.value.response.headers["x-request-id"]  # the client gave none
    root, _ = tree(receiver.trace_of(made_id))
    assert root.attributes["http.response.status_code"] == 404
    assert root.attributes["miniapp.outcome"] == "refused" and root.status == ERROR_CODE
    assert log_line(server, made_id)["outcome"] == "refused"


def test_an_answer_the_engine_fails_is_a_failed_tree_naming_the_failure(
    server, receiver, fault_file
):
    fault_file.touch()
    try:
        failed = httpx.post(
            server.base + "/v1/chat/completions",
            json=question("Hi", 4),
            headers={"X-Request-Id": "engine-fails-1"},
            timeout=60,
        )
    finally:
        fault_file.unlink()
    assert failed.status_code == 500, failed.text
    root, children = tree(receiver.trace_of("engine-fails-1"))
    assert root.attributes["miniapp.outcome"] == "failed"
    assert root.attributes["http.response.status_code"] == 500
    assert root.status == ERROR_CODE and "fault was injected" in root.description
    assert "queue" in children and "decode" not in children  # it failed at its first step
    logged = log_line(server, "engine-fails-1")
    assert logged["outcome"] == "failed" and "fault was injected" in logged["error"]


def test_an_answer_the_engines_full_queue_refuses_stops_at_its_queue(server, receiver):
    """Two slots busy and the one waiting place taken: the engine refuses the next answer
    after the request was checked and submitted, and the clients that leave are cancelled."""
    body = question("Write a very long essay on rivers.", 400) | {"stream": True}
    url = server.base + "/v1/chat/completions"
    clients = [httpx.Client(timeout=60) for _ in range(3)]
    streams = []
    try:
        for i, http in enumerate(clients):
            headers = {"X-Request-Id": f"busy-{i}"}
            streams.append(
                http.send(http.build_request("POST", url, json=body, headers=headers), stream=True)
            )
        assert [s.status_code for s in streams] == [200, 200, 200]
        full = httpx.post(url, json=body, headers={"X-Request-Id": "full-1"})
        assert full.status_code == 503, full.text
    finally:
        for s in streams:
            s.close()
        for http in clients:
            http.close()

    root, children = tree(receiver.trace_of("full-1"))
    assert root.attributes["miniapp.outcome"] == "refused" and root.status == ERROR_CODE
    assert root.attributes["gen_ai.request.model"] == MODEL  # it got as far as the engine
    assert set(children) == {"receive", "queue", "stream"}
    assert log_line(server, "full-1")["error"] == root.description
    for i in range(3):  # each slot is free again for the next test once its trace is written
        left, _ = tree(receiver.trace_of(f"busy-{i}"))
        assert left.attributes["miniapp.outcome"] == "cancelled"


# ------------------------------------------------------------------ hand-built records

MS = 1_000_000  # nanoseconds


def record_of(**fields) -> RequestRecord:
    record = RequestRecord("hand-1", "POST", "/v1/completions", started_ns=1_000 * MS)
    for name, value in fields.items():
        setattr(record, name, value)
    return record


def test_a_records_spans_hang_from_its_root_with_clamped_times():
    started = 1_000 * MS
    finished = AnswerTiming(
        0,
        submitted_ns=started + 5 * MS,
        opened_ns=started + 6 * MS,
        first_token_ns=started + 30 * MS,
        ended_ns=started + 90 * MS,
        queued_s=0.010,
        prompt_tokens=20,
        cached_tokens=8,
        generated_tokens=7,
        finish_reason="length",
    )
    # Read on another thread, its end came out a hair before its submission: clamped.
    cancelled_queued = AnswerTiming(1, submitted_ns=started + 5 * MS, ended_ns=started + 4 * MS)
    record = record_of(
        model="m",
        adapters=("sql", "poem"),
        key_name="alice",
        stream=True,
        status=200,
        response_started_ns=started + 3 * MS,
        ended_ns=started + 100 * MS,
        answers=[finished, cancelled_queued],
    )
    exporter = InMemorySpanExporter()
    provider = tracer_provider(exporter=exporter)
    span_sink(provider)(record)
    provider.force_flush()
    spans = exporter.get_finished_spans()

    root = next(s for s in spans if s.parent is None)
    assert root.name == "POST /v1/completions" and root.kind is SpanKind.SERVER
    assert (root.start_time, root.end_time) == (started, started + 100 * MS)
    assert root.resource.attributes["service.name"] == "miniapp"
    assert root.attributes["miniapp.adapters"] == "sql,poem"
    assert root.attributes["miniapp.key"] == "alice"
    assert root.attributes["miniapp.outcome"] == "cancelled"
    assert root.status.status_code is StatusCode.UNSET
    children = [s for s in spans if s is not root]
    assert all(s.parent.span_id == root.context.span_id for s in children)
    assert all(s.context.trace_id == root.context.trace_id for s in children)
    stages = {(s.name, s.attributes.get("miniapp.answer.index")): s for s in children}
    times = {key: (s.start_time - started, s.end_time - started) for key, s in stages.items()}
    assert times == {
        ("receive", None): (0, 5 * MS),
        ("queue", 0): (5 * MS, 15 * MS),  # the engine's 10 ms wait for a slot
        ("prefill", 0): (15 * MS, 30 * MS),
        ("decode", 0): (30 * MS, 90 * MS),
        ("queue", 1): (5 * MS, 5 * MS),  # clamped: never before its start
        ("stream", None): (3 * MS, 100 * MS),
    }
    assert stages["decode", 0].attributes["gen_ai.response.finish_reasons"] == ("length",)
    assert stages["prefill", 0].attributes["miniapp.cached_tokens"] == 8
    assert "gen_ai.response.finish_reasons" not in stages["queue", 1].attributes


def test_an_error_marks_the_root_and_names_why():
    record = record_of(status=500, error="internal error: boom", ended_ns=1_001 * MS)
    exporter = InMemorySpanExporter()
    provider = tracer_provider(exporter=exporter)
    span_sink(provider)(record)
    provider.force_flush()
    root = next(s for s in exporter.get_finished_spans() if s.parent is None)
    assert root.status.status_code is StatusCode.ERROR
    assert root.status.description == "internal error: boom"


def answer(**fields) -> AnswerTiming:
    return AnswerTiming(0, submitted_ns=1_000 * MS, **fields)


RAN = {"opened_ns": 1_001 * MS, "first_token_ns": 1_002 * MS}


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({"status": 200, "answers": [answer(**RAN, finish_reason="stop")]}, "ok"),
        ({"status": 200}, "ok"),  # no answers: /health, /v1/models
        ({"status": 401, "error": "no key"}, "refused"),
        ({"status": 503, "error": "queue full", "answers": [answer()]}, "refused"),
        ({"status": 500, "error": "boom", "answers": [answer(**RAN)]}, "failed"),
        ({"status": 200, "error": "RuntimeError: x", "answers": [answer(**RAN)]}, "failed"),
        ({"status": None, "error": "RuntimeError: x"}, "failed"),
        ({"status": 200, "answers": [answer(**RAN)]}, "cancelled"),
        ({"status": 200, "answers": [answer(**RAN, finish_reason="stop"), answer()]}, "cancelled"),
    ],
)
def test_the_outcome_says_how_the_request_went(fields, expected):
    assert outcome(record_of(**fields)) == expected


def _finished(reason: FinishReason) -> Finished:
    return Finished(reason, GenerationStats("torch", 9, 0, 5, 0.1, 90.0, 50.0))


@pytest.mark.parametrize(
    ("closed_first", "reason", "expected"),
    [
        (False, FinishReason.MAX_TOKENS, "length"),
        (False, FinishReason.END_OF_TURN, "stop"),
        (False, FinishReason.CANCELLED, None),
        # A closed batched sequence ends looking like one out of tokens; whether its end
        # reaches the record before the response ends is a race the outcome must not show.
        (True, FinishReason.MAX_TOKENS, None),
    ],
)
def test_an_answer_ended_after_its_client_left_never_finished(closed_first, reason, expected):
    timings = AnswerTimings([answer(**RAN)])
    if closed_first:
        timings.closed()
    timings.finished(0, _finished(reason))
    assert timings.answers[0].finish_reason == expected
    assert timings.answers[0].generated_tokens == 5
    expected_outcome = "ok" if expected else "cancelled"
    assert outcome(record_of(status=200, answers=timings.answers)) == expected_outcome


def test_the_log_fields_of_a_record():
    first = answer(**RAN, queued_s=0.25, prompt_tokens=9, cached_tokens=4, generated_tokens=3)
    second = answer(opened_ns=1_001 * MS, first_token_ns=1_040 * MS, prompt_tokens=9)
    record = record_of(status=200, ended_ns=1_500 * MS, key_name="bob", answers=[first, second])
    fields = log_fields(record)
    assert fields == {
        "time": "1970-01-01T00:00:01.000Z",
        "request_id": "hand-1",
        "method": "POST",
        "path": "/v1/completions",
        "status": 200,
        "key": "bob",
        "model": None,
        "stream": False,
        "prompt_tokens": 9,
        "completion_tokens": 3,
        "cached_tokens": 4,
        "queued_ms": 250.0,
        "ttft_ms": 2.0,  # the earlier of the two first tokens
        "duration_ms": 500.0,
        "outcome": "cancelled",
        "error": None,
    }


def test_without_an_endpoint_no_tracer_is_built():
    # The SDK and the exporter, that is: FastAPI itself imports OpenTelemetry's API.
    script = (
        "import sys\n"
        "from miniapp.app.serve.tracing import request_sinks\n"
        "def ours(): return any(m.startswith(OURS) for m in sys.modules)\n"
        "assert request_sinks(None, 'text') == []\n"
        "assert len(request_sinks(None, 'json')) == 1\n"
        "print(ours())\n"
        "assert len(request_sinks('http://127.0.0.1:9/v1/traces', 'text')) == 1\n"
        "print(ours())\n"
    ).replace("OURS", repr(("opentelemetry.sdk", "opentelemetry.exporter")))
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", "True"]  # not until an endpoint is given
