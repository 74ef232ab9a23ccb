"""The speculative decoding modes, importable without torch (the CLI lists them)."""

from __future__ import annotations

from enum import StrEnum


class SpecMode(StrEnum):
    OFF = "off"
    AUTO = "auto"  # prompt lookup when it pays; a trained head or early exit where they pay
    EARLY_EXIT = "early-exit"
    HEAD = "head"  # the trained drafting head (`miniapp calibrate --train-head`)
    LOOKUP = "lookup"


SPEC_MODES = tuple(mode.value for mode in SpecMode)
