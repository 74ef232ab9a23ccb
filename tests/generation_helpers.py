"""Helpers shared by tests that drive a runtime's token generator directly."""

from __future__ import annotations

from miniapp.engine.runtimes.base import Runtime
from miniapp.engine.tokens.sampling import GREEDY, SamplingParams


def first_tokens(
    runtime: Runtime, prompt: list[int], n: int, params: SamplingParams = GREEDY
) -> list[int]:
    """The first n tokens generated after `prompt` (the cached prefix is reused, as in chat)."""
    out: list[int] = []
    tokens = runtime.generate_tokens(prompt, params)
    try:
        for token in tokens:
            out.append(token)
            if len(out) == n:
                break
    finally:
        tokens.close()
    return out
