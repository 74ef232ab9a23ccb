"""The honest text stand-in for an image when no vision model is available.

Only what can be measured goes in: size and format, the text OCR found, the dominant colours
and the EXIF facts. The label says each fact's origin, so the model (and whoever reads the
prompt) knows the picture itself was not seen.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import PurePath

from .colours import Colour, dominant_colours
from .loading import ExifFacts, LoadedImage
from .ocr import OcrEngine, OcrResult, OcrUnavailableError, shared_ocr

MAX_OCR_CHARS = 3000  # a page of text; more would crowd out the conversation
OCR_LINE_SEPARATOR = " / "


@dataclass(frozen=True)
class ImageDescription:
    name: str  # the file's name, without its folder
    width: int
    height: int
    format_name: str  # PNG, JPEG, WebP, GIF
    frames: int
    ocr: OcrResult | None  # None when OCR could not run
    ocr_problem: str | None  # why OCR could not run
    colours: tuple[Colour, ...]
    exif: ExifFacts

    @property
    def ocr_text(self) -> str:
        return self.ocr.text if self.ocr else ""

    def label(self) -> str:
        """One line for the prompt, e.g. '[image: receipt.png, 1280x720 PNG; text found by
        OCR: "TOTAL 42.50"; dominant colours: white 71%, black 20%; EXIF: Canon EOS 80D]'."""
        parts = [f"image: {self.name}, {self._size_and_format()}", self._ocr_part()]
        if self.colours:
            parts.append("dominant colours: " + ", ".join(c.summary() for c in self.colours))
        exif = self.exif.summary()
        if exif:
            parts.append(f"EXIF: {exif}")
        return "[" + "; ".join(parts) + "]"

    def _size_and_format(self) -> str:
        text = f"{self.width}x{self.height} {self.format_name}"
        if self.frames > 1:
            text += f", first of {self.frames} frames"
        return text

    def _ocr_part(self) -> str:
        if self.ocr is None:
            return f"OCR unavailable ({self.ocr_problem})"
        if not self.ocr.found_text:
            return "no text found by OCR"
        text = OCR_LINE_SEPARATOR.join(line.text for line in self.ocr.lines)
        if len(text) > MAX_OCR_CHARS:
            text = f"{text[:MAX_OCR_CHARS]}... ({len(text) - MAX_OCR_CHARS} more characters)"
        quoted = text.replace("\\", "\\\\").replace('"', '\\"')
        return f'text found by OCR: "{quoted}"'


def describe_image(loaded: LoadedImage, ocr: OcrEngine | None = None) -> ImageDescription:
    """Measure an image: OCR (the shared engine unless one is given), colours, EXIF."""
    engine = ocr or shared_ocr()
    result: OcrResult | None = None
    problem: str | None = None
    try:
        result = engine.read(loaded.image)
    except OcrUnavailableError as exc:
        problem = str(exc)
    return ImageDescription(
        name=PurePath(loaded.source).name or loaded.source,
        width=loaded.width,
        height=loaded.height,
        format_name=loaded.format_name,
        frames=loaded.frames,
        ocr=result,
        ocr_problem=problem,
        colours=dominant_colours(loaded.image),
        exif=loaded.exif,
    )
