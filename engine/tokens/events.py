"""Typed events that generation yields; every interface (terminal, GUI, bench) consumes these."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from .sampling import TokenLogprob


class FinishReason(StrEnum):
    END_OF_TURN = "end_of_turn"  # the model emitted an end-of-generation token
    STOP_STRING = "stop_string"
    MAX_TOKENS = "max_tokens"
    CONTEXT_FULL = "context_full"
    CANCELLED = "cancelled"


@dataclass(frozen=True)
class TextDelta:
    """A piece of answer text, ready to print, and, when asked for (SamplingParams.logprobs),
    the log-probabilities of the tokens that made it."""

    text: str
    logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True)
class ReasoningDelta:
    """A piece of a reasoning model's thinking before its answer (a server's
    `reasoning_content`): shown apart from the answer, and not kept in the conversation."""

    text: str


@dataclass
class SpeculationStats:
    """Speculative decoding's counts for one answer (torch engine, --spec other than off)."""

    mode: str
    steps: int = 0  # full-model passes: plain steps plus verifications
    verifications: int = 0
    drafted: int = 0
    accepted: int = 0
    emitted: int = 0
    # Per drafter ("lookup", "head", "early-exit", "grammar"): [verifications, drafted,
    # accepted].
    by_drafter: dict[str, list[int]] = field(default_factory=dict)

    def count(self, drafter: str, drafted: int, accepted: int) -> None:
        self.steps += 1
        self.verifications += 1
        self.drafted += drafted
        self.accepted += accepted
        counts = self.by_drafter.setdefault(drafter.split(":", 1)[0], [0, 0, 0])
        counts[0] += 1
        counts[1] += drafted
        counts[2] += accepted

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_step(self) -> float:
        return self.emitted / self.steps if self.steps else 0.0

    def summary(self) -> str:
        drafters = ", ".join(f"{name} {n[2]}/{n[1]}" for name, n in self.by_drafter.items())
        return (
            f"speculative ({self.mode}): {self.accepted}/{self.drafted} drafts accepted "
            f"({self.acceptance_rate:.0%}{'; ' + drafters if drafters else ''}), "
            f"{self.tokens_per_step:.2f} tok per step"
        )


@dataclass(frozen=True)
class GenerationStats:
    backend: str
    prompt_tokens: int
    cached_prompt_tokens: int  # prompt prefix reused from the previous turn's cache
    generated_tokens: int
    ttft_s: float  # request start -> first token sampled (time in the queue included)
    prefill_tok_s: float  # prompt tokens actually evaluated / prefill time
    decode_tok_s: float  # tokens after the first / time after the first
    speculation: SpeculationStats | None = None
    queued_s: float = 0.0  # waiting for a free slot of the batching engine

    def summary(self) -> str:
        text = (
            f"{self.backend}: prompt {self.prompt_tokens} tok "
            f"({self.cached_prompt_tokens} cached), prefill {self.prefill_tok_s:.1f} tok/s, "
            f"TTFT {self.ttft_s * 1000:.0f} ms, generated {self.generated_tokens} tok "
            f"at {self.decode_tok_s:.1f} tok/s"
        )
        if self.queued_s > 0.05:
            text += f", {self.queued_s:.1f} s queued"
        if self.speculation is not None:
            text += "; " + self.speculation.summary()
        return text


@dataclass(frozen=True)
class Finished:
    reason: FinishReason
    stats: GenerationStats
    stop: str | None = None  # the stop string that ended the answer (reason STOP_STRING)


GenerationEvent = TextDelta | ReasoningDelta | Finished
