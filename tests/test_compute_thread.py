"""Handing work to one thread (the GUI's main thread): results, errors, iteration and closing
all happen there, and unserved work runs in place."""

from __future__ import annotations

import threading
import time

import pytest

from miniapp.engine.platform.compute_thread import ComputeThread


def _serve_while(compute: ComputeThread, fn):
    """Serve on this (the main) thread while `fn` runs on another, started once serving."""
    box, stop = {}, threading.Event()

    def run():
        while not compute.serving:
            time.sleep(0.001)
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001
            box["error"] = exc
        finally:
            stop.set()

    thread = threading.Thread(target=run)
    thread.start()
    compute.serve(stop)
    thread.join()
    return box


def test_a_generator_iterated_elsewhere_runs_on_the_serving_thread():
    compute = ComputeThread()
    ran_on, closed_on = [], []

    def tokens():
        try:
            for i in range(3):
                ran_on.append(threading.current_thread())
                yield i
            raise ValueError("model failed")
        finally:
            closed_on.append(threading.current_thread())

    def consume():
        got = []
        try:
            for item in compute.iterate(tokens()):
                got.append(item)
        except ValueError as exc:
            return got, str(exc)
        return got, None

    box = _serve_while(compute, consume)
    assert box["value"] == ([0, 1, 2], "model failed")
    main = threading.current_thread()
    assert ran_on == [main] * 3 and closed_on == [main]
    assert not compute.serving


def test_closing_early_closes_the_generator_on_the_serving_thread():
    compute = ComputeThread()
    closed_on = []

    def endless():
        try:
            while True:
                yield 1
        finally:
            closed_on.append(threading.current_thread())

    def consume():
        items = compute.iterate(endless())
        first = next(items)
        items.close()
        return first

    box = _serve_while(compute, consume)
    assert box["value"] == 1 and closed_on == [threading.current_thread()]


def test_without_a_server_work_runs_in_place():
    compute = ComputeThread()
    ran_on = []

    def items():
        ran_on.append(threading.current_thread())
        yield 1
        raise ZeroDivisionError

    with pytest.raises(ZeroDivisionError):
        list(compute.iterate(items()))
    assert ran_on == [threading.current_thread()]
