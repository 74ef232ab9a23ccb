"""Runtime selection. Each backend is imported only when chosen, so a llama.cpp-only process
(for example the benchmark's llama.cpp worker) never pays for importing torch models."""

from __future__ import annotations

from pathlib import Path

from ..errors import MiniappError
from .base import DEFAULT_CTX, Runtime

BACKENDS = ("torch", "llamacpp")


def open_runtime(
    backend: str,
    model_path: Path | str,
    n_ctx: int = DEFAULT_CTX,
    threads: int | None = None,
    logits_all: bool = False,
) -> Runtime:
    if backend == "torch":
        from .torch_runtime import TorchRuntime

        return TorchRuntime(model_path, n_ctx=n_ctx, threads=threads)
    if backend == "llamacpp":
        from .llamacpp_runtime import LlamaCppRuntime

        return LlamaCppRuntime(model_path, n_ctx=n_ctx, threads=threads, logits_all=logits_all)
    raise MiniappError(f"unknown backend '{backend}' (choose from {', '.join(BACKENDS)})")


__all__ = ["BACKENDS", "DEFAULT_CTX", "Runtime", "open_runtime"]
