"""`miniapp chat`: the terminal chat.

Interactive on a terminal (line editing, /commands, Ctrl-C stops the answer, not the app);
with piped input, the whole of stdin is one message and the answer is printed once.
With --audio FILE the file's transcript is the (first) message; with --voice, Enter on an
empty line records until the next Enter (push-to-talk). Spoken messages keep their word times.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TextIO

from miniapp.engine.chat_template import Message
from miniapp.engine.errors import MiniappError
from miniapp.engine.events import Finished, FinishReason, TextDelta
from miniapp.engine.generation import GenerationRequest
from miniapp.engine.model_store import resolve_model
from miniapp.engine.runtimes import open_runtime
from miniapp.engine.sampling import SamplingParams
from miniapp.engine.session import ChatSession

from .transcribe import VoiceInput, spoken_file

PROMPT = ">>> "
HELP = """commands:
  /reset   start a new conversation
  /stats   speed of the last answer
  /exit    quit (also Ctrl-D)
Ctrl-C stops an answer."""


def request_from_args(args: argparse.Namespace) -> GenerationRequest:
    sampling = SamplingParams(
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        repeat_penalty=args.repeat_penalty,
        seed=args.seed,
    )
    return GenerationRequest(max_tokens=args.max_tokens, sampling=sampling, stop=tuple(args.stop))


def run_chat(args: argparse.Namespace) -> int:
    model_path = resolve_model(args.model)
    interactive = sys.stdin.isatty()
    # A bad or silent audio file is a one-line error before the model loads.
    spoken = spoken_file(args.audio, args.asr_model, args.threads) if args.audio else None
    if interactive:
        print(f"loading {model_path.name} on {args.backend}...", file=sys.stderr, flush=True)
    runtime = open_runtime(
        args.backend, model_path, n_ctx=args.ctx, threads=args.threads,
        sinks=args.sinks, window=args.window, spec=args.spec, device=args.device,
    )  # fmt: skip
    plan = getattr(runtime, "device_plan", None)
    if interactive and plan is not None:
        print(f"running on {plan.device} ({plan.reason})", file=sys.stderr, flush=True)
    session = ChatSession(runtime, system_prompt=args.system, request=request_from_args(args))
    voice = VoiceInput.for_chat(args, interactive)
    if spoken is not None:
        print(f"you said: {spoken.content}", flush=True)
        if not interactive:
            return _answer_piped(session, spoken, args.stats)
        _stream_answer(session, spoken, threading.Event(), sys.stdout)
    if not interactive:
        return _answer_piped(session, sys.stdin.read(), args.stats)
    return _interactive(session, model_path.name, args.stats, voice)


def _answer_piped(session: ChatSession, text: str | Message, show_stats: bool) -> int:
    if isinstance(text, str):
        text = text.strip()
    if not text:
        print("miniapp: error: no input on stdin", file=sys.stderr)
        return 2
    _stream_answer(session, text, threading.Event(), sys.stdout)
    if show_stats and session.last_stats:
        print(session.last_stats.summary(), file=sys.stderr)
    return 0


def _interactive(
    session: ChatSession, model_name: str, show_stats: bool, voice: VoiceInput | None = None
) -> int:
    try:
        import readline  # noqa: F401 - line editing and history for input()
    except ImportError:
        pass
    print(f"miniapp chat - {model_name} on {session.runtime.backend}. /help for commands.")
    if voice is not None:
        print(voice.greeting)
    while True:
        try:
            line = input(PROMPT)
        except EOFError:
            print()
            return 0
        except KeyboardInterrupt:
            print("\n(use /exit or Ctrl-D to quit)")
            continue
        text: str | Message = line.strip()
        if not text and voice is not None and voice.available:
            text = voice.record(sys.stdout)
            if text is None:
                continue
        if not text:
            continue
        if isinstance(text, str) and text.startswith("/"):
            if _command(session, text) == "exit":
                return 0
            continue
        cancel = threading.Event()
        try:
            with _sigint_sets(cancel):
                _stream_answer(session, text, cancel, sys.stdout)
        except MiniappError as exc:
            print(f"error: {exc}")
            continue
        if show_stats and session.last_stats:
            print(session.last_stats.summary())


def _command(session: ChatSession, text: str) -> str | None:
    name = text.split()[0].lower()
    if name in ("/exit", "/quit", "/bye"):
        return "exit"
    if name == "/reset":
        session.reset()
        print("(new conversation)")
    elif name == "/stats":
        stats = session.last_stats
        print(stats.summary() if stats else "(no answer yet)")
    elif name == "/help":
        print(HELP)
    else:
        print(f"unknown command {name}; /help lists them")
    return None


def _stream_answer(
    session: ChatSession, text: str | Message, cancel: threading.Event, out: TextIO
) -> None:
    finish = None
    for event in session.send(text, should_stop=cancel.is_set):
        if isinstance(event, TextDelta):
            out.write(event.text)
            out.flush()
        elif isinstance(event, Finished):
            finish = event
    out.write("\n")
    if finish and finish.reason == FinishReason.CANCELLED:
        out.write("(stopped)\n")
    elif finish and finish.reason == FinishReason.CONTEXT_FULL:
        out.write("(context full: /reset or raise --ctx)\n")
    out.flush()


@contextmanager
def _sigint_sets(event: threading.Event) -> Iterator[None]:
    """While generating, Ctrl-C sets `event` (the answer stops at the next token)."""
    previous = signal.signal(signal.SIGINT, lambda *_: event.set())
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
