"""The speculative decoding modes, importable without torch (the CLI lists them)."""

from __future__ import annotations

from enum import StrEnum


class SpecMode(StrEnum):
    OFF = "off"
    AUTO = "auto"  # prompt lookup when it pays; early exit where calibration says it pays
    EARLY_EXIT = "early-exit"
    LOOKUP = "lookup"


SPEC_MODES = tuple(mode.value for mode in SpecMode)
