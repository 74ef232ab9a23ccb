"""The overload target, measured on a real `miniapp serve` with a flooding and a polite key.

Two keys: one floods at 10x its quota from 8 connections; the other (polite) sends one
request at a time. The polite key's p99 time to first token should stay within 1.2x of its
figure without the flood, with no 5xx; the flooder gets 429s whose Retry-After is honoured
(a retry at that time succeeds).

Phase 3: the flood key alone, as a client that honours Retry-After: refused, it waits as told
and retries once; each retry must get in.

Phase 1 (baseline): the polite key alone sends N streamed chats, one at a time. Phase 2: the
flood runs (tests/flood_clients.py) and the polite key sends N more. Time to first token is
client-side: from sending the request to the first chunk with text. It prints one table and
a PASS or MISS line for each target; the exit code is 0 either way (this measures).

    .venv/bin/python scripts/overload_check.py [--requests 100] [--json FILE]
    .venv/bin/python scripts/overload_check.py --quick     # a smoke run, under a minute
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the bundled model: nothing to look up
sys.path.insert(0, str(REPO / "tests"))
from flood_clients import (  # noqa: E402
    FLOOD_CONNECTIONS,
    FLOOD_FACTOR,
    Flood,
    FloodFigures,
    chat_body,
    key_file_text,
    short_prompt,
    stream_chat,
)
from test_serve import running_server, wait_ready  # noqa: E402

POLITE_KEY, FLOOD_KEY = "sk-polite-overload", "sk-flood-overload"
P99_RATIO_TARGET = 1.2
WARM_UP_REQUESTS = 3  # the first answers grow the allocator's pools: not measured
FLOOD_LEAD_S = 2.0  # the flood is under way before the polite key's first request


@dataclass
class PolitePhase:
    name: str
    ttft_s: list[float] = field(default_factory=list)
    statuses: Counter = field(default_factory=Counter)
    no_text: int = 0  # 200s whose stream had no text
    load_after: float = 0.0  # the 1-minute load average as it ended: others' work skews times

    def server_errors(self) -> int:
        return sum(n for status, n in self.statuses.items() if status >= 500 or status == 0)

    def figures(self) -> dict[str, float]:
        """Median, p90, p99 and max time to first token, in seconds."""
        if len(self.ttft_s) < 2:
            return {}
        cuts = statistics.quantiles(self.ttft_s, n=100, method="inclusive")
        return {
            "median": statistics.median(self.ttft_s),
            "p90": cuts[89],
            "p99": cuts[98],
            "max": max(self.ttft_s),
        }


def polite_phase(base: str, model: str, name: str, requests: int, seed: int) -> PolitePhase:
    """The polite key's `requests` streamed chats, one at a time."""
    phase, rng = PolitePhase(name), random.Random(seed)
    headers = {"Authorization": f"Bearer {POLITE_KEY}"}
    with httpx.Client(base_url=base, headers=headers, timeout=120) as http:
        for _ in range(requests):
            try:
                outcome = stream_chat(http, chat_body(model, short_prompt(rng)))
            except httpx.HTTPError:
                phase.statuses[0] += 1  # no answer at all counts with the 5xx
                continue
            phase.statuses[outcome.status] += 1
            if outcome.status == 200 and outcome.first_content_s is None:
                phase.no_text += 1
            elif outcome.first_content_s is not None:
                phase.ttft_s.append(outcome.first_content_s)
    phase.load_after = os.getloadavg()[0]
    return phase


def flooded_phase(base: str, model: str, args) -> tuple[PolitePhase, FloodFigures]:
    """The polite key's chats while the flood runs beside them."""
    flood = Flood(base, FLOOD_KEY, model, FLOOD_FACTOR * args.flood_rpm, args.flood_connections)
    flooding = threading.Thread(target=flood.run, args=(float("inf"),))
    flooding.start()
    try:
        time.sleep(FLOOD_LEAD_S)
        phase = polite_phase(base, model, "flood", args.requests, seed=2)
    finally:
        flood.stop()
        flooding.join()
    return phase, flood.figures


HONOURED_RETRIES = 5


def honoured_retries(base: str, model: str, count: int = HONOURED_RETRIES) -> list[bool]:
    """The flood key as a client that honours Retry-After: it sends one request at a time
    until refused, waits as told, and retries once; whether each retry got in. (During the
    flood the key's other connections keep sending and may take the room a retry was
    promised: those retries are reported, not judged.)"""
    rng = random.Random(7)
    outcomes = []
    headers = {"Authorization": f"Bearer {FLOOD_KEY}"}
    with httpx.Client(base_url=base, headers=headers, timeout=120) as http:
        for _ in range(count):
            refused = None
            for _ in range(200):  # a minute's quota at most, then refused
                answer = stream_chat(http, chat_body(model, short_prompt(rng)))
                if answer.status == 429:
                    refused = answer
                    break
            if refused is None:
                outcomes.append(False)
                continue
            time.sleep(max(0.0, refused.answered_at + int(refused.retry_after) - time.monotonic()))
            outcomes.append(stream_chat(http, chat_body(model, short_prompt(rng))).status == 200)
    return outcomes


def write_key_file(folder: Path, args) -> Path:
    flood_limits = {"key": FLOOD_KEY, "requests_per_minute": args.flood_rpm}
    flood_limits |= {"tokens_per_minute": args.flood_tpm}
    if args.flood_concurrent:
        flood_limits["max_concurrent"] = args.flood_concurrent
    path = folder / "keys.toml"
    path.write_text(key_file_text({"polite": {"key": POLITE_KEY}, "flood": flood_limits}))
    return path


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except OSError:
        return "unknown"
    names = [line.split(":", 1)[1].strip() for line in out.splitlines() if "Model name" in line]
    return names[0] if names else "unknown"


def measure(args) -> dict:
    with tempfile.TemporaryDirectory(prefix="overload-") as folder:
        key_file = write_key_file(Path(folder), args)
        flags = ("--parallel", str(args.parallel), "--threads", str(args.threads))
        with running_server(args.exe, *flags, "--api-key-file", str(key_file)) as (proc, base):
            wait_ready(base)
            headers = {"Authorization": f"Bearer {POLITE_KEY}"}
            model = httpx.get(base + "/v1/models", headers=headers).json()["data"][0]["id"]
            polite_phase(base, model, "warm-up", WARM_UP_REQUESTS, seed=0)
            baseline = polite_phase(base, model, "baseline", args.requests, seed=1)
            flooded, flood = flooded_phase(base, model, args)
            honoured = honoured_retries(base, model)
            exited = proc.poll()
    return report(args, baseline, flooded, flood, exited) | {"honoured_retries": honoured}


def report(args, baseline: PolitePhase, flooded: PolitePhase, flood: FloodFigures, exited):
    base_p99 = baseline.figures().get("p99")
    flood_p99 = flooded.figures().get("p99")
    return {
        "cpu": cpu_model(),
        "server": {"parallel": args.parallel, "threads": args.threads},
        "flood_key": {
            "requests_per_minute": args.flood_rpm,
            "tokens_per_minute": args.flood_tpm,
            "max_concurrent": args.flood_concurrent,
            "connections": args.flood_connections,
            "asked_per_minute": FLOOD_FACTOR * args.flood_rpm,
        },
        "polite": {
            phase.name: {
                "requests": sum(phase.statuses.values()),
                "ttft_s": phase.figures(),
                "statuses": dict(phase.statuses),
                "no_text": phase.no_text,
                "load_after": phase.load_after,
            }
            for phase in (baseline, flooded)
        },
        "p99_ratio": flood_p99 / base_p99 if base_p99 and flood_p99 else None,
        "polite_server_errors": baseline.server_errors() + flooded.server_errors(),
        "flood": {
            "sent": flood.sent,
            "sent_per_minute": flood.sent_per_minute,
            "statuses": dict(flood.statuses),
            "refusals": dict(flood.refusals),
            "retries_tried": flood.retries_tried,
            "retries_ok": flood.retries_ok,
            "retry_failures": dict(flood.retry_failures),
            "problems": flood.problems(),
        },
        "server_exited": exited,
    }


def print_table(result: dict) -> None:
    print(
        f"CPU: {result['cpu']}; serve --parallel {result['server']['parallel']} "
        f"--threads {result['server']['threads']}"
    )
    limits = result["flood_key"]
    print(
        f"flood key: {limits['requests_per_minute']} requests/min, "
        f"{limits['tokens_per_minute']} tokens/min, "
        f"max_concurrent {limits['max_concurrent'] or 'none'}; "
        f"{limits['connections']} connections asking {limits['asked_per_minute']}/min"
    )
    heads = "".join(f"{head:>9}" for head in ("median", "p90", "p99", "max", "load"))
    print(f"{'polite TTFT (ms)':<18}{'n':>5}{heads}  statuses")
    for name, phase in result["polite"].items():
        ttft = phase["ttft_s"]
        cells = "".join(
            f"{ttft.get(k, float('nan')) * 1000:>9.0f}" for k in ("median", "p90", "p99", "max")
        )
        statuses = ", ".join(f"{s}: {n}" for s, n in sorted(phase["statuses"].items()))
        load = f"{phase['load_after']:>9.1f}"
        print(f"{name:<18}{phase['requests']:>5}{cells}{load}  {statuses}")
    print(
        f"(load: the 1-minute load average as the phase ended; past {os.cpu_count()} CPUs, "
        "other work shared them and skewed the times)"
    )
    ratio = result["p99_ratio"]
    print(f"p99 ratio, flood over baseline: {ratio:.2f}" if ratio else "p99 ratio: n/a")
    flood = result["flood"]
    statuses = flood["statuses"]
    other = flood["sent"] - statuses.get(200, 0) - statuses.get(429, 0)
    refusals = ", ".join(f"{why} {n}" for why, n in sorted(flood["refusals"].items()))
    print(
        f"flooder: {flood['sent']} sent ({flood['sent_per_minute']:.0f}/min): "
        f"{statuses.get(200, 0)} x 200, {statuses.get(429, 0)} x 429 ({refusals or 'none'}), "
        f"{other} other"
    )
    failures = ", ".join(f"{why}: {n}" for why, n in sorted(flood["retry_failures"].items()))
    print(
        f"retries during the flood, after Retry-After: {flood['retries_ok']}/"
        f"{flood['retries_tried']} succeeded" + (f" (failed: {failures})" if failures else "")
    )
    honoured = result["honoured_retries"]
    print(f"retries of a client honouring Retry-After: {sum(honoured)}/{len(honoured)} succeeded")


def print_verdicts(result: dict) -> None:
    flood, ratio = result["flood"], result["p99_ratio"]
    verdicts = {
        f"polite p99 TTFT within {P99_RATIO_TARGET}x of baseline": (
            ratio is not None and ratio <= P99_RATIO_TARGET
        ),
        "no polite 5xx": result["polite_server_errors"] == 0,
        "flood answered only 200 or 429 (with Retry-After)": not flood["problems"],
        "a retry at Retry-After succeeds (a client honouring it)": (
            bool(result["honoured_retries"]) and all(result["honoured_retries"])
        ),
    }
    for target, met in verdicts.items():
        print(f"{'PASS' if met else 'MISS'}: {target}")
    for problem in flood["problems"]:
        print(f"  {problem}")
    if result["server_exited"] is not None:
        print(f"MISS: the server exited with {result['server_exited']}")


def parse_args(argv: list[str] | None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=100, help="polite requests a phase")
    parser.add_argument("--quick", action="store_true", help="20 polite requests a phase")
    parser.add_argument("--parallel", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--flood-rpm", type=int, default=30, help="the flood key's quota")
    parser.add_argument("--flood-tpm", type=int, default=3000)
    parser.add_argument("--flood-concurrent", type=int, default=1, help="0: no limit")
    parser.add_argument("--flood-connections", type=int, default=FLOOD_CONNECTIONS)
    parser.add_argument("--exe", default=str(Path(sys.executable).parent / "miniapp"))
    parser.add_argument("--json", type=Path, metavar="FILE", help="write the figures here too")
    args = parser.parse_args(argv)
    if args.quick:
        args.requests = 20
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = measure(args)
    print_table(result)
    print_verdicts(result)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
