"""`--backend openai` for the interfaces: the server's address and key from the flags and the
environment, and the one-line refusals of what only a local backend does.

The openai client takes half a second to import; the engine imports it only when a server's
model is opened, so only a command that uses a server pays for it."""

from __future__ import annotations

import argparse
import os
from urllib.parse import urlsplit

from miniapp.engine.api import (
    REMOTE_BACKEND,
    WINDOW_POLICY,
    MiniappError,
    RuntimeConfig,
    open_runtime,
)

from .settings import lora_specs, runtime_kv_type

KEY_ENVIRONMENT = ("OPENAI_API_KEY", "MINIAPP_API_KEY")


def add_remote_flags(parser: argparse.ArgumentParser, settings: bool = False) -> None:
    """--base-url and --remote-model (unless the settings model makes them), and --api-key."""
    if not settings:
        parser.add_argument(
            "--base-url",
            metavar="URL",
            help="an OpenAI-compatible server's address, e.g. "
            "http://host:8000/v1 (vLLM, llama-server, miniapp serve)",
        )
        parser.add_argument(
            "--remote-model",
            metavar="NAME",
            help="--backend openai: the server's model (default: its first)",
        )
    parser.add_argument(
        "--api-key",
        help="--backend openai: the server's key (default: OPENAI_API_KEY or MINIAPP_API_KEY)",
    )


def remote_config(args: argparse.Namespace, sampling: tuple[str, ...] = ()) -> RuntimeConfig:
    """The RuntimeConfig the flags and the environment name for --backend openai, with the
    local-only options as given (its `check` refuses them, one line each). `sampling`: the
    sampling settings the server is sent."""
    url = getattr(args, "base_url", None)
    key = getattr(args, "api_key", None)
    key = key or next((os.environ[n] for n in KEY_ENVIRONMENT if os.environ.get(n)), None)
    return RuntimeConfig(
        model=getattr(args, "remote_model", None) or "",
        backend=REMOTE_BACKEND,
        device=getattr(args, "device", "auto"),
        spec=getattr(args, "spec", "auto") or "auto",
        window=getattr(args, "window", None),
        sinks=getattr(args, "sinks", None),
        kv_policy=getattr(args, "kv_policy", None) or WINDOW_POLICY,
        kv_type=runtime_kv_type(args),
        lora=lora_specs(args),
        base_url=api_base(url) if url else None,
        api_key=key,
        send_sampling=sampling,
    )


def api_base(url: str) -> str:
    """The API's base URL: a bare server address gets the usual /v1."""
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise MiniappError(f"--base-url {url!r}: expected http://host:port/v1")
    base = url.strip().rstrip("/")
    return base if parts.path.strip("/") else base + "/v1"


def open_remote(args: argparse.Namespace, sampling: tuple[str, ...]):
    """The server's model (a MessageRuntime), after refusing local-only options, one line
    each. `sampling`: the sampling settings sent to it."""
    return open_runtime(checked_remote_config(args, sampling))


def checked_remote_config(
    args: argparse.Namespace, sampling: tuple[str, ...] = ()
) -> RuntimeConfig:
    """`remote_config`, its options checked: one line for what only a local backend has."""
    config = remote_config(args, sampling)
    config.check()
    if getattr(args, "mmproj", None):
        raise MiniappError("--mmproj: local backends only; the server has its own projector")
    return config


def chosen_sampling(args: argparse.Namespace) -> tuple[str, ...]:
    """The sampling settings given by flag, environment or config file: only these go to
    the server, the rest are its own defaults."""
    from miniapp.engine.api import SAMPLING_FIELDS

    sources = getattr(args, "setting_sources", None) or {}
    return tuple(n for n in SAMPLING_FIELDS if sources.get(n, "default") != "default")
