"""OpenAI's Responses API: `POST /v1/responses`, `GET /v1/responses/{id}` and
`DELETE /v1/responses/{id}`, as a translation of the chat endpoint (answers.py).

A request's conversation (its `instructions` as a system message, the stored conversation
of `previous_response_id`, then its `input` items) becomes an OpenAI chat request, run by
`AnswerService.start_chat`; the relay's events come back as Responses output items: a
`message` with one `output_text` part, or `function_call` items. Streamed (`stream: true`),
they are server-sent events (`event:` and `data:` lines, each with its `sequence_number`):
response.created, response.in_progress, then per item response.output_item.added, for a
message response.content_part.added, response.output_text.delta..., response.output_text.done
and response.content_part.done, for a call response.function_call_arguments.delta... and
.done, then response.output_item.done; last response.completed (or response.incomplete when
`max_output_tokens` cut the answer, or response.failed). A client that disconnects cancels
the answer.

Supported: `model`, `input` (a string, or message items with input_text, input_image (a data
URI) and output_text parts, function_call and function_call_output items), `instructions`,
`max_output_tokens`, `temperature`, `top_p`, `stream`, function `tools` with `tool_choice`
and `parallel_tool_calls` (calls work as on the chat endpoint, see tools.py), `text.format`
(text, json_object, json_schema), `previous_response_id`, `store`, `metadata`, `user`,
`safety_identifier`, `prompt_cache_key`, and `max_tool_calls` (it limits built-in tools,
which this server has none of).

Stored responses (`store`, true unless asked otherwise) are kept in memory with their
conversation, the least recently used going first past MAX_STORED_RESPONSES; a server
restart forgets them. As on OpenAI, `instructions` and `tools` are not carried over by
`previous_response_id`.

Refused by name (400), never ignored: built-in tools (web_search, file_search, ...) and
tool_choice naming them, `reasoning` effort or summaries (the models answer directly),
`background`, `include`, `truncation: "auto"`, `conversation`, `prompt` templates,
`top_logprobs`, service tiers other than auto/default, `text.verbosity` other than medium,
`prompt_cache_retention: "24h"`, `stream_options.include_obfuscation: true`, input items
other than messages and function calls (reasoning, item_reference, ...), images by file_id
or outside user messages. Unknown fields are a 400 too. Not served: resuming a stream
(GET with stream=true), input_items listing, cancelling (there are no background responses).
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    StringConstraints,
    Tag,
    TypeAdapter,
    ValidationError,
    model_validator,
)
from pydantic_core import PydanticCustomError

from miniapp.engine.api import Finished, TextDelta

from .answers import Answer, AnswerService, until_disconnected
from .errors import ApiError, bad_request
from .protocol import ChatCompletionRequest
from .service import Relay, finish_reason
from .tools import CallStream, ToolPlan

MAX_STORED_RESPONSES = 256  # responses kept for GET and previous_response_id
MAX_METADATA_PAIRS = 16  # OpenAI's limits on `metadata`
MAX_METADATA_KEY, MAX_METADATA_VALUE = 64, 512
FUNCTION_NAME = r"^[a-zA-Z0-9_-]+$"
LAST_EVENTS = {"completed": "response.completed", "incomplete": "response.incomplete"}

# ------------------------------------------------------------------ request


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _Unsupported(BaseModel):
    """Anything of a `type` we do not serve, kept so that it is refused by its name."""

    model_config = ConfigDict(extra="allow")
    type: str


def _kind(default: str | None, served: tuple[str, ...]):
    """A discriminator: an object's `type` (default if it has none), "unsupported" if we do
    not serve that type; None for what is no object at all (a number, a string), which
    pydantic then refuses as a 400 naming the item."""

    def kind(value: Any) -> str | None:
        if isinstance(value, dict):
            given = value.get("type", default)
        elif isinstance(value, BaseModel):  # an item already parsed (a stored output)
            given = getattr(value, "type", default)
        else:
            return None
        return given if given in served else "unsupported"

    return kind


class InputText(_Body):
    type: Literal["input_text"]
    text: str


class OutputText(_Body):
    """An earlier answer's text (as our own output items carry it)."""

    type: Literal["output_text"]
    text: str
    annotations: list[dict] = []
    logprobs: list[dict] | None = None


class InputImage(_Body):
    type: Literal["input_image"]
    image_url: str | None = None  # a data URI
    file_id: str | None = None
    detail: Literal["auto", "low", "high"] | None = None


ContentPart = Annotated[InputText | OutputText | InputImage, Field(discriminator="type")]


def _text_as_parts(content: Any) -> Any:
    """A message's content given as a string, as the one text part it is."""
    if isinstance(content, str):
        return [{"type": "input_text", "text": content}]
    return content


class MessageItem(_Body):
    """A message, with `type: "message"` or without (OpenAI's "easy" input message)."""

    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: Annotated[list[ContentPart], BeforeValidator(_text_as_parts)]
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None
    phase: Literal["commentary", "final_answer"] | None = None

    def text(self) -> str:
        return "".join(part.text for part in self.content if not isinstance(part, InputImage))

    def images(self) -> list[InputImage]:
        return [part for part in self.content if isinstance(part, InputImage)]


class FunctionCallItem(_Body):
    """A call an earlier answer made."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str  # JSON text
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class FunctionCallOutputItem(_Body):
    """What the caller's function returned for a call."""

    type: Literal["function_call_output"]
    call_id: str
    output: Annotated[list[InputText], BeforeValidator(_text_as_parts)]
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None

    def text(self) -> str:
        return "".join(part.text for part in self.output)


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[_Unsupported, Tag("unsupported")],
    Discriminator(
        _kind("message", ("message", "function_call", "function_call_output")),
        custom_error_type="item_type",
        custom_error_message="an input item must be an object: a message, a function call "
        "or a function call's output",
    ),
]
_ITEMS = TypeAdapter(list[InputItem])


def _string_as_user_message(value: Any) -> Any:
    if isinstance(value, str):
        return [{"type": "message", "role": "user", "content": value}]
    if not isinstance(value, list):
        raise PydanticCustomError("input_type", "input must be a string or a list of items")
    return value


class FunctionTool(_Body):
    type: Literal["function"]
    name: str = Field(max_length=64, pattern=FUNCTION_NAME)
    description: str | None = None
    parameters: dict | None = None  # a JSON schema for the arguments object
    strict: bool | None = None

    def as_chat(self) -> dict:
        function = {"name": self.name, "description": self.description}
        function |= {"parameters": self.parameters, "strict": self.strict}
        return {"type": "function", "function": function}

    def echoed(self) -> dict:
        # Calls are always constrained to the parameters' schema: strict, whatever was asked.
        return self.model_dump() | {"strict": True}


ToolSpec = Annotated[
    Annotated[FunctionTool, Tag("function")] | Annotated[_Unsupported, Tag("unsupported")],
    Discriminator(
        _kind(None, ("function",)),
        custom_error_type="tool_type",
        custom_error_message="a tool must be an object with its type",
    ),
]


def _checked_tool_choice(value: Any) -> Any:
    """tool_choice as a string or a function named; other kinds are refused by `refused`."""
    if value in ("auto", "none", "required") or value is None:
        return value
    if isinstance(value, dict) and isinstance(value.get("type"), str):
        if value["type"] != "function":
            return value
        if set(value) == {"type", "name"} and isinstance(value["name"], str):
            return value
    raise PydanticCustomError(
        "tool_choice", 'tool_choice must be "auto", "none", "required" or a function named'
    )


class TextFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(None, max_length=64, pattern=FUNCTION_NAME)
    # "schema" would shadow pydantic's own attribute: the field is read under that alias.
    json_schema: dict | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None

    @model_validator(mode="after")
    def _schema_named(self) -> TextFormat:
        if self.type == "json_schema" and (self.name is None or self.json_schema is None):
            raise ValueError("a json_schema format needs its name and schema")
        return self

    def as_response_format(self) -> dict:
        if self.type != "json_schema":
            return {"type": self.type}
        schema = {"name": self.name, "schema": self.json_schema, "description": self.description}
        return {"type": "json_schema", "json_schema": schema | {"strict": self.strict}}


class TextConfig(_Body):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ReasoningConfig(_Body):
    effort: str | None = None
    summary: str | None = None
    generate_summary: str | None = None


class StreamOptions(_Body):
    include_obfuscation: bool | None = None


Metadata = Annotated[
    dict[
        Annotated[str, StringConstraints(max_length=MAX_METADATA_KEY)],
        Annotated[str, StringConstraints(max_length=MAX_METADATA_VALUE)],
    ],
    Field(max_length=MAX_METADATA_PAIRS),
]


class ResponsesRequest(_Body):
    model: str
    input: Annotated[list[InputItem], BeforeValidator(_string_as_user_message)] | None = None
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    max_tool_calls: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    tools: list[ToolSpec] | None = Field(None, max_length=128)
    tool_choice: Annotated[Any, BeforeValidator(_checked_tool_choice)] = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    previous_response_id: str | None = None
    store: bool | None = True
    metadata: Metadata | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    # Refused unless asked for what we do anyway (see `refused`).
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    reasoning: ReasoningConfig | None = None
    background: bool | None = None
    include: list[str] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    service_tier: str | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    conversation: str | dict | None = None
    prompt: dict | None = None

    def refused(self) -> tuple[str, str] | None:
        """(field, why) for a request we will not answer as asked."""
        return _refused_option(self) or _refused_tool(self) or _refused_item(self.input or [])

    def format(self) -> TextFormat | None:
        return self.text.format if self.text else None


def _refused_option(body: ResponsesRequest) -> tuple[str, str] | None:
    reasoning = body.reasoning or ReasoningConfig()
    reasons = {
        "background": body.background and "background responses are not supported",
        "conversation": body.conversation is not None
        and "conversations are not supported: continue with previous_response_id",
        "prompt": body.prompt is not None and "prompt templates are not supported",
        "include": body.include and f"include is not supported: {', '.join(body.include)}",
        "reasoning": (
            reasoning.effort not in (None, "none")
            or reasoning.summary
            or reasoning.generate_summary
        )
        and "reasoning is not supported: the models served answer directly",
        "truncation": body.truncation == "auto"
        and 'truncation "auto" is not supported: a conversation must fit the context',
        "service_tier": body.service_tier not in (None, "auto", "default")
        and f'service_tier "{body.service_tier}" is not supported (only auto and default)',
        "top_logprobs": body.top_logprobs and "top_logprobs is not supported",
        "text.verbosity": body.text is not None
        and body.text.verbosity not in (None, "medium")
        and "text.verbosity is not supported (the models are not steered by it)",
        "prompt_cache_retention": body.prompt_cache_retention == "24h"
        and 'prompt_cache_retention "24h" is not supported (cached prompts stay in memory)',
        "stream_options.include_obfuscation": body.stream_options is not None
        and body.stream_options.include_obfuscation
        and "stream obfuscation is not supported",
    }
    for field, why in reasons.items():
        if why:
            return field, why
    return None


def _refused_tool(body: ResponsesRequest) -> tuple[str, str] | None:
    for i, tool in enumerate(body.tools or []):
        if isinstance(tool, _Unsupported):
            why = f'the tool type "{tool.type}" is not supported: only function tools'
            return f"tools.{i}.type", why
    choice = body.tool_choice
    if isinstance(choice, dict) and choice["type"] != "function":
        return "tool_choice", f'tool_choice of type "{choice["type"]}" is not supported'
    return None


def _refused_item(items: list) -> tuple[str, str] | None:
    for i, item in enumerate(items):
        if isinstance(item, _Unsupported):
            why = f'input items of type "{item.type}" are not supported'
            return f"input.{i}.type", why + " (only messages, function calls and their outputs)"
        if not isinstance(item, MessageItem):
            continue
        for image in item.images():
            if item.role != "user":
                return f"input.{i}.content", "images are only supported in user messages"
            if image.image_url is None:
                why = "images by file_id are not supported: send image_url as a data URI"
                return f"input.{i}.content", why
    return None


# ------------------------------------------------------------------ translation


def chat_request(body: ResponsesRequest, earlier: tuple) -> ChatCompletionRequest:
    """The chat request that answers this Responses request after `earlier` items."""
    messages = [{"role": "system", "content": body.instructions}] if body.instructions else []
    messages += chat_messages([*earlier, *(body.input or [])])
    if not any(m["role"] != "system" for m in messages):
        raise bad_request(
            "Missing required parameter: 'input'.", "input", "missing_required_parameter"
        )
    text_format = body.format()
    fields = {
        "model": body.model,
        "messages": messages,
        "max_completion_tokens": body.max_output_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "user": body.user,
        "tools": [tool.as_chat() for tool in body.tools] if body.tools else None,
        "tool_choice": _chat_tool_choice(body.tool_choice),
        "parallel_tool_calls": body.parallel_tool_calls,
        "response_format": text_format.as_response_format() if text_format else None,
    }
    try:
        return ChatCompletionRequest.model_validate(
            {name: value for name, value in fields.items() if value is not None}
        )
    except ValidationError as exc:  # what our own models should have caught: still a 400
        raise bad_request(f"the request cannot be answered: {exc.errors()[0]['msg']}") from None


def _chat_tool_choice(choice: Any) -> Any:
    if isinstance(choice, dict):
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice


def chat_messages(items: list) -> list[dict]:
    """Input items as chat messages; a run of calls becomes one assistant message."""
    messages: list[dict] = []
    for item in items:
        if isinstance(item, MessageItem):
            messages.append({"role": item.role, "content": _chat_content(item)})
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function"}
            call["function"] = {"name": item.name, "arguments": item.arguments}
            if messages and messages[-1].get("tool_calls"):
                messages[-1]["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutputItem):
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text()})
    return messages


def _chat_content(item: MessageItem) -> str | list[dict]:
    if not item.images():
        return item.text()
    parts = []
    for part in item.content:
        if isinstance(part, InputImage):
            image = {"url": part.image_url, "detail": part.detail}
            parts.append({"type": "image_url", "image_url": image})
        else:
            parts.append({"type": "text", "text": part.text})
    return parts


# The chat request's field names, as this API calls them, for the errors start_chat raises.
RESPONSES_PARAMS = {
    "messages": "input",
    "response_format": "text.format",
    "max_completion_tokens": "max_output_tokens",
    "max_tokens": "max_output_tokens",
}


async def _started(answers: AnswerService, chat: ChatCompletionRequest) -> tuple[Relay, Answer]:
    try:
        return await answers.start_chat(chat)
    except ApiError as exc:
        if exc.param is not None:
            exc.param = RESPONSES_PARAMS.get(exc.param.split(".")[0], exc.param)
        raise


# ------------------------------------------------------------------ the store


@dataclass(frozen=True)
class StoredResponse:
    response: dict  # the response object, as created
    conversation: tuple  # its input items after the earlier ones, then its output items


class ResponseStore:
    """Stored responses by id, the least recently used (created, read or continued) going
    first past `bound`. Handlers on worker threads and in the event loop share it."""

    def __init__(self, bound: int = MAX_STORED_RESPONSES):
        self.bound = bound
        self._kept: OrderedDict[str, StoredResponse] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, stored: StoredResponse) -> None:
        with self._lock:
            self._kept[stored.response["id"]] = stored
            self._kept.move_to_end(stored.response["id"])
            while len(self._kept) > self.bound:
                self._kept.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        with self._lock:
            stored = self._kept.get(response_id)
            if stored is not None:
                self._kept.move_to_end(response_id)
            return stored

    def delete(self, response_id: str) -> bool:
        with self._lock:
            return self._kept.pop(response_id, None) is not None

    def __len__(self) -> int:
        with self._lock:
            return len(self._kept)

    def found(self, response_id: str, param: str | None = None) -> StoredResponse:
        """The stored response; 404 in OpenAI's shape if it is not (or no longer) kept."""
        stored = self.get(response_id)
        if stored is None:
            raise ApiError(
                404,
                f"Response with id '{response_id}' not found.",
                param=param,
                code="previous_response_not_found" if param else "not_found",
            )
        return stored


# ------------------------------------------------------------------ output


class _Events:
    """Server-sent events in the Responses shape, numbered in the order they are sent."""

    def __init__(self):
        self.sequence = 0

    def __call__(self, kind: str, **fields) -> str:
        payload = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        data = json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
        return f"event: {kind}\ndata: {data}\n\n"


def _output_text(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


class OutputBuilder:
    """One answer's output items, built from its text as it arrives, with the events that
    stream them (a plain response drops the events: both get the same items).

    With tools, text is held while it may still become a call; once it begins as calls do,
    each call is a function_call item whose arguments arrive as the model writes them."""

    def __init__(self, tools: ToolPlan | None, events: _Events):
        self.tools, self.event = tools, events
        self.items: list[dict] = []
        self.status = "completed"
        self._held: str | None = "" if tools else None
        self._calls: CallStream | None = None
        self._message: dict | None = None  # the message item being written
        self._call: dict | None = None  # the function_call item being written

    def text(self, piece: str) -> Iterator[str]:
        if self._held is not None:
            self._held += piece
            start, opener = self._held.lstrip(), self.tools.opener
            if len(start) < len(opener) and opener.startswith(start):
                return  # blank, or may still become a call
            piece, self._held = self._held, None
            if start.startswith(opener):
                self._calls = self.tools.call_stream()
        if self._calls is None:
            yield from self._message_text(piece)
            return
        for part in self._calls.feed(piece):
            yield from self._call_part(part)

    def finish(self, finished: Finished) -> Iterator[str]:
        """The last events: what was held, then every open item done."""
        cut_off = finish_reason(finished) == "length"
        leftover = self._held or ""  # blank, or the start of an unfinished call
        if self._calls is not None and not self._calls.opened:
            leftover = self._calls.text  # cut off before a call opened: its text
        elif self._calls is not None:
            cut_off = self.tools.calls_in(self._calls.text) is None
        if leftover or not self.items:
            yield from self._message_text(leftover)
        self.status = "incomplete" if cut_off else "completed"
        yield from self._close_call(self.status)
        yield from self._close_message()

    def _message_text(self, piece: str) -> Iterator[str]:
        if self._message is None:
            self._message = {
                "type": "message",
                "id": f"msg_{uuid.uuid4().hex}",
                "status": "in_progress",
                "role": "assistant",
                "content": [],
            }
            yield from self._added(self._message)
            yield self.event("response.content_part.added", **self._at(), part=_output_text(""))
            self._message["content"].append(_output_text(""))
        if piece:
            self._message["content"][0]["text"] += piece
            yield self.event("response.output_text.delta", **self._at(), delta=piece, logprobs=[])

    def _close_message(self) -> Iterator[str]:
        message, self._message = self._message, None
        if message is None:
            return
        where = self._at(message)
        part = message["content"][0]
        yield self.event("response.output_text.done", **where, text=part["text"], logprobs=[])
        yield self.event("response.content_part.done", **where, part=part)
        message["status"] = self.status
        yield self._done(message)

    def _call_part(self, part: dict) -> Iterator[str]:
        if "id" in part:  # a call opens: the one before it is complete
            yield from self._close_call("completed")
            self._call = {
                "type": "function_call",
                "id": f"fc_{uuid.uuid4().hex}",
                "call_id": part["id"],
                "name": part["function"]["name"],
                "arguments": "",
                "status": "in_progress",
            }
            yield from self._added(self._call)
        piece = part["function"].get("arguments")
        if piece:
            self._call["arguments"] += piece
            where = self._where(self._call)
            yield self.event("response.function_call_arguments.delta", **where, delta=piece)

    def _close_call(self, status: str) -> Iterator[str]:
        call, self._call = self._call, None
        if call is None:
            return
        where = self._where(call)
        arguments = call["arguments"]
        yield self.event("response.function_call_arguments.done", **where, arguments=arguments)
        call["status"] = status
        yield self._done(call)

    def _added(self, item: dict) -> Iterator[str]:
        self.items.append(item)
        yield self.event("response.output_item.added", output_index=len(self.items) - 1, item=item)

    def _done(self, item: dict) -> str:
        index = self.items.index(item)
        return self.event("response.output_item.done", output_index=index, item=item)

    def _where(self, item: dict) -> dict:
        return {"item_id": item["id"], "output_index": self.items.index(item)}

    def _at(self, message: dict | None = None) -> dict:
        """Where the message's one text part is, for its events."""
        return self._where(message or self._message) | {"content_index": 0}


def _drain(events: Iterator[str]) -> None:
    """Build the output without sending the events that stream it."""
    for _ in events:
        pass


def _usage(answer: Answer, finished: Finished) -> dict:
    chat = answer.usage({0: finished})
    return {
        "input_tokens": chat["prompt_tokens"],
        "input_tokens_details": {
            "cached_tokens": chat["prompt_tokens_details"]["cached_tokens"],
            "cache_write_tokens": 0,
        },
        "output_tokens": chat["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": chat["total_tokens"],
    }


class ResponseDraft:
    """The response object being built: what the request asked, echoed as OpenAI does."""

    def __init__(self, body: ResponsesRequest, answer: Answer, answers: AnswerService):
        self.body, self.answer = body, answer
        self.id = f"resp_{uuid.uuid4().hex}"
        self.created_at = int(time.time())
        defaults = answers.defaults
        self.temperature = defaults.temperature if body.temperature is None else body.temperature
        self.top_p = defaults.top_p if body.top_p is None else body.top_p

    def response(
        self,
        status: str,
        output: list[dict],
        finished: Finished | None = None,
        error: dict | None = None,
    ) -> dict:
        body = self.body
        text_format = body.format()
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "completed_at": int(time.time()) if status == "completed" else None,
            "background": False,
            "error": error,
            "incomplete_details": incomplete,
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "max_tool_calls": body.max_tool_calls,
            "metadata": body.metadata or {},
            "model": self.answer.model,
            "output": output,
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": body.previous_response_id,
            "prompt_cache_key": body.prompt_cache_key,
            "reasoning": {"effort": None, "summary": None},
            "safety_identifier": body.safety_identifier,
            "service_tier": "default",
            "store": body.store is not False,
            "temperature": self.temperature,
            "text": {
                "format": text_format.model_dump(by_alias=True, exclude_none=True)
                if text_format
                else {"type": "text"},
                "verbosity": "medium",
            },
            "tool_choice": body.tool_choice or "auto",
            "tools": [tool.echoed() for tool in body.tools or []],
            "top_logprobs": 0,
            "top_p": self.top_p,
            "truncation": "disabled",
            "usage": _usage(self.answer, finished) if finished else None,
            "user": body.user,
        }


# ------------------------------------------------------------------ routes


def responses_router(answers: AnswerService, store: ResponseStore | None = None) -> APIRouter:
    router = APIRouter()
    store = store if store is not None else ResponseStore()

    @router.post("/v1/responses")
    async def create_response(body: ResponsesRequest, request: Request):
        refusal = body.refused()
        if refusal is not None:
            field, why = refusal
            raise bad_request(why, field, code="unsupported_parameter")
        earlier: tuple = ()
        if body.previous_response_id is not None:
            earlier = store.found(body.previous_response_id, "previous_response_id").conversation
        relay, answer = await _started(answers, chat_request(body, earlier))
        turn = _Turn(body, ResponseDraft(body, answer, answers), relay, answer, store, earlier)
        if body.stream:
            return StreamingResponse(
                turn.stream(),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache"},
            )
        return JSONResponse(await turn.complete(request))

    @router.get("/v1/responses/{response_id}")
    def get_response(response_id: str, request: Request) -> JSONResponse:
        if request.query_params.get("stream", "false").lower() not in ("false", "0"):
            raise bad_request("streaming a stored response again is not supported", "stream")
        if any(
            name.startswith("include") and name != "include_obfuscation"
            for name in request.query_params
        ):
            raise bad_request("include is not supported", "include", "unsupported_parameter")
        return JSONResponse(store.found(response_id).response)

    @router.delete("/v1/responses/{response_id}")
    def delete_response(response_id: str) -> JSONResponse:
        if not store.delete(response_id):
            store.found(response_id)  # the 404
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})

    return router


class _Turn:
    """One request's answer, presented as a response object or as its stream of events,
    and stored (if asked) once it is complete."""

    def __init__(
        self,
        body: ResponsesRequest,
        draft: ResponseDraft,
        relay: Relay,
        answer: Answer,
        store: ResponseStore,
        earlier: tuple,
    ):
        self.body, self.draft, self.relay, self.answer = body, draft, relay, answer
        self.store, self.earlier = store, earlier
        self.events = _Events()
        self.output = OutputBuilder(answer.tools, self.events)

    async def complete(self, request: Request) -> dict:
        """The response object, once the answer is complete (its events are not sent)."""
        finished = None
        async for _, event in until_disconnected(self.relay, request):
            if isinstance(event, TextDelta):
                _drain(self.output.text(event.text))
            elif isinstance(event, Finished):
                finished = event
                _drain(self.output.finish(event))
        if finished is None:  # the client left: nobody to answer
            return {}
        return self._kept(self.draft.response(self.output.status, self.output.items, finished))

    async def stream(self) -> AsyncIterator[str]:
        draft, event = self.draft, self.events
        try:
            started = draft.response("in_progress", [])
            yield event("response.created", response=started)
            yield event("response.in_progress", response=started)
            async for _, generated in self.relay.events():
                if isinstance(generated, TextDelta):
                    for sent in self.output.text(generated.text):
                        yield sent
                elif isinstance(generated, Finished):
                    for sent in self.output.finish(generated):
                        yield sent
                    done = draft.response(self.output.status, self.output.items, generated)
                    yield event(LAST_EVENTS[done["status"]], response=self._kept(done))
        except ApiError as exc:  # raised while generating, after the stream began
            failed = draft.response(
                "failed", self.output.items, error={"code": "server_error", "message": exc.message}
            )
            yield event("response.failed", response=failed)
        finally:  # also when the client went away mid-answer: its generation stops
            self.relay.close()

    def _kept(self, response: dict) -> dict:
        if self.body.store is not False:
            items = (
                *self.earlier,
                *(self.body.input or []),
                *_ITEMS.validate_python(response["output"]),
            )
            self.store.put(StoredResponse(response, items))
        return response
