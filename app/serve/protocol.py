"""The request bodies the server takes, in OpenAI's field names, checked by pydantic.

A field OpenAI defines that we do not implement is refused by name (400), never ignored:
`extra="forbid"` for unknown names, and `refused()` for known ones set to what we do not
do. `top_k`, `min_p` and `repeat_penalty` are extras our sampler has, as llama-server and
vLLM accept them.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from miniapp.engine.api import (
    KV_POLICIES,
    MAX_LORA_SCALE,
    ConstraintError,
    ConstraintKind,
    OutputConstraint,
)

MAX_CHOICES = 8  # `n`: answers to one request
MAX_STOPS = 16
MAX_ADAPTERS = 16  # `lora`: adapters one request runs with


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


class CalledFunction(_Body):
    name: str
    arguments: str  # JSON text


class ToolCallMessage(_Body):
    """A call an earlier assistant message made."""

    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(_Body):
    # "developer" is what OpenAI's newer models call the system role.
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallMessage] | None = None  # an assistant's calls
    tool_call_id: str | None = None  # a tool message: the call it answers

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "".join(part.text for part in self.content if isinstance(part, TextPart))

    def images(self) -> list[str]:
        if not isinstance(self.content, list):
            return []
        return [part.image_url.url for part in self.content if isinstance(part, ImagePart)]


Stop = str | Annotated[list[str], Field(max_length=MAX_STOPS)] | None


class JsonSchemaFormat(_Body):
    name: str = Field(max_length=64, pattern=r"^[a-zA-Z0-9_-]+$")
    description: str | None = None
    # "schema" would shadow pydantic's own attribute: the field is read under that alias.
    json_schema: dict | bool | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    def constraint(self) -> OutputConstraint | None:
        if self.type == "json_object":
            return OutputConstraint.json_object()
        if self.type == "json_schema":
            if self.json_schema is None:
                raise ValueError("json_schema is required when the type is json_schema")
            schema = self.json_schema.json_schema
            return OutputConstraint.json_schema(True if schema is None else schema)
        return None


class FunctionSpec(_Body):
    name: str = Field(max_length=64, pattern=r"^[a-zA-Z0-9_-]+$")
    description: str | None = None
    parameters: dict | None = None  # a JSON schema for the arguments object
    strict: bool | None = None

    def spec(self) -> dict:
        parameters = self.parameters or {"type": "object", "properties": {}}
        return {"name": self.name, "description": self.description or "", "parameters": parameters}


class Tool(_Body):
    type: Literal["function"]
    function: FunctionSpec


class ChosenFunction(_Body):
    name: str


class ToolChoiceFunction(_Body):
    type: Literal["function"]
    function: ChosenFunction


class LoraPick(_Body):
    """An adapter a request runs with (llama-server's `lora` field): its `id` (its index in
    /v1/models' adapters, as /lora-adapters numbers them) or its `name`, and a scale (unset:
    the one it was loaded with; 0: not applied)."""

    id: int | None = Field(None, ge=0)
    name: str | None = Field(None, min_length=1, max_length=128)
    scale: float | None = Field(None, ge=-MAX_LORA_SCALE, le=MAX_LORA_SCALE, allow_inf_nan=False)

    @model_validator(mode="after")
    def _id_or_name(self) -> LoraPick:
        if (self.id is None) == (self.name is None):
            raise ValueError("give the adapter's id or its name (one of them)")
        return self


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
    # vLLM's: among waiting requests the lowest goes first (a running one is not preempted).
    priority: int = Field(0, ge=-(2**31), le=2**31 - 1)
    # Ours (torch engine): which tokens this answer's cache keeps once full (--kv-policy;
    # unset: the server's).
    kv_policy: Literal[KV_POLICIES] | None = None
    response_format: ResponseFormat | None = None
    # Other servers' names for constraints: llama-server's GBNF `grammar`, vLLM's
    # `guided_regex` and `guided_choice`.
    grammar: str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    # llama-server's LoRA adapters for this request (see LoraPick); `model` may name one too.
    lora: list[LoraPick] | None = Field(None, max_length=MAX_ADAPTERS)

    def output_constraint(self) -> OutputConstraint | None:
        """What the answer must match (checked: ConstraintError if it does not compile)."""
        asked = {
            name: value
            for name, value in (
                ("response_format", self._format_constraint()),
                ("grammar", self.grammar and OutputConstraint(ConstraintKind.GBNF, self.grammar)),
                (
                    "guided_regex",
                    self.guided_regex and OutputConstraint("regex", self.guided_regex),
                ),
                (
                    "guided_choice",
                    self.guided_choice is not None and OutputConstraint.choices(self.guided_choice),
                ),
            )
            if value
        }
        if len(asked) > 1:
            raise ConstraintError(f"only one constraint at a time: {', '.join(asked)}")
        for constraint in asked.values():
            constraint.grammar()
            return constraint
        return None

    def constraint_field(self) -> str:
        """The request field a constraint came from, for errors."""
        for name in ("grammar", "guided_regex", "guided_choice"):
            if getattr(self, name) is not None:
                return name
        return "response_format"

    def _format_constraint(self) -> OutputConstraint | None:
        if self.response_format is None:
            return None
        try:
            return self.response_format.constraint()
        except ValueError as exc:
            raise ConstraintError(str(exc)) from None

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
    tools: list[Tool] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | ToolChoiceFunction | None = None
    parallel_tool_calls: bool | None = None

    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def logprob_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def refused(self) -> tuple[str, str] | None:
        """(field, why) for a request we will not answer as asked."""
        if self.top_logprobs and not self.logprobs:  # as OpenAI, which refuses it alone too
            return "top_logprobs", "top_logprobs needs logprobs: true"
        format_asked = self.response_format is not None and self.response_format.type != "text"
        constrained = format_asked or self.grammar or self.guided_regex or self.guided_choice
        tools_used = bool(self.tools) and self.tool_choice != "none"
        if constrained and tools_used:
            field = self.constraint_field()
            return field, f"{field} together with tools is not supported"
        if tools_used and self.logprobs:
            return "logprobs", "logprobs together with tools is not supported"
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


class LoadLoraRequest(_Body):
    """vLLM's `POST /v1/load_lora_adapter`; `scale` is ours (the default for requests that
    give none; 1 if unset)."""

    lora_name: str = Field(min_length=1, max_length=128)
    lora_path: str = Field(min_length=1)
    scale: float | None = Field(None, ge=-MAX_LORA_SCALE, le=MAX_LORA_SCALE, allow_inf_nan=False)
    load_inplace: bool = False  # vLLM's: replace a loaded adapter of that name (refused)


class UnloadLoraRequest(_Body):
    """vLLM's `POST /v1/unload_lora_adapter`."""

    lora_name: str = Field(min_length=1)
