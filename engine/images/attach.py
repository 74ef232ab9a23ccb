"""Attaching images to a chat message: load, route, describe, and build the message text."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path, PurePath

from .describe import ImageDescription, describe_image
from .loading import LoadedImage, load_image
from .ocr import OcrEngine
from .route import ImagePath, ImageRoute

# Opens the text that stands in for images on the OCR path, so the model does not answer as
# if it had seen them.
OCR_PREAMBLE = (
    "(Attached images, described by automatic text extraction; the pictures themselves "
    "are not visible to you.)"
)


@dataclass(frozen=True)
class ImageAttachment:
    """One attached image and the path it takes, with the reason (for the UI and terminal)."""

    image: LoadedImage
    path: ImagePath
    reason: str
    description: ImageDescription | None = None  # set on the OCR path: what the prompt gets

    @property
    def name(self) -> str:
        return PurePath(self.image.source).name or self.image.source

    def notice(self) -> str:
        """e.g. 'receipt.png (1280x720 PNG): read by OCR, 3 lines of text (no mmproj beside
        the model)' or 'cat.jpg (4032x3024 JPEG): shown to the vision model (projector ...)'."""
        head = f"{self.name} ({self.image.width}x{self.image.height} {self.image.format_name})"
        if self.path == ImagePath.VISION_MODEL:
            return f"{head}: shown to the vision model ({self.reason})"
        return f"{head}: read by OCR, {self._ocr_outcome()} ({self.reason})"

    def _ocr_outcome(self) -> str:
        description = self.description
        if description is None or description.ocr is None:
            return "OCR unavailable"
        count = len(description.ocr.lines)
        if count == 0:
            return "no text found"
        return f"{count} line{'s' if count != 1 else ''} of text"


def attach_image(
    source: Path | str | bytes,
    route: ImageRoute,
    ocr: OcrEngine | None = None,
    name: str | None = None,
) -> ImageAttachment:
    """Load an image and prepare it for the route's path; on the OCR path this runs OCR
    (about a second). Raises ImageInputError (one line) for an unusable file."""
    loaded = load_image(source, name=name)
    if route.path == ImagePath.VISION_MODEL:
        return ImageAttachment(loaded, route.path, route.reason)
    return ImageAttachment(loaded, route.path, route.reason, describe_image(loaded, ocr))


def build_user_message(text: str, attachments: Sequence[ImageAttachment]) -> str:
    """The user message text for a turn. Images on the OCR path become labelled lines before
    the typed text; images for the vision model are not text (send them with the message)."""
    labels = [a.description.label() for a in attachments if a.description is not None]
    if not labels:
        return text
    lines = [OCR_PREAMBLE, *labels]
    if text:
        lines += ["", text]
    return "\n".join(lines)


def vision_images(attachments: Sequence[ImageAttachment]) -> list[LoadedImage]:
    """The pictures a vision model is shown with the message (the attachments on its path)."""
    return [a.image for a in attachments if a.path == ImagePath.VISION_MODEL]
