"""Serving many clients at once on llama-server, llama.cpp's own HTTP server, measured as
serving.py measures our engine (`miniapp bench serve`): the same prompts as token ids, the
same number of new tokens (end of sequence ignored, as our bench ignores it), greedy.

Each client count gets a server of its own with one slot per client (`--parallel N`,
continuous batching) and `ctx` tokens in each slot: llama-server splits `-c` across its slots.
A token's arrival is timed when its server-sent event arrives; the peak RSS is the server
process's own. Every answer is compared with the same prompt's answer from llama-server with
a lone client.
"""

from __future__ import annotations

import json
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

from ..errors import MiniappError
from .serving import ServingResult, run_clients, summarize

HOST = "127.0.0.1"  # never reachable from another machine
READY_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 10.0
# A slot's first event waits for its prompt and for the slots ahead of it: minutes, on a CPU.
HTTP_TIMEOUT = httpx.Timeout(600.0, connect=10.0)


class LlamaServerExited(MiniappError):
    """llama-server ended on its own; the caller words how (`returncode`) for the user."""

    def __init__(self, doing: str, returncode: int, last_line: str):
        self.doing, self.returncode, self.last_line = doing, returncode, last_line
        super().__init__(f"llama-server ended (exit code {returncode}) while {doing}: {last_line}")


class ServerProcess:
    """A server process on a free port of 127.0.0.1 (the command is a subclass's, given the
    port); a context manager that waits until GET /health answers 200 and stops it."""

    name = "the server"

    def __init__(self, command: list[str]):
        self._log = None
        self._process: subprocess.Popen | None = None
        self.command = command

    def __enter__(self) -> ServerProcess:
        self._log = tempfile.TemporaryFile()  # a file, not a pipe: it never fills and blocks
        self._process = subprocess.Popen(
            self.command, stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT
        )
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def check_running(self, doing: str) -> None:
        returncode = self._process.poll()
        if returncode is not None:
            raise self.exited(doing, returncode)

    def exited(self, doing: str, returncode: int) -> MiniappError:
        return MiniappError(
            f"{self.name} ended (exit code {returncode}) while {doing}: {self.last_log_line()}"
        )

    def peak_rss_mb(self) -> float:
        """The process's peak resident set so far (Linux's VmHWM); 0 where unknown."""
        try:
            status = Path(f"/proc/{self._process.pid}/status").read_text()
        except OSError:
            return 0.0
        for line in status.splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024  # kB
        return 0.0

    def last_log_line(self) -> str:
        self._log.seek(0)
        lines = self._log.read().decode("utf-8", "replace").strip().splitlines()
        return lines[-1].strip() if lines else "(no output)"

    def stop(self) -> None:
        if self._process is not None and self._process.poll() is None:
            self._process.terminate()
            try:
                self._process.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
        if self._log is not None:
            self._log.close()

    def _wait_ready(self) -> None:
        """Until GET /health answers 200 (it answers 503 while the model loads)."""
        deadline = time.monotonic() + READY_TIMEOUT_S
        with httpx.Client(timeout=2.0, trust_env=False) as client:  # no proxy for 127.0.0.1
            while True:
                self.check_running("starting")
                try:
                    if client.get(f"{self.url}/health").status_code == 200:
                        return
                except httpx.TransportError:
                    pass  # not listening yet
                if time.monotonic() > deadline:
                    raise MiniappError(
                        f"{self.name} was not ready after {READY_TIMEOUT_S:.0f} s: "
                        f"{self.last_log_line()}"
                    )
                time.sleep(0.1)


class LlamaServer(ServerProcess):
    """llama-server with `slots` slots of `ctx_per_slot` tokens."""

    name = "llama-server"

    def __init__(self, binary: Path, model: Path, slots: int, ctx_per_slot: int, threads: int):
        port = _free_port()
        self.url = f"http://{HOST}:{port}"
        super().__init__(
            [
                str(binary),
                "-m",
                str(model),
                "--host",
                HOST,
                "--port",
                str(port),
                "-t",
                str(threads),
                "-tb",
                str(threads),
                "--parallel",
                str(slots),
                "-c",
                str(ctx_per_slot * slots),
                "-cb",
                "--no-webui",
            ]
        )

    def exited(self, doing: str, returncode: int) -> MiniappError:
        return LlamaServerExited(doing, returncode, self.last_log_line())


def stream_completion(
    client: httpx.Client, url: str, prompt: list[int], tokens: int
) -> Iterator[int]:
    """POST /completion with `prompt` as token ids; yields the answer's token ids as their
    events arrive (one token an event; all of an event's tokens if it carries several)."""
    body = {
        "prompt": prompt,
        "n_predict": tokens,
        "temperature": 0,
        "stream": True,
        "cache_prompt": True,
        "ignore_eos": True,
        "return_tokens": True,  # recent servers stream ids anyway; older ones only with this
    }
    with client.stream("POST", f"{url}/completion", json=body) as response:
        if response.status_code != 200:
            response.read()
            raise MiniappError(f"llama-server answered {response.status_code}: {response.text}")
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue  # blank separators, pings
            event = json.loads(line.removeprefix("data: "))
            if "error" in event:
                raise MiniappError(f"llama-server: {event['error']}")
            if event.get("content") and not event.get("tokens"):
                raise MiniappError("this llama-server streams no token ids: run make llama-server")
            yield from event.get("tokens", [])
            if event.get("stop"):
                return


def llama_server_version(binary: Path) -> str:
    """The first line `llama-server --version` prints, e.g. "version: 1 (unknown)"."""
    try:
        done = subprocess.run(
            [str(binary), "--version"], capture_output=True, text=True, timeout=30
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"unknown ({exc})"
    lines = (done.stdout + done.stderr).strip().splitlines()
    return next((line for line in lines if line.startswith("version")), lines[0] if lines else "")


class LlamaServerBench:
    def __init__(
        self,
        binary: Path,
        model: Path,
        prompts: list[list[int]],
        tokens: int,
        ctx: int,
        threads: int,
    ):
        self.binary, self.model = binary, model
        self.prompts, self.tokens, self.ctx, self.threads = prompts, tokens, ctx, threads
        self.commands: dict[int, list[str]] = {}  # each client count's command line
        self._lone: dict[int, list[int]] = {}

    def lone_answers(self) -> None:
        """Each prompt's greedy answer from a one-slot server, the reference for `identical`.
        A server of its own, so that its cached prompts do not speed up the measured runs."""
        with self._server(1) as server, _http_client(1) as client:
            for index, prompt in enumerate(self.prompts):
                self._lone[index] = list(self._answer(server, client, prompt, "answering alone"))

    def run(self, clients: int, requests_per_client: int) -> ServingResult:
        with self._server(clients) as server, _http_client(clients) as client:

            def stream(index: int) -> Iterator[int]:
                doing = f"serving {clients} clients"
                return self._answer(server, client, self.prompts[index], doing)

            done, wall = run_clients(clients, requests_per_client, len(self.prompts), stream)
            peak_rss_mb = server.peak_rss_mb()  # read before the process goes
        return summarize(clients, done, wall, self._lone, peak_rss_mb)

    def _server(self, slots: int) -> LlamaServer:
        server = LlamaServer(self.binary, self.model, slots, self.ctx, self.threads)
        self.commands[slots] = server.command
        return server

    def _answer(
        self, server: LlamaServer, client: httpx.Client, prompt: list[int], doing: str
    ) -> Iterator[int]:
        """The answer's tokens as they arrive; a server that died says so (not a reset
        connection)."""
        try:
            yield from stream_completion(client, server.url, prompt, self.tokens)
        except httpx.TransportError:
            server.check_running(doing)
            raise


def _http_client(connections: int) -> httpx.Client:
    """One kept-alive connection a client; no proxy from the environment (127.0.0.1 is local)."""
    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
    return httpx.Client(timeout=HTTP_TIMEOUT, limits=limits, trust_env=False)


def _free_port() -> int:
    """A port nothing listens on now (the kernel's pick), for the server to bind."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        return sock.getsockname()[1]
