"""Sampling settings, shared by both backends (no torch import: llama.cpp-only processes use it)."""

from __future__ import annotations

from dataclasses import dataclass, field

from .constraints import OutputConstraint


@dataclass(frozen=True)
class LoraChoice:
    """One LoRA adapter an answer runs with, by the name it was loaded under, at `scale`
    (None: the scale it was loaded with). y = W x + scale * alpha / rank * B (A x)."""

    name: str
    scale: float | None = None


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.8  # <= 0 means greedy
    top_k: int = 40  # <= 0 disables
    top_p: float = 0.95  # >= 1 disables
    min_p: float = 0.05  # <= 0 disables
    repeat_penalty: float = 1.0  # 1 disables
    # OpenAI's penalties, subtracted from a token's logit: presence once if the token is among
    # the last repeat_last_n, frequency once per time it is there (llama.cpp's rule). 0 disables.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repeat_last_n: int = 64
    seed: int | None = None
    # Report each sampled token's log-probability and this many most likely alternatives
    # (None: report nothing). From the model's own distribution (the raw logits'
    # log-softmax), whatever the sampling settings, as OpenAI's and vLLM's logprobs are.
    # Answers that report them are decoded without speculation.
    logprobs: int | None = None
    # What the answer must match (a JSON schema, a pattern...): tokens that would break it
    # are masked before sampling (constraints.py). None: free text.
    constraint: OutputConstraint | None = None
    # LoRA adapters the answer runs with, applied in this order (the torch engine's loaded
    # adapters, engine/lora). Empty: the base model alone.
    lora: tuple[LoraChoice, ...] = ()
    # Not sampling, but carried with it to the batching scheduler, which orders waiting
    # answers by them: the lowest `priority` first (vLLM's convention), then round-robin
    # across `client`s (a server's API keys), so one client's burst cannot starve the others.
    priority: int = 0
    client: str | None = None
    # Which tokens the answer's cache keeps once full (engine/kv/policies.py; None: the
    # runtime's --kv-policy). Answers with different policies still share batched steps.
    kv_policy: str | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0


@dataclass(frozen=True)
class TokenLogprob:
    """A sampled token's log-probability, and the most likely tokens at its position."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token, logprob), most likely first


GREEDY = SamplingParams(temperature=0.0)


@dataclass(frozen=True)
class GenerationRequest:
    """What one answer may be: its sampling, its length, its stop strings."""

    max_tokens: int = 512
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: tuple[str, ...] = ()
    ignore_end_of_turn: bool = False  # benchmarks generate a fixed number of tokens
