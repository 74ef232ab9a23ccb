"""Each request's trace and log line, made from its record (records.py) once its response has
ended: `request_sinks` gives what `RequestIdMiddleware` hands every record to.

- `--otlp-endpoint URL`: one OpenTelemetry span tree per request, sent to an OTLP/HTTP
  collector. The root is the request as received; its children are the stages: "receive"
  (reading and checking it), per answer "queue", "prefill" and "decode", and "stream"
  (sending the response). The spans are made after the fact, with the record's times.
- `--log-format json`: one JSON line per request on stderr (logger "miniapp.requests").

Sinks run on the event loop, so they only build and hand over: the spans go to the collector
from the SDK's own export thread. Without an endpoint nothing of OpenTelemetry is imported.
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Callable
from datetime import UTC, datetime
from typing import TYPE_CHECKING

from .records import AnswerTiming, RequestRecord

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter
    from opentelemetry.trace import Tracer

Sink = Callable[[RequestRecord], None]

SERVICE_NAME = "miniapp"
EXPORT_DELAY_MS = 500  # spans reach the collector within about this long of their request
REQUEST_LOGGER = "miniapp.requests"


def request_sinks(otlp_endpoint: str | None, log_format: str) -> list[Sink]:
    """What each request's record is handed to when its response ends."""
    sinks: list[Sink] = []
    if otlp_endpoint:
        sinks.append(span_sink(tracer_provider(otlp_endpoint)))
    if log_format == "json":
        sinks.append(json_log_sink())
    return sinks


def outcome(record: RequestRecord) -> str:
    """How the request went, in one word: "ok"; "refused" (an error status before any answer
    ran); "failed" (an error once answers ran, or a crash); "cancelled" (an answer was cut
    short without an error: the client left, or it was stopped)."""
    error_status = record.status is not None and record.status >= 400
    if error_status and not any(_ran(answer) for answer in record.answers):
        return "refused"
    if error_status or record.error is not None:
        return "failed"
    if any(answer.finish_reason is None for answer in record.answers):
        return "cancelled"
    return "ok"


def _ran(answer: AnswerTiming) -> bool:
    # Submitted is not enough: a full queue refuses an answer the relay already submitted.
    return answer.opened_ns is not None or answer.first_token_ns is not None


# ------------------------------------------------------------------ spans


def tracer_provider(
    endpoint: str | None = None, exporter: SpanExporter | None = None
) -> TracerProvider:
    """A provider of our own (the process-wide one stays the application's) whose spans go
    to `exporter`, by default OTLP/HTTP to `endpoint`, in batches from the SDK's thread."""
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    if exporter is None:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        exporter = OTLPSpanExporter(endpoint=endpoint)
    provider = TracerProvider(resource=Resource.create({"service.name": SERVICE_NAME}))
    provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=EXPORT_DELAY_MS))
    return provider


def span_sink(provider: TracerProvider) -> Sink:
    tracer = provider.get_tracer("miniapp.serve")
    return lambda record: write_spans(tracer, record)


def write_spans(tracer: Tracer, record: RequestRecord) -> None:
    """The record as a span tree: the request, and under it each stage it reached."""
    from opentelemetry import trace
    from opentelemetry.trace import SpanKind, Status, StatusCode

    ended = record.ended_ns or record.started_ns
    root = tracer.start_span(
        f"{record.method} {record.path}",
        kind=SpanKind.SERVER,
        start_time=record.started_ns,
        attributes=_request_attributes(record),
    )
    if _is_error(record):
        root.set_status(Status(StatusCode.ERROR, record.error or f"HTTP {record.status}"))
    inside = trace.set_span_in_context(root)

    def stage(name: str, start: int, end: int, attributes: dict | None = None) -> None:
        span = tracer.start_span(name, context=inside, start_time=start, attributes=attributes)
        span.end(end_time=max(start, end))  # clocks read on other threads may cross by a hair

    stage("receive", record.started_ns, _received_ns(record))
    for answer in record.answers:
        for name, start, end in _answer_stages(answer, ended):
            stage(name, start, end, _answer_attributes(answer))
    if record.response_started_ns is not None:
        stage("stream", record.response_started_ns, ended)
    root.end(end_time=max(record.started_ns, ended))


def _is_error(record: RequestRecord) -> bool:
    return (record.status is not None and record.status >= 400) or record.error is not None


def _received_ns(record: RequestRecord) -> int:
    """When the request was read and checked: its first answer went to the engine, or else
    its response began (a refusal), or else it ended."""
    if record.answers:
        return min(answer.submitted_ns for answer in record.answers)
    return record.response_started_ns or record.ended_ns or record.started_ns


def _answer_stages(answer: AnswerTiming, request_ended: int) -> list[tuple[str, int, int]]:
    """(name, start, end) of the stages the answer reached: waiting for a slot, evaluating
    its prompt (up to its first token), and generating the rest."""
    ended = answer.ended_ns or request_ended
    if answer.first_token_ns is None:
        # Cancelled or refused before its first token: when it left the queue is not known
        # (the engine's wait is reported only when an answer finishes), so all is "queue".
        return [("queue", answer.submitted_ns, ended)]
    queued = _queue_end(answer)
    return [
        ("queue", answer.submitted_ns, queued),
        ("prefill", queued, answer.first_token_ns),
        ("decode", answer.first_token_ns, ended),
    ]


def _queue_end(answer: AnswerTiming) -> int:
    """The engine measures a batched answer's wait for a slot (known once it finished); an
    answer that takes turns waits before its stream opens."""
    waited = answer.submitted_ns + int(answer.queued_s * 1e9)
    return min(max(waited, answer.opened_ns or answer.submitted_ns), answer.first_token_ns)


def _request_attributes(record: RequestRecord) -> dict:
    attributes = {
        "http.request.method": record.method,
        "url.path": record.path,
        "miniapp.request_id": record.request_id,
        "gen_ai.usage.input_tokens": record.prompt_tokens,
        "gen_ai.usage.output_tokens": record.completion_tokens,
        "miniapp.stream": record.stream,
        "miniapp.outcome": outcome(record),
    }
    if record.status is not None:
        attributes["http.response.status_code"] = record.status
    if record.key_name:
        attributes["miniapp.key"] = record.key_name
    if record.model:
        attributes["gen_ai.request.model"] = record.model
    if record.adapters:
        attributes["miniapp.adapters"] = ",".join(record.adapters)
    return attributes


def _answer_attributes(answer: AnswerTiming) -> dict:
    attributes = {
        "miniapp.answer.index": answer.index,
        "gen_ai.usage.input_tokens": answer.prompt_tokens,
        "miniapp.cached_tokens": answer.cached_tokens,
        "gen_ai.usage.output_tokens": answer.generated_tokens,
    }
    if answer.finish_reason is not None:
        attributes["gen_ai.response.finish_reasons"] = [answer.finish_reason]
    return attributes


# ------------------------------------------------------------------ log lines


def json_log_sink() -> Sink:
    logger = _request_logger()
    return lambda record: logger.info(json.dumps(log_fields(record), separators=(",", ":")))


def _request_logger() -> logging.Logger:
    """The per-request lines' logger: each line as it is, on stderr, apart from the server's
    other logging (which may be formatted as text)."""
    logger = logging.getLogger(REQUEST_LOGGER)
    if not any(getattr(h, "name", None) == REQUEST_LOGGER for h in logger.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.set_name(REQUEST_LOGGER)  # one handler however many apps are made
        handler.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    return logger


def log_fields(record: RequestRecord) -> dict:
    answers = record.answers
    first_tokens = [a.first_token_ns for a in answers if a.first_token_ns is not None]
    ended = record.ended_ns or record.started_ns
    return {
        "time": _iso_utc(record.started_ns),
        "request_id": record.request_id,
        "method": record.method,
        "path": record.path,
        "status": record.status,
        "key": record.key_name,
        "model": record.model,
        "stream": record.stream,
        "prompt_tokens": record.prompt_tokens,
        "completion_tokens": record.completion_tokens,
        "cached_tokens": max((a.cached_tokens for a in answers), default=0),
        "queued_ms": _ms(int(max((a.queued_s for a in answers), default=0.0) * 1e9)),
        "ttft_ms": _ms(min(first_tokens) - record.started_ns) if first_tokens else None,
        "duration_ms": _ms(ended - record.started_ns),
        "outcome": outcome(record),
        "error": record.error,
    }


def _iso_utc(ns: int) -> str:
    moment = datetime.fromtimestamp(ns / 1e9, tz=UTC)
    return moment.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _ms(ns: int) -> float:
    return round(ns / 1e6, 1)
