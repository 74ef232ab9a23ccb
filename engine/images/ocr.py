"""Text in images, read by RapidOCR (PaddleOCR's models in ONNX, run by onnxruntime).

The rapidocr-onnxruntime wheel carries its three models (detection, orientation, recognition)
inside the package, so nothing is fetched at run time; we check they are there before use.
Building the engine takes a moment, so there is one per process, made on first use.
"""

from __future__ import annotations

import functools
import logging
import statistics
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

from ..errors import MiniappError

OCR_THREADS = 2  # onnxruntime's intra-op threads: the app shares a small machine
# Recognised pieces below this confidence are mostly noise (texture read as letters).
MIN_CONFIDENCE = 0.6
# Two pieces are on the same line when their vertical centres are closer than this fraction
# of the line's typical text height.
SAME_LINE_FRACTION = 0.5

log = logging.getLogger("miniapp.images")


class OcrUnavailableError(MiniappError):
    """The OCR package or its bundled models are missing from this installation."""


@dataclass(frozen=True)
class OcrLine:
    text: str
    confidence: float  # the lowest of the line's pieces, 0..1
    box: tuple[int, int, int, int]  # left, top, right, bottom in the processed image


@dataclass(frozen=True)
class OcrResult:
    lines: tuple[OcrLine, ...]  # reading order: top to bottom, left to right
    dropped: int = 0  # pieces under MIN_CONFIDENCE, left out

    @property
    def text(self) -> str:
        return "\n".join(line.text for line in self.lines)

    @property
    def found_text(self) -> bool:
        return bool(self.lines)


@dataclass(frozen=True)
class _Piece:
    text: str
    confidence: float
    left: float
    top: float
    right: float
    bottom: float

    @property
    def centre_y(self) -> float:
        return (self.top + self.bottom) / 2

    @property
    def height(self) -> float:
        return max(self.bottom - self.top, 1.0)


class OcrEngine:
    def __init__(self, threads: int = OCR_THREADS, min_confidence: float = MIN_CONFIDENCE):
        self.threads = threads
        self.min_confidence = min_confidence
        self._engine = None
        self._lock = threading.Lock()

    def read(self, image: Image.Image) -> OcrResult:
        """The text in an RGB image, line by line in reading order."""
        pixels = np.asarray(image.convert("RGB"))[:, :, ::-1]  # RapidOCR wants BGR arrays
        with self._lock:
            engine = self._load()
            try:
                found, _timings = engine(np.ascontiguousarray(pixels))
            except Exception as exc:  # onnxruntime/opencv errors on odd inputs
                log.warning("OCR failed: %s", exc)
                raise OcrUnavailableError(f"OCR failed on this image ({exc})") from exc
        pieces = [_piece(entry) for entry in found or ()]
        kept = [p for p in pieces if p.confidence >= self.min_confidence and p.text.strip()]
        return OcrResult(tuple(_reading_order(kept)), dropped=len(pieces) - len(kept))

    def _load(self):
        if self._engine is None:
            self._engine = _build_engine(self.threads)
        return self._engine


@functools.cache
def shared_ocr() -> OcrEngine:
    """The process's OCR engine (its models load on the first read)."""
    return OcrEngine()


def _build_engine(threads: int):
    try:
        import rapidocr_onnxruntime
        from rapidocr_onnxruntime import RapidOCR
    except ImportError as exc:
        raise OcrUnavailableError(f"OCR is not installed (rapidocr-onnxruntime: {exc})") from exc
    models = Path(rapidocr_onnxruntime.__file__).parent / "models"
    if not list(models.glob("*.onnx")):
        raise OcrUnavailableError(f"OCR models are missing from {models}; reinstall miniapp")
    # Its own loggers print to stderr at DEBUG level; we report failures ourselves.
    for name in ("RapidOCR", "OrtInferSession"):
        logging.getLogger(name).setLevel(logging.ERROR)
    return RapidOCR(
        intra_op_num_threads=threads,
        inter_op_num_threads=1,
        # Our own threshold applies afterwards; let every piece through to count the dropped.
        text_score=0.0,
    )


def _piece(entry) -> _Piece:
    box, text, score = entry[0], str(entry[1]), float(entry[2])
    xs = [float(point[0]) for point in box]
    ys = [float(point[1]) for point in box]
    return _Piece(text.strip(), score, min(xs), min(ys), max(xs), max(ys))


def _reading_order(pieces: list[_Piece]) -> list[OcrLine]:
    """Group pieces into lines by vertical position, then read each line left to right."""
    rows: list[list[_Piece]] = []
    for piece in sorted(pieces, key=lambda p: p.centre_y):
        if rows and _same_row(rows[-1], piece):
            rows[-1].append(piece)
        else:
            rows.append([piece])
    return [_line(sorted(row, key=lambda p: p.left)) for row in rows]


def _same_row(row: list[_Piece], piece: _Piece) -> bool:
    centre = statistics.fmean(p.centre_y for p in row)
    height = statistics.median(p.height for p in row)
    return abs(piece.centre_y - centre) < SAME_LINE_FRACTION * min(height, piece.height)


def _line(row: list[_Piece]) -> OcrLine:
    box = (
        round(min(p.left for p in row)),
        round(min(p.top for p in row)),
        round(max(p.right for p in row)),
        round(max(p.bottom for p in row)),
    )
    return OcrLine(" ".join(p.text for p in row), min(p.confidence for p in row), box)
