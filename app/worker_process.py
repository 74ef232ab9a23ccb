"""The parent's side of a `bench_worker` subprocess (protocol in bench_worker.py): one loaded
backend that answers one-line commands.

A worker that dies is reported as one line naming the backend, how it died and what it was
doing, e.g. `llama.cpp crashed (SIGSEGV) while loading the model; see miniapp doctor`, and
the parent goes on to report it (exit code 2) instead of dying with it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from miniapp.engine.api import MiniappError

EXIT_USAGE = 2  # the worker printed its own one-line error
BACKEND_NAMES = {"llamacpp": "llama.cpp", "torch": "the torch engine"}


class WorkerCrashed(MiniappError):
    """A worker process ended without answering; the message says how, in one line."""


def exit_description(returncode: int) -> str:
    """How a process ended, in a few words: "SIGSEGV", "exit code 1"."""
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        # The kernel's out-of-memory killer sends SIGKILL; nothing else here does.
        return f"{name}, perhaps out of memory" if name == "SIGKILL" else name
    return f"exit code {returncode}"


class WorkerProcess:
    """A `python -m miniapp.app.bench_worker` process holding one backend."""

    def __init__(self, backend: str, arguments: list[str], env: dict[str, str] | None = None):
        self.backend = backend
        self._doing = "loading the model"
        self._runs = 0
        command = [sys.executable, "-m", "miniapp.app.bench_worker", "--backend", backend]
        self._stderr = tempfile.TemporaryFile(mode="w+")
        self._process = subprocess.Popen(
            [*command, *arguments],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            text=True,
            env={**os.environ, **(env or {})},
        )

    def wait_ready(self) -> None:
        self._read("ready")

    def run(self) -> tuple[float, str]:
        """One measured run: (decode tok/s, digest of the generated tokens)."""
        self._runs += 1
        self._doing = f"generating (run {self._runs})"
        _, speed, digest = self.ask("run", expect="done").split()
        return float(speed), digest

    def ask(self, command: str, expect: str | None = None) -> str:
        if command == "result":
            self._doing = "reporting its result"
        try:
            self._process.stdin.write(command + "\n")
            self._process.stdin.flush()
        except BrokenPipeError:
            self._fail()  # it died before reading the command
        return self._read(expect)

    def _read(self, expect: str | None) -> str:
        line = self._process.stdout.readline().strip()
        if not line or (expect and line.split()[0] != expect):
            self._fail()
        return line

    def _fail(self) -> None:
        code = self._process.wait()
        self._stderr.seek(0)
        last = (self._stderr.read().strip().splitlines() or ["no output"])[-1]
        if code == EXIT_USAGE:
            raise MiniappError(last)
        name = BACKEND_NAMES.get(self.backend, self.backend)
        if code < 0:
            raise WorkerCrashed(
                f"{name} crashed ({exit_description(code)}) while {self._doing}; see miniapp doctor"
            )
        raise WorkerCrashed(f"{name} failed ({exit_description(code)}) while {self._doing}: {last}")

    def stop(self) -> None:
        if self._process.poll() is None:
            self._process.kill()
        self._process.wait()
        self._stderr.close()


def worker_arguments(model: Path, prompts: Path, tokens: int, ctx: int, spec: str) -> list[str]:
    """The arguments every worker takes (see bench_worker.py for the rest)."""
    return [
        "--model",
        str(model),
        "--prompts",
        str(prompts),
        "--tokens",
        str(tokens),
        "--ctx",
        str(ctx),
        "--spec",
        spec,
    ]
