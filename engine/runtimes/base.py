"""The interface both runtimes (our torch engine, llama.cpp) implement."""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from ..errors import MiniappError
from ..lora.registry import LoraRegistry
from ..platform.compute_thread import ComputeThread
from ..platform.devices import DevicePlan
from ..tokens.events import GenerationStats, SpeculationStats
from ..tokens.sampling import SamplingParams
from ..tokens.stream import TokenStream
from ..tokens.tokenizer import Tokenizer
from .embedding import Pooling, model_pooling

DEFAULT_CTX = 4096
DEFAULT_SINKS = 4  # StreamingLLM's number of attention-sink tokens (the torch engine's cache)
DEFAULT_PARALLEL = 4  # answers a multi-user interface generates at once (LM Studio's default)
LOGIT_BLOCK = 256
# The sampling settings a remote server may be sent. Those other than OpenAI's own go only
# when set (strict servers refuse unknown fields): llama-server and `miniapp serve` read
# repeat_penalty, vLLM repetition_penalty.
EXTRA_SAMPLING = ("top_k", "min_p", "repeat_penalty")
SAMPLING_FIELDS = ("temperature", "top_p", "seed", *EXTRA_SAMPLING)


def default_threads() -> int:
    """One thread per CPU this process may run on: decode is memory-bound, so more won't help."""
    return max(1, len(os.sched_getaffinity(0)))


@dataclass(frozen=True)
class RuntimeInfo:
    """What a runtime is and where it runs, for interfaces to show."""

    backend: str
    model_path: Path
    device_plan: DevicePlan | None = None  # the torch engine's device, weights and reason
    spec: str = "off"  # speculative decoding mode
    sinks: int | None = None  # the torch engine's sliding window: sinks kept, recent tokens
    window: int | None = None
    kv_type: str | None = None  # how the KV cache stores keys and values (--kv-type)
    kv_bytes_per_token: int | None = None  # its bytes a token, every layer
    model_name: str | None = None  # a server's name for its model (--backend openai)
    endpoint: str | None = None  # that server's base URL
    weight_bytes_per_token: int | None = None  # the torch engine: weights a decode step reads
    adapters: tuple[str, ...] = ()  # LoRA adapters applied to every answer (llama.cpp's)
    kv_policy: str | None = None  # the torch engine: which tokens a full cache keeps

    @property
    def label(self) -> str:
        """The model as interfaces name it: the server's name, or the GGUF's file name."""
        return self.model_name or self.model_path.name

    @property
    def kv_summary(self) -> str | None:
        """'KV q8, 12.8 KiB/token', or None when the runtime does not say."""
        if self.kv_type is None:
            return None
        if self.kv_bytes_per_token is None:
            return f"KV {self.kv_type}"
        return f"KV {self.kv_type}, {self.kv_bytes_per_token / 1024:.1f} KiB/token"

    @property
    def placement(self) -> str:
        """'cpu (int4)', 'cuda:0 (bf16)', the server's address, or the backend."""
        plan = self.device_plan
        if plan is not None:
            return f"{plan.device} ({plan.weights})"
        return self.endpoint or self.backend


class Runtime(ABC):
    backend: str
    model_path: Path
    tokenizer: Tokenizer
    n_ctx: int
    chat_template: str | None  # the GGUF's own template source, if it has one
    slides_past_ctx: bool = False  # a sliding window: keeps generating past n_ctx, not stopping
    architecture: str  # general.architecture
    last_speculation: SpeculationStats | None = None  # of the latest lone generation
    # Generations it runs at once: above 1 (the torch engine's --parallel), generate_tokens
    # may be called from several threads, and their streams advance together.
    parallel: int = 1
    # Adapters loaded by name, for requests to pick (SamplingParams.lora) and to load and
    # unload while the model runs: the torch engine's. None: this runtime cannot (llama.cpp
    # applies the adapters it was opened with to every answer: RuntimeInfo.adapters).
    lora: LoraRegistry | None = None

    @abstractmethod
    def reusable_prefix(self, prompt: Sequence[int]) -> int:
        """How many leading prompt tokens are already in the cache from the previous call."""

    @abstractmethod
    def generate_tokens(self, prompt: Sequence[int], params: SamplingParams) -> TokenStream:
        """Evaluate `prompt` (reusing the cached prefix) and yield sampled tokens until closed.

        The consumer decides when to stop (end-of-turn, max tokens, Ctrl-C); the cache stays
        consistent whenever the stream is closed or interrupted.
        """

    def run_steps_on(self, compute: ComputeThread) -> None:  # noqa: B027 - optional hook
        """Run the engine's batched steps on `compute`'s serving thread (a runtime that
        serves one generation at a time runs it on its consumer's thread instead)."""

    @abstractmethod
    def reset(self) -> None:
        """Forget the cached context (the next prompt is evaluated from scratch)."""

    @abstractmethod
    def logit_blocks(
        self, tokens: Sequence[int], first: int = 0, block: int = LOGIT_BLOCK
    ) -> Iterator[tuple[int, np.ndarray]]:
        """Evaluate `tokens` from a fresh context (no reuse) and yield (start, logits) for
        rows first.. in blocks of `block` rows, fp32 [rows, vocab]. Blocks bound memory:
        a 2048-token context with a 262k vocabulary would be 2 GB of logits at once."""

    def stream_blocks(self, tokens: Sequence[int]) -> Iterator[tuple[int, np.ndarray]]:
        """Like `logit_blocks`, but through the sliding-window cache (fresh), as a stream."""
        raise MiniappError(f"the {self.backend} backend has no sliding-window cache; use torch")

    def logits(self, tokens: Sequence[int]) -> np.ndarray:
        """fp32 [len(tokens), vocab]: every row at once (small inputs only)."""
        return np.concatenate([rows for _, rows in self.logit_blocks(tokens)])

    def embed(self, prompts: Sequence[Sequence[int]], pooling: Pooling) -> np.ndarray:
        """Each prompt's final-normed hidden states, pooled and at unit length: fp32
        [len(prompts), dim] (engine/runtimes/embedding.py). A prompt's vector is the same
        whatever other prompts come with it."""
        raise MiniappError(f"the {self.backend} backend does not compute embeddings")

    def default_pooling(self) -> Pooling:
        """The pooling the model's file asks for, else mean pooling."""
        return model_pooling(self.model_path, self.architecture) or Pooling.MEAN

    def forget(self, start: int, end: int) -> bool:
        """Drop fed tokens start..end-1 from the context without evaluating anything again;
        False if this runtime cannot (the caller then lets prefix reuse re-evaluate)."""
        return False

    def info(self) -> RuntimeInfo:
        """What this runtime is (interfaces read it here, never from attributes)."""
        return RuntimeInfo(self.backend, self.model_path)

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release native resources early."""


class MessageRuntime(ABC):
    """A runtime that takes the conversation's messages rather than tokens: a server that
    holds the model, its template and its context (--backend openai)."""

    backend: str
    n_ctx: int | None  # the server's context for the model, where it says
    parallel: int  # answers that may stream at once
    slides_past_ctx: bool = False

    @property
    @abstractmethod
    def accepts_images(self) -> bool:
        """Whether pictures may go to the model as they are."""

    @abstractmethod
    def chat(
        self,
        messages: Sequence,
        request,
        should_stop: Callable[[], bool] = lambda: False,
    ) -> Iterator:
        """Stream the answer to `messages` (chat_template.Message) for `request`
        (generation.GenerationRequest) as generation events."""

    @abstractmethod
    def info(self) -> RuntimeInfo: ...

    def run_steps_on(self, compute: ComputeThread) -> None:  # noqa: B027 - nothing to run
        """Nothing runs here: the server computes every answer."""

    def reset(self) -> None:  # noqa: B027 - nothing to forget
        """The server keeps no conversation between requests."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release the connection pool."""


@dataclass(frozen=True)
class Prefill:
    """A prompt with pictures, evaluated ahead of generation (the loop then finds it all in
    the context)."""

    prompt: list[int]  # the context's ids after it (a picture's positions hold placeholders)
    text: str  # the rendered prompt, a media marker where each picture goes
    reused: int  # positions found already in the context, not evaluated again
    seconds: float

    def applied_to(self, stats: GenerationStats) -> GenerationStats:
        """The generation loop saw the whole prompt as cached; all but `reused` positions of
        it were evaluated (with the pictures) just before."""
        evaluated = stats.prompt_tokens - self.reused
        return replace(
            stats,
            cached_prompt_tokens=self.reused,
            ttft_s=self.seconds + stats.ttft_s,
            prefill_tok_s=evaluated / self.seconds if self.seconds > 0 else 0.0,
        )


class VisionRuntime(Runtime):
    """A runtime that also sees pictures: its prompt text holds `media_marker` where each
    picture goes, and `prefill` evaluates text and pictures before generation."""

    media_marker: str
    marker_stand_in: str  # what a marker in typed text becomes: it is not a picture
    last_prefill: Prefill | None = None

    def typed(self, text: str) -> str:
        """Typed text as it goes into the prompt: never mistaken for a picture's place."""
        return text.replace(self.media_marker, self.marker_stand_in)

    @abstractmethod
    def prefill(self, text: str, pictures: Sequence[bytes]) -> Prefill | None:
        """Bring the context up to this prompt (PNG `pictures` in marker order), evaluating
        only what it does not hold yet; None, with the context as it was, if it would not
        fit."""
