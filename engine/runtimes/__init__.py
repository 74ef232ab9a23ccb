"""Runtime selection. Each backend is imported only when chosen, so a llama.cpp-only process
(for example the benchmark's llama.cpp worker) never pays for importing torch models.

Two backends run a GGUF here (torch, llamacpp); the third (openai) sends the conversation to
an OpenAI-compatible server, which holds the model (remote.py)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from ..errors import MiniappError
from ..kv.policies import WINDOW_POLICY
from ..kv.types import kv_type
from ..lora.registry import LoraSpec
from ..tokens.spec_modes import SpecMode
from .base import DEFAULT_CTX, DEFAULT_PARALLEL, DEFAULT_SINKS, Runtime, VisionRuntime

LOCAL_BACKENDS = ("torch", "llamacpp")
REMOTE_BACKEND = "openai"
BACKENDS = (*LOCAL_BACKENDS, REMOTE_BACKEND)


def plan_torch_cache_and_device(gguf, n_ctx: int, device: str, probe, kv=None, cpu_moe=False):
    """The KV cache type and device plan the torch engine would take for this model, as
    TorchRuntime chooses them (`miniapp doctor` reports them): `kv`, else its default for the
    device. Imports the torch engine only when called."""
    from .torch_runtime import plan_cache_and_device

    return plan_cache_and_device(gguf, n_ctx, device, probe, kv, cpu_moe)


def open_local_runtime(
    backend: str,
    model_path: Path | str,
    n_ctx: int = DEFAULT_CTX,
    threads: int | None = None,
    logits_all: bool = False,
    sinks: int | None = None,
    window: int | None = None,
    kv_policy: str = WINDOW_POLICY,
    spec: str = SpecMode.AUTO,
    device: str = "auto",
    parallel: int = 1,
    kv: str | None = None,
    max_queue: int | None = None,
    lora: Sequence[LoraSpec] = (),
    lora_budget_mb: int | None = None,
    cpu_moe: bool = False,
) -> Runtime:
    """`sinks` and `window` shape the torch engine's sliding-window cache (see TorchRuntime);
    llama.cpp's Python binding has no equivalent, so it stops at a full context instead.
    `parallel`: generations the torch engine runs at once (continuous batching); llama.cpp
    here runs one at a time; `max_queue` more may wait for a slot (None: the engine's
    default), and further ones are refused (QueueFullError). `kv`: how the KV cache stores
    keys and values (kv_types.py; None: the torch engine's default for the model, llama.cpp's
    own f16). `lora`: adapters loaded with the model (the torch engine keeps them for
    requests to pick, within `lora_budget_mb`; llama.cpp applies them to every answer).
    `cpu_moe`: a mixture of experts on a GPU keeps its experts on the CPU (torch engine)."""
    kind = None if kv is None else kv_type(kv)  # a bad name is one line, before any loading
    if backend == "torch":
        from .torch_runtime import TorchRuntime

        sinks = DEFAULT_SINKS if sinks is None else sinks
        return TorchRuntime(
            model_path,
            n_ctx=n_ctx,
            threads=threads,
            sinks=sinks,
            window=window,
            kv_policy=kv_policy,
            spec=spec,
            device=device,
            parallel=parallel,
            kv=kind,
            lora=lora,
            lora_budget_mb=lora_budget_mb,
            cpu_moe=cpu_moe,
            **({} if max_queue is None else {"max_queue": max_queue}),
        )
    if backend == "llamacpp":
        from .llamacpp_runtime import LlamaCppRuntime

        if sinks is not None or window is not None or kv_policy != WINDOW_POLICY:
            raise MiniappError("--window, --sinks and --kv-policy apply to the torch backend only")
        if device != "auto":
            raise MiniappError("--device applies to the torch backend (llama.cpp picks its own)")
        if cpu_moe:
            raise MiniappError(
                "--cpu-moe applies to the torch backend (this llama.cpp binding cannot place "
                "tensors)"
            )
        if spec not in ("off", "auto"):
            raise MiniappError("--spec early-exit, head and lookup apply to the torch backend only")
        if parallel > 1:
            raise MiniappError(
                "--parallel applies to the torch backend (llama.cpp here answers one at a time)"
            )
        return LlamaCppRuntime(
            model_path, n_ctx=n_ctx, threads=threads, logits_all=logits_all, kv=kind, lora=lora
        )
    if backend == REMOTE_BACKEND:
        raise MiniappError(
            "--backend openai answers chats, not token prompts: this command "
            "needs a local backend (torch or llamacpp)"
        )
    raise MiniappError(f"unknown backend '{backend}' (choose from {', '.join(BACKENDS)})")


def open_vision_runtime(
    model_path: Path | str,
    mmproj_path: Path | str,
    n_ctx: int = DEFAULT_CTX,
    threads: int | None = None,
) -> VisionRuntime:
    """The model with its vision projector, on llama.cpp (the only backend with a vision
    path). A projector that does not fit the model, or that llama.cpp refuses, is a
    ModelFileError naming it."""
    from .llamacpp_vision import LlamaCppVisionRuntime

    return LlamaCppVisionRuntime(model_path, mmproj_path, n_ctx=n_ctx, threads=threads)


__all__ = [
    "BACKENDS",
    "LOCAL_BACKENDS",
    "REMOTE_BACKEND",
    "DEFAULT_CTX",
    "DEFAULT_PARALLEL",
    "DEFAULT_SINKS",
    "Runtime",
    "VisionRuntime",
    "open_local_runtime",
    "open_vision_runtime",
]
