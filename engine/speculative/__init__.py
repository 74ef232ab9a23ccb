"""Speculative decoding: prompt lookup and early-exit self-drafting, verified losslessly."""

from ..spec_modes import SpecMode
from .controller import DraftController
from .decoder import SpeculativeDecoder
from .drafter import Draft, Drafter, build_drafters
from .early_exit import EarlyExitDrafter

__all__ = [
    "Draft",
    "Drafter",
    "DraftController",
    "EarlyExitDrafter",
    "SpecMode",
    "SpeculativeDecoder",
    "build_drafters",
]
