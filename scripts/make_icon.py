"""Draws assets/icon.png (256 px): a speech bubble holding a small chip, miniapp's own mark.
Run once; the file is committed."""

from pathlib import Path

from PIL import Image, ImageDraw

SIZE = 256
INK = (31, 41, 55)
ACCENT = (249, 115, 22)
ASSETS = Path(__file__).resolve().parents[1] / "assets"


def draw() -> Image.Image:
    image = Image.new("RGBA", (SIZE, SIZE), (0, 0, 0, 0))
    pen = ImageDraw.Draw(image)
    pen.rounded_rectangle((16, 24, 240, 196), radius=44, fill=ACCENT)
    pen.polygon([(64, 188), (56, 240), (116, 192)], fill=ACCENT)  # the bubble's tail
    pen.rounded_rectangle((84, 66, 172, 154), radius=14, fill=INK)  # the chip
    for offset in range(96, 170, 22):  # its pins
        for y0, y1 in ((50, 66), (154, 170)):
            pen.rectangle((offset, y0, offset + 8, y1), fill=INK)
        for x0, x1 in ((68, 84), (172, 188)):
            pen.rectangle((x0, offset - 18, x1, offset - 10), fill=INK)
    pen.ellipse((112, 94, 144, 126), fill=ACCENT)
    return image


if __name__ == "__main__":
    draw().save(ASSETS / "icon.png")
    print(ASSETS / "icon.png")
