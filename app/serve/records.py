"""What one HTTP request did, recorded as it runs: the facts its trace spans and its log line
are made from (tracing.py), and the handles a timeout or a stalled client uses to stop its
answers.

The outermost middleware makes a `RequestRecord` and puts it in `CURRENT_RECORD`; the
handlers fill it in (the model, adapters, key, tokens), and each answer's relay reports its
timings through `AnswerTimings`, a relay observer. Times are `time.time_ns()` wall-clock
nanoseconds (what OpenTelemetry's spans take).
"""

from __future__ import annotations

import threading
import time
from contextvars import ContextVar
from dataclasses import dataclass, field

from miniapp.engine.api import Finished, FinishReason

from .service import RelayObserver, finish_reason


def now_ns() -> int:
    return time.time_ns()


@dataclass
class AnswerTiming:
    """One answer (a choice) of a request, as the engine ran it. A stage not reached stays
    None: an answer cancelled while queued has no first token."""

    index: int
    submitted_ns: int  # handed to the engine
    opened_ns: int | None = None  # the engine took it (it runs, or waits for a slot)
    first_token_ns: int | None = None
    ended_ns: int | None = None  # its token stream closed: finished, failed or cancelled
    queued_s: float = 0.0  # waiting for a slot, as the engine measured it
    prompt_tokens: int = 0
    cached_tokens: int = 0
    generated_tokens: int = 0
    finish_reason: str | None = None  # None: it never finished (cancelled or failed)


@dataclass
class RequestRecord:
    request_id: str
    method: str
    path: str
    started_ns: int = field(default_factory=now_ns)
    key_name: str | None = None
    model: str | None = None
    adapters: tuple[str, ...] = ()
    priority: int = 0
    stream: bool = False
    status: int | None = None  # the response's status, once it starts
    response_started_ns: int | None = None
    ended_ns: int | None = None
    error: str | None = None  # why it failed (an error response's message, or a crash)
    answers: list[AnswerTiming] = field(default_factory=list)
    _stoppers: list = field(default_factory=list, repr=False)  # closes each started relay
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def prompt_tokens(self) -> int:
        # A request's choices share one prompt: counted once per distinct answer prompt.
        return max((a.prompt_tokens for a in self.answers), default=0)

    @property
    def completion_tokens(self) -> int:
        return sum(a.generated_tokens for a in self.answers)

    def timings(self, prompts: list[int]) -> AnswerTimings:
        """The observer of one relay, started now, whose answers' prompts have these
        lengths."""
        submitted = now_ns()
        with self._lock:
            base = len(self.answers)
            added = [
                AnswerTiming(base + i, submitted, prompt_tokens=length)
                for i, length in enumerate(prompts)
            ]
            self.answers.extend(added)
        return AnswerTimings(added)

    def on_stop(self, stop) -> None:
        """`stop()` is called if the request is cut short (timeout, a stalled client)."""
        with self._lock:
            self._stoppers.append(stop)

    def stop_answers(self) -> None:
        with self._lock:
            stoppers = list(self._stoppers)
        for stop in stoppers:
            stop()

    def close(self) -> None:
        """The request is over: forget the stoppers. A record can outlive its request (an
        asyncio timer made during it keeps a copy of its context, and so the record), and
        the stoppers hold the answers' relays, and through them the model's runtime, which
        an idle unload must be able to free."""
        with self._lock:
            self._stoppers.clear()


class AnswerTimings(RelayObserver):
    """A relay's reports, written into its request's record (thread-safe: each hook writes
    its own answer's fields)."""

    def __init__(self, answers: list[AnswerTiming]):
        self.answers = answers
        self._closed = False

    def _answer(self, index: int) -> AnswerTiming | None:
        return self.answers[index] if 0 <= index < len(self.answers) else None

    def opened(self, index: int) -> None:
        if (answer := self._answer(index)) is not None and answer.opened_ns is None:
            answer.opened_ns = now_ns()

    def token(self, index: int) -> None:
        if (answer := self._answer(index)) is None:
            return
        if answer.first_token_ns is None:
            answer.first_token_ns = now_ns()
        answer.generated_tokens += 1  # a cancelled answer's count (the engine's replaces it)

    def ended(self, index: int) -> None:
        if (answer := self._answer(index)) is not None and answer.ended_ns is None:
            answer.ended_ns = now_ns()

    def finished(self, index: int, finished: Finished) -> None:
        if (answer := self._answer(index)) is None:
            return
        stats = finished.stats
        answer.queued_s = stats.queued_s
        answer.prompt_tokens = stats.prompt_tokens
        answer.cached_tokens = stats.cached_prompt_tokens
        answer.generated_tokens = stats.generated_tokens
        # An answer that ends after its relay closed was cut short: the client left, and a
        # closed batched sequence ends looking like one that ran out of tokens. Whether its
        # Finished comes before the record is handed on is a race, so both say "never ended".
        if not self._closed and finished.reason is not FinishReason.CANCELLED:
            answer.finish_reason = finish_reason(finished)

    def closed(self) -> None:
        self._closed = True


class Observers(RelayObserver):
    """Several observers of one relay, each told of everything."""

    def __init__(self, *observers: RelayObserver):
        self.observers = observers

    def opened(self, index: int) -> None:
        for observer in self.observers:
            observer.opened(index)

    def token(self, index: int) -> None:
        for observer in self.observers:
            observer.token(index)

    def ended(self, index: int) -> None:
        for observer in self.observers:
            observer.ended(index)

    def finished(self, index: int, finished: Finished) -> None:
        for observer in self.observers:
            observer.finished(index, finished)

    def closed(self) -> None:
        for observer in self.observers:
            observer.closed()


CURRENT_RECORD: ContextVar[RequestRecord | None] = ContextVar("miniapp_record", default=None)
