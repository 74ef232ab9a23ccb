"""`--backend openai` for the interfaces: the server's address and key from the flags and the
environment, and the one-line refusals of what only a local backend does.

The openai client takes half a second to import, so the runtime's module is imported inside
the functions: only a command that uses a server pays for it."""

from __future__ import annotations

import argparse
import os
from urllib.parse import urlsplit

from miniapp.engine.errors import MiniappError
from miniapp.engine.runtimes import check_remote_options

from .settings import runtime_kv_type

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


def endpoint_from_args(args: argparse.Namespace):
    """The RemoteEndpoint the flags and the environment name."""
    from miniapp.engine.runtimes.remote import RemoteEndpoint

    if not getattr(args, "base_url", None):
        raise MiniappError(
            "--backend openai needs --base-url URL, the server's address (e.g. http://host:8000/v1)"
        )
    key = args.api_key or next((os.environ[n] for n in KEY_ENVIRONMENT if os.environ.get(n)), None)
    return RemoteEndpoint(api_base(args.base_url), key)


def api_base(url: str) -> str:
    """The API's base URL: a bare server address gets the usual /v1."""
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise MiniappError(f"--base-url {url!r}: expected http://host:port/v1")
    base = url.strip().rstrip("/")
    return base if parts.path.strip("/") else base + "/v1"


def open_remote(args: argparse.Namespace, sampling: tuple[str, ...]):
    """The server's model (a RemoteRuntime), after refusing local-only options, one line
    each. `sampling`: the sampling settings sent to it."""
    from miniapp.engine.runtimes.remote import RemoteRuntime

    open_remote_checks(args)
    return RemoteRuntime(endpoint_from_args(args), getattr(args, "remote_model", None), sampling)


def open_remote_checks(args: argparse.Namespace) -> None:
    """Refuse, in one line, the options only a local backend has."""
    check_remote_options(
        getattr(args, "spec", "auto") or "auto",
        getattr(args, "device", "auto"),
        getattr(args, "window", None),
        getattr(args, "sinks", None),
        runtime_kv_type(args),
    )
    if getattr(args, "mmproj", None):
        raise MiniappError("--mmproj: local backends only; the server has its own projector")


def chosen_sampling(args: argparse.Namespace) -> tuple[str, ...]:
    """The sampling settings given by flag, environment or config file: only these go to
    the server, the rest are its own defaults."""
    from miniapp.engine.runtimes.remote import SAMPLING_FIELDS

    sources = getattr(args, "setting_sources", None) or {}
    return tuple(n for n in SAMPLING_FIELDS if sources.get(n, "default") != "default")
