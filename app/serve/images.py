"""Images in chat messages (`image_url` parts): base64 data URIs only (the server is offline and
fetches nothing), then the chat's own image path: the vision model when the model has a
projector, otherwise OCR and the image's facts as a labelled line of the message."""

from __future__ import annotations

import asyncio
import base64
import binascii
import re
import threading
from pathlib import Path

from miniapp.engine.api import Conversation, Message, MiniappError
from miniapp.engine.images import (
    ImagePath,
    ImageRoute,
    attach_image,
    build_user_message,
    choose_route,
    vision_images,
)

from .errors import bad_request
from .protocol import ChatMessage
from .tools import tool_message

DATA_URI = re.compile(
    r"data:(?P<type>[\w.+-]+/[\w.+-]+)?(?P<params>(;[^;,]*)*?);base64,", re.IGNORECASE
)


class ServedImages:
    """Where the served model's images go, decided once per model (reading a projector takes
    a moment; beside the GUI the model may change)."""

    def __init__(self, served):
        self.served = served
        self._routes: dict[tuple[Path, str], ImageRoute] = {}
        self._ocr_lock = threading.Lock()  # OCR runs one image at a time, off the event loop

    @property
    def route(self) -> ImageRoute:
        key = (self.served.model_path, self.served.spec.backend)
        if key not in self._routes:
            self._routes[key] = choose_route(*key, None, allow_backend_switch=True)
        return self._routes[key]

    @property
    def to_vision_model(self) -> bool:
        return self.route.path == ImagePath.VISION_MODEL

    async def messages(self, messages: list[ChatMessage]) -> list[Message]:
        """The chat as the model sees it: on the OCR path each image becomes text in its
        message; on the vision path the pictures travel with their message."""
        return [await self._message(m, n) for n, m in enumerate(messages)]

    async def _message(self, message: ChatMessage, number: int) -> Message:
        role = "system" if message.role == "developer" else message.role
        if role == "tool" or message.tool_calls:
            return tool_message(role, message.text(), message.tool_calls, message.tool_call_id)
        urls = message.images()
        if not urls:
            return Message(role, message.text())
        if role != "user":
            raise bad_request("only user messages may carry images", f"messages.{number}")
        images = [decode_data_uri(url, f"messages.{number}") for url in urls]
        attachments = await asyncio.to_thread(self._attach, images, number)
        if self.to_vision_model:
            pictures = tuple(image.png_bytes() for image in vision_images(attachments))
            return Message(role, message.text(), pictures)
        return Message(role, build_user_message(message.text(), attachments))

    def _attach(self, images: list[bytes], number: int):
        with self._ocr_lock:
            try:
                return [
                    attach_image(data, self.route, name=f"image {i + 1}")
                    for i, data in enumerate(images)
                ]
            except MiniappError as exc:  # an unreadable or oversized image: one line
                raise bad_request(
                    str(exc), f"messages.{number}.content", code="invalid_image"
                ) from None


def decode_data_uri(url: str, param: str) -> bytes:
    """The bytes of a `data:image/...;base64,...` URI; a 400 naming why for anything else."""
    match = DATA_URI.match(url)
    if match is None:
        where = "an http(s) URL" if url.startswith(("http://", "https://")) else "not a data URI"
        raise bad_request(
            f"image_url is {where}: this server runs offline and fetches nothing; "
            "send the image as data:image/...;base64,...",
            param,
            code="invalid_image_url",
        )
    kind = (match.group("type") or "").lower()
    if kind and not kind.startswith("image/"):
        raise bad_request(f"image_url carries {kind}, not an image", param, code="invalid_image")
    try:
        return base64.b64decode("".join(url[match.end() :].split()), validate=True)
    except (binascii.Error, ValueError):
        raise bad_request(
            "image_url's base64 data does not decode", param, code="invalid_image"
        ) from None


def vision_producer(served, route: ImageRoute, messages: list[Message], request):
    """A Job's `produce` for a chat with pictures: the conversation on the vision model (a
    second copy of the model, on llama.cpp with its projector), which evaluates the
    pictures and answers the last message. Runs in turn, under the host's generation lock."""
    *history, last = messages
    if last.role != "user":
        raise bad_request("a chat with images must end with a user message", "messages")

    def produce(should_stop):
        runtime = served.host.vision_runtime(served.spec, route.mmproj)
        conversation = Conversation(runtime, None, request, history=history)
        yield from conversation.send(last, last.pictures, should_stop=should_stop)

    return produce
