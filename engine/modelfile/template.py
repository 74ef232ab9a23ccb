"""Chat templates from the GGUF (`tokenizer.chat_template`), rendered in jinja2's sandbox.

Templates are code from a downloaded file, so they run in an immutable sandbox with only the
helpers Hugging Face templates expect (raise_exception, strftime_now, tojson), and a render is
bounded in time and in the size of what it builds: a hostile template is refused in one line
instead of hanging the app or filling its memory.
"""

from __future__ import annotations

import datetime
import json
import operator
import threading
import time
from dataclasses import dataclass, field

import jinja2
import jinja2.meta
from jinja2.exceptions import SecurityError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ..errors import MiniappError

RENDER_SECONDS = 2.0  # a real template renders a long chat in milliseconds
MAX_RENDERED_CHARS = 32 * 1024 * 1024  # the prompt, and any string or list built on the way

# What llama.cpp falls back to when a file carries no template.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Gemma's turn format, for Gemma files without a template (base models): its vocabulary has
# <start_of_turn>/<end_of_turn> but no ChatML tokens. A system prompt opens the first turn.
GEMMA_TEMPLATE = (
    "{{ bos_token }}"
    "{% set system = messages[0]['content'] + '\\n\\n' "
    "if messages and messages[0]['role'] == 'system' else '' %}"
    "{% for message in messages if message['role'] != 'system' %}"
    "{{ '<start_of_turn>' + ('model' if message['role'] == 'assistant' else 'user') + '\\n' }}"
    "{{ (system if loop.first else '') + message['content'] + '<end_of_turn>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"
)


def fallback_template(architecture: str) -> str:
    return GEMMA_TEMPLATE if architecture.startswith("gemma") else CHATML_TEMPLATE


class TemplateError(MiniappError):
    """The model's chat template failed to render."""


@dataclass(frozen=True)
class Message:
    role: str  # "system" | "user" | "assistant", or "tool" for templates that take tools
    content: str
    # PNG files a vision model sees before the text, in this order (a user message's only).
    pictures: tuple[bytes, ...] = field(default=(), repr=False)
    # For templates that render tool traffic: an assistant's calls, each
    # {"id", "type": "function", "function": {"name", "arguments": <object>}}, and the id
    # of the call a "tool" message answers.
    tool_calls: tuple[dict, ...] = ()
    tool_call_id: str | None = None

    def for_template(self) -> dict:
        message = {"role": self.role, "content": self.content}
        if self.tool_calls:
            message["tool_calls"] = list(self.tool_calls)
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


class ChatTemplate:
    def __init__(
        self,
        source: str | None,
        bos_text: str = "",
        eos_text: str = "",
        architecture: str = "",
    ):
        self.source = source or fallback_template(architecture)
        self.is_fallback = not source
        env = _BoundedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        try:
            self._template = env.from_string(self.source)
            names = jinja2.meta.find_undeclared_variables(env.parse(self.source))
        except jinja2.TemplateError as exc:
            raise TemplateError(f"the model's chat template does not parse: {exc}") from exc
        self.bos_text, self.eos_text = bos_text, eos_text
        # A template that reads `tools` describes them to the model itself; one that also
        # writes <tool_call> tags (Hermes' format: Qwen 2.5 and 3, Hermes 2 and 3, many
        # fine-tunes) has the model answer with calls in those tags.
        self.takes_tools = "tools" in names
        self.tags_tool_calls = self.takes_tools and "<tool_call>" in self.source

    @classmethod
    def for_model(cls, source: str | None, tokenizer, architecture: str) -> ChatTemplate:
        """The model's template (or the architecture's fallback) with its BOS/EOS texts."""
        return cls(source, tokenizer.bos_text, tokenizer.eos_text, architecture)

    def render(
        self,
        messages: list[Message],
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
    ) -> str:
        """The prompt text; `tools` (OpenAI's {"type": "function", "function": ...} each)
        go to templates that take them."""
        extra = {"tools": tools} if tools else {}
        budget = _Budget.start()
        try:
            pieces, size = [], 0
            for piece in self._template.generate(
                messages=[m.for_template() for m in messages],
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_text,
                eos_token=self.eos_text,
                **extra,
            ):
                size += len(piece)
                budget.check(size)
                pieces.append(piece)
            return "".join(pieces)
        except _OverBudget as exc:
            raise TemplateError(f"the model's chat template was stopped: {exc}") from None
        except Exception as exc:  # a template is code: whatever it raises is its failure
            raise TemplateError(f"the model's chat template failed: {exc}") from exc
        finally:
            budget.stop()


class _OverBudget(Exception):
    pass


class _Budget:
    """This thread's render deadline (renders run on server threads at once)."""

    _local = threading.local()

    def __init__(self, deadline: float):
        self.deadline = deadline

    @classmethod
    def start(cls) -> _Budget:
        budget = cls(time.monotonic() + RENDER_SECONDS)
        cls._local.budget = budget
        return budget

    @classmethod
    def current(cls) -> _Budget | None:
        return getattr(cls._local, "budget", None)

    def stop(self) -> None:
        self._local.budget = None

    def check(self, size: int = 0) -> None:
        if size > MAX_RENDERED_CHARS:
            raise _OverBudget(f"it built more than {MAX_RENDERED_CHARS} characters")
        if time.monotonic() > self.deadline:
            raise _OverBudget(f"it ran longer than {RENDER_SECONDS:g} s")


def _check_budget(size: int = 0) -> None:
    budget = _Budget.current()
    if budget is not None:
        budget.check(size)


class _BoundedEnvironment(ImmutableSandboxedEnvironment):
    """The immutable sandbox, checking the render's budget at every call, attribute and
    item access (a loop that builds nothing still reads or calls something each turn), and
    refusing `*` and `**` whose result would be too large before computing it."""

    intercepted_binops = frozenset(["*", "**"])

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (jinja's signature)
        _check_budget()
        return super().call(__context, __obj, *args, **kwargs)

    def unsafe_undefined(self, obj, attribute):
        """Reading an attribute the sandbox forbids fails the render (jinja's default is
        an undefined value that prints as nothing): such a template is hostile or broken."""
        raise SecurityError(f"{type(obj).__name__}.{attribute} is not allowed in a template")

    def getattr(self, obj, attribute):
        _check_budget()
        return super().getattr(obj, attribute)

    def getitem(self, obj, argument):
        _check_budget()
        return super().getitem(obj, argument)

    def call_binop(self, context, operator_name: str, left, right):
        _check_budget()
        if operator_name == "**":
            if isinstance(right, int | float) and abs(right) > 64:
                raise _OverBudget(f"it raised a number to the power {right}")
            return operator.pow(left, right)
        sequence, count = (left, right) if isinstance(right, int) else (right, left)
        if isinstance(count, int) and hasattr(sequence, "__len__"):
            _check_budget(len(sequence) * count)
        return operator.mul(left, right)


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


def _tojson(value, indent=None, ensure_ascii=False, **_ignored) -> str:
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii)
