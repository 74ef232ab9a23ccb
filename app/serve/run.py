"""`miniapp serve`: the API on uvicorn in a background thread, the engine's work on the main
thread (OpenMP runs about 3x slower on any other, see engine/platform/compute_thread.py), the model
loading in the background while /health says 503."""

from __future__ import annotations

import argparse
import ipaddress
import signal
import socket
import threading
import time
from pathlib import Path

from miniapp.engine.api import (
    REMOTE_BACKEND,
    ChatTemplate,
    GGUFFile,
    MiniappError,
    RuntimeConfig,
    SamplingParams,
    check_model_file,
    check_supported,
    resolve_model,
)

from ..host.model_host import ModelHost
from ..host.settings import local_runtime_config
from .api import ServeOptions, create_app
from .quotas import KeyTable, read_key_file
from .service import ServedModel

STARTUP_TIMEOUT_S = 30.0
# Bytes of a connection's unsent answer held by the kernel (which doubles it for its own
# bookkeeping) and by asyncio, each: a few hundred SSE chunks. Ample on loopback and a LAN.
SEND_BUFFER_BYTES = 32 * 1024


def run_serve(args: argparse.Namespace) -> int:
    check_local_backend(args.backend)
    key_table(args.api_key_file)  # a bad key file stops us before loading
    check_exposure(args.host, args.api_key or args.api_key_file)
    model_path = resolve_model(args.model)
    if not model_path.is_file():
        raise MiniappError(f"{args.model}: model file not found")
    check_model(model_path, args.backend)
    chat_template_source(args.chat_template_file)  # a bad file stops us before loading
    spec = local_runtime_config(args)
    host = ModelHost(max_models=args.max_models, idle_unload_s=args.idle_unload)
    host.request(spec)
    server = start_api(host, spec, args, args.host, args.port)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        host.compute.serve(stop)  # until Ctrl-C or SIGTERM
    except KeyboardInterrupt:
        pass
    finally:
        server.should_exit = True
    return 0


def check_model(path: Path, backend: str) -> None:
    """The file's structure and metadata, checked before the server listens (milliseconds):
    a bad file is one line and exit code 2, not a server that can never answer. What only
    loading finds (NaN weights, a vocabulary llama.cpp cannot read) /health reports."""
    gguf = GGUFFile(path)
    if backend == "torch":
        check_supported(gguf)
    else:
        check_model_file(gguf)


def check_local_backend(backend: str) -> None:
    """The API serves a model that runs here; passing another server's answers through is
    that server's job."""
    if backend == REMOTE_BACKEND:
        raise MiniappError(
            "the API serves a local model (--backend torch or llamacpp); point "
            "clients at the --backend openai server itself"
        )


def start_api(
    host: ModelHost, spec: RuntimeConfig, args: argparse.Namespace, address: str, port: int
):
    """The API on uvicorn in a background thread, over `host` (the server's own, or the
    GUI's); prints its URL once it listens. Returns the uvicorn server."""
    served = ServedModel(host, spec, chat_template_source(args.chat_template_file))
    options = ServeOptions(
        api_key=args.api_key,
        cors_origins=tuple(args.cors_origin),
        body_limit=int(args.max_body_mb * 1024 * 1024),
        defaults=_sampling_defaults(args),
        asr_model=args.asr_model,
        threads=args.threads,
        lora_dir=getattr(args, "lora_dir", None),
        pooling=getattr(args, "pooling", None),
        keys=key_table(getattr(args, "api_key_file", None)),
        request_timeout=getattr(args, "request_timeout", None),
        stall_timeout=getattr(args, "stall_timeout", 30.0),
        breaker_threshold=getattr(args, "breaker_threshold", 5),
        breaker_pause=getattr(args, "breaker_pause", 10.0),
        otlp_endpoint=getattr(args, "otlp_endpoint", None),
        log_format=getattr(args, "log_format", "text"),
    )
    server = _start_uvicorn(create_app(served, options), address, port)
    bound = server.servers[0].sockets[0].getsockname()[1]
    print(
        f"miniapp serve: http://{_url_host(address)}:{bound}/v1 ({served.model_id}, "
        f"{spec.backend}; /health says when the model is ready)",
        flush=True,
    )
    return server


def key_table(path: str | None) -> KeyTable | None:
    """`--api-key-file`'s keys and quotas (a one-line error for a file that cannot be used)."""
    return KeyTable(read_key_file(path)) if path else None


def chat_template_source(path: str | None) -> str | None:
    """`--chat-template-file`'s text, checked to parse (a one-line error if it does not)."""
    if path is None:
        return None
    try:
        source = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise MiniappError(
            f"{path}: cannot read the chat template ({exc.__class__.__name__})"
        ) from None
    ChatTemplate(source)  # TemplateError, one line, if it does not parse
    return source


def _sampling_defaults(args: argparse.Namespace) -> SamplingParams:
    """The settings' sampling, for what a request leaves unset (as llama-server does); the
    GUI's settings have no top_k, min_p, repeat penalty or seed: the engine's defaults."""
    given = {
        name: getattr(args, name)
        for name in ("temperature", "top_k", "top_p", "min_p", "repeat_penalty", "seed")
        if hasattr(args, name)
    }
    return SamplingParams(**given)


def check_exposure(host: str, api_key: str | None) -> None:
    """Loopback is the default; any other address lets other machines in, so it needs a key."""
    if _is_loopback(host) or api_key:
        return
    raise MiniappError(
        f"--host {host} lets other machines reach the API: give --api-key KEY "
        "(or MINIAPP_API_KEY) or --api-key-file FILE too, or bind 127.0.0.1"
    )


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _http_protocol():
    """uvicorn's HTTP protocol with small send buffers for each connection: the kernel's
    (fixed, which turns off its autotuning, up to megabytes on loopback) and asyncio's. A
    client that stops reading then fills them within tens of kilobytes, its sends block, and
    `--stall-timeout` can drop it."""
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    class SmallBuffers(AutoHTTPProtocol):
        def connection_made(self, transport):
            sock = transport.get_extra_info("socket")
            if sock is not None:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)
            transport.set_write_buffer_limits(high=SEND_BUFFER_BYTES)
            super().connection_made(transport)

    return SmallBuffers


def _start_uvicorn(app, host: str, port: int):
    import uvicorn

    config = uvicorn.Config(
        app,
        http=_http_protocol(),
        host=host,
        port=port,
        log_level="warning",
        access_log=False,
        timeout_graceful_shutdown=2,
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise MiniappError(
                f"could not listen on {host}:{port} (in use, or not an address of this machine)"
            )
        time.sleep(0.02)
    return server
