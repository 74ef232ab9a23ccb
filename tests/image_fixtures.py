"""Images for the image-input tests, generated on the fly: text drawn with a system font,
EXIF orientation, animated GIFs, a decompression bomb; and a tiny random-weight vision
projector (mmproj) GGUF for llama.cpp's multimodal path.
"""

from __future__ import annotations

import io
import re
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGUFWriter
from PIL import Image, ImageDraw, ImageFont

# Any of these draws text OCR reads well; the set-up installs DejaVu (fonts-dejavu-core).
FONT_CANDIDATES = (
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/truetype/liberation/LiberationSans-Regular.ttf",
    "/usr/share/fonts/TTF/DejaVuSans.ttf",
    "/Library/Fonts/Arial.ttf",
)

# EXIF orientation -> how a camera stores an upright scene for that tag (the inverse of the
# turn a viewer applies).
STORED_FOR_ORIENTATION = {
    3: Image.Transpose.ROTATE_180,
    6: Image.Transpose.ROTATE_90,
    8: Image.Transpose.ROTATE_270,
}


def font_path() -> Path:
    found = next((Path(p) for p in FONT_CANDIDATES if Path(p).exists()), None)
    if found is None:  # fail, not skip: a missing font must not hide the OCR tests
        raise RuntimeError("no TrueType font for the image tests; install fonts-dejavu-core")
    return found


def text_image(
    lines: list[str],
    size: tuple[int, int] = (900, 320),
    font_size: int = 44,
    ink: str = "black",
    paper: str | tuple = "white",
    mode: str = "RGB",
) -> Image.Image:
    """Lines of text drawn top to bottom on a plain background."""
    font = ImageFont.truetype(str(font_path()), font_size)
    image = Image.new(mode, size, paper)
    draw = ImageDraw.Draw(image)
    y = 30
    for line in lines:
        draw.text((40, y), line, fill=ink, font=font)
        y += int(font_size * 1.8)
    return image


def encode(image: Image.Image, fmt: str, **options) -> bytes:
    out = io.BytesIO()
    image.save(out, fmt, **options)
    return out.getvalue()


def camera_jpeg(upright: Image.Image, orientation: int) -> bytes:
    """A JPEG as a camera held sideways writes it: pixels turned, EXIF saying how to show
    them, plus camera, date and GPS facts."""
    stored = upright.transpose(STORED_FOR_ORIENTATION[orientation])
    exif = Image.Exif()
    exif[0x0112] = orientation  # Orientation
    exif[0x010F] = "Canon"  # Make
    exif[0x0110] = "Canon EOS 80D"  # Model
    exif.get_ifd(0x8769)[0x9003] = "2024:05:01 14:03:22"  # Exif IFD: DateTimeOriginal
    exif.get_ifd(0x8825)[1] = "N"  # GPS IFD: GPSLatitudeRef
    return encode(stored, "JPEG", quality=92, exif=exif)


def two_frame_gif(first: str = "red", second: str = "blue") -> bytes:
    frames = [Image.new("RGB", (64, 48), first), Image.new("RGB", (64, 48), second)]
    return encode(frames[0], "GIF", save_all=True, append_images=frames[1:], duration=100)


def png_bomb(side: int = 30000) -> bytes:
    """A valid 1-bit PNG of side x side pixels that is small on disk: the rows are all zero,
    which deflate squeezes ~1000:1. Built by hand; Pillow would need the canvas in memory."""
    row = b"\x00" * (1 + (side + 7) // 8)  # filter byte + packed bits
    deflate = zlib.compressobj(9)
    body = b"".join(deflate.compress(row) for _ in range(side)) + deflate.flush()
    header = struct.pack(">IIBBBBB", side, side, 1, 0, 0, 0, 0)  # 1-bit greyscale
    return (
        b"\x89PNG\r\n\x1a\n"
        + _chunk(b"IHDR", header)
        + _chunk(b"IDAT", body)
        + _chunk(b"IEND", b"")
    )


def _chunk(kind: bytes, data: bytes) -> bytes:
    crc = zlib.crc32(kind + data) & 0xFFFFFFFF
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", crc)


def normalised(text: str) -> str:
    """OCR output compared by letters, digits and full stops only: the recogniser often
    drops spaces, and sometimes adds a colon where a gap is wide."""
    return re.sub(r"[^0-9a-z.]", "", text.lower())


@dataclass(frozen=True)
class TinyProjector:
    """A Gemma 3-style projector: a one-layer SigLIP-like encoder, average pooling and a
    linear map into the text model's embedding space (the fewest tensors llama.cpp takes)."""

    text_dim: int = 64  # must equal the text model's embedding width
    dim: int = 32
    ffn_dim: int = 64
    heads: int = 2
    image_size: int = 64
    patch_size: int = 8
    pooling: int = 2  # tokens per side = image_size / patch_size / pooling
    skip_tensor: str | None = None  # leave one out, to test llama.cpp's refusal

    @property
    def image_tokens(self) -> int:
        return (self.image_size // self.patch_size // self.pooling) ** 2


def write_tiny_projector(path: Path, spec: TinyProjector = TinyProjector(), seed: int = 1) -> Path:
    rng = np.random.default_rng(seed)
    writer = GGUFWriter(str(path), "clip")
    writer.add_bool("clip.has_vision_encoder", True)
    writer.add_string("clip.projector_type", "gemma3")
    writer.add_bool("clip.use_gelu", True)
    writer.add_uint32("clip.vision.embedding_length", spec.dim)
    writer.add_uint32("clip.vision.feed_forward_length", spec.ffn_dim)
    writer.add_uint32("clip.vision.attention.head_count", spec.heads)
    writer.add_uint32("clip.vision.block_count", 1)
    writer.add_uint32("clip.vision.projection_dim", spec.text_dim)
    writer.add_float32("clip.vision.attention.layer_norm_epsilon", 1e-6)
    writer.add_uint32("clip.vision.image_size", spec.image_size)
    writer.add_uint32("clip.vision.patch_size", spec.patch_size)
    writer.add_uint32("clip.vision.projector.scale_factor", spec.pooling)
    writer.add_array("clip.vision.image_mean", [0.5, 0.5, 0.5])
    writer.add_array("clip.vision.image_std", [0.5, 0.5, 0.5])

    def tensor(name: str, *shape: int, mean: float = 0.0, scale: float = 0.2) -> None:
        if name != spec.skip_tensor:
            values = mean + rng.normal(0.0, scale, size=shape)
            writer.add_tensor(name, values.astype(np.float32))

    d, patches = spec.dim, (spec.image_size // spec.patch_size) ** 2
    tensor("v.patch_embd.weight", d, 3, spec.patch_size, spec.patch_size)
    tensor("v.patch_embd.bias", d)
    tensor("v.position_embd.weight", patches, d)
    block = "v.blk.0."
    for norm in ("ln1", "ln2"):
        tensor(f"{block}{norm}.weight", d, mean=1.0, scale=0.05)
        tensor(f"{block}{norm}.bias", d, scale=0.05)
    for name in ("attn_q", "attn_k", "attn_v", "attn_out"):
        tensor(f"{block}{name}.weight", d, d)
        tensor(f"{block}{name}.bias", d, scale=0.05)
    tensor(f"{block}ffn_up.weight", spec.ffn_dim, d)
    tensor(f"{block}ffn_up.bias", spec.ffn_dim, scale=0.05)
    tensor(f"{block}ffn_down.weight", d, spec.ffn_dim)
    tensor(f"{block}ffn_down.bias", d, scale=0.05)
    tensor("v.post_ln.weight", d, mean=1.0, scale=0.05)
    tensor("v.post_ln.bias", d, scale=0.05)
    tensor("mm.soft_emb_norm.weight", d, scale=0.05)
    # Stored [vision, text]; llama.cpp multiplies by its transpose.
    tensor("mm.input_projection.weight", d, spec.text_dim, scale=1.0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
