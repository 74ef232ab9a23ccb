"""Opening an attached image safely: format check, size limits, EXIF orientation, one frame.

Everything downstream (OCR, colours, the vision model) gets the same upright RGB picture, so
a phone photo taken sideways is read the way its owner sees it.
"""

from __future__ import annotations

import io
import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path

from PIL import ExifTags, Image, ImageOps, UnidentifiedImageError

from .errors import ImageInputError

ACCEPTED_FORMATS = ("PNG", "JPEG", "WEBP", "GIF")
FORMAT_NAMES = {"PNG": "PNG", "JPEG": "JPEG", "WEBP": "WebP", "GIF": "GIF"}

MAX_FILE_BYTES = 50_000_000
# Decoded size limit. A small file can claim a huge canvas (a "decompression bomb"): 60 MP
# covers any phone or camera photo, while a 30000x30000 claim would need 2.7 GB of RGB.
MAX_PIXELS = 60_000_000
# OCR, colour statistics and the vision encoders gain nothing from more pixels than this, and
# every step after loading costs time in proportion to the pixel count.
PROCESS_LONG_SIDE = 2048

# Pillow warns above its limit and raises above twice it; ours is explicit and it raises.
Image.MAX_IMAGE_PIXELS = MAX_PIXELS

# Magic numbers of formats people commonly try, to name them in the error message.
_KNOWN_OTHER_FORMATS = (
    (b"BM", "BMP"),
    (b"II*\x00", "TIFF"),
    (b"MM\x00*", "TIFF"),
    (b"%PDF", "PDF"),
    (b"\x00\x00\x01\x00", "ICO"),
    (b"8BPS", "Photoshop"),
)
_HEIF_BRANDS = (b"heic", b"heix", b"hevc", b"mif1", b"avif")


@dataclass(frozen=True)
class ExifFacts:
    """What the file's EXIF block states, as facts (nothing inferred)."""

    camera: str | None = None  # "Canon EOS 80D"
    taken: str | None = None  # "2024-05-01 14:03"
    orientation: int | None = None  # the EXIF orientation tag, 1..8
    has_gps: bool = False

    @property
    def rotated(self) -> bool:
        """Whether the orientation tag asked for a rotation or flip (which we applied)."""
        return self.orientation not in (None, 1)

    def summary(self) -> str:
        """e.g. 'Canon EOS 80D, taken 2024-05-01 14:03, GPS position recorded'; '' if none."""
        parts = []
        if self.camera:
            parts.append(self.camera)
        if self.taken:
            parts.append(f"taken {self.taken}")
        if self.has_gps:
            parts.append("GPS position recorded")
        if self.rotated:
            parts.append(f"orientation {self.orientation} applied")
        return ", ".join(parts)


@dataclass(frozen=True)
class LoadedImage:
    """An attached image, decoded and upright."""

    source: str  # the file name shown to the user, or a label for in-memory bytes
    image: Image.Image = field(repr=False)  # RGB, upright, long side <= PROCESS_LONG_SIDE
    format: str  # Pillow's name: PNG, JPEG, WEBP, GIF
    width: int  # upright size as stored, before any downscaling
    height: int
    frames: int  # > 1 for an animated GIF or WebP (we use the first)
    exif: ExifFacts
    file_bytes: int

    @property
    def format_name(self) -> str:
        return FORMAT_NAMES.get(self.format, self.format)

    @property
    def downscaled(self) -> bool:
        return self.image.size != (self.width, self.height)

    def png_bytes(self) -> bytes:
        """The processed picture as PNG: what the vision model is sent. Re-encoding means
        the model gets the upright first frame, and never a WebP that llama.cpp can't read."""
        out = io.BytesIO()
        self.image.save(out, "PNG", compress_level=1)  # speed over size: it stays in memory
        return out.getvalue()


def load_image(source: Path | str | bytes, name: str | None = None) -> LoadedImage:
    """Open and check an image file (or bytes), apply its EXIF orientation, keep the first
    frame, flatten transparency onto white and downscale to PROCESS_LONG_SIDE.

    Raises ImageInputError, one line naming the file and the cause, for anything unusable.
    """
    if isinstance(source, bytes):
        label = name or "image"
        data = source
        if len(data) > MAX_FILE_BYTES:
            raise ImageInputError(label, _too_big(len(data)))
    else:
        label = name or str(source)
        data = _read_file(Path(source), label)
    if not data:
        raise ImageInputError(label, "empty file")
    return _decode(data, label)


def _read_file(path: Path, label: str) -> bytes:
    try:
        size = path.stat().st_size
        if path.is_dir():
            raise ImageInputError(label, "is a folder, not an image")
        if size > MAX_FILE_BYTES:
            raise ImageInputError(label, _too_big(size))
        return path.read_bytes()
    except FileNotFoundError:
        raise ImageInputError(label, "no such file") from None
    except PermissionError:
        raise ImageInputError(label, "permission denied") from None
    except OSError as exc:
        raise ImageInputError(label, f"cannot read it ({exc.strerror or exc})") from None


def _too_big(size: int) -> str:
    return f"file is {size / 1e6:.0f} MB; images up to {MAX_FILE_BYTES / 1e6:.0f} MB are accepted"


def _decode(data: bytes, label: str) -> LoadedImage:
    try:
        with warnings.catch_warnings():
            # Pillow only warns between its limit and twice it: make every bomb an error.
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(data), formats=ACCEPTED_FORMATS) as opened:
                _check_pixels(opened.size, label)
                stored_size = opened.size  # before draft() shrinks a JPEG
                frames = getattr(opened, "n_frames", 1)
                opened.seek(0)
                # JPEG can decode at 1/2, 1/4 or 1/8 scale directly: far faster for big photos.
                opened.draft("RGB", (PROCESS_LONG_SIDE, PROCESS_LONG_SIDE))
                exif = _exif_facts(opened)
                upright = ImageOps.exif_transpose(opened)  # also decodes the pixels
                width, height = _upright_size(stored_size, exif.orientation)
                rgb = _to_rgb(upright)
                fmt = opened.format or "?"
    except ImageInputError:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise ImageInputError(label, _bomb_reason(exc)) from None
    except UnidentifiedImageError:
        raise ImageInputError(label, _identify_failure(data)) from None
    except (OSError, ValueError, SyntaxError, EOFError) as exc:
        # Pillow reports truncated and corrupt data with all of these.
        raise ImageInputError(label, f"corrupt or truncated image ({_short(exc)})") from None
    rgb.thumbnail((PROCESS_LONG_SIDE, PROCESS_LONG_SIDE), Image.Resampling.LANCZOS)
    return LoadedImage(label, rgb, fmt, width, height, frames, exif, len(data))


def _check_pixels(size: tuple[int, int], label: str) -> None:
    width, height = size
    if width <= 0 or height <= 0:
        raise ImageInputError(label, f"invalid image size {width}x{height}")
    if width * height > MAX_PIXELS:
        raise ImageInputError(label, _pixels_reason(width, height))


def _pixels_reason(width: int, height: int) -> str:
    return (
        f"image claims {width}x{height} pixels ({width * height / 1e6:.0f} MP), over the "
        f"{MAX_PIXELS / 1e6:.0f} MP limit (a possible decompression bomb)"
    )


def _bomb_reason(exc: Exception) -> str:
    # Pillow names the pixel count, not the sides: "Image size (900000000 pixels) exceeds..."
    found = re.search(r"\((\d+) pixels\)", str(exc))
    claimed = f"claims {int(found.group(1)) / 1e6:.0f} MP, " if found else "is "
    return (
        f"image {claimed}over the {MAX_PIXELS / 1e6:.0f} MP limit (a possible decompression bomb)"
    )


def _upright_size(size: tuple[int, int], orientation: int | None) -> tuple[int, int]:
    # Orientations 5-8 swap width and height (a quarter turn, possibly mirrored).
    width, height = size
    return (height, width) if orientation in (5, 6, 7, 8) else (width, height)


def _to_rgb(image: Image.Image) -> Image.Image:
    """RGB with any transparency composited onto white, as a viewer would show it."""
    if image.mode in ("RGBA", "LA", "PA") or (image.mode == "P" and "transparency" in image.info):
        rgba = image.convert("RGBA")
        background = Image.new("RGB", rgba.size, (255, 255, 255))
        background.paste(rgba, mask=rgba.getchannel("A"))
        return background
    return image.convert("RGB")


def _exif_facts(image: Image.Image) -> ExifFacts:
    try:
        exif = image.getexif()
    except Exception:  # noqa: BLE001 - a broken EXIF block must not block the picture
        return ExifFacts()
    if not exif:
        return ExifFacts()
    base, tags = ExifTags.Base, ExifTags.IFD
    try:
        details = exif.get_ifd(tags.Exif)
    except Exception:  # noqa: BLE001
        details = {}
    taken = details.get(base.DateTimeOriginal) or exif.get(base.DateTime)
    orientation = exif.get(base.Orientation)
    return ExifFacts(
        camera=_camera(exif.get(base.Make), exif.get(base.Model)),
        taken=_exif_date(taken),
        orientation=orientation if isinstance(orientation, int) and 1 <= orientation <= 8 else None,
        has_gps=tags.GPSInfo in exif,
    )


def _camera(make: object, model: object) -> str | None:
    make_text, model_text = _clean(make), _clean(model)
    if make_text and model_text and model_text.lower().startswith(make_text.lower()):
        return model_text  # "Canon" + "Canon EOS 80D": the model already names the make
    joined = " ".join(p for p in (make_text, model_text) if p)
    return joined or None


def _exif_date(value: object) -> str | None:
    """EXIF writes '2024:05:01 14:03:22'; we show '2024-05-01 14:03'."""
    text = _clean(value)
    if not text:
        return None
    date, _, time = text.partition(" ")
    parts = date.split(":")
    if len(parts) != 3 or not all(p.isdigit() for p in parts):
        return text[:40]
    shown = "-".join(parts)
    if time.count(":") >= 1:
        shown += " " + ":".join(time.split(":")[:2])
    return shown


def _clean(value: object) -> str:
    if isinstance(value, bytes):
        value = value.decode("utf-8", "replace")
    if not isinstance(value, str):
        return ""
    return " ".join(value.replace("\x00", " ").split())[:80]


def _identify_failure(data: bytes) -> str:
    """Why Pillow could not open it as one of our formats, as specific as we can tell."""
    accepted = "PNG, JPEG, WebP or GIF"
    head = data[:16]
    for magic, kind in _KNOWN_OTHER_FORMATS:
        if head.startswith(magic):
            return f"{kind} files are not accepted; use {accepted}"
    if head[4:8] == b"ftyp" and head[8:12] in _HEIF_BRANDS:
        return f"HEIC/AVIF files are not accepted; use {accepted}"
    if _looks_like_text(data[:4096]):
        if data.lstrip()[:5].lower() in (b"<svg ", b"<?xml"):
            return f"SVG/XML files are not accepted; use {accepted}"
        return f"a text file, not an image ({accepted})"
    return f"not a {accepted} image, or its header is corrupt"


def _looks_like_text(sample: bytes) -> bool:
    if b"\x00" in sample:
        return False
    try:
        sample.decode("utf-8")
    except UnicodeDecodeError as exc:
        return exc.start >= len(sample) - 4  # only a character cut at the sample's end
    return True


def _short(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:120] if text else type(exc).__name__
