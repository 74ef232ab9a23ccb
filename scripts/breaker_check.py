"""The circuit breaker's targets, measured on a real `miniapp serve` (docs/RELIABILITY.md):
with a fault injected into the engine (every step fails), how fast requests past the
threshold are refused, and how soon after the fault is removed the breaker closes by itself.

    .venv/bin/python scripts/breaker_check.py [--refusals 200] [--pause 5]

Prints the refusal latencies (client-side, loopback, keep-alive connection), the time from
the fault's removal to the first 200 and the number of requests that took, and PASS/MISS
against the targets: refusals within 10 ms; closed within the pause plus one request.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from test_serve import MODEL, running_server, wait_ready  # noqa: E402

from miniapp.engine.platform.faults import FAULT_FILE_VARIABLE  # noqa: E402

THRESHOLD = 3


def chat(client: httpx.Client) -> tuple[int, float]:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    started = time.perf_counter()
    status = client.post("/v1/chat/completions", json=body).status_code
    return status, time.perf_counter() - started


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def measure(exe: str, refusals: int, pause: float) -> bool:
    fault = Path(tempfile.mkdtemp()) / "fail-every-step"
    os.environ[FAULT_FILE_VARIABLE] = str(fault)
    flags = ["--parallel", "4", "--breaker-threshold", str(THRESHOLD)]
    with running_server(exe, *flags, "--breaker-pause", str(pause)) as (_, base):
        wait_ready(base)
        with httpx.Client(base_url=base, timeout=60) as client:
            chat(client)  # warm: the first answer builds what later ones reuse
            fault.touch()
            failures = [chat(client)[0] for _ in range(THRESHOLD)]
            refused = [chat(client) for _ in range(refusals)]
            fault.unlink()
            removed = time.perf_counter()
            tries, status = 0, 0
            while status != 200 and time.perf_counter() - removed < pause + 30:
                status, _ = chat(client)
                tries += 1
                if status != 200:
                    time.sleep(0.05)
            closed_after = time.perf_counter() - removed
    statuses = sorted({status for status, _ in refused})
    latencies = [seconds * 1000 for _, seconds in refused]
    print(f"CPU: {_cpu_model()}")
    print(f"engine failures before the breaker opened: {failures}")
    print(
        f"{len(refused)} refusals, statuses {statuses}: median {statistics.median(latencies):.2f}"
        f" ms, p99 {quantile(latencies, 0.99):.2f} ms, max {max(latencies):.2f} ms"
    )
    print(
        f"fault removed -> first 200 after {closed_after:.2f} s (pause {pause:g} s), "
        f"{tries} requests (refused ones included)"
    )
    fast = statuses == [503] and quantile(latencies, 0.99) < 10
    closed = status == 200 and closed_after <= pause + 1.0
    print(f"{'PASS' if fast else 'MISS'}: refusals within 10 ms (p99)")
    print(f"{'PASS' if closed else 'MISS'}: closed within the pause plus one request")
    return fast and closed


def _cpu_model() -> str:
    for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines():
        if line.startswith("Model name:"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--refusals", type=int, default=200)
    parser.add_argument("--pause", type=float, default=5.0)
    parser.add_argument("--exe", default=str(Path(sys.executable).parent / "miniapp"))
    args = parser.parse_args()
    measure(args.exe, args.refusals, args.pause)


if __name__ == "__main__":
    main()
