"""Starting the GUI server: loads the model in the background, binds 127.0.0.1 by default,
never makes a public share link, and opens a browser when there is a display."""

from __future__ import annotations

import argparse
import os
import sys
import threading

# Gradio reports usage to its makers unless told not to; miniapp is offline.
os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

from miniapp.engine.api import REMOTE_BACKEND

MAX_UPLOAD = "50mb"  # Gradio refuses larger uploads with a message; images cap at 50 MB too
MAX_UPLOAD_ENV = "MINIAPP_MAX_UPLOAD"  # e.g. "1mb", to try the limit without a huge file


def settings_from_args(args: argparse.Namespace):
    from ..host.settings import lora_specs, runtime_kv_type
    from .controller import ChatSettings

    defaults = ChatSettings()
    if args.backend == REMOTE_BACKEND:
        from ..host.remote import checked_remote_config

        # Local-only options are one line, before the page starts.
        remote = checked_remote_config(args)
        return ChatSettings(
            model=args.remote_model or "",
            backend=args.backend,
            ctx=args.ctx or defaults.ctx,
            system_prompt=args.system or "",
            temperature=args.temperature,
            top_p=args.top_p,
            max_tokens=args.max_tokens,
            base_url=remote.base_url,
            api_key=remote.api_key,
        )
    return ChatSettings(
        model=args.model or defaults.model,
        backend=args.backend,
        device=args.device,
        spec=args.spec,
        ctx=args.ctx or defaults.ctx,
        window=args.window,
        sinks=args.sinks,
        kv_policy=args.kv_policy,
        threads=args.threads,
        parallel=args.parallel,
        kv_type=runtime_kv_type(args),
        system_prompt=args.system or "",
        temperature=args.temperature,
        top_p=args.top_p,
        max_tokens=args.max_tokens,
        lora=lora_specs(args),  # a bad --lora is one line before the page starts
        lora_budget_mb=getattr(args, "lora_budget_mb", None),
    )


def run_gui(args: argparse.Namespace) -> int:
    import gradio as gr

    from ..host.model_host import ModelHost
    from .controller import Transcriber, adapter_folder
    from .history import ChatStore
    from .ui import GuiContext, build_ui

    settings = settings_from_args(args)
    if args.api:
        from ..serve.run import check_exposure, check_local_backend

        check_local_backend(args.backend)
        check_exposure(args.host, args.api_key or args.api_key_file)  # before anything loads
    context = GuiContext(
        ModelHost(),
        ChatStore(),
        Transcriber(args.asr_model, args.threads),
        settings,
        adapter_dir=adapter_folder(getattr(args, "lora_dir", None)),
    )
    context.host.request(settings.runtime_config)  # loads while the page comes up
    api = _start_api(context.host, settings.runtime_config, args) if args.api else None
    demo = build_ui(context)
    demo.queue(default_concurrency_limit=1)
    theme = gr.themes.Default(font=["system-ui", "sans-serif"], font_mono=["monospace"])
    demo.launch(
        server_name=args.host,
        server_port=args.port,
        share=False,
        inbrowser=_has_display(args),
        max_file_size=os.environ.get(MAX_UPLOAD_ENV, MAX_UPLOAD),
        prevent_thread_lock=True,
        quiet=True,
        theme=theme,
        footer_links=[],
        favicon_path=_icon(),
    )
    print(f"miniapp GUI: {demo.local_url}", flush=True)
    try:
        # The main thread computes the answers the browser sessions ask for (OpenMP is
        # about 3x slower on any other thread); Ctrl-C ends it.
        context.host.compute.serve(threading.Event())
    except KeyboardInterrupt:
        pass
    finally:
        demo.close()
        if api is not None:
            api.should_exit = True
    return 0


def _start_api(host, spec, args: argparse.Namespace):
    """The OpenAI-compatible API beside the GUI, on the same host (the model it loaded, and
    whichever it loads next), at the GUI's address and --api-port."""
    from ..serve.run import start_api

    return start_api(host, spec, args, args.host, args.api_port)


def _icon() -> str | None:
    from importlib.resources import files

    icon = files("miniapp.assets") / "icon.png"
    return str(icon) if icon.is_file() else None


def _has_display(args: argparse.Namespace) -> bool:
    if args.no_browser:
        return False
    return sys.platform in ("darwin", "win32") or bool(
        os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY")
    )
