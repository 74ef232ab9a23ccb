"""Anthropic's Messages API: POST /v1/messages and POST /v1/messages/count_tokens, in
Anthropic's shapes, so that Claude Code and the official `anthropic` client work against
`miniapp serve`.

A request is translated into an OpenAI chat request and answered by the chat pipeline
(`AnswerService.start_chat`): the same prompt, sampling, tool calls and refusals as
/v1/chat/completions. Its events are presented as Anthropic's message, or streamed as its
server-sent events: message_start, content_block_start, ping, content_block_delta
(text_delta, or input_json_delta for a tool_use block), content_block_stop, message_delta,
message_stop. count_tokens counts the prompt that /v1/messages would build from the same
translation. Errors take Anthropic's shape (errors.shaped_response).

Supported: `model` (the served model, another installed model, loaded on demand, or a
loaded LoRA adapter's name; any other is a 404, so Claude Code needs `--model`),
`max_tokens` (required), `messages` (user and assistant turns; text, base64 `image`,
`tool_use` and `tool_result` blocks), `system`,
`stop_sequences`, `temperature`, `top_p`, `top_k`, `stream`, `tools` with `input_schema`,
`tool_choice` (auto, any, tool, none; `disable_parallel_tool_use`), and `output_config`'s
`format` (a JSON schema the answer must match).

Accepted and ignored, as they do not change the answer: `metadata`, `service_tier`,
`speed`, `inference_geo`, `betas`, `diagnostics`, `user_profile_id`, `workspace_id`,
`context_management` (the whole conversation is always used), `thinking` (the model
answers without a thinking block), `output_config.effort`, `cache_control` anywhere (the
engine reuses prompt prefixes on its own), a tool's `strict` and `eager_input_streaming`
(calls always match the schema and stream as written), a text block's `citations`, and
`thinking` blocks of earlier turns (Anthropic leaves them out of the prompt too). Usage
reports the whole prompt as `input_tokens` (the cache fields stay 0).

Refused with a 400 naming the field: image sources by `url` or `file` (the server runs
offline), images inside tool results, server tools (web search and the like), content
blocks of other types (documents, ...), a conversation ending with an assistant turn (a
prefill to continue), and any other field.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Annotated, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    model_validator,
)
from pydantic_core import PydanticCustomError

from miniapp.engine.api import Finished, FinishReason, TextDelta

from .answers import Answer, AnswerService, until_disconnected
from .errors import ApiError, anthropic_body, bad_request
from .protocol import MAX_STOPS, ChatCompletionRequest
from .service import Relay
from .tools import CallStream, ToolCall

log = logging.getLogger("miniapp.serve")

TOOL_NAME = r"^[a-zA-Z0-9_-]+$"  # Anthropic's rule for tool names, and OpenAI's
MAX_TOOLS = 128
IMAGE_TYPES = Literal["image/jpeg", "image/png", "image/gif", "image/webp"]


# ------------------------------------------------------------------ request bodies


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


def _blocks_of(*kinds: str):
    """A content field's check before its blocks are parsed: a string is one text block, and
    a block of a type not listed is refused by its type, rather than with pydantic's list
    of the tags it expected."""

    def check(value):
        if isinstance(value, str):
            return [{"type": "text", "text": value}]
        for block in value if isinstance(value, list) else ():
            kind = block.get("type") if isinstance(block, dict) else None
            if isinstance(kind, str) and kind not in kinds:
                raise PydanticCustomError(
                    "unsupported_block",
                    "content blocks of type '{kind}' are not supported here (only {kinds})",
                    {"kind": kind, "kinds": ", ".join(kinds)},
                )
        return value

    return BeforeValidator(check)


class TextBlock(_Body):
    type: Literal["text"]
    text: str
    cache_control: dict | None = None
    citations: list[dict] | None = None


class Base64Source(_Body):
    type: Literal["base64"]
    media_type: IMAGE_TYPES
    data: str


class UrlSource(_Body):
    type: Literal["url"]
    url: str


class FileSource(_Body):
    type: Literal["file"]
    file_id: str


class ImageBlock(_Body):
    type: Literal["image"]
    # url and file sources are parsed so that they are refused by name (see _image_part).
    source: Annotated[Base64Source | UrlSource | FileSource, Field(discriminator="type")]
    cache_control: dict | None = None


class ToolUseBlock(_Body):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict
    cache_control: dict | None = None


ResultBlocks = Annotated[
    list[Annotated[TextBlock | ImageBlock, Field(discriminator="type")]],
    _blocks_of("text", "image"),
]


class ToolResultBlock(_Body):
    type: Literal["tool_result"]
    tool_use_id: str
    content: ResultBlocks = []
    is_error: bool = False
    cache_control: dict | None = None


class ThinkingBlock(_Body):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(_Body):
    type: Literal["redacted_thinking"]
    data: str


ContentBlock = Annotated[
    TextBlock | ImageBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock,
    Field(discriminator="type"),
]
MessageBlocks = Annotated[
    list[ContentBlock],
    _blocks_of("text", "image", "tool_use", "tool_result", "thinking", "redacted_thinking"),
]
SystemBlocks = Annotated[list[TextBlock], _blocks_of("text")]


class InputMessage(_Body):
    role: Literal["user", "assistant"]
    content: MessageBlocks


class ToolDefinition(_Body):
    name: str = Field(min_length=1, max_length=64, pattern=TOOL_NAME)
    description: str | None = None
    input_schema: dict
    type: Literal["custom"] | None = None
    cache_control: dict | None = None
    strict: bool | None = None
    eager_input_streaming: bool | None = None

    @model_validator(mode="before")
    @classmethod
    def _no_server_tools(cls, data):
        kind = data.get("type") if isinstance(data, dict) else None
        if kind not in (None, "custom"):
            raise PydanticCustomError(
                "server_tool",
                "server tools ('{kind}') are not supported: this server runs offline and "
                "runs no tools itself; describe the tool with an input_schema instead",
                {"kind": kind},
            )
        return data


class ToolChoice(_Body):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None

    @model_validator(mode="after")
    def _name_with_tool(self) -> ToolChoice:
        if (self.type == "tool") != (self.name is not None):
            raise ValueError("a name is given with type 'tool', and only then")
        return self

    def as_openai(self) -> str | dict:
        if self.type == "tool":
            return {"type": "function", "function": {"name": self.name}}
        return {"auto": "auto", "any": "required", "none": "none"}[self.type]


class OutputFormat(_Body):
    type: Literal["json_schema"]
    schema_: dict = Field(alias="schema")  # "schema" would shadow pydantic's own attribute


class OutputConfig(_Body):
    format: OutputFormat | None = None
    effort: str | None = None  # how hard Claude thinks: ignored

    def response_format(self) -> dict | None:
        if self.format is None:
            return None
        spec = {"name": "output", "schema": self.format.schema_}
        return {"type": "json_schema", "json_schema": spec}


class ConversationRequest(_Body):
    """What count_tokens and messages share: the conversation and its tools."""

    model: str
    messages: list[InputMessage] = Field(min_length=1)
    system: SystemBlocks | None = None
    tools: list[ToolDefinition] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: ToolChoice | None = None
    output_config: OutputConfig | None = None
    # Accepted and ignored (see the module's docstring): real clients send them.
    metadata: dict | None = None
    service_tier: str | None = None
    speed: str | None = None
    inference_geo: str | None = None
    betas: list[str] | None = None
    context_management: dict | None = None
    thinking: dict | None = None
    cache_control: dict | None = None
    diagnostics: dict | None = None
    user_profile_id: str | None = None
    workspace_id: str | None = None

    def sampling(self) -> dict:
        """The OpenAI fields for how the answer is generated (none: only counted)."""
        return {}


class MessagesRequest(ConversationRequest):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = Field(None, max_length=MAX_STOPS)
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)
    stream: bool = False

    def sampling(self) -> dict:
        return {
            "max_tokens": self.max_tokens,
            "stop": self.stop_sequences,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
        }


class CountTokensRequest(ConversationRequest):
    pass


# ------------------------------------------------------------------ translation


def chat_request(body: ConversationRequest) -> ChatCompletionRequest:
    """The Anthropic request as the OpenAI chat request that answers it."""
    fields = {
        "model": body.model,
        "messages": _chat_messages(body),
        **_tool_fields(body),
        **_format_fields(body),
        **body.sampling(),
    }
    try:
        return ChatCompletionRequest.model_validate(fields)
    except ValidationError as exc:  # what our own checks let through: one line still
        error = exc.errors()[0]
        where = ".".join(str(part) for part in error.get("loc", ()))
        raise bad_request(f"the request does not translate ({where}): {error['msg']}") from None


def _refused(where: str, why: str) -> ApiError:
    """A 400 whose message says where (Anthropic's errors carry no separate field)."""
    return bad_request(f"{where}: {why}", where, code="unsupported_parameter")


def _chat_messages(body: ConversationRequest) -> list[dict]:
    if body.messages[-1].role == "assistant":
        raise _refused(
            f"messages.{len(body.messages) - 1}",
            "a conversation that ends with an assistant turn (a prefill for the answer to "
            "continue) is not supported: end with a user turn",
        )
    messages = _system_message(body.system)
    for number, message in enumerate(body.messages):
        turn = _user_turn if message.role == "user" else _assistant_turn
        messages.extend(turn(message, f"messages.{number}"))
    return messages


def _system_message(system: list[TextBlock] | None) -> list[dict]:
    text = "\n\n".join(block.text for block in system or ())
    return [{"role": "system", "content": text}] if text else []


def _user_turn(message: InputMessage, where: str) -> list[dict]:
    """A user turn: each tool_result becomes a tool message, in order; the text and images
    between them a user message."""
    turns: list[dict] = []
    parts: list[dict] = []
    for number, block in enumerate(message.content):
        at = f"{where}.content.{number}"
        if isinstance(block, ToolResultBlock):
            if parts:
                turns.append({"role": "user", "content": parts})
                parts = []
            turns.append(
                {
                    "role": "tool",
                    "tool_call_id": block.tool_use_id,
                    "content": _result_text(block, at),
                }
            )
        elif isinstance(block, TextBlock):
            parts.append({"type": "text", "text": block.text})
        elif isinstance(block, ImageBlock):
            parts.append({"type": "image_url", "image_url": {"url": _image_url(block, at)}})
        else:
            raise _refused(at, f"{block.type} blocks belong in assistant turns")
    if parts or not turns:
        turns.append({"role": "user", "content": parts})
    return turns


def _assistant_turn(message: InputMessage, where: str) -> list[dict]:
    texts: list[str] = []
    calls: list[dict] = []
    for number, block in enumerate(message.content):
        if isinstance(block, TextBlock):
            texts.append(block.text)
        elif isinstance(block, ToolUseBlock):
            arguments = json.dumps(block.input, ensure_ascii=False)
            calls.append(
                {
                    "id": block.id,
                    "type": "function",
                    "function": {"name": block.name, "arguments": arguments},
                }
            )
        elif isinstance(block, ThinkingBlock | RedactedThinkingBlock):
            continue  # earlier turns' thinking is not part of the prompt (as at Anthropic)
        else:
            raise _refused(f"{where}.content.{number}", f"{block.type} blocks belong in user turns")
    turn: dict = {"role": "assistant", "content": "".join(texts) or None}
    if calls:
        turn["tool_calls"] = calls
    return [turn]


def _result_text(block: ToolResultBlock, where: str) -> str:
    if any(isinstance(part, ImageBlock) for part in block.content):
        raise _refused(
            f"{where}.content",
            "images inside a tool_result are not supported: send them in a user turn's image block",
        )
    text = "".join(part.text for part in block.content)
    return f"(the tool failed) {text}" if block.is_error else text


def _image_url(block: ImageBlock, where: str) -> str:
    """The image as the data URI OpenAI's image_url carries."""
    source = block.source
    if isinstance(source, UrlSource):
        raise _refused(
            f"{where}.source",
            "image sources of type 'url' are not supported: this server runs offline and "
            "fetches nothing; send the image as a base64 source",
        )
    if isinstance(source, FileSource):
        raise _refused(
            f"{where}.source",
            "image sources of type 'file' are not supported (there is no Files API here); "
            "send the image as a base64 source",
        )
    return f"data:{source.media_type};base64,{source.data}"


def _format_fields(body: ConversationRequest) -> dict:
    config = body.output_config
    if config is None or config.format is None:
        return {}
    tools_used = bool(body.tools) and (body.tool_choice is None or body.tool_choice.type != "none")
    if tools_used:  # one constraint at a time: the calls' or the format's
        raise _refused("output_config.format", "not supported together with tools")
    return {"response_format": config.response_format()}


def _tool_fields(body: ConversationRequest) -> dict:
    fields: dict = {}
    if body.tools:
        fields["tools"] = [
            {
                "type": "function",
                "function": {
                    "name": tool.name,
                    "description": tool.description,
                    "parameters": tool.input_schema,
                },
            }
            for tool in body.tools
        ]
    choice = body.tool_choice
    if choice is not None:
        fields["tool_choice"] = choice.as_openai()
        if choice.disable_parallel_tool_use:
            fields["parallel_tool_calls"] = False
    return fields


# ------------------------------------------------------------------ responses


def _message_id() -> str:
    return f"msg_{uuid.uuid4().hex[:24]}"


def _tool_use_id(call_id: str) -> str:
    """Anthropic's kind of id for one of our calls ("call_..." as OpenAI's are)."""
    return "toolu_" + call_id.removeprefix("call_")


def _tool_use(call: ToolCall) -> dict:
    return {
        "type": "tool_use",
        "id": _tool_use_id(call.id),
        "name": call.name,
        "input": json.loads(call.arguments),
    }


def _stop_reason(finished: Finished, called: bool) -> str:
    if called:
        return "tool_use"
    return {
        FinishReason.STOP_STRING: "stop_sequence",
        FinishReason.MAX_TOKENS: "max_tokens",
        FinishReason.CONTEXT_FULL: "model_context_window_exceeded",
    }.get(finished.reason, "end_turn")


def _stop_sequence(finished: Finished, answer: Answer) -> str | None:
    if finished.reason is not FinishReason.STOP_STRING:
        return None
    if finished.stop is not None:
        return finished.stop
    # An answer that did not say which (the vision model's path): only one could have.
    given = answer.body.stops()
    return given[0] if len(given) == 1 else None


def _usage(answer: Answer, finished: Finished) -> dict:
    # The whole prompt is input_tokens, as count_tokens counts it. Anthropic counts cached
    # prompt tokens apart (cache_read_input_tokens) and clients add the three up, so the
    # cache fields stay 0 rather than counting reused prefixes twice.
    return {
        "input_tokens": answer.usage({0: finished})["prompt_tokens"],
        "output_tokens": finished.stats.generated_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 0,
    }


def _message(message_id: str, answer: Answer, content: list[dict]) -> dict:
    return {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": answer.model,
        "content": content,
        "stop_reason": None,
        "stop_sequence": None,
        "usage": {"input_tokens": answer.prompt_tokens or 0, "output_tokens": 0},
    }


async def _whole_message(relay: Relay, answer: Answer, request: Request) -> Response:
    pieces: list[str] = []
    finished: Finished | None = None
    async for _, event in until_disconnected(relay, request):
        if isinstance(event, TextDelta):
            pieces.append(event.text)
        elif isinstance(event, Finished):
            finished = event
    if finished is None:  # the client left: nobody reads this
        return Response(status_code=499)
    text = "".join(pieces)
    calls = answer.tools.calls_in(text) if answer.tools else None
    if calls:
        content = [_tool_use(call) for call in calls]
    else:
        content = [{"type": "text", "text": text}] if text else []
    message = _message(_message_id(), answer, content) | {
        "stop_reason": _stop_reason(finished, bool(calls)),
        "stop_sequence": _stop_sequence(finished, answer),
        "usage": _usage(answer, finished),
    }
    return JSONResponse(message)


def _sse(name: str, payload: dict) -> str:
    data = json.dumps({"type": name, **payload}, ensure_ascii=False, separators=(",", ":"))
    return f"event: {name}\ndata: {data}\n\n"


class MessageStream:
    """One answer's events as Anthropic's stream: blocks open, take deltas and close in turn.
    With tools, text is held while it may still become a call (as answers._stream does);
    a call streams as a tool_use block whose input arrives as the model writes it."""

    def __init__(self, answer: Answer):
        self.answer, self.id = answer, _message_id()
        self.index = -1  # of the last block opened
        self.open_kind: str | None = None  # "text" or "tool_use" while a block is open
        self.held: str | None = "" if answer.tools else None
        self.calls: CallStream | None = None
        self.pinged = False

    def started(self) -> str:
        return _sse("message_start", {"message": _message(self.id, self.answer, [])})

    def text(self, piece: str) -> Iterator[str]:
        if self.held is not None:
            self.held += piece
            start, opener = self.held.lstrip(), self.answer.tools.opener
            if len(start) < len(opener) and opener.startswith(start):
                return  # blank, or may still become a call
            piece, self.held = self.held, None
            if start.startswith(opener):
                self.calls = self.answer.tools.call_stream()
        if self.calls is not None:
            yield from self._call_parts(self.calls.feed(piece))
        else:
            yield from self._text_delta(piece)

    def finished(self, finished: Finished) -> Iterator[str]:
        leftover, self.held = self.held or "", None  # blank, or an unfinished call's start
        called = False
        if self.calls is not None:
            called = bool(self.answer.tools.calls_in(self.calls.text))
            if not self.calls.opened:  # cut off before a call opened: it is text
                leftover = self.calls.text
        yield from self._text_delta(leftover)
        yield from self._close()
        usage = _usage(self.answer, finished)
        delta = {
            "stop_reason": _stop_reason(finished, called),
            "stop_sequence": _stop_sequence(finished, self.answer),
        }
        yield _sse("message_delta", {"delta": delta, "usage": usage})
        yield _sse("message_stop", {})

    def _text_delta(self, piece: str) -> Iterator[str]:
        if not piece:
            return
        if self.open_kind != "text":
            yield from self._open({"type": "text", "text": ""})
        yield self._delta({"type": "text_delta", "text": piece})

    def _call_parts(self, parts: list[dict]) -> Iterator[str]:
        """CallStream's parts (OpenAI's tool_calls deltas): a part with an id opens a call,
        and calls end in order, so each call's arguments go to the block open last."""
        for part in parts:
            function = part["function"]
            if "id" in part:
                block = {
                    "type": "tool_use",
                    "id": _tool_use_id(part["id"]),
                    "name": function["name"],
                    "input": {},
                }
                yield from self._open(block)
            if function.get("arguments"):
                yield self._delta(
                    {"type": "input_json_delta", "partial_json": function["arguments"]}
                )

    def _open(self, block: dict) -> Iterator[str]:
        yield from self._close()
        self.index += 1
        self.open_kind = block["type"]
        yield _sse("content_block_start", {"index": self.index, "content_block": block})
        if not self.pinged:  # where Anthropic's own streams send theirs
            self.pinged = True
            yield _sse("ping", {})

    def _close(self) -> Iterator[str]:
        if self.open_kind is not None:
            self.open_kind = None
            yield _sse("content_block_stop", {"index": self.index})

    def _delta(self, delta: dict) -> str:
        return _sse("content_block_delta", {"index": self.index, "delta": delta})


async def _streamed_message(relay: Relay, answer: Answer) -> AsyncIterator[str]:
    """Server-sent events. A client that goes away cancels the generator, and with it the
    answer (the `finally`, which also covers leaving before the first event)."""
    stream = MessageStream(answer)
    try:
        yield stream.started()
        async for _, event in relay.events():
            if isinstance(event, TextDelta):
                for text in stream.text(event.text):
                    yield text
            elif isinstance(event, Finished):
                for text in stream.finished(event):
                    yield text
    except ApiError as exc:  # once the stream has begun, an error is one of its events
        yield _sse("error", {"error": anthropic_body(exc.status, exc.message)["error"]})
    except Exception as exc:  # noqa: BLE001 - the client hears of it; the log has the trace
        log.exception("streamed message failed")
        message = f"internal error: {type(exc).__name__}: {exc}"
        yield _sse("error", {"error": anthropic_body(500, message)["error"]})
    finally:
        relay.close()


# ------------------------------------------------------------------ routes


def anthropic_router(answers: AnswerService) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/messages")
    async def messages(body: MessagesRequest, request: Request) -> Response:
        relay, answer = await answers.start_chat(chat_request(body))
        if body.stream:
            return StreamingResponse(
                _streamed_message(relay, answer),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache"},
            )
        return await _whole_message(relay, answer, request)

    @router.post("/v1/messages/count_tokens")
    async def count_tokens(body: CountTokensRequest) -> JSONResponse:
        tokens = await answers.count_chat_tokens(chat_request(body))
        return JSONResponse({"input_tokens": tokens})

    return router
