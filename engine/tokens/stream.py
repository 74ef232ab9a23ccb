"""What a runtime's `generate_tokens` returns: the tokens of one generation, and what the
runtime learned about it while producing them. Several generations may be in flight at once
(the batching engine), so these figures live on each stream, never on the runtime."""

from __future__ import annotations

from collections.abc import Iterator

from .events import SpeculationStats
from .sampling import TokenLogprob


class TokenStream(Iterator[int]):
    """Tokens until closed. The figures are final once the consumer stops reading."""

    cached_prompt_tokens: int = 0  # leading prompt tokens found already evaluated
    queued_s: float = 0.0  # time spent waiting for a free slot before evaluation began
    speculation: SpeculationStats | None = None  # drafting's counts, when it drafted
    # One entry per token yielded, appended before the token is (SamplingParams.logprobs);
    # None when not asked for.
    logprobs: list[TokenLogprob] | None = None

    def close(self) -> None:  # noqa: B027 - nothing to release by default
        """Stop generating; the runtime's state stays consistent."""


class GeneratedTokens(TokenStream):
    """A token generator, as a stream: its producer may set the figures as it runs."""

    def __init__(self, tokens: Iterator[int] | None = None, cached_prompt_tokens: int = 0):
        self._tokens = tokens
        self.cached_prompt_tokens = cached_prompt_tokens

    def feeding(self, tokens: Iterator[int]) -> GeneratedTokens:
        """Set the generator (when it needs this stream to report into)."""
        self._tokens = tokens
        return self

    def __next__(self) -> int:
        assert self._tokens is not None, "a stream with no generator"
        return next(self._tokens)

    def close(self) -> None:
        close = getattr(self._tokens, "close", None)
        if close is not None:
            close()
