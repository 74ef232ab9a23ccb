"""Image input for chats: loading, the OCR fallback, and the route to a vision model.

The app calls, per chat:    route = choose_route(model_path, backend, mmproj)
per attached image:         attachment = attach_image(path, route)   (ImageInputError if bad)
per message:                text = build_user_message(typed, attachments)
and on the vision path sends `vision_images(attachments)` (as PNG) with the message to the
conversation (engine/chat/conversation.py), which answers on the vision runtime
(engine/runtimes/llamacpp_vision.py).
"""

from __future__ import annotations

from .attach import ImageAttachment, attach_image, build_user_message, vision_images
from .describe import ImageDescription, describe_image
from .errors import ImageInputError
from .loading import ExifFacts, LoadedImage, load_image
from .ocr import OcrEngine, OcrResult, OcrUnavailableError, shared_ocr
from .route import ImagePath, ImageRoute, MmprojSearch, choose_route, find_mmproj, remote_route

__all__ = [
    "ExifFacts",
    "ImageAttachment",
    "ImageDescription",
    "ImageInputError",
    "ImagePath",
    "ImageRoute",
    "LoadedImage",
    "MmprojSearch",
    "OcrEngine",
    "OcrResult",
    "OcrUnavailableError",
    "attach_image",
    "build_user_message",
    "choose_route",
    "describe_image",
    "find_mmproj",
    "load_image",
    "remote_route",
    "shared_ocr",
    "vision_images",
]
