"""Running the engine's work on one chosen thread (the process's main thread) for callers on
other threads: a GUI's or a server's request handlers.

Why: torch's CPU ops and our kernels parallelise with OpenMP, and with the libgomp that torch
ships, parallel regions started from any thread but the main one run about 3x slower here (a
SmolLM2 decode step 8 ms on the main thread, 19-28 ms on another; see docs/BENCHMARKS.md).
So an interface that answers on worker threads hands its answers to the thread that runs
`serve` (the GUI: its main thread), which produces them while the worker thread relays them.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from typing import TypeVar

T = TypeVar("T")
_STOP = object()


class ComputeThread:
    """Work handed over by any thread runs on the thread in `serve`. While nothing serves,
    or when the serving thread itself calls, the work runs in place."""

    def __init__(self) -> None:
        self._jobs: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None

    @property
    def serving(self) -> bool:
        return self._thread is not None

    @property
    def on_serving_thread(self) -> bool:
        """Whether the caller is the serving thread itself (work it posts would wait for it)."""
        return self._thread is threading.current_thread()

    def serve(self, stop: threading.Event) -> None:
        """Run handed-over work until `stop` is set (or Ctrl-C)."""
        self._thread = threading.current_thread()
        try:
            while not stop.is_set():
                try:
                    job = self._jobs.get(timeout=0.1)
                except queue.Empty:
                    continue
                job()
                del job  # waiting for the next, this frame must not keep the last one's model
        finally:
            self._thread = None
            self._drain()

    def _drain(self) -> None:
        """Work that arrived as serving ended still runs (its caller is waiting)."""
        while True:
            try:
                self._jobs.get_nowait()()
            except queue.Empty:
                return

    @property
    def has_waiting_work(self) -> bool:
        """Whether handed-over work waits (a long job, such as a batching engine's step
        loop, lets it run between its steps: another model's steps, an embedding pass)."""
        return not self._jobs.empty()

    def call(self, job: Callable[[], T]) -> T:
        """`job()`, run on the serving thread; its result, or its exception, here."""
        return list(self.iterate(_once(job)))[0]

    def post(self, job: Callable[[], None]) -> bool:
        """Run `job` on the serving thread, without waiting for it; False (and nothing
        queued) while nothing serves. A batching engine posts its step loop here."""
        if self._thread is None:
            return False
        self._jobs.put(job)
        return True

    def iterate(self, items: Iterator[T]) -> Iterator[T]:
        """`items`, produced on the serving thread, which runs ahead and never waits for
        the consumer (a handoff per item would cost two thread switches a token). Closing
        the result stops the producer at its next item and closes `items` there."""
        thread = self._thread
        if thread is None or thread is threading.current_thread():
            yield from items
            return
        produced: queue.Queue = queue.Queue()
        cancelled, finished = threading.Event(), threading.Event()

        def produce() -> None:
            try:
                for item in items:
                    if cancelled.is_set():
                        break
                    produced.put((item, None))
                produced.put((_STOP, None))
            except BaseException as exc:  # noqa: BLE001 - raised in the consumer's thread
                produced.put((_STOP, exc))
            finally:
                close = getattr(items, "close", None)
                if close is not None:
                    close()
                finished.set()

        self._jobs.put(produce)
        try:
            while True:
                item, error = produced.get()
                if item is _STOP:
                    if error is not None:
                        raise error
                    return
                yield item
        finally:
            cancelled.set()
            while not finished.wait(timeout=0.5):
                if self._thread is None:  # serving ended before the producer ran
                    self._drain()


def _once(job: Callable[[], T]) -> Iterator[T]:
    yield job()
