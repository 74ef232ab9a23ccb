"""Fuzzing every endpoint of `miniapp serve` from its OpenAPI schema (/openapi.json):
schemathesis (on hypothesis) generates requests for each operation, both valid by the schema
and not, and they go to a real server (the bundled SmolLM2, --threads 1, --parallel 2,
--queue 4, --ctx 2048) with a key from an --api-key-file, whose generous quotas are
admitted and settled on every answer. Several processes fuzz at once, rounds over every
operation with fresh cases until the time is up; the first begins with schemathesis's
coverage cases (each field's bounds, wrong types and absence, the methods a path does not
take). Generated bodies are bounded (`bounded`: why is said there).

What each response must be (`response_problems`, then schemathesis's `BUILTIN_CHECKS`):
- no status of 500 or above but a 503 that says why: the queue's bound (queue_full), a model
  loading (model_loading) or the circuit breaker (engine_unavailable); under /v1/messages,
  whose errors carry no code, Anthropic's overloaded_error;
- an error (400 and above) in its API's shape: OpenAI's {"error": {"message", "type", ...}},
  or Anthropic's {"type": "error", "error": {"type", "message"}} under /v1/messages;
- JSON that parses where the response says JSON; a stream without a crash's error event;
- an answer within REQUEST_TIMEOUT_S (a hang fails).
Afterwards the server must have no answer left running or waiting (the /metrics gauges read
0), answer a plain chat, and hold at most RSS_GROWTH_BOUND more resident memory at the end
than after the warm-up (the first WARMUP_SHARE of the run).

    make fuzz-api                           # 20 minutes; FUZZ_API_MINUTES=5 make fuzz-api
    python tests/fuzz_api.py --minutes 3

A failure is printed as the request that caused it (method, path, body, and a curl command).
tests/test_serve_fuzz.py runs a few examples of every operation in `make test`. Linux only
(RSS from /proc).
"""

from __future__ import annotations

import argparse
import io
import json
import math
import multiprocessing
import queue
import random
import struct
import subprocess
import sys
import tempfile
import time
import wave
from collections import Counter, deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, Verbosity, given, settings
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.core import NOT_SET
from schemathesis.core.failures import FailureGroup
from schemathesis.specs.openapi.checks import response_headers_conformance, unsupported_method

sys.path.insert(0, str(Path(__file__).parent))
from test_serve import START_TIMEOUT_S, stop_server, wait_ready  # noqa: E402

KEY = "sk-fuzz-0123456789"
# Generous: the quota's admission and settling run on every answer, its 429s almost never.
KEY_FILE = f"""
[keys.fuzzer]
key = "{KEY}"
requests_per_minute = 100000
tokens_per_minute = 10000000
max_concurrent = 16
"""
SERVER_FLAGS = ("--threads", "1", "--parallel", "2", "--queue", "4", "--ctx", "2048")
REQUEST_TIMEOUT_S = 60.0
SERVER_LOG = Path(__file__).resolve().parents[1] / "build" / "fuzz-api" / "server.log"
RSS_GROWTH_BOUND = 0.15
WARMUP_SHARE = 0.25
MODES = (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)

# 503s that are a bound doing its job, not a failure (their error codes).
REFUSALS = frozenset({"queue_full", "model_loading", "engine_unavailable"})
ANTHROPIC_PATHS = "/v1/messages"

# schemathesis's own checks that hold for this API: unsupported_method (the methods a path
# does not take, which schemathesis's coverage cases try, answer 405 with an Allow header)
# and response_headers_conformance (the headers the schema documents). Left out:
# not_a_server_error, replaced by `response_problems`, which lets the 503s of REFUSALS
# through; status_code_conformance, content_type_conformance and
# response_schema_conformance, because FastAPI's schema documents a 200 of JSON (of any
# shape) and a 422 only, while the API answers 400, 401, 404, 429 and 503 in OpenAI's error
# shape, streams text/event-stream, and serves /metrics as Prometheus's text: they would fail
# on every documented refusal, and `response_problems` checks those responses' shapes
# instead; positive_data_acceptance, because a request valid by the schema is still refused
# for what no schema says (a model that is not installed, token ids past the vocabulary, a
# prompt over the context); negative_data_rejection, because pydantic reads "1" as 1 and
# 1.0 as 1 by design; and the stateful checks, which need schemathesis's own runner.
BUILTIN_CHECKS = (unsupported_method, response_headers_conformance)

# ------------------------------------------------------------------ bounded requests

# Generated bodies are bounded before they are sent: the 135M model on one thread makes a few
# dozen tokens a second, so one request that leaves max_tokens unset (the rest of the 2048-token
# context, for each of `n` answers) holds a slot for a minute, and a run would measure the
# model's speed rather than the API. Only values over a cap are lowered (and a missing token
# limit set), so values under it, zero and negative ones included, still reach the checks.
TOKEN_CAP = 8
CHOICE_CAP = 2  # `n`: answers to one request
LIST_CAP = 2  # prompts, embedding inputs, rerank documents: each is a pass of the model
TOKEN_LIMITS = {  # the fields that limit an answer's tokens; True: set one when none is
    "/v1/chat/completions": (("max_tokens", "max_completion_tokens"), True),
    "/v1/completions": (("max_tokens",), True),
    "/v1/responses": (("max_output_tokens",), True),
    "/v1/messages": (("max_tokens",), False),  # required: a missing one is the 400 to test
}
LISTS = {
    "/v1/completions": "prompt",
    "/v1/embeddings": "input",
    "/v1/rerank": "documents",
    "/rerank": "documents",
    "/v1/reranking": "documents",
}


def bounded(path: str, body: object) -> object:
    """`body` with its answer's tokens, choices and passes capped (see TOKEN_CAP)."""
    if not isinstance(body, dict):
        return body
    body = dict(body)
    fields, set_missing = TOKEN_LIMITS.get(path, ((), False))
    for name in fields:
        if name in body:
            body[name] = _capped(body[name], TOKEN_CAP)
    if set_missing and all(body.get(name) is None for name in fields):
        body[fields[0]] = TOKEN_CAP
    if "n" in body:
        body["n"] = _capped(body["n"], CHOICE_CAP)
    listed = LISTS.get(path)
    items = body.get(listed)
    if isinstance(items, list) and items and not isinstance(items[0], int | float):
        body[listed] = items[:LIST_CAP]  # texts, or lists of token ids: one pass each
    return body


def _capped(value: object, cap: int) -> object:
    number = isinstance(value, int | float) and not isinstance(value, bool)
    return cap if number and value > cap else value


# The transcription route reads its multipart form itself, so FastAPI's schema has no body
# for it; this one (OpenAI's fields) has schemathesis send forms with random bytes as audio.
TRANSCRIPTION_BODY = {
    "required": True,
    "content": {
        "multipart/form-data": {
            "schema": {
                "type": "object",
                "required": ["file", "model"],
                "properties": {
                    "file": {"type": "string", "format": "binary"},
                    "model": {"type": "string"},
                    "response_format": {
                        "type": "string",
                        "enum": ["json", "text", "srt", "vtt", "verbose_json"],
                    },
                    "stream": {"type": "string", "enum": ["true", "false"]},
                    "language": {"type": "string"},
                    "temperature": {"type": "string"},
                    "prompt": {"type": "string"},
                },
            }
        }
    },
}
TRANSCRIPTIONS = "/v1/audio/transcriptions"
SPEECH_MODEL = "whisper-1"


def load_schema(base: str, served_model: str, response_ids) -> schemathesis.BaseSchema:
    """The server's schema, with the transcription form added, and hooks that name a model
    the server has in most bodies, reuse response ids it gave, and bound what is generated."""
    raw = httpx.get(base + "/openapi.json", headers=key_headers()).json()
    raw["paths"][TRANSCRIPTIONS]["post"]["requestBody"] = TRANSCRIPTION_BODY
    config = schemathesis.Config.from_dict(
        {
            "base-url": base,
            "max-stream-events": 100000,  # streams read to their end, to be checked whole
            # Its curl commands as sent: "max_tokens" and "prompt_cache_key" look like secrets.
            "output": {"sanitization": {"enabled": False}},
        }
    )
    schema = schemathesis.openapi.from_dict(raw, config=config)

    @schema.hook("flatmap_body")
    def known_model(context, body):
        # A random model name is a 404 before anything runs: three bodies in four name one
        # the server has, so the rest of the request is what gets tested. (Hypothesis
        # draws the first of the choices most: the model's name.)
        named = answerable(context.operation.path, body, served_model)
        return st.just(body) if named is body else st.sampled_from((named, named, named, body))

    @schema.hook("flatmap_path_parameters")
    def known_response(context, parameters):
        # Ids of stored responses, so that GET and DELETE find some (and some deleted ones).
        if not parameters or "response_id" not in parameters:
            return st.just(parameters)
        known = [{**parameters, "response_id": rid} for rid in response_ids()]
        return st.sampled_from([parameters, *known])

    @schema.hook("map_body")
    def bounded_body(context, body):
        return bounded(context.operation.path, body)

    return schema


def answerable(path: str, body: object, served_model: str) -> object:
    """`body` naming a model the server has (itself if it names none)."""
    if not isinstance(body, dict) or "model" not in body:
        return body
    named = {**body, "model": SPEECH_MODEL if path == TRANSCRIPTIONS else served_model}
    if path == "/v1/responses" and named.get("input") is None:
        named["input"] = "Hi."  # optional in the schema, but without it nothing is asked
    return named


def key_headers() -> dict[str, str]:
    return {"Authorization": f"Bearer {KEY}"}


# ------------------------------------------------------------------ checks


def response_problems(path: str, status: int, content_type: str, content: bytes) -> list[str]:
    """What is wrong with one response (nothing: an empty list)."""
    problems = []
    parsed = _json(content) if "json" in content_type else None
    if "json" in content_type and parsed is _UNPARSED:
        problems.append(f"a {content_type} body that does not parse")
    if status >= 500 and not (status == 503 and _refusal(path, parsed)):
        problems.append(f"a server error ({status}){_said(parsed)}")
    if status >= 400 and not _error_shaped(path, parsed):
        problems.append(f"a {status} not in {_api_name(path)}'s error shape")
    if "text/event-stream" in content_type and _crashed_stream(content):
        problems.append("a stream with a crash's error event")
    return problems


_UNPARSED = object()


def _json(content: bytes) -> object:
    try:
        return json.loads(content)
    except ValueError:
        return _UNPARSED


def _api_name(path: str) -> str:
    return "Anthropic" if path.startswith(ANTHROPIC_PATHS) else "OpenAI"


def _error_shaped(path: str, body: object) -> bool:
    if not isinstance(body, dict) or not isinstance(body.get("error"), dict):
        return False
    error = body["error"]
    if not (isinstance(error.get("message"), str) and isinstance(error.get("type"), str)):
        return False
    return body.get("type") == "error" if path.startswith(ANTHROPIC_PATHS) else True


def _refusal(path: str, body: object) -> bool:
    """A 503 from a bound: its code says which (Anthropic's shape has no code: its type)."""
    if not _error_shaped(path, body):
        return False
    if path.startswith(ANTHROPIC_PATHS):
        return body["error"]["type"] == "overloaded_error"
    return body["error"].get("code") in REFUSALS


def _said(body: object) -> str:
    """An error body's message, shortened, to tell one cause from another."""
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        return f": {str(body['error'].get('message'))[:100]}"
    return ""


CRASH_TYPES = ("server_error", "api_error")  # OpenAI's and Anthropic's types of a 500
CRASH_MESSAGES = ("internal error", "the engine failed")  # how the server words either


def _crashed_stream(content: bytes) -> bool:
    """Whether a stream carries the error event of a crash (once a stream has begun, an
    error is sent as its last event): a 500's type, or, in the Responses API's
    response.failed, whose code says server_error for any error, a crash's wording."""
    for line in content.decode("utf-8", "replace").splitlines():
        event = _json(line.removeprefix("data:").encode()) if line.startswith("data:") else None
        if not isinstance(event, dict):
            continue
        response = event.get("response")
        error = event.get("error") or (
            response.get("error") if isinstance(response, dict) else None
        )
        if not isinstance(error, dict) or error.get("code") in REFUSALS:
            continue
        message = str(error.get("message", ""))
        if error.get("type") in CRASH_TYPES or message.startswith(CRASH_MESSAGES):
            return True
    return False


# ------------------------------------------------------------------ the fuzzer


@dataclass
class Failure:
    problem: str
    request: str  # method, path, body: the request to send again
    curl: str


@dataclass
class FuzzFigures:
    requests: int = 0
    statuses: Counter = field(default_factory=Counter)  # status -> count
    by_operation: Counter = field(default_factory=Counter)  # (label, status) -> count
    failures: dict[tuple[str, str], list[Failure]] = field(default_factory=dict)
    failure_counts: Counter = field(default_factory=Counter)  # (label, problem) -> count
    # Errors of the generation itself (schemathesis, hypothesis): the fuzzer's, not the
    # server's; reported, and a reason to look at the fuzzer.
    generation_errors: Counter = field(default_factory=Counter)  # (label, error) -> count

    def failed(self, label: str, failure: Failure) -> None:
        key = (label, failure.problem)
        self.failure_counts[key] += 1
        kept = self.failures.setdefault(key, [])
        if len(kept) < 3:  # a few of each: the first is usually enough to reproduce it
            kept.append(failure)

    def merge(self, other: FuzzFigures) -> None:
        self.requests += other.requests
        self.statuses.update(other.statuses)
        self.by_operation.update(other.by_operation)
        self.generation_errors.update(other.generation_errors)
        for (label, _), failures in other.failures.items():
            for failure in failures:
                self.failed(label, failure)
        for key, n in other.failure_counts.items():  # those not kept count too
            self.failure_counts[key] += n - len(other.failures[key])

    def histogram(self) -> str:
        return ", ".join(f"{status}: {n}" for status, n in sorted(self.statuses.items()))

    def report(self) -> str:
        lines = []
        for (label, problem), failures in self.failures.items():
            lines.append(f"FAILED {label}: {problem} ({self.failure_counts[label, problem]}x)")
            for failure in failures:
                lines += ["  " + failure.request, "  " + failure.curl.replace("\n", "\n  ")]
        for (label, error), n in self.generation_errors.items():
            lines.append(f"generation error, {n}x, {label}: {error}")
        return "\n".join(lines)


class Fuzzer:
    """Sends generated cases to the server and records what came back, from one thread
    (hypothesis and schemathesis's generation are not safe to share between threads)."""

    def __init__(
        self,
        base: str,
        served_model: str,
        derandomize: bool = False,
        timeout: float = REQUEST_TIMEOUT_S,
    ):
        self.base, self.served_model = base, served_model
        self.timeout = timeout  # seconds an answer may take before it counts as a hang
        self.derandomize = derandomize  # the same cases every run (the test suite's)
        self.response_ids: deque[str] = deque(maxlen=16)  # of responses the server stored
        self.schema = load_schema(base, served_model, lambda: self._known_ids)
        self.operations = [result.ok() for result in self.schema.get_all_operations()]
        self.figures = FuzzFigures()
        self._strategies: dict = {}  # (operation label, mode) -> its cases' strategy
        self.until = math.inf  # time.monotonic() past which nothing more is sent
        self.unsent = 0  # cases generated past `until`
        self._known_ids: tuple[str, ...] = ()  # response ids the generation may use now
        self._http = requests.Session()

    def fuzz(self, operation, mode: GenerationMode, examples: int) -> None:
        """Up to `examples` fresh cases of `operation` (valid or invalid by the schema)."""

        @settings(
            max_examples=examples,
            deadline=None,
            database=None,  # nothing kept between runs
            derandomize=self.derandomize,
            phases=[Phase.generate],  # failures are recorded, not raised: nothing to shrink
            suppress_health_check=list(HealthCheck),
            verbosity=Verbosity.quiet,  # an Unsatisfiable below is expected, not news
        )
        @given(case=self._strategy(operation, mode))
        def send_each(case):
            self.send(case)

        # Generation must not change while hypothesis runs: its ids are those known now.
        self._known_ids = tuple(self.response_ids)
        try:
            send_each()
        except Unsatisfiable:  # nothing to make invalid in an operation without inputs
            pass
        except Exception as exc:  # noqa: BLE001 - the generation's own error, recorded
            self._generation_error(operation, exc)

    def _generation_error(self, operation, exc: Exception) -> None:
        error = f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0]}"
        self.figures.generation_errors[(operation.label, error)] += 1

    def _strategy(self, operation, mode: GenerationMode):
        key = (operation.label, mode)
        if key not in self._strategies:
            self._strategies[key] = operation.as_strategy(generation_mode=mode)
        return self._strategies[key]

    def coverage(self, operation) -> None:
        """schemathesis's coverage cases: each field's bounds, types and absence, and the
        methods the path does not take (which must be a 405 with Allow)."""
        generation = self.schema.config.generation_for(operation=operation)
        cases = self.schema.iter_coverage_cases(
            operation, generation_modes=list(MODES), generation_config=generation
        )
        try:
            for case in cases:
                if time.monotonic() > self.until:
                    return
                if case.meta.generation.mode.is_positive:  # valid: it may as well be answered
                    case.body = answerable(operation.path, case.body, self.served_model)
                case.body = bounded(operation.path, case.body)
                self.send(case)
        except Exception as exc:  # noqa: BLE001 - the generation's own error, recorded
            self._generation_error(operation, exc)

    def send(self, case) -> None:
        if time.monotonic() > self.until:
            self.unsent += 1
            return
        started = time.monotonic()
        try:
            response = case.call(
                base_url=self.base,
                session=self._http,
                headers=key_headers(),
                timeout=self.timeout,
            )
        except requests.RequestException as exc:
            self._record(case, 0, [f"no answer: {type(exc).__name__}: {exc}"])
            return
        problems = response_problems(
            case.path, response.status_code, _content_type(response), response.content
        )
        if time.monotonic() - started > self.timeout or response.stream_cut_short:
            problems.append(f"no complete answer within {self.timeout:.0f} s")
        problems += self._builtin_failures(case, response)
        self._note_response_id(case, response)
        self._record(case, response.status_code, problems)

    def _builtin_failures(self, case, response) -> list[str]:
        try:
            case.validate_response(response, checks=list(BUILTIN_CHECKS), headers=key_headers())
        except FailureGroup as group:
            # One line each, the same for every method a check tried (one entry per kind).
            return [
                f"{failure.title}: {failure.message.splitlines()[0]}".replace(case.method, "METHOD")
                for failure in group.exceptions
            ]
        return []

    def _note_response_id(self, case, response) -> None:
        if case.path == "/v1/responses" and case.method == "POST" and response.status_code == 200:
            body = _json(response.content)
            if isinstance(body, dict) and isinstance(body.get("id"), str):
                self.response_ids.append(body["id"])

    def _record(self, case, status: int, problems: list[str]) -> None:
        label = case.operation.label
        self.figures.requests += 1
        self.figures.statuses[status] += 1
        self.figures.by_operation[(label, status)] += 1
        for problem in problems:
            self.figures.failed(label, Failure(problem, described(case), _curl(case)))


def _content_type(response) -> str:
    for name, values in response.headers.items():
        if name.lower() == "content-type" and values:
            return values[0]
    return ""


def described(case) -> str:
    """The request in a line: method, path (with its query) and body."""
    query = "?" + "&".join(f"{k}={v}" for k, v in case.query.items()) if case.query else ""
    body = case.body
    if isinstance(body, dict | list) and case.media_type == "application/json":
        shown = json.dumps(body, ensure_ascii=False)
    else:
        shown = "" if body is NOT_SET or body is None else repr(body)
    media = f" ({case.media_type})" if case.media_type else ""
    return f"{case.method} {case.formatted_path}{query}{media} {shown}".rstrip()


def _curl(case) -> str:
    try:
        return case.as_curl_command(headers=key_headers())
    except Exception as exc:  # noqa: BLE001 - the line above says what was sent
        return f"(no curl command: {exc})"


# ------------------------------------------------------------------ the server


@contextmanager
def fuzz_server(exe: str, log_path: Path) -> Iterator[tuple[subprocess.Popen, str]]:
    """A `miniapp serve` with the fuzzing flags and key file, ready; its process and URL.
    Its output goes to `log_path`: a 500's traceback is there."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="miniapp-fuzz-") as folder, log_path.open("w") as log:
        key_file = Path(folder) / "keys.toml"
        key_file.write_text(KEY_FILE)
        command = [exe, "serve", "--port", "0", "--spec", "off", *SERVER_FLAGS]
        proc = subprocess.Popen(
            [*command, "--api-key-file", str(key_file)], stdout=log, stderr=subprocess.STDOUT
        )
        try:
            base = _announced_url(proc, log_path)
            wait_ready(base)
            yield proc, base
        finally:
            stop_server(proc)


def _announced_url(proc: subprocess.Popen, log_path: Path) -> str:
    """The base URL the server prints first ("miniapp serve: http://127.0.0.1:PORT/v1 ...")."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline and proc.poll() is None:
        first = log_path.read_text(errors="replace").partition("\n")
        if first[1]:
            assert first[0].startswith("miniapp serve: http://127.0.0.1:"), first[0]
            return first[0].split()[2].removesuffix("/v1")
        time.sleep(0.1)
    raise AssertionError(f"the server did not start: {log_path.read_text(errors='replace')}")


def served_model(base: str) -> str:
    return httpx.get(base + "/v1/models", headers=key_headers()).json()["data"][0]["id"]


def aftermath(proc, base: str, model: str) -> list[str]:
    """What is wrong with the server once the fuzzing is over."""
    if proc.poll() is not None:
        return [f"the server exited with {proc.returncode}"]
    problems = []
    running = waiting = -1.0
    for _ in range(50):  # abandoned answers end at their next step
        metrics = httpx.get(base + "/metrics", headers=key_headers()).text
        running = gauge(metrics, "miniapp_requests_running")
        waiting = gauge(metrics, "miniapp_requests_waiting")
        if running == 0 and waiting == 0:
            break
        time.sleep(0.2)
    if running or waiting:
        problems.append(f"left {running:g} answers running and {waiting:g} waiting")
    answered = plain_chat(base, model)
    if answered is not None:
        problems.append(answered)
    return problems


def resident_bytes(pid: int) -> int:
    """The process's resident memory (VmRSS), in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def gauge(metrics: str, name: str) -> float:
    """A gauge's value in Prometheus's text (-1 if it is not there)."""
    for line in metrics.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return -1.0


def plain_chat(base: str, model: str) -> str | None:
    """None if the server answers a plain chat, else what went wrong. A circuit breaker
    that the last failures opened is waited for once (its Retry-After)."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "Say hello."}],
        "max_tokens": TOKEN_CAP,
    }
    for _ in range(2):
        response = httpx.post(
            base + "/v1/chat/completions", json=body, headers=key_headers(), timeout=60
        )
        if response.status_code != 503:
            break
        time.sleep(min(15, int(response.headers.get("retry-after", "1"))) + 1)
    if response.status_code != 200:
        return f"a plain chat got {response.status_code}: {response.text[:200]}"
    content = response.json()["choices"][0]["message"]["content"]
    return None if isinstance(content, str) else f"a plain chat answered {content!r}"


def tone_wav(seconds: float = 1.0, rate: int = 16000) -> bytes:
    """A WAV of a 440 Hz tone: audio that decodes, so the speech model loads in warm-up."""
    samples = (
        int(8000 * math.sin(2 * math.pi * 440 * i / rate)) for i in range(int(seconds * rate))
    )
    out = io.BytesIO()
    with wave.open(out, "wb") as wav:
        wav.setnchannels(1)
        wav.setsampwidth(2)
        wav.setframerate(rate)
        wav.writeframes(b"".join(struct.pack("<h", s) for s in samples))
    return out.getvalue()


def load_speech_model(base: str) -> None:
    """One transcription of a tone (no speech: a 400 or an empty text, either will do)."""
    httpx.post(
        base + TRANSCRIPTIONS,
        data={"model": SPEECH_MODEL},
        files={"file": ("tone.wav", tone_wav(), "audio/wav")},
        headers=key_headers(),
        timeout=120,
    )


# ------------------------------------------------------------------ the long run


@dataclass
class RunFigures:
    fuzz: FuzzFigures
    seconds: float
    rss_warm: int = 0  # bytes, after the warm-up
    rss_end: int = 0
    problems: list[str] = field(default_factory=list)

    def rss_growth(self) -> float:
        return self.rss_end / self.rss_warm - 1 if self.rss_warm else math.inf

    def all_problems(self) -> list[str]:
        counts = self.fuzz.failure_counts
        found = [f"{n} x {label}: {problem}" for (label, problem), n in counts.items()]
        found += self.problems
        if self.rss_growth() > RSS_GROWTH_BOUND:
            found.append(f"RSS grew {self.rss_growth():.1%} after warm-up")
        return found

    def summary(self) -> str:
        fuzz = self.fuzz
        operations = sorted({label for label, _ in fuzz.by_operation})
        lines = [
            f"{self.seconds:.0f} s, {fuzz.requests} requests",
            f"statuses: {fuzz.histogram()}",
            *(
                f"  {label}: "
                + ", ".join(
                    f"{s}: {n}" for (op, s), n in sorted(fuzz.by_operation.items()) if op == label
                )
                for label in operations
            ),
            f"RSS after warm-up {self.rss_warm / 2**20:.0f} MB, at the end "
            f"{self.rss_end / 2**20:.0f} MB ({self.rss_growth():+.1%}; bound "
            f"{RSS_GROWTH_BOUND:.0%})",
        ]
        return "\n".join(lines)


def long_run(exe: str, seconds: float, workers: int, examples: int, log: Path) -> RunFigures:
    """The server fuzzed by `workers` processes at once for `seconds` (processes, not threads:
    hypothesis and schemathesis's generation are not safe to share between threads)."""
    with fuzz_server(exe, log) as (proc, base):
        model = served_model(base)
        load_speech_model(base)
        started = time.monotonic()  # the same clock in every process (CLOCK_MONOTONIC)
        until = started + seconds
        figures = RunFigures(FuzzFigures(), seconds)
        spawn = multiprocessing.get_context("spawn")
        results = spawn.Queue()
        processes = [
            spawn.Process(target=_fuzz_worker, args=(base, model, n, examples, until, results))
            for n in range(workers)
        ]
        for process in processes:
            process.start()
        time.sleep(max(0.0, started + seconds * WARMUP_SHARE - time.monotonic()))
        figures.rss_warm = resident_bytes(proc.pid)
        for _ in processes:
            try:
                figures.fuzz.merge(results.get(timeout=until - time.monotonic() + 120))
            except queue.Empty:
                figures.problems.append("a fuzzing process never reported")
        for process in processes:
            process.join(timeout=10)
        figures.problems += aftermath(proc, base, model)
        figures.rss_end = resident_bytes(proc.pid)
        figures.seconds = time.monotonic() - started
        return figures


def _fuzz_worker(base: str, model: str, worker: int, examples: int, until: float, results):
    """One fuzzing process: rounds over every operation, in an order of its own, until the
    time is up; the first worker begins with schemathesis's coverage cases of every one."""
    figures = FuzzFigures()
    try:
        fuzzer = Fuzzer(base, model)
        figures, fuzzer.until = fuzzer.figures, until
        operations = list(fuzzer.operations)
        order = random.Random()
        if worker == 0:
            order.shuffle(operations)
            for operation in operations:
                fuzzer.coverage(operation)
        while time.monotonic() < until:
            order.shuffle(operations)
            for operation in operations:
                for mode in MODES:
                    fuzzer.fuzz(operation, mode, examples)
    except Exception as exc:  # noqa: BLE001 - reported with the figures so far
        figures.generation_errors[(f"worker {worker}", f"{type(exc).__name__}: {exc}")] += 1
    finally:
        results.put(figures)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=20.0)
    parser.add_argument("--workers", type=int, default=3, help="clients fuzzing at once")
    parser.add_argument("--examples", type=int, default=10, help="cases per operation a round")
    parser.add_argument("--exe", default=str(Path(sys.executable).parent / "miniapp"))
    parser.add_argument("--log", type=Path, default=SERVER_LOG, help="the server's output")
    args = parser.parse_args()
    figures = long_run(args.exe, args.minutes * 60, args.workers, args.examples, args.log)
    print(figures.summary())
    print(f"the server's log: {args.log}")
    report = figures.fuzz.report()
    if report:
        print(report)
    problems = figures.all_problems()
    print("PASSED" if not problems else "FAILED: " + "; ".join(problems))
    raise SystemExit(1 if problems else 0)


if __name__ == "__main__":
    main()
