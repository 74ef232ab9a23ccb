"""Loading attached images: accepted formats, EXIF orientation and facts, limits, and the
one-line errors for files that are not usable images."""

from __future__ import annotations

import pytest
from image_fixtures import camera_jpeg, encode, png_bomb, text_image, two_frame_gif
from PIL import Image, ImageChops, ImageStat

from miniapp.engine.errors import MiniappError
from miniapp.engine.images import ImageInputError, load_image
from miniapp.engine.images.loading import MAX_FILE_BYTES, PROCESS_LONG_SIDE


def _mean_difference(a: Image.Image, b: Image.Image) -> float:
    return sum(ImageStat.Stat(ImageChops.difference(a, b)).mean) / 3


def _write(tmp_path, name: str, data: bytes):
    path = tmp_path / name
    path.write_bytes(data)
    return path


@pytest.mark.parametrize(
    ("fmt", "name"), [("PNG", "PNG"), ("JPEG", "JPEG"), ("WEBP", "WebP"), ("GIF", "GIF")]
)
def test_accepted_formats_load_as_rgb(tmp_path, fmt, name):
    picture = Image.new("RGB", (120, 80), (200, 30, 30))
    path = _write(tmp_path, f"red.{fmt.lower()}", encode(picture, fmt))
    loaded = load_image(path)
    assert loaded.format_name == name
    assert (loaded.width, loaded.height) == (120, 80)
    assert loaded.image.mode == "RGB"
    red, green, blue = loaded.image.getpixel((60, 40))
    assert red > 150 and green < 80 and blue < 80
    assert not loaded.exif.summary()


def test_bytes_load_like_files():
    loaded = load_image(encode(Image.new("RGB", (10, 10), "blue"), "PNG"), name="paste.png")
    assert loaded.source == "paste.png" and loaded.format == "PNG"


@pytest.mark.parametrize("orientation", [3, 6, 8])
def test_exif_orientation_is_applied(tmp_path, orientation):
    upright = text_image(["UPRIGHT"], size=(400, 120))
    path = _write(tmp_path, "sideways.jpg", camera_jpeg(upright, orientation))
    loaded = load_image(path)
    assert (loaded.width, loaded.height) == upright.size
    assert loaded.image.size == upright.size
    # JPEG noise aside, the pixels are the upright scene, not the stored (turned) one.
    assert _mean_difference(loaded.image, upright) < 4
    assert loaded.exif.orientation == orientation
    assert f"orientation {orientation} applied" in loaded.exif.summary()


def test_exif_facts(tmp_path):
    path = _write(tmp_path, "photo.jpg", camera_jpeg(Image.new("RGB", (60, 40), "green"), 6))
    exif = load_image(path).exif
    assert exif.camera == "Canon EOS 80D"  # "Canon" + "Canon EOS 80D" is said once
    assert exif.taken == "2024-05-01 14:03"
    assert exif.has_gps
    assert exif.summary().startswith("Canon EOS 80D, taken 2024-05-01 14:03, GPS position")


def test_gif_first_frame(tmp_path):
    loaded = load_image(_write(tmp_path, "anim.gif", two_frame_gif("red", "blue")))
    assert loaded.frames == 2
    red, _green, blue = loaded.image.getpixel((5, 5))
    assert red > 200 and blue < 50


def test_transparency_is_flattened_onto_white(tmp_path):
    clear = Image.new("RGBA", (50, 50), (0, 0, 0, 0))
    loaded = load_image(_write(tmp_path, "clear.png", encode(clear, "PNG")))
    assert loaded.image.getpixel((25, 25)) == (255, 255, 255)


def test_big_pictures_are_downscaled_for_processing(tmp_path):
    wide = Image.new("RGB", (5000, 1000), "white")
    loaded = load_image(_write(tmp_path, "wide.png", encode(wide, "PNG")))
    assert (loaded.width, loaded.height) == (5000, 1000)  # the facts keep the real size
    assert max(loaded.image.size) == PROCESS_LONG_SIDE
    assert loaded.downscaled


def _error(source, **kwargs) -> str:
    with pytest.raises(ImageInputError) as caught:
        load_image(source, **kwargs)
    message = str(caught.value)
    assert isinstance(caught.value, MiniappError)  # the CLI prints it and the chat goes on
    assert "\n" not in message
    return message


def test_missing_file(tmp_path):
    message = _error(tmp_path / "nothere.png")
    assert message.endswith("nothere.png: no such file")


def test_folder(tmp_path):
    assert "is a folder" in _error(tmp_path)


def test_corrupt_bytes(tmp_path):
    noise = bytes(range(256)) * 8
    message = _error(_write(tmp_path, "noise.png", b"\x00\xff" + noise))
    assert "noise.png" in message and "not a PNG, JPEG, WebP or GIF image" in message


def test_truncated_png(tmp_path):
    data = encode(text_image(["TRUNCATED"]), "PNG")
    message = _error(_write(tmp_path, "cut.png", data[: len(data) // 2]))
    assert "cut.png: corrupt or truncated image" in message


def test_text_file_renamed_png(tmp_path):
    message = _error(_write(tmp_path, "notes.png", b"Shopping list:\n- milk\n- bread\n"))
    assert "notes.png: a text file, not an image" in message


def test_other_image_formats_are_named(tmp_path):
    bmp = encode(Image.new("RGB", (8, 8)), "BMP")
    assert "BMP files are not accepted" in _error(_write(tmp_path, "old.bmp", bmp))


def test_empty_file(tmp_path):
    assert _error(_write(tmp_path, "empty.png", b"")).endswith("empty.png: empty file")


def test_decompression_bomb(tmp_path):
    bomb = png_bomb(30000)
    assert len(bomb) < 200_000  # small on disk, 900 MP once decoded
    message = _error(_write(tmp_path, "bomb.png", bomb))
    assert "bomb.png: image claims 900 MP, over the 60 MP limit" in message


def test_file_too_big(tmp_path):
    path = tmp_path / "huge.png"
    with path.open("wb") as handle:  # sparse: no disk space used
        handle.write(b"\x89PNG\r\n\x1a\n")
        handle.truncate(MAX_FILE_BYTES + 1)
    message = _error(path)
    assert "huge.png: file is 50 MB; images up to 50 MB are accepted" in message
    assert "images up to" in _error(b"\x00" * (MAX_FILE_BYTES + 1), name="pasted")


def test_an_error_leaves_later_images_working(tmp_path):
    _error(_write(tmp_path, "bad.png", b"not an image at all"))
    good = load_image(_write(tmp_path, "good.png", encode(Image.new("RGB", (4, 4)), "PNG")))
    assert good.format == "PNG"
