"""Dominant colours: a small median-cut palette, each entry named from a table of basic hues."""

from __future__ import annotations

import colorsys
from collections import defaultdict
from dataclasses import dataclass

from PIL import Image

PALETTE_SIZE = 8  # median-cut boxes; named colours are merged afterwards
TOP_COLOURS = 3
MIN_SHARE = 0.02  # a colour under 2% of the picture is detail, not a dominant colour
SAMPLE_LONG_SIDE = 160  # the statistics barely change above this, the cost does

# Achromatic thresholds on HSV value/saturation (0..1).
BLACK_BELOW_VALUE = 0.18
GREY_BELOW_SATURATION = 0.14
WHITE_ABOVE_VALUE = 0.88
LIGHT_GREY_ABOVE_VALUE = 0.62

# Hue ranges in degrees, [start, end), with a darker and a paler variant where English
# has a common word for it.
_HUES = (
    (0, 15, "red"),
    (15, 45, "orange"),
    (45, 70, "yellow"),
    (70, 165, "green"),
    (165, 195, "cyan"),
    (195, 255, "blue"),
    (255, 290, "purple"),
    (290, 340, "pink"),
    (340, 360, "red"),
)
_DARK_VARIANTS = {
    "orange": "brown",
    "red": "dark red",
    "yellow": "olive",
    "blue": "navy",
    "pink": "purple",
}
_PALE_VARIANTS = {"red": "pink"}
DARK_BELOW_VALUE = 0.55
PALE_BELOW_SATURATION = 0.45


@dataclass(frozen=True)
class Colour:
    name: str
    hex: str  # the most common palette shade under this name, e.g. "#f4f4f2"
    share: float  # fraction of the picture, 0..1

    def summary(self) -> str:
        return f"{self.name} {self.share:.0%}"


def dominant_colours(image: Image.Image, top: int = TOP_COLOURS) -> tuple[Colour, ...]:
    """The `top` biggest named colours of an RGB image, largest first."""
    sample = image.convert("RGB")
    sample.thumbnail((SAMPLE_LONG_SIDE, SAMPLE_LONG_SIDE), Image.Resampling.BOX)
    palette_image = sample.quantize(PALETTE_SIZE, method=Image.Quantize.MEDIANCUT)
    palette = palette_image.getpalette() or []
    counts = palette_image.getcolors(PALETTE_SIZE) or []
    total = sum(count for count, _index in counts) or 1
    by_name: dict[str, int] = defaultdict(int)
    shade: dict[str, tuple[int, tuple[int, int, int]]] = {}
    for count, index in counts:
        rgb = tuple(palette[3 * index : 3 * index + 3])
        name = colour_name(rgb)
        by_name[name] += count
        if count > shade.get(name, (0, rgb))[0]:
            shade[name] = (count, rgb)
    ranked = sorted(by_name.items(), key=lambda item: -item[1])
    return tuple(
        Colour(name, _hex(shade[name][1]), count / total)
        for name, count in ranked[:top]
        if count / total >= MIN_SHARE
    )


def colour_name(rgb: tuple[int, ...]) -> str:
    """A basic English colour name for an sRGB triple."""
    r, g, b = (channel / 255 for channel in rgb[:3])
    hue, saturation, value = colorsys.rgb_to_hsv(r, g, b)
    if value < BLACK_BELOW_VALUE:
        return "black"
    if saturation < GREY_BELOW_SATURATION:
        if value > WHITE_ABOVE_VALUE:
            return "white"
        return "light grey" if value > LIGHT_GREY_ABOVE_VALUE else "grey"
    degrees = hue * 360
    name = next(label for start, end, label in _HUES if start <= degrees < end)
    if value < DARK_BELOW_VALUE and name in _DARK_VARIANTS:
        return _DARK_VARIANTS[name]
    if saturation < PALE_BELOW_SATURATION and name in _PALE_VARIANTS:
        return _PALE_VARIANTS[name]
    return name


def _hex(rgb: tuple[int, ...]) -> str:
    return "#" + "".join(f"{channel:02x}" for channel in rgb[:3])
