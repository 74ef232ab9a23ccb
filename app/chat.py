"""`miniapp chat`: the terminal chat.

Interactive on a terminal (line editing, /commands, Ctrl-C stops the answer, not the app);
with piped input, the whole of stdin is one message and the answer is printed once.
With --audio FILE the file's transcript is the (first) message; with --voice, Enter on an
empty line records until the next Enter (push-to-talk). Spoken messages keep their word times.
--json / --json-schema FILE constrain every answer to JSON (engine/tokens/constraints.py).
Images (--image, /image) go with the next message: as OCR text, or to a vision model
(chat_images.py). LoRA adapters (--lora, /lora) pick the fine-tune each answer runs with
(chat_lora.py). `/model NAME` switches to another installed model on the same model host
as the GUI's picker (chat_models.py). The conversation itself (history, template, fitting
the context, the vision switch) is engine/chat/conversation.py's.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TextIO

from miniapp.engine.api import (
    REMOTE_BACKEND,
    ConstraintError,
    Conversation,
    Finished,
    FinishReason,
    GenerationEvent,
    GenerationRequest,
    InputFileError,
    Message,
    MiniappError,
    OutputConstraint,
    ReasoningDelta,
    SamplingParams,
    TextDelta,
    resolve_model,
)
from miniapp.engine.images import ImageAttachment

from .chat_images import ChatImages, image_paths, pictures_of, print_prompt, with_image_labels
from .chat_lora import ChatAdapters, startup_adapters
from .chat_models import ChatModels
from .host.settings import local_runtime_config
from .transcribe import VoiceInput, spoken_file

PROMPT = ">>> "
HELP = """commands:
  /image PATH   attach an image to your next message (repeatable; /image lists them)
  /lora         list the LoRA adapters loaded (* = answers run with it)
  /lora load PATH [SCALE]
                load an adapter (named after its file) and answer with it alone
  /lora use NAME[:SCALE][,NAME...]
                answer with these loaded adapters from now on
  /lora off     answer with the base model (/lora unload NAME lets one go)
  /model [NAME] list the installed models, or go on with NAME (the conversation is kept)
  /reset        start a new conversation (attached images are dropped too)
  /stats        speed of the last answer
  /exit         quit (also Ctrl-D)
Ctrl-C stops an answer."""


def request_from_args(args: argparse.Namespace) -> GenerationRequest:
    """The answer's settings; a bad --json-schema is a one-line error here, before loading."""
    sampling = SamplingParams(
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        repeat_penalty=args.repeat_penalty,
        seed=args.seed,
        constraint=answer_constraint(args),
    )
    return GenerationRequest(max_tokens=args.max_tokens, sampling=sampling, stop=tuple(args.stop))


def answer_constraint(args: argparse.Namespace) -> OutputConstraint | None:
    """--json: any JSON object; --json-schema FILE: JSON valid against the schema."""
    if getattr(args, "json_schema", None):
        path = Path(args.json_schema)
        try:
            schema = json.loads(path.read_text(encoding="utf-8"))
        except OSError as exc:
            raise InputFileError(f"{path}: cannot read the schema ({exc.strerror})") from None
        except (ValueError, UnicodeDecodeError) as exc:
            raise InputFileError(f"{path}: not JSON ({exc})") from None
        constraint = OutputConstraint.json_schema(schema)
    elif getattr(args, "json", False):
        constraint = OutputConstraint.json_object()
    else:
        return None
    try:
        constraint.grammar()  # compiles it now: a bad schema is reported before loading
    except ConstraintError as exc:
        where = f"{args.json_schema}: " if args.json_schema else ""
        raise InputFileError(f"{where}{exc}") from None
    return constraint


class ChatTurns:
    """The terminal's side of a conversation: attached images go with the next message (as
    OCR text, or as pictures for a vision model), and --show-prompt prints what it renders."""

    def __init__(
        self,
        conversation: Conversation,
        images: ChatImages,
        show_prompt: bool,
        adapters: ChatAdapters | None = None,
        models: ChatModels | None = None,
    ):
        self.conversation = conversation
        self.images = images
        self.show_prompt = show_prompt
        self.adapters = adapters or ChatAdapters("none")
        self.models = models  # None: a server's model (--backend openai)

    def send(
        self, text: str | Message, should_stop: Callable[[], bool]
    ) -> Iterator[GenerationEvent]:
        attachments = self.images.take()
        pictures = pictures_of(attachments)
        message = with_image_labels(text, attachments)
        if pictures and self.images.route.switches_backend and not self.conversation.on_vision:
            unadapted = " (without LoRA adapters)" if self.adapters.active else ""
            print(
                f"images: sent to the vision model ({self.images.route.reason}); the rest of "
                f"this conversation runs on llama.cpp{unadapted}",
                file=sys.stderr,
                flush=True,
            )
        if self.show_prompt:
            print_prompt(self.conversation.preview(message, pictures=len(pictures)))
        request = self.adapters.request(self.conversation.request)
        return self.conversation.send(message, pictures, request, should_stop=should_stop)

    def reset(self) -> None:
        self.conversation.reset()
        self.images.reset()

    def model_command(self, argument: str) -> str:
        """`/model` lists the installed models; `/model NAME` goes on with that one."""
        if self.models is None:
            return "the server picks its model (--remote-model NAME when starting)"
        if not argument:
            return self.models.listing()
        try:
            runtime = self.models.switch(argument)
        except MiniappError as exc:
            return f"error: {exc}"
        old = self.conversation
        self.conversation = Conversation(
            runtime, old.system_prompt, old.request, history=old.messages
        )
        self.adapters = ChatAdapters(runtime.backend)  # adapters belong to the model left
        return f"(now answering with {self.models.spec.label}; the conversation goes on)"


def run_chat(args: argparse.Namespace) -> int:
    remote = _open_remote(args) if args.backend == REMOTE_BACKEND else None
    model_path = None if remote else resolve_model(args.model)
    interactive = sys.stdin.isatty()
    request = request_from_args(args)
    adapters = ChatAdapters(args.backend, () if remote else startup_adapters(args))
    # Bad images, a bad --mmproj and bad or silent audio are one-line errors (exit 2)
    # before the model loads.
    images = _startup_images(model_path, args, remote)
    spoken = spoken_file(args.audio, args.asr_model, args.threads) if args.audio else None
    piped = None if interactive else _piped_message(spoken, images)
    models = None
    if remote is not None:
        conversation = Conversation(remote, args.system, request)
    else:
        # The text model opens on first use: a piped message with pictures for a vision
        # model never loads it.
        models = ChatModels(local_runtime_config(args, str(model_path)), interactive)
        conversation = Conversation(models.open, args.system, request, vision=images.open_vision)
    turns = ChatTurns(conversation, images, args.show_prompt, adapters, models)
    if piped is not None:
        _say_spoken(spoken)
        if request.sampling.constraint is not None:
            return _json_piped(turns, piped, args.stats)
        return _answer_piped(turns, piped, args.stats)
    conversation.runtime  # noqa: B018 - load the model before greeting
    voice = VoiceInput.for_chat(args, interactive)
    if spoken is not None:
        _say_spoken(spoken)
        _stream_answer(turns.send(spoken, threading.Event().is_set), sys.stdout)
    name = remote.info().label if remote else model_path.name
    return _interactive(turns, name, args.stats, voice)


def _open_remote(args: argparse.Namespace):
    """The server's model, asked for its models first: an unreachable server, a refused key
    or an unknown model is one line before anything is read."""
    from .host.remote import chosen_sampling, open_remote

    return open_remote(args, chosen_sampling(args))


def _startup_images(model_path: Path | None, args: argparse.Namespace, remote) -> ChatImages:
    images = ChatImages(model_path, args, remote)
    if args.mmproj:
        _ = images.route  # checks the projector now
    for path in args.image:
        _report_attached(images.attach(path))
    return images


def _say_spoken(spoken: Message | None) -> None:
    if spoken is not None:
        print(f"you said: {spoken.content}", flush=True)


def _report_attached(attachment: ImageAttachment) -> None:
    print(attachment.notice(), file=sys.stderr, flush=True)


def _piped_message(spoken: Message | None, images: ChatImages) -> str | Message:
    if spoken is not None:
        return spoken
    text = sys.stdin.read().strip()
    if not text and not images.pending:  # pictures alone are a message
        raise MiniappError("no input on stdin")
    return text


def _answer_piped(turns: ChatTurns, message: str | Message, show_stats: bool) -> int:
    finish = _stream_answer(turns.send(message, lambda: False), sys.stdout)
    if show_stats and finish is not None:
        print(finish.stats.summary(), file=sys.stderr)
    return 0


def _json_piped(turns: ChatTurns, message: str | Message, show_stats: bool) -> int:
    """For scripts: exactly the JSON value on stdout, or a one-line error (exit 2) when the
    answer stopped before the value was complete."""
    text, finish = "", None
    for event in turns.send(message, lambda: False):
        if isinstance(event, TextDelta):
            text += event.text
        elif isinstance(event, Finished):
            finish = event
    if finish is None or finish.reason != FinishReason.END_OF_TURN:
        limit = finish is not None and finish.reason == FinishReason.MAX_TOKENS
        why = "--max-tokens" if limit else "a stop"
        raise MiniappError(f"the answer ended at {why} before its JSON value was complete")
    print(text.strip(), flush=True)
    if show_stats:
        print(finish.stats.summary(), file=sys.stderr)
    return 0


def _interactive(
    turns: ChatTurns, model_name: str, show_stats: bool, voice: VoiceInput | None = None
) -> int:
    try:
        import readline  # noqa: F401 - line editing and history for input()
    except ImportError:
        pass
    # A process started in the background of a script inherits SIGINT ignored, and Python
    # then leaves it so; in the terminal chat Ctrl-C must always reach us.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    backend = turns.conversation.runtime.backend
    print(f"miniapp chat - {model_name} on {backend}. /help for commands.")
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
            if _command(turns, text) == "exit":
                return 0
            continue
        cancel = threading.Event()
        try:
            with _sigint_sets(cancel):
                _stream_answer(turns.send(text, cancel.is_set), sys.stdout)
        except MiniappError as exc:
            print(f"error: {exc}")
            continue
        if show_stats and turns.conversation.last_stats:
            print(turns.conversation.last_stats.summary())


def _command(turns: ChatTurns, text: str) -> str | None:
    name, _, argument = text.partition(" ")
    name = name.lower()
    if name in ("/exit", "/quit", "/bye"):
        return "exit"
    if name == "/reset":
        turns.reset()
        print("(new conversation)")
    elif name == "/stats":
        stats = turns.conversation.last_stats
        print(stats.summary() if stats else "(no answer yet)")
    elif name == "/image":
        _image_command(turns.images, argument)
    elif name == "/lora":
        print(turns.adapters.command(turns.conversation.runtime, argument))
    elif name == "/model":
        print(turns.model_command(argument.strip()))
    elif name == "/help":
        print(HELP)
    else:
        print(f"unknown command {name}; /help lists them")
    return None


def _image_command(images: ChatImages, argument: str) -> None:
    """`/image PATH...` attaches; a file that cannot be used is a one-line error and the
    chat goes on without it. Plain `/image` lists what is attached."""
    paths = image_paths(argument)
    if not paths:
        print(images.listing())
    for path in paths:
        try:
            _report_attached(images.attach(path))
        except MiniappError as exc:
            print(f"error: {exc}")


def _stream_answer(events: Iterator[GenerationEvent], out: TextIO) -> Finished | None:
    finish = None
    thinking = _Thinking()
    for event in events:
        if isinstance(event, TextDelta):
            thinking.end()
            out.write(event.text)
            out.flush()
        elif isinstance(event, ReasoningDelta):
            thinking.write(event.text)
        elif isinstance(event, Finished):
            finish = event
    thinking.end()
    out.write("\n")
    if finish and finish.reason == FinishReason.CANCELLED:
        out.write("(stopped)\n")
    elif finish and finish.reason == FinishReason.CONTEXT_FULL:
        out.write("(context full: /reset or raise --ctx)\n")
    out.flush()
    return finish


class _Thinking:
    """A reasoning model's thinking, on stderr (dim on a terminal): apart from the answer,
    which alone goes to stdout."""

    def __init__(self, err: TextIO | None = None):
        self.err = err or sys.stderr
        self.open = False
        self._dim = self.err.isatty()

    def write(self, text: str) -> None:
        if not self.open:
            self.open = True
            self.err.write("\x1b[2m(thinking) " if self._dim else "(thinking) ")
        self.err.write(text)
        self.err.flush()

    def end(self) -> None:
        if self.open:
            self.open = False
            self.err.write("\x1b[0m\n" if self._dim else "\n")
            self.err.flush()


@contextmanager
def _sigint_sets(event: threading.Event) -> Iterator[None]:
    """While generating, Ctrl-C sets `event` (the answer stops at the next token)."""
    previous = signal.signal(signal.SIGINT, lambda *_: event.set())
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
