"""Images in the terminal chat: files attached to the next message, and where they go.

Without a vision model (the offline default) an image becomes text: OCR, size, colours and
EXIF in a labelled line of the message. With a projector (--mmproj, or an mmproj GGUF beside
the model) the turn that carries images is answered by llama.cpp's multimodal path, even
when the chat runs on the torch engine; the conversation's text history goes with it. From
then on the conversation stays there, so follow-up questions still see the pictures (the
vision chat keeps them in its context and evaluates only what each turn adds); every
exchange is also added to the chat's history.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from collections.abc import Callable, Iterator
from dataclasses import replace
from functools import cached_property
from pathlib import Path

from miniapp.engine.chat_template import Message
from miniapp.engine.events import GenerationEvent, TextDelta
from miniapp.engine.generation import GenerationRequest
from miniapp.engine.images import (
    ImageAttachment,
    ImagePath,
    ImageRoute,
    attach_image,
    build_user_message,
    choose_route,
    vision_images,
)


class ChatImages:
    """The images waiting for the next message, the route they take, and the vision chat
    (loaded when a picture first needs it)."""

    def __init__(self, model_path: Path, args: argparse.Namespace, request: GenerationRequest):
        self.model_path = model_path
        self.backend = args.backend
        self.mmproj = args.mmproj
        self.n_ctx, self.threads = args.ctx, args.threads
        self.system_prompt = args.system
        self.request = request
        self.pending: list[ImageAttachment] = []
        self._vision = None
        self.vision_active = False  # the conversation has pictures on the vision chat

    @cached_property
    def route(self) -> ImageRoute:
        """Decided on first use: reading the model's metadata takes a moment, and a chat
        without images never needs it. A bad --mmproj raises ModelFileError here."""
        return choose_route(self.model_path, self.backend, self.mmproj, allow_backend_switch=True)

    def attach(self, path: str) -> ImageAttachment:
        """Load (and on the OCR path, read) an image for the next message; ImageInputError,
        one line, if the file is unusable (nothing is attached then)."""
        attachment = attach_image(Path(path).expanduser(), self.route, name=path)
        self.pending.append(attachment)
        return attachment

    def listing(self) -> str:
        if not self.pending:
            return "(no images attached)"
        return "\n".join(f"attached: {a.notice()}" for a in self.pending)

    @property
    def next_turn_is_vision(self) -> bool:
        return bool(self.pending) and self.route.path == ImagePath.VISION_MODEL

    def take(self) -> list[ImageAttachment]:
        """The attachments for the message being sent; they go with that message only."""
        taken, self.pending = self.pending, []
        return taken

    def vision_turn(
        self,
        history: list[Message],
        text: str,
        attachments: list[ImageAttachment],
        should_stop: Callable[[], bool],
        show_prompt: bool,
    ) -> Iterator[GenerationEvent]:
        """Answer a message on the vision chat: one with pictures, or any later one of a
        conversation that has them. The chat keeps its own messages (pictures included)
        while they match `history`; otherwise it starts again from `history`'s text. The
        exchange, even a partial one, is then appended to `history`."""
        chat = self._vision_chat()
        if self.route.switches_backend and not self.vision_active:
            print(f"images: sent to the vision model ({self.route.reason}); the rest of this "
                  "conversation runs on llama.cpp", file=sys.stderr, flush=True)  # fmt: skip
        if not (self.vision_active and _matches(chat, history)):
            _start_from(chat, history)
        self.vision_active = True
        if show_prompt:
            print_prompt(chat.render_prompt(text, images=len(attachments)))
        answer: list[str] = []
        started = False
        try:
            for event in chat.send(text, vision_images(attachments), self.request, should_stop):
                started = True
                if isinstance(event, TextDelta):
                    answer.append(event.text)
                yield event
        finally:
            if started:  # a refused turn (context full) is not part of the conversation
                history.extend([Message("user", text), Message("assistant", "".join(answer))])

    def _vision_chat(self):
        from miniapp.engine.images.vision_llamacpp import LlamaCppVisionChat

        if self._vision is None:
            self._vision = LlamaCppVisionChat(
                self.model_path, self.route.mmproj, n_ctx=self.n_ctx, threads=self.threads,
                system_prompt=self.system_prompt, request=self.request,
            )  # fmt: skip
        return self._vision

    def reset(self) -> None:
        """A new conversation: attachments dropped, and text turns back on the session."""
        self.pending = []
        self.vision_active = False
        if self._vision is not None:
            self._vision.reset()


def _start_from(chat, history: list[Message]) -> None:
    """The vision chat's messages from the history's text; what its context already holds
    of them is kept (only what differs is evaluated)."""
    from miniapp.engine.images.vision_llamacpp import VisionMessage

    chat.messages = [VisionMessage(m.role, m.content) for m in history if m.role != "system"]


def _matches(chat, history: list[Message]) -> bool:
    """Whether the vision chat's messages are the history's (text and roles)."""
    text = [(m.role, m.content) for m in history if m.role != "system"]
    return [(m.role, m.text) for m in chat.messages] == text


def with_image_labels(text: str | Message, attachments: list[ImageAttachment]) -> str | Message:
    """The message with the OCR path's image labels before the typed (or spoken) text; a
    spoken message stays a spoken message, word times included."""
    if not attachments:
        return text
    if isinstance(text, Message):
        return replace(text, content=build_user_message(text.content, attachments))
    return build_user_message(text, attachments)


def image_paths(argument: str) -> list[str]:
    """The paths after `/image`: one path as typed if such a file exists (spaces and all),
    else shell-style words, so `'my cat.png' receipt.png` or `my\\ cat.png` work too."""
    argument = argument.strip()
    if not argument or Path(argument).expanduser().is_file():
        return [argument] if argument else []
    try:
        return shlex.split(argument)
    except ValueError:  # an unbalanced quote: take the line as it is
        return [argument]


def print_prompt(prompt: str) -> None:
    print(f"--- prompt ---\n{prompt}\n--- end of prompt ---", file=sys.stderr, flush=True)
