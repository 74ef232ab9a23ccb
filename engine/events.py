"""Typed events that generation yields; every interface (terminal, GUI, bench) consumes these."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class FinishReason(StrEnum):
    END_OF_TURN = "end_of_turn"  # the model emitted an end-of-generation token
    STOP_STRING = "stop_string"
    MAX_TOKENS = "max_tokens"
    CONTEXT_FULL = "context_full"
    CANCELLED = "cancelled"


@dataclass(frozen=True)
class TextDelta:
    """A piece of answer text, ready to print."""

    text: str


@dataclass(frozen=True)
class GenerationStats:
    backend: str
    prompt_tokens: int
    cached_prompt_tokens: int  # prompt prefix reused from the previous turn's cache
    generated_tokens: int
    ttft_s: float  # request start -> first token sampled
    prefill_tok_s: float  # prompt tokens actually evaluated / prefill time
    decode_tok_s: float  # tokens after the first / time after the first

    def summary(self) -> str:
        return (
            f"{self.backend}: prompt {self.prompt_tokens} tok "
            f"({self.cached_prompt_tokens} cached), prefill {self.prefill_tok_s:.1f} tok/s, "
            f"TTFT {self.ttft_s * 1000:.0f} ms, generated {self.generated_tokens} tok "
            f"at {self.decode_tok_s:.1f} tok/s"
        )


@dataclass(frozen=True)
class Finished:
    reason: FinishReason
    stats: GenerationStats


GenerationEvent = TextDelta | Finished
