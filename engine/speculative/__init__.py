"""Speculative decoding: prompt lookup and early-exit self-drafting, verified losslessly."""

from ..spec_modes import SpecMode
from .controller import DraftController
from .decoder import SpeculativeDecoder
from .early_exit import EarlyExitDrafter

__all__ = ["DraftController", "EarlyExitDrafter", "SpecMode", "SpeculativeDecoder"]
