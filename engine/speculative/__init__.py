"""Speculative decoding: prompt lookup and early-exit self-drafting, verified losslessly."""

from ..tokens.spec_modes import SpecMode
from .controller import DraftController
from .drafter import Draft, Drafter, build_drafters
from .early_exit import EarlyExitDrafter
from .speculative_decoder import SpeculativeDecoder

__all__ = [
    "Draft",
    "Drafter",
    "DraftController",
    "EarlyExitDrafter",
    "SpecMode",
    "SpeculativeDecoder",
    "build_drafters",
]
