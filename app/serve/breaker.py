"""The circuit breaker: when the engine fails again and again (out of memory, a native fault,
a broken model), answering requests are refused at once with 503, a reason and Retry-After,
instead of each waiting in the queue for a failure of its own.

Closed, every request goes through, and `threshold` engine failures in a row open it (a
success in between starts the count again). Open, requests are refused until `pause` seconds
have passed; then one request goes through as a probe (half-open) while the others are still
refused. The probe's success closes the breaker; its failure opens it for another pause. A
probe that ends without a verdict (its client left) lets the next request probe instead.

Only the engine's own failures count: a request's mistakes (a bad schema, a prompt too long,
a full queue) say nothing about the engine's health.
"""

from __future__ import annotations

import enum
import math
import threading
import time
from collections.abc import Callable

from .errors import ApiError


class BreakerState(enum.Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


class CircuitBreaker:
    def __init__(self, threshold: int, pause: float, clock: Callable[[], float] = time.monotonic):
        self.threshold, self.pause, self.clock = threshold, pause, clock
        self._lock = threading.Lock()
        self._state = BreakerState.CLOSED
        self._failures = 0  # in a row
        self._opened_at = 0.0
        self._probing = False  # a probe request is out (half-open)
        self.reason = ""  # the latest failure that counted
        self.trips = 0  # times it opened

    @property
    def state(self) -> BreakerState:
        with self._lock:
            return self._current()

    def retry_after(self) -> int:
        """Whole seconds until an open breaker lets a probe through (at least 1)."""
        with self._lock:
            left = self._opened_at + self.pause - self.clock()
        return max(1, math.ceil(left))

    def admit(self) -> bool:
        """Let a request through, or raise the 503 saying why and when to come back.
        Returns True when the request is the probe of a half-open breaker."""
        with self._lock:
            state = self._current()
            if state is BreakerState.CLOSED:
                return False
            if state is BreakerState.HALF_OPEN and not self._probing:
                self._probing = True
                return True
        raise self.refusal()

    def refusal(self) -> ApiError:
        return ApiError(
            503,
            f"the engine is failing ({self.reason}); requests are refused for now",
            kind="server_error",
            code="engine_unavailable",
            headers={"Retry-After": str(self.retry_after())},
        )

    def succeeded(self, probe: bool) -> None:
        with self._lock:
            self._failures = 0
            if probe or self._state is BreakerState.CLOSED:
                self._state, self._probing = BreakerState.CLOSED, False

    def failed(self, reason: str, probe: bool) -> None:
        with self._lock:
            self.reason = reason
            self._failures += 1
            reopen = probe and self._state is not BreakerState.CLOSED
            if reopen or (self._state is BreakerState.CLOSED and self._failures >= self.threshold):
                self._state, self._opened_at, self._probing = BreakerState.OPEN, self.clock(), False
                self.trips += 1

    def abandoned(self, probe: bool) -> None:
        """A request ended with no verdict on the engine (cancelled, or refused)."""
        if probe:
            with self._lock:
                self._probing = False

    def _current(self) -> BreakerState:
        """The state now: an open breaker whose pause is over is half-open."""
        if self._state is BreakerState.OPEN and self.clock() >= self._opened_at + self.pause:
            self._state = BreakerState.HALF_OPEN
        return self._state


class Verdict:
    """One request's report to the breaker: the first outcome counts, once."""

    def __init__(self, breaker: CircuitBreaker | None, probe: bool):
        self.breaker, self.probe = breaker, probe
        self._given = threading.Lock()

    def _first(self) -> bool:
        return self.breaker is not None and self._given.acquire(blocking=False)

    def succeeded(self) -> None:
        if self._first():
            self.breaker.succeeded(self.probe)

    def failed(self, reason: str) -> None:
        if self._first():
            self.breaker.failed(reason, self.probe)

    def abandoned(self) -> None:
        if self._first():
            self.breaker.abandoned(self.probe)
