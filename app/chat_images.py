"""Images in the terminal chat: files attached to the next message, and where they go.

Without a vision model (the offline default) an image becomes text: OCR, size, colours and
EXIF in a labelled line of the message. With a projector (--mmproj, or an mmproj GGUF beside
the model) the pictures go with the message to the conversation, which answers that turn and
the rest of the chat on llama.cpp's vision path (engine/chat/conversation.py), even when the chat
runs on the torch engine.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from dataclasses import replace
from functools import cached_property
from pathlib import Path

from miniapp.engine.api import Message, VisionRuntime, open_vision_runtime
from miniapp.engine.images import (
    ImageAttachment,
    ImageRoute,
    attach_image,
    build_user_message,
    choose_route,
    remote_route,
    vision_images,
)


class ChatImages:
    """The images waiting for the next message, and the route they take."""

    def __init__(self, model_path: Path | None, args: argparse.Namespace, remote=None):
        """`remote`: the server's model (--backend openai), instead of `model_path`."""
        self.model_path = model_path
        self.remote = remote
        self.backend = args.backend
        self.mmproj = args.mmproj
        self.n_ctx, self.threads = args.ctx, args.threads
        self.pending: list[ImageAttachment] = []

    @cached_property
    def route(self) -> ImageRoute:
        """Decided on first use: reading the model's metadata takes a moment, and a chat
        without images never needs it. A bad --mmproj raises ModelFileError here."""
        if self.remote is not None:
            return remote_route(self.remote.accepts_images)
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

    def take(self) -> list[ImageAttachment]:
        """The attachments for the message being sent; they go with that message only."""
        taken, self.pending = self.pending, []
        return taken

    def open_vision(self) -> VisionRuntime:
        """The vision runtime (a second copy of the model, on llama.cpp with its projector),
        opened when a picture first needs it."""
        assert self.route.mmproj is not None
        return open_vision_runtime(
            self.model_path, self.route.mmproj, n_ctx=self.n_ctx, threads=self.threads
        )

    def reset(self) -> None:
        self.pending = []


def pictures_of(attachments: list[ImageAttachment]) -> list[bytes]:
    """The PNG files a vision model is shown, from the attachments on its path (PNG: llama.cpp
    decodes pictures with stb_image, which reads it)."""
    return [image.png_bytes() for image in vision_images(attachments)]


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
