"""Tool calls (OpenAI's `tools` and `tool_choice`), in one of two formats.

**The model's own**, where its chat template takes `tools` and writes calls in Hermes'
<tool_call> tags (Qwen 2.5 and 3, Hermes 2 and 3, and many fine-tunes): the template
describes the tools and renders earlier calls and results itself, and the model answers with
one call per tag:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

**The documented format**, for every other template (every model we bundle): the tools are
described in a system message (below), and a call is a JSON array of objects, written as the
whole answer:

    [{"name": "get_weather", "arguments": {"city": "Paris"}}]

Earlier calls and their results go back into the conversation in the same format: an
assistant's calls as the array it wrote, a tool's result as a user message naming the call.

In both, `tool_choice` "required" or a named function constrains the answer to valid calls
(the name one of the tools', the arguments valid against that tool's parameter schema).
"auto": the answer is either text that does not begin as a call does ("[" or "<") or calls,
and once it begins as a call it is constrained the same way. "none": the tools are not
described and the answer is free text. `parallel_tool_calls: false` allows one call.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, replace

from miniapp.engine.api import ChatTemplate, ConstraintError, Message, OutputConstraint

from .errors import bad_request
from .protocol import ChatCompletionRequest, ToolChoiceFunction

MAX_PARALLEL_CALLS = 8
TAG_OPEN, TAG_CLOSE = "<tool_call>", "</tool_call>"
TOOLS_PREAMBLE = (
    "You can call functions. To call them, answer with only a JSON array of calls, each "
    '{"name": <function name>, "arguments": <object>}, for example '
    '[{"name": "get_weather", "arguments": {"city": "Paris"}}]. '
    "Otherwise answer in plain text. The functions, as JSON:"
)


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON string, as OpenAI sends it

    def as_openai(self, index: int | None = None) -> dict:
        call = {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        return call if index is None else {"index": index, **call}


@dataclass(frozen=True)
class ToolPlan:
    """What a request's tools mean for its prompt, its constraint and its answer."""

    functions: tuple[dict, ...]  # {"name", "description", "parameters"} each
    choice: str  # "auto", "required", or the one function's name
    parallel: bool
    tagged: bool = False  # the model's own format: calls in <tool_call> tags

    def for_template(self, template: ChatTemplate) -> ToolPlan:
        """The plan for a model with this chat template (its format, see the module)."""
        return replace(self, tagged=template.tags_tool_calls)

    @property
    def opener(self) -> str:
        """How an answer that makes calls begins."""
        return TAG_OPEN if self.tagged else "["

    def template_tools(self) -> list[dict] | None:
        """The tools as the template takes them (the model's own format only)."""
        if not self.tagged:
            return None
        return [{"type": "function", "function": f} for f in self.functions]

    @classmethod
    def of(cls, body: ChatCompletionRequest) -> ToolPlan | None:
        """None when the answer is plain text (no tools, or tool_choice "none")."""
        choice = body.tool_choice
        if not body.tools:
            if choice not in (None, "none"):
                raise bad_request("tool_choice needs tools", "tool_choice")
            return None
        if choice == "none":
            return None
        functions = tuple(tool.function.spec() for tool in body.tools)
        names = [f["name"] for f in functions]
        if len(set(names)) != len(names):
            raise bad_request("tools must have different names", "tools")
        if isinstance(choice, ToolChoiceFunction):
            chosen = choice.function.name
            if chosen not in names:
                raise bad_request(
                    f"tool_choice names '{chosen}', which is not in tools", "tool_choice"
                )
        else:
            chosen = choice or "auto"
        return cls(functions, chosen, body.parallel_tool_calls is not False)

    def call_schema(self) -> dict:
        """One valid call of a function the choice allows."""
        allowed = [f for f in self.functions if self.choice in ("auto", "required", f["name"])]
        calls = [
            {
                "type": "object",
                "properties": {"name": {"const": f["name"]}, "arguments": f["parameters"]},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for f in allowed
        ]
        return calls[0] if len(calls) == 1 else {"anyOf": calls}

    def calls_schema(self) -> dict:
        """The documented format's answer: an array of calls."""
        return {
            "type": "array",
            "minItems": 1,
            "items": self.call_schema(),
            "maxItems": MAX_PARALLEL_CALLS if self.parallel else 1,
        }

    def constraint(self) -> OutputConstraint:
        if self.tagged or self.choice == "auto":
            constraint = OutputConstraint("lark", self._grammar())
        else:
            constraint = OutputConstraint.json_schema(self.calls_schema())
        try:
            constraint.grammar()
        except ConstraintError as exc:
            raise bad_request(
                f"a tool's parameters are not a usable JSON schema: {exc}", "tools"
            ) from None
        return constraint

    def _grammar(self) -> str:
        """The calls in Lark; with "auto", text that does not begin as calls do, or calls."""
        if self.tagged:
            more = f'("\\n" call){{0,{MAX_PARALLEL_CALLS - 1}}}' if self.parallel else ""
            schema = json.dumps(self.call_schema())
            rules = [
                f"calls: call {more}",
                f'call: "{TAG_OPEN}\\n" %json {schema} "\\n{TAG_CLOSE}"',
            ]
        else:
            rules = [f"calls: %json {json.dumps(self.calls_schema())}"]
        if self.choice != "auto":
            return "\n".join(["start: calls", *rules]) + "\n"
        first = re.escape(self.opener[0])  # the character a call begins with
        text = f"text: /[^{first}\\s][\\s\\S]*/"
        return "\n".join(["start: calls | text", *rules, text]) + "\n"

    def described(self, messages: list[Message]) -> list[Message]:
        """The conversation with the tools described in its system message."""
        note = f"{TOOLS_PREAMBLE}\n{json.dumps(list(self.functions), ensure_ascii=False)}"
        if messages and messages[0].role == "system":
            first = messages[0]
            return [Message("system", f"{first.content}\n\n{note}"), *messages[1:]]
        return [Message("system", note), *messages]

    def calls_in(self, text: str) -> list[ToolCall] | None:
        """The calls an answer makes, or None when it is text (or was cut off by
        max_tokens before its calls were complete: it is shown as the text it is)."""
        if not text.lstrip().startswith(self.opener):
            return None
        calls = _tagged_calls(text) if self.tagged else _array_calls(text)
        if calls is None:
            return None
        return [
            ToolCall(_call_id(), call["name"], json.dumps(call["arguments"], ensure_ascii=False))
            for call in calls
        ]

    def call_stream(self) -> CallStream:
        return CallStream(tagged=self.tagged)


def _array_calls(text: str) -> list[dict] | None:
    try:
        return json.loads(text)
    except ValueError:
        return None


def _tagged_calls(text: str) -> list[dict] | None:
    """The objects in an answer's <tool_call> tags, or None where one is incomplete."""
    calls, rest, decoder = [], text.strip(), json.JSONDecoder()
    while rest.startswith(TAG_OPEN):
        body = rest[len(TAG_OPEN) :].lstrip()
        try:
            call, end = decoder.raw_decode(body)
        except ValueError:
            return None
        rest = body[end:].lstrip()
        if not rest.startswith(TAG_CLOSE):
            return None
        calls.append(call)
        rest = rest[len(TAG_CLOSE) :].lstrip()
    return calls or None


@dataclass
class _PartialCall:
    name: str | None = None
    arguments: str = ""  # the arguments' JSON text as written so far


class _CallScanner:
    """Reads an answer in the documented format while it is being written: each call's name
    once its string has ended, and its arguments' text so far (a prefix of the final text, so
    what was sent stays valid as more arrives). Each character is read once, whatever the
    size of the pieces. The constraint keeps the answer well-formed, so following strings and
    nesting is enough."""

    def __init__(self, tagged: bool = False):
        self.text = ""
        self.calls: list[_PartialCall] = []
        self._opens_call = 0 if tagged else 1  # the depth at which a `{` opens a call
        self._depth, self._in_string, self._escaped = 0, False, False
        self._key: str | None = None
        self._expecting_key = False
        self._string_start = 0
        self._value_start: int | None = None  # where the arguments being written begin

    def feed(self, piece: str) -> None:
        begin = len(self.text)
        self.text += piece
        for at in range(begin, len(self.text)):
            self._read(at, self.text[at])
        if self._value_start is not None:
            self.calls[-1].arguments = self.text[self._value_start :]

    def _read(self, at: int, char: str) -> None:
        if self._in_string:
            if self._escaped:
                self._escaped = False
            elif char == "\\":
                self._escaped = True
            elif char == '"':
                self._in_string = False
                self._string_ended(at)
            return
        top = self._depth == self._opens_call + 1  # inside a call object, outside its values
        if char == '"':
            self._in_string, self._string_start = True, at
            arguments_string = top and self._key == "arguments" and not self._expecting_key
            if arguments_string and self._value_start is None:
                self._value_start = at
        elif char in "{[":
            if self._depth == self._opens_call:
                self.calls.append(_PartialCall())
                self._expecting_key = True
            elif top and self._key == "arguments" and self._value_start is None:
                self._value_start = at
            self._depth += 1
        elif char in "}]":
            self._depth -= 1
            if self._depth == self._opens_call + 1 and self._value_start is not None:
                self._end_arguments(at)
        elif char == "," and top:
            self._key, self._expecting_key = None, True

    def _string_ended(self, at: int) -> None:
        if self._depth != self._opens_call + 1:
            return
        value = json.loads(self.text[self._string_start : at + 1])
        if self._expecting_key:
            self._key, self._expecting_key = value, False
        elif self._key == "name":
            self.calls[-1].name = value
        elif self._key == "arguments":  # arguments given as a string
            self._end_arguments(at)

    def _end_arguments(self, at: int) -> None:
        self.calls[-1].arguments = self.text[self._value_start : at + 1]
        self._value_start = None


def partial_calls(text: str, tagged: bool = False) -> list[_PartialCall]:
    """The calls of an answer still being written (see _CallScanner)."""
    scanner = _CallScanner(tagged)
    scanner.feed(text)
    return scanner.calls


class CallStream:
    """One streamed answer's tool calls as `tool_calls` delta parts, sent while the model
    writes them: a call opens (index, id, name) once its name has ended, and its arguments
    follow piece by piece, as OpenAI streams them."""

    def __init__(self, tagged: bool = False):
        self._scanner = _CallScanner(tagged)
        self.ids: list[str] = []  # of the calls opened so far
        self.sent: list[int] = []  # characters of each call's arguments sent

    @property
    def text(self) -> str:
        return self._scanner.text

    def feed(self, text: str) -> list[dict]:
        """The parts that `text`, the answer's next piece, makes sendable."""
        self._scanner.feed(text)
        parts = []
        for k, call in enumerate(self._scanner.calls):
            if call.name is None:
                break  # a later call cannot open before this one
            if k == len(self.ids):
                self.ids.append(_call_id())
                self.sent.append(0)
                parts.append(
                    {
                        "index": k,
                        "id": self.ids[k],
                        "type": "function",
                        "function": {"name": call.name, "arguments": ""},
                    }
                )
            if len(call.arguments) > self.sent[k]:
                piece = call.arguments[self.sent[k] :]
                self.sent[k] = len(call.arguments)
                parts.append({"index": k, "function": {"arguments": piece}})
        return parts

    @property
    def opened(self) -> bool:
        return bool(self.ids)


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def tool_message(role: str, content: str, tool_calls, tool_call_id) -> Message:
    """A request's tool traffic as a Message: an assistant's calls (arguments as objects, as
    templates expect them), or a tool's result with the id of the call it answers."""
    calls = tuple(
        {
            "id": c.id,
            "type": "function",
            "function": {"name": c.function.name, "arguments": _arguments(c.function.arguments)},
        }
        for c in tool_calls or ()
    )
    return Message(role, content, tool_calls=calls, tool_call_id=tool_call_id)


def messages_for(
    plan: ToolPlan | None, template: ChatTemplate, messages: list[Message]
) -> list[Message]:
    """The conversation as the template gets it: as it is where the template renders tool
    traffic (the model's own format), else with tool traffic as text and the tools, if the
    request has any, described in the system message (the documented format)."""
    if template.tags_tool_calls:
        return messages
    messages = tool_traffic_as_text(messages)
    return plan.described(messages) if plan is not None else messages


def tool_traffic_as_text(messages: list[Message]) -> list[Message]:
    """Tool traffic in the documented format, for templates that do not render it: an
    assistant's calls as the JSON array it wrote, a tool's result as a user message."""
    return [_as_text(m) for m in messages]


def _as_text(message: Message) -> Message:
    if message.role == "assistant" and message.tool_calls:
        calls = [
            {"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
            for c in message.tool_calls
        ]
        return Message("assistant", json.dumps(calls, ensure_ascii=False))
    if message.role == "tool":
        return Message("user", f"Result of call {message.tool_call_id}: {message.content}")
    return message


def _arguments(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return text
