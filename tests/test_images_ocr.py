"""The OCR fallback: text drawn into generated images is read, in reading order, and lands
in the user message with the image's size, format, colours and EXIF facts."""

from __future__ import annotations

from pathlib import Path

import pytest
from image_fixtures import camera_jpeg, encode, normalised, text_image
from PIL import Image

from miniapp.engine.images import (
    ImageInputError,
    ImagePath,
    ImageRoute,
    attach_image,
    build_user_message,
    describe_image,
    load_image,
    shared_ocr,
)
from miniapp.engine.images.attach import OCR_PREAMBLE
from miniapp.engine.images.colours import colour_name, dominant_colours

OCR_ROUTE = ImageRoute(ImagePath.OCR_FALLBACK, "no mmproj GGUF beside the model")


@pytest.fixture(scope="module")
def ocr():
    return shared_ocr()  # one engine for the whole run: building it takes a moment


def _save(tmp_path: Path, name: str, data: bytes) -> Path:
    path = tmp_path / name
    path.write_bytes(data)
    return path


def test_ocr_models_come_inside_the_wheel():
    import rapidocr_onnxruntime

    models = Path(rapidocr_onnxruntime.__file__).parent / "models"
    assert len(list(models.glob("*.onnx"))) == 3  # detection, orientation, recognition


def test_ocr_reads_lines_in_order(ocr):
    image = text_image(["INVOICE 2291", "Total due 73.15", "Thank you"])
    result = ocr.read(image)
    assert [normalised(line.text) for line in result.lines] == [
        "invoice2291",
        "totaldue73.15",
        "thankyou",
    ]
    assert all(line.confidence >= 0.6 for line in result.lines)
    tops = [line.box[1] for line in result.lines]
    assert tops == sorted(tops)


def test_pieces_on_one_line_are_joined_left_to_right(ocr):
    image = Image.new("RGB", (1000, 200), "white")
    image.paste(text_image(["PRICE"], size=(300, 120)), (620, 40))
    image.paste(text_image(["APPLES"], size=(300, 120)), (20, 40))
    (line,) = ocr.read(image).lines
    assert normalised(line.text) == "applesprice"


def test_blank_image_has_no_text(ocr):
    result = ocr.read(Image.new("RGB", (400, 300), (40, 90, 160)))
    assert not result.found_text and result.text == ""


def test_ocr_text_lands_in_the_prompt(tmp_path, ocr):
    path = _save(tmp_path, "receipt.png", encode(text_image(["CAFE LUNA", "TOTAL 42.50"]), "PNG"))
    attachment = attach_image(path, OCR_ROUTE, ocr)
    assert attachment.path == ImagePath.OCR_FALLBACK
    message = build_user_message("What did I pay?", [attachment])
    label = attachment.description.label()
    assert message == f"{OCR_PREAMBLE}\n{label}\n\nWhat did I pay?"
    assert label.startswith('[image: receipt.png, 900x320 PNG; text found by OCR: "')
    assert 'text found by OCR: "CAFE' in label
    assert "cafelunatotal42.50" in normalised(label)
    assert " / " in label  # one line of the image per OCR line
    assert "dominant colours: white" in label
    assert attachment.notice() == (
        "receipt.png (900x320 PNG): read by OCR, 2 lines of text (no mmproj GGUF beside the model)"
    )


def test_rotated_exif_photo_is_read_upright(tmp_path, ocr):
    upright = text_image(["SIDEWAYS NOTE", "MEET AT 5PM"], size=(760, 260))
    path = _save(tmp_path, "phone.jpg", camera_jpeg(upright, orientation=6))
    description = describe_image(load_image(path), ocr)
    assert [normalised(line.text) for line in description.ocr.lines] == [
        "sidewaysnote",
        "meetat5pm",
    ]
    label = description.label()
    assert label.startswith("[image: phone.jpg, 760x260 JPEG;")
    assert "EXIF: Canon EOS 80D, taken 2024-05-01 14:03, GPS position recorded" in label


def test_several_images_in_one_message(tmp_path, ocr):
    first = _save(tmp_path, "a.png", encode(text_image(["FIRST PAGE"]), "PNG"))
    second = _save(tmp_path, "b.webp", encode(text_image(["SECOND PAGE"]), "WEBP", quality=95))
    attachments = [attach_image(p, OCR_ROUTE, ocr) for p in (first, second)]
    lines = build_user_message("Compare them.", attachments).split("\n")
    assert lines[0] == OCR_PREAMBLE
    assert lines[1].startswith("[image: a.png,") and "firstpage" in normalised(lines[1])
    assert lines[2].startswith("[image: b.webp, 900x320 WebP;")
    assert "secondpage" in normalised(lines[2])
    assert lines[3:] == ["", "Compare them."]


def test_no_text_is_said_plainly(tmp_path, ocr):
    path = _save(tmp_path, "sky.gif", encode(Image.new("RGB", (300, 200), (70, 130, 220)), "GIF"))
    label = attach_image(path, OCR_ROUTE, ocr).description.label()
    assert label == (
        "[image: sky.gif, 300x200 GIF; no text found by OCR; dominant colours: blue 100%]"
    )


def test_quotes_in_text_are_escaped(tmp_path, ocr):
    path = _save(tmp_path, "quote.png", encode(text_image(['SAY "HELLO"']), "PNG"))
    label = attach_image(path, OCR_ROUTE, ocr).description.label()
    assert '\\"' in label and label.count('"') - label.count('\\"') == 2


def test_a_bad_file_does_not_stop_the_next(tmp_path, ocr):
    with pytest.raises(ImageInputError, match="bad.png: a text file"):
        attach_image(_save(tmp_path, "bad.png", b"hello"), OCR_ROUTE, ocr)
    good = _save(tmp_path, "ok.png", encode(text_image(["STILL HERE"]), "PNG"))
    assert "stillhere" in normalised(attach_image(good, OCR_ROUTE, ocr).description.ocr_text)


def test_dominant_colours():
    image = Image.new("RGB", (100, 100), "white")
    image.paste(Image.new("RGB", (100, 30), (0, 0, 0)), (0, 0))
    image.paste(Image.new("RGB", (100, 10), (220, 20, 20)), (0, 90))
    colours = dominant_colours(image)
    assert [(c.name, round(c.share, 2)) for c in colours] == [
        ("white", 0.6),
        ("black", 0.3),
        ("red", 0.1),
    ]
    assert colours[2].hex.startswith("#") and len(colours[2].hex) == 7


@pytest.mark.parametrize(
    ("rgb", "name"),
    [
        ((255, 255, 255), "white"),
        ((10, 10, 10), "black"),
        ((128, 128, 128), "grey"),
        ((250, 140, 0), "orange"),
        ((120, 70, 20), "brown"),
        ((30, 160, 60), "green"),
        ((20, 60, 200), "blue"),
        ((250, 180, 200), "pink"),
        ((110, 20, 120), "purple"),
    ],
)
def test_colour_names(rgb, name):
    assert colour_name(rgb) == name
