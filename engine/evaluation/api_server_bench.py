"""Serving many clients at once through `miniapp serve`'s HTTP API, measured as serving.py
measures the engine in-process (`miniapp bench serve --http`): the same prompts as token ids,
the same number of new tokens (end of turn ignored), greedy, each client on its own
connection. What it adds to the in-process figures is the cost of the HTTP layer: uvicorn,
JSON, server-sent events and the relay from the engine's thread to the event loop.

The server streams text, one event per piece of text (a token, or a few whose bytes only
make text together): an event's arrival times its tokens, and the answer's length is the
usage chunk's count. Answers are compared, piece by piece, with a lone client's.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx

from ..errors import MiniappError
from .llama_server_bench import HOST, HTTP_TIMEOUT, ServerProcess, _free_port
from .serving import ServingResult, run_clients, summarize


class ApiServer(ServerProcess):
    """`miniapp serve` with `slots` slots of `ctx` tokens, drafting off (as in-process)."""

    name = "miniapp serve"

    def __init__(self, model: Path, slots: int, ctx: int, threads: int, kv_type: str):
        port = _free_port()
        self.url = f"http://{HOST}:{port}"
        # Two slots at least: one is the engine without its scheduler, another code path
        # (the in-process bench's lone client runs on a one-slot scheduler).
        super().__init__(
            [
                sys.executable,
                "-m",
                "miniapp.app",
                "serve",
                "--model",
                str(model),
                "--host",
                HOST,
                "--port",
                str(port),
                "--parallel",
                str(max(slots, 2)),
                "--queue",
                str(slots * 2),
                "--ctx",
                str(ctx),
                "--threads",
                str(threads),
                "--kv-type",
                kv_type,
                "--spec",
                "off",
            ]
        )


def stream_answer(
    client: httpx.Client, url: str, model: str, prompt: list[int], tokens: int
) -> Iterator[str]:
    """One streamed completion of exactly `tokens` tokens: yields each event's text as it
    arrives, then an empty piece for each token that came in an event with others (the
    usage chunk's count says how many), so that one item stands for one token."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": tokens,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
    }
    pieces, count = 0, 0
    with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        if response.status_code != 200:
            response.read()
            raise MiniappError(f"miniapp serve answered {response.status_code}: {response.text}")
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue  # separators and the closing [DONE]
            event = json.loads(line.removeprefix("data: "))
            if event.get("usage"):
                count = event["usage"]["completion_tokens"]
            for choice in event.get("choices", []):
                if choice.get("text"):
                    pieces += 1
                    yield choice["text"]
    yield from [""] * max(0, count - pieces)


class ApiServerBench:
    """`miniapp serve` with N slots for N clients, as LlamaServerBench runs llama-server."""

    def __init__(
        self,
        model: Path,
        prompts: list[list[int]],
        tokens: int,
        ctx: int,
        threads: int,
        kv_type: str,
    ):
        self.model, self.prompts, self.tokens = model, prompts, tokens
        self.ctx, self.threads, self.kv_type = ctx, threads, kv_type
        self._lone: dict[int, list[str]] = {}

    def lone_answers(self) -> None:
        """Each prompt's answer from a one-slot server: the reference for `identical`."""
        with self._server(1) as server, _client() as client:
            for index, prompt in enumerate(self.prompts):
                self._lone[index] = list(self._answer(server, client, prompt))

    def run(self, clients: int, requests_per_client: int) -> ServingResult:
        with self._server(clients) as server, _client() as client:
            done, wall = run_clients(
                clients,
                requests_per_client,
                len(self.prompts),
                lambda i: self._answer(server, client, self.prompts[i]),
            )
            peak_rss_mb = server.peak_rss_mb()
        return summarize(clients, done, wall, self._lone, peak_rss_mb)

    def _server(self, slots: int) -> ApiServer:
        return ApiServer(self.model, slots, self.ctx, self.threads, self.kv_type)

    def _answer(self, server: ApiServer, client: httpx.Client, prompt: list[int]):
        return stream_answer(client, server.url, self.model.name, prompt, self.tokens)


def _client() -> httpx.Client:
    # One connection a client at most; no proxy for 127.0.0.1.
    return httpx.Client(
        timeout=HTTP_TIMEOUT, trust_env=False, limits=httpx.Limits(max_connections=64)
    )
