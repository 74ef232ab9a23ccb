"""The request bodies the server takes, in OpenAI's field names, checked by pydantic.

A field OpenAI defines that we do not implement is refused by name (400), never ignored:
`extra="forbid"` for unknown names, and `refused()` for known ones set to what we do not
do. `top_k`, `min_p` and `repeat_penalty` are extras our sampler has, as llama-server and
vLLM accept them.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

MAX_CHOICES = 8  # `n`: answers to one request
MAX_STOPS = 16


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Body):
    include_usage: bool = False


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ImageUrl(_Body):
    url: str
    detail: Literal["auto", "low", "high"] | None = None


class ImagePart(_Body):
    type: Literal["image_url"]
    image_url: ImageUrl


ContentPart = Annotated[TextPart | ImagePart, Field(discriminator="type")]


class ChatMessage(_Body):
    # "developer" is what OpenAI's newer models call the system role.
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[ContentPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "".join(part.text for part in self.content if isinstance(part, TextPart))

    def images(self) -> list[str]:
        if not isinstance(self.content, list):
            return []
        return [part.image_url.url for part in self.content if isinstance(part, ImagePart)]


Stop = str | Annotated[list[str], Field(max_length=MAX_STOPS)] | None


class Sampling(_Body):
    """What chat and completion requests share: sampling, limits, choices, streaming."""

    model: str
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    seed: int | None = None
    stop: Stop = None
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    user: str | None = None  # an end-user id, for the caller's own records
    # Our sampler's extras.
    top_k: int | None = Field(None, ge=0)
    min_p: float | None = Field(None, ge=0, le=1)
    repeat_penalty: float | None = Field(None, gt=0)
    ignore_eos: bool = False  # generate max_tokens whatever the model says (benchmarks)

    def stops(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def token_limit(self) -> int | None:
        return self.max_tokens

    def logprob_count(self) -> int | None:
        """Alternatives to report with each token's log-probability (None: no logprobs)."""
        return None


class ChatCompletionRequest(Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)

    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def logprob_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def refused(self) -> tuple[str, str] | None:
        """(field, why) for a request we will not answer as asked."""
        if self.top_logprobs and not self.logprobs:  # as OpenAI, which refuses it alone too
            return "top_logprobs", "top_logprobs needs logprobs: true"
        return None


class CompletionRequest(Sampling):
    # A string, a list of strings, token ids, or a list of token-id lists (one answer each).
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=5)
    best_of: int | None = Field(None, ge=1)
    suffix: str | None = None

    def prompts(self) -> list[str | list[int]]:
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if prompt and all(isinstance(item, int) for item in prompt):
            return [list(prompt)]
        return list(prompt)

    def logprob_count(self) -> int | None:
        return self.logprobs

    def refused(self) -> tuple[str, str] | None:
        if self.best_of not in (None, self.n):
            return "best_of", "'best_of' is not supported by this server"
        if self.suffix:
            return "suffix", "'suffix' (insertion) is not supported by this server"
        return None
