"""Clients of a server with per-key quotas (`--api-key-file`): a flood from one key, sent at
a multiple of its quota from several connections, and the short streamed chats both the flood
and a polite key send (scripts/overload_check.py, tests/soak_serve.py).

The flood is evenly paced: connection i of C sends at start + i*gap, then every C*gap, where
gap is 60 s over the requests a minute asked for; a connection whose answer ran past its next
turn skips the turns it missed rather than sending them at once, so the rate offered is at
most the one asked for (`FloodFigures.sent_per_minute` says what it was).

On a 429 a connection offers its request to the retrier, which takes one at a time (others
are not retried, so the retries stay few and do not add to the flood): it waits exactly the
Retry-After the server gave and sends the request once more. A retry refused again is noted
with the quota of each refusal, and whether another of the key's connections, sent in
between, was admitted (it may have taken the room Retry-After promised).
"""

from __future__ import annotations

import json
import queue
import random
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx

WORDS = (
    "river mountain lantern orchard harbour meadow violin glacier compass willow "
    "thunder pebble saffron beacon canyon feather marble ember tundra quill"
).split()
FLOOD_CONNECTIONS = 8
FLOOD_FACTOR = 10  # the flood asks for this many times its key's requests_per_minute
RATE_LIMIT_CODE = "rate_limit_exceeded"
RETRY_LATE_S = 0.1  # a retry that cannot be sent this close to its time is not sent


def key_file_text(keys: dict[str, dict]) -> str:
    """A key file's TOML: one [keys.NAME] table per key, its key and its limits."""
    tables = []
    for name, fields in keys.items():
        lines = [f"[keys.{name}]"] + [
            f"{field_name} = {json.dumps(value)}" for field_name, value in fields.items()
        ]
        tables.append("\n".join(lines))
    return "\n\n".join(tables) + "\n"


def short_prompt(rng: random.Random) -> str:
    """A short question, varied so that no two share more than the chat template's prefix."""
    words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 12)))
    return f"In one sentence, what links these words: {words}?"


def chat_body(model: str, prompt: str, max_tokens: int = 16) -> dict:
    return {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
    }


@dataclass
class Streamed:
    """One streamed chat's outcome, timed from the request's start."""

    status: int
    answered_at: float = 0.0  # time.monotonic() when its status came
    first_content_s: float | None = None  # None: no text came (or not a 200)
    complete: bool = False  # a 200 whose stream ended with [DONE]
    error: dict = field(default_factory=dict)  # a refusal's {"message", "type", "code"}
    retry_after: str | None = None


def stream_chat(http: httpx.Client, body: dict, on_admitted=None) -> Streamed:
    """Send a streamed chat and read it to its end, noting when its first text came. On a
    200, `on_admitted(sent_at)` is called at once, with the time.monotonic() it was sent."""
    started, sent_at = time.perf_counter(), time.monotonic()
    with http.stream("POST", "/v1/chat/completions", json=body) as response:
        answered_at = time.monotonic()
        if response.status_code == 200 and on_admitted is not None:
            on_admitted(sent_at)
        if response.status_code != 200:
            response.read()
            return Streamed(
                response.status_code,
                answered_at,
                error=_error_of(response),
                retry_after=response.headers.get("retry-after"),
            )
        outcome = Streamed(200, answered_at)
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            data = line.removeprefix("data: ")
            if data == "[DONE]":
                outcome.complete = True
            elif outcome.first_content_s is None and _has_content(data):
                outcome.first_content_s = time.perf_counter() - started
        return outcome


def _has_content(data: str) -> bool:
    choices = json.loads(data).get("choices") or []
    return bool(choices and choices[0].get("delta", {}).get("content"))


def _error_of(response: httpx.Response) -> dict:
    try:
        return response.json().get("error") or {}
    except ValueError:
        return {"message": response.text[:120]}


def refusal_reason(outcome: Streamed) -> str:
    """Which quota a 429 was for (its message names max_concurrent; its type says the rest)."""
    if "max_concurrent" in outcome.error.get("message", ""):
        return "max_concurrent"
    return f"{outcome.error.get('type', '?')}_per_minute"


@dataclass
class FloodFigures:
    sent: int = 0
    seconds: float = 0.0
    statuses: Counter = field(default_factory=Counter)  # the paced sends' statuses
    refusals: Counter = field(default_factory=Counter)  # a 429's quota -> count
    retries_tried: int = 0
    retries_ok: int = 0
    retry_failures: Counter = field(default_factory=Counter)  # "429 max_concurrent" ...
    admitted_sent_at: list[float] = field(default_factory=list)  # when each 200 was sent
    invalid: list[str] = field(default_factory=list)

    @property
    def sent_per_minute(self) -> float:
        return self.sent / self.seconds * 60 if self.seconds else 0.0

    def problems(self) -> list[str]:
        """Each response must be a complete 200 or a 429 with Retry-After and the code."""
        others = {status: n for status, n in self.statuses.items() if status not in (200, 429)}
        found = [f"flood: {n} x {status}" for status, n in sorted(others.items())]
        found += [
            f"flood: {n} retries answered {why}"
            for why, n in sorted(self.retry_failures.items())
            if ", then 429" not in why
        ]
        return found + self.invalid[:5]

    def summary(self) -> str:
        refused = ", ".join(f"{reason} {n}" for reason, n in sorted(self.refusals.items()))
        failed = ", ".join(f"{why} {n}" for why, n in sorted(self.retry_failures.items()))
        return (
            f"flood: {self.sent} sent ({self.sent_per_minute:.0f}/min), "
            f"{self.statuses[200]} x 200, {self.statuses[429]} x 429 ({refused or 'none'}), "
            f"{self.sent - self.statuses[200] - self.statuses[429]} other; retries after "
            f"Retry-After: {self.retries_ok}/{self.retries_tried} succeeded"
            + (f" (failed: {failed})" if failed else "")
        )


class Flood:
    """`connections` threads sending `per_minute` requests a minute between them with `key`,
    and the retrier; `run(until)` returns when all have stopped."""

    def __init__(
        self,
        base: str,
        key: str,
        model: str,
        per_minute: float,
        connections: int = FLOOD_CONNECTIONS,
        seed: int = 1000,
    ):
        self.base, self.key, self.model = base, key, model
        self.gap = 60.0 / per_minute  # between two sends, all connections together
        self.connections, self.seed = connections, seed
        self.figures = FloodFigures()
        self._lock = threading.Lock()
        self._retry: queue.Queue[tuple[Streamed, dict]] = queue.Queue(maxsize=1)
        self._stop = threading.Event()
        self._stopped_at: float | None = None

    def run(self, until: float) -> FloodFigures:
        """Flood until `until` (time.monotonic()) or `stop()`, whichever comes first."""
        started = time.monotonic()
        threads = [
            threading.Thread(target=self._connection, args=(i, started, until))
            for i in range(self.connections)
        ]
        threads.append(threading.Thread(target=self._retrier, args=(until,)))
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        self.figures.seconds = min(until, self._stopped_at or until) - started
        return self.figures

    def stop(self) -> None:
        self._stopped_at = time.monotonic()
        self._stop.set()

    def _going(self, until: float) -> bool:
        return not self._stop.is_set() and time.monotonic() < until

    def _client(self) -> httpx.Client:
        headers = {"Authorization": f"Bearer {self.key}"}
        # A connection idle near the server's keep-alive (uvicorn closes after 5 s; a flood
        # connection sends every few seconds) may be reused just as the server closes it,
        # and the request dies unanswered. Dropping idle connections after 2 s avoids it.
        limits = httpx.Limits(keepalive_expiry=2.0)
        return httpx.Client(base_url=self.base, headers=headers, timeout=120, limits=limits)

    def _connection(self, index: int, started: float, until: float) -> None:
        rng = random.Random(self.seed + index)
        period = self.gap * self.connections
        turn = started + index * self.gap
        with self._client() as http:
            while True:
                self._stop.wait(max(0.0, min(turn, until) - time.monotonic()))
                if not self._going(until):
                    return
                body = chat_body(self.model, short_prompt(rng))
                outcome = self._send(http, body)
                with self._lock:
                    self.figures.sent += 1
                    self.figures.statuses[outcome.status] += 1
                    if outcome.status == 429:
                        self.figures.refusals[refusal_reason(outcome)] += 1
                if outcome.status == 429 and (outcome.retry_after or "").isdigit():
                    self._offer_retry(outcome, body)
                turn += period
                missed = max(0.0, time.monotonic() - turn)
                turn += period * -(-missed // period)  # the next turn not yet past

    def _offer_retry(self, refused: Streamed, body: dict) -> None:
        try:
            self._retry.put_nowait((refused, body))
        except queue.Full:
            pass  # a retry is already under way: this 429 is not sampled

    def _retrier(self, until: float) -> None:
        with self._client() as http:
            while self._going(until):
                try:
                    refused, body = self._retry.get(timeout=0.5)
                except queue.Empty:
                    continue
                retry_at = refused.answered_at + int(refused.retry_after)
                if retry_at >= until or time.monotonic() > retry_at + RETRY_LATE_S:
                    continue  # the flood ends first, or the last retry ran past this one's time
                if self._stop.wait(max(0.0, retry_at - time.monotonic())):
                    continue
                self._note_retry(refused, self._send(http, body))

    def _note_retry(self, refused: Streamed, retried: Streamed) -> None:
        """Count the retry; a failed one by the refusal it retried and the one it got."""
        with self._lock:
            self.figures.retries_tried += 1
            if retried.status == 200:
                self.figures.retries_ok += 1
                return
            why = f"{refusal_reason(refused)}, then {retried.status}"
            if retried.status == 429:
                why += " " + refusal_reason(retried)
            # The key's other connections keep sending: one sent after the refusal and
            # admitted may have taken the room Retry-After promised.
            window = (refused.answered_at, retried.answered_at)
            if any(window[0] < sent < window[1] for sent in self.figures.admitted_sent_at):
                why += " (another connection got in first)"
            self.figures.retry_failures[why] += 1

    def _send(self, http: httpx.Client, body: dict) -> Streamed:
        try:
            outcome = stream_chat(http, body, self._admitted)
        except httpx.HTTPError as exc:
            self._invalid(f"flood: {type(exc).__name__}: {exc}")
            return Streamed(0)
        if outcome.status == 200 and not outcome.complete:
            self._invalid("flood: a 200 stream without [DONE] at its end")
        elif outcome.status == 429:
            self._check_refusal(outcome)
        return outcome

    def _admitted(self, sent_at: float) -> None:
        with self._lock:
            self.figures.admitted_sent_at.append(sent_at)

    def _check_refusal(self, outcome: Streamed) -> None:
        if outcome.error.get("code") != RATE_LIMIT_CODE:
            self._invalid(f"flood: a 429 with code {outcome.error.get('code')!r}")
        elif not (outcome.retry_after or "").isdigit() or int(outcome.retry_after) < 1:
            self._invalid(f"flood: a 429 with Retry-After {outcome.retry_after!r}")

    def _invalid(self, reason: str) -> None:
        with self._lock:
            self.figures.invalid.append(reason)
