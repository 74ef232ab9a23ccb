"""A serving soak: clients send a mix of good and bad requests to a real `miniapp serve` for a
set time, and the server must come out of it as it went in.

Each client (a thread with its own seeded random mix) sends, over and over: chats of varied
lengths, plain and streamed; streams it abandons after the first chunk; raw completions;
malformed JSON; bodies over the size limit; unknown fields and unknown models; transcriptions
of audio that is not audio. They send with the polite key of the server's key file (no
limits); beside them a second key floods at 10x its quota from 8 connections
(tests/flood_clients.py). Meanwhile the server's resident memory is sampled.

What must hold afterwards (`SoakFigures.problems`):
- no status of 500 or above other than 503 (the queue's bound, with its code);
- every completed answer valid: its finish reason, its token counts, its streamed chunks;
- no answer left running or waiting (the /metrics gauges read 0);
- every flood response a complete 200 or a 429 with Retry-After and rate_limit_exceeded;
- peak RSS in the last quarter at most 5% above the peak in the second (the first quarter is
  warm-up: the first answers grow the allocator's pools and the prefix cache);
- generated tokens per second in the last quarter at least 0.9x the first quarter's.

    make soak                              # 20 minutes; SOAK_MINUTES=5 make soak
    python tests/soak_serve.py --minutes 1

tests/test_soak.py runs a one-minute version in `make test`. Linux only (RSS from /proc).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from flood_clients import FLOOD_FACTOR, Flood, FloodFigures, key_file_text  # noqa: E402
from test_serve import running_server, wait_ready  # noqa: E402

CLIENTS = 8
BODY_LIMIT_MB = 1
SERVER_FLAGS = ("--parallel", "4", "--queue", "8", "--max-body-mb", str(BODY_LIMIT_MB))
POLITE_KEY, FLOOD_KEY = "sk-soak-polite", "sk-soak-flood"
# A small quota, so that the flood is refused for both reasons: its two answers at once are
# busy, and its requests a minute run out after the first few. (With 30 a minute and one
# answer at once, a busy 2-core machine only ever refused it for the first.)
FLOOD_LIMITS = {"requests_per_minute": 6, "tokens_per_minute": 3000, "max_concurrent": 2}
KEYS = {"polite": {"key": POLITE_KEY}, "flood": {"key": FLOOD_KEY, **FLOOD_LIMITS}}
POLITE_HEADERS = {"Authorization": f"Bearer {POLITE_KEY}"}
WORDS = (
    "the quick brown fox jumps over a lazy dog while seven small birds sing about "
    "rivers mountains and the long road home"
).split()
# Each kind of request and how often a client picks it.
MIX = {
    "chat": 30,
    "chat_stream": 25,
    "abandoned_stream": 10,
    "completion": 6,
    "malformed_json": 8,
    "oversized": 4,
    "unknown_field": 6,
    "unknown_model": 6,
    "bad_audio": 5,
}
CLIENT_ERRORS = {"malformed_json": {400, 422}, "oversized": {413}, "bad_audio": {400}}


@dataclass
class SoakFigures:
    seconds: float
    started: float  # time.monotonic() at the start
    statuses: Counter = field(default_factory=Counter)  # (kind, status) -> count
    tokens: list[tuple[float, int]] = field(default_factory=list)  # (end time, tokens)
    rss: list[tuple[float, int]] = field(default_factory=list)  # (time, bytes)
    invalid: list[str] = field(default_factory=list)
    left_running: float = -1.0
    left_waiting: float = -1.0
    flood: FloodFigures = field(default_factory=FloodFigures)

    def quarter(self, samples: list[tuple[float, int]], index: int) -> list[int]:
        start, end = self.seconds * index / 4, self.seconds * (index + 1) / 4
        return [value for at, value in samples if start <= at < end]

    def throughput_ratio(self) -> float:
        first, last = sum(self.quarter(self.tokens, 0)), sum(self.quarter(self.tokens, 3))
        return last / first if first else 0.0

    def rss_growth(self) -> float:
        second, last = self.quarter(self.rss, 1), self.quarter(self.rss, 3)
        return max(last) / max(second) - 1 if second and last else float("inf")

    def server_errors(self) -> dict[tuple[str, int], int]:
        return {key: n for key, n in self.statuses.items() if key[1] >= 500 and key[1] != 503}

    def problems(self) -> list[str]:
        found = [f"{n} x {status} on {kind}" for (kind, status), n in self.server_errors().items()]
        found += self.invalid[:5]
        found += self.flood.problems()
        if self.left_running or self.left_waiting:
            found.append(f"left {self.left_running:g} running, {self.left_waiting:g} waiting")
        if self.rss_growth() > 0.05:
            found.append(f"peak RSS grew {self.rss_growth():.1%} from the second quarter")
        if self.throughput_ratio() < 0.9:
            found.append(f"last quarter's throughput {self.throughput_ratio():.2f}x the first")
        return found

    def summary(self) -> str:
        answered = sum(n for (kind, status), n in self.statuses.items() if status == 200)
        lines = [
            f"{self.seconds:.0f} s, {CLIENTS} clients, {sum(self.statuses.values())} requests "
            f"({answered} answered 200), {sum(t for _, t in self.tokens)} tokens generated",
            "statuses: "
            + ", ".join(
                f"{kind} {status}: {n}" for (kind, status), n in sorted(self.statuses.items())
            ),
            "peak RSS by quarter (MB): "
            + ", ".join(
                f"{max(self.quarter(self.rss, q), default=0) / 2**20:.0f}" for q in range(4)
            ),
            f"RSS growth, last quarter over second: {self.rss_growth():+.1%}",
            "tokens/s by quarter: "
            + ", ".join(
                f"{sum(self.quarter(self.tokens, q)) / (self.seconds / 4):.1f}" for q in range(4)
            ),
            f"throughput, last quarter over first: {self.throughput_ratio():.2f}x",
            f"left running/waiting: {self.left_running:g}/{self.left_waiting:g}",
            f"invalid answers: {len(self.invalid)}",
            self.flood.summary(),
        ]
        return "\n".join(lines)


class _Client:
    def __init__(self, base: str, seed: int, figures: SoakFigures, lock: threading.Lock):
        self.random = random.Random(seed)
        self.model = _model(base)
        self.figures, self.lock = figures, lock
        self.last_code = ""  # the error code of the last 503
        self.http = httpx.Client(
            base_url=base,
            headers=POLITE_HEADERS,
            timeout=120,
            event_hooks={"response": [self._note_refusal]},
        )

    def run(self, until: float) -> None:
        kinds, weights = zip(*MIX.items(), strict=True)
        while time.monotonic() < until:
            kind = self.random.choices(kinds, weights)[0]
            self.last_code = ""
            try:
                status = getattr(self, kind)()
            except httpx.HTTPError as exc:
                status = 0
                self.invalid(f"{kind}: {type(exc).__name__}: {exc}")
            if status == 503 and self.last_code != "queue_full":
                self.invalid(f"{kind}: a 503 that is not the queue's bound ({self.last_code})")
            with self.lock:
                self.figures.statuses[(kind, status)] += 1

    # -- helpers

    def _note_refusal(self, response: httpx.Response) -> None:
        if response.status_code == 503:
            response.read()
            self.last_code = response.json().get("error", {}).get("code", "")

    def invalid(self, reason: str) -> None:
        with self.lock:
            self.figures.invalid.append(reason)

    def produced(self, tokens: int) -> None:
        with self.lock:
            self.figures.tokens.append((time.monotonic() - self.figures.started, tokens))

    def messages(self) -> list[dict]:
        words = self.random.randint(2, 300)
        text = " ".join(self.random.choice(WORDS) for _ in range(words))
        return [{"role": "user", "content": f"Say something about this: {text}"}]

    def chat_body(self, **extra) -> dict:
        body = {
            "model": self.model,
            "messages": self.messages(),
            "max_tokens": self.random.randint(4, 48),
            "temperature": 0.8,
            "seed": self.random.randint(0, 1 << 30),
        }
        return {**body, **extra}

    def check_answer(self, kind: str, body: dict, answer: dict) -> None:
        choice, usage = answer["choices"][0], answer["usage"]
        limit = body["max_tokens"]
        tokens = usage["completion_tokens"]
        text = choice["message"]["content"] if "message" in choice else choice["text"]
        if choice["finish_reason"] not in ("stop", "length") or not isinstance(text, str):
            self.invalid(f"{kind}: finish_reason {choice['finish_reason']!r}")
        # "stop" may come at the limit too: the end-of-turn token can be the last one allowed.
        elif not 0 <= tokens <= limit or (choice["finish_reason"] == "length" and tokens < limit):
            self.invalid(f"{kind}: {tokens} tokens, {choice['finish_reason']} at {limit}")
        else:
            self.produced(tokens)

    # -- the requests

    def chat(self) -> int:
        body = self.chat_body()
        response = self.http.post("/v1/chat/completions", json=body)
        if response.status_code == 200:
            self.check_answer("chat", body, response.json())
        return response.status_code

    def completion(self) -> int:
        body = {
            "model": self.model,
            "prompt": self.messages()[0]["content"],
            "max_tokens": self.random.randint(4, 32),
        }
        response = self.http.post("/v1/completions", json=body)
        if response.status_code == 200:
            self.check_answer("completion", body, response.json())
        return response.status_code

    def chat_stream(self) -> int:
        body = self.chat_body(stream=True, stream_options={"include_usage": True})
        with self.http.stream("POST", "/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                response.read()
                return response.status_code
            chunks = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
        if not chunks or chunks[-1] != "[DONE]":
            self.invalid("chat_stream: no [DONE] at the end")
            return 200
        events = [json.loads(chunk) for chunk in chunks[:-1]]
        finals = [
            e["choices"][0] for e in events if e["choices"] and e["choices"][0].get("finish_reason")
        ]
        usage = events[-1].get("usage") if events else None
        if len(finals) != 1 or usage is None:
            self.invalid(f"chat_stream: {len(finals)} finish reasons, usage {usage}")
            return 200
        text = "".join(
            e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"]
        )
        choice = {"message": {"content": text}, "finish_reason": finals[0]["finish_reason"]}
        answer = {"choices": [choice], "usage": usage}
        self.check_answer("chat_stream", body, answer)
        return 200

    def abandoned_stream(self) -> int:
        body = self.chat_body(stream=True, max_tokens=48)
        with self.http.stream("POST", "/v1/chat/completions", json=body) as response:
            for _ in response.iter_lines():
                break  # the client walks away after the first line
            return response.status_code

    def malformed_json(self) -> int:
        broken = b'{"model": "soak", "messages": [{"role": "user", "content": "hi"'
        response = self.http.post(
            "/v1/chat/completions", content=broken, headers={"Content-Type": "application/json"}
        )
        return self.expect("malformed_json", response)

    def oversized(self) -> int:
        padding = "x" * (BODY_LIMIT_MB * 2**20 + 1000)
        body = self.chat_body(messages=[{"role": "user", "content": padding}])
        return self.expect("oversized", self.http.post("/v1/chat/completions", json=body))

    def unknown_field(self) -> int:
        body = self.chat_body(frobnicate={"level": 11}, max_tokens=4)
        return self.http.post("/v1/chat/completions", json=body).status_code

    def unknown_model(self) -> int:
        body = self.chat_body(model="no-such-model-anywhere", max_tokens=4)
        return self.http.post("/v1/chat/completions", json=body).status_code

    def bad_audio(self) -> int:
        noise = bytes(self.random.getrandbits(8) for _ in range(4000))
        response = self.http.post(
            "/v1/audio/transcriptions",
            data={"model": "whisper-1"},
            files={"file": ("speech.wav", noise, "audio/wav")},
        )
        return self.expect("bad_audio", response)

    def expect(self, kind: str, response: httpx.Response) -> int:
        if response.status_code not in CLIENT_ERRORS[kind]:
            self.invalid(f"{kind}: {response.status_code} {response.text[:120]}")
        elif "error" not in response.json():
            self.invalid(f"{kind}: a {response.status_code} without OpenAI's error shape")
        return response.status_code


def _model(base: str) -> str:
    return httpx.get(base + "/v1/models", headers=POLITE_HEADERS).json()["data"][0]["id"]


def _resident_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def _gauge(metrics: str, name: str) -> float:
    for line in metrics.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return -1.0


def soak(exe: str, seconds: float, clients: int = CLIENTS) -> SoakFigures:
    """Runs the soak against a server of its own and returns what it measured."""
    with tempfile.TemporaryDirectory(prefix="soak-keys-") as folder:
        key_file = Path(folder) / "keys.toml"
        key_file.write_text(key_file_text(KEYS))
        flags = (*SERVER_FLAGS, "--api-key-file", str(key_file))
        with running_server(exe, *flags) as (proc, base):
            wait_ready(base)
            return _soak_server(proc, base, seconds, clients)


def _soak_server(proc, base: str, seconds: float, clients: int) -> SoakFigures:
    started = time.monotonic()
    figures = SoakFigures(seconds, started)
    until = started + seconds
    lock = threading.Lock()
    workers = [
        threading.Thread(target=_Client(base, seed, figures, lock).run, args=(until,))
        for seed in range(clients)
    ]
    flood = Flood(base, FLOOD_KEY, _model(base), FLOOD_FACTOR * FLOOD_LIMITS["requests_per_minute"])
    figures.flood = flood.figures
    workers.append(threading.Thread(target=flood.run, args=(until,)))
    for worker in workers:
        worker.start()
    while (now := time.monotonic()) < until:
        figures.rss.append((now - started, _resident_bytes(proc.pid)))
        time.sleep(0.5)
    for worker in workers:
        worker.join()
    time.sleep(1.0)  # abandoned streams are noticed at their next token
    metrics = httpx.get(base + "/metrics", headers=POLITE_HEADERS).text
    figures.left_running = _gauge(metrics, "miniapp_requests_running")
    figures.left_waiting = _gauge(metrics, "miniapp_requests_waiting")
    if proc.poll() is not None:
        figures.invalid.append(f"the server exited with {proc.returncode}")
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=20.0)
    parser.add_argument("--exe", default=str(Path(sys.executable).parent / "miniapp"))
    args = parser.parse_args()
    figures = soak(args.exe, args.minutes * 60)
    print(figures.summary())
    problems = figures.problems()
    print("PASSED" if not problems else "FAILED: " + "; ".join(problems))
    raise SystemExit(1 if problems else 0)


if __name__ == "__main__":
    main()
