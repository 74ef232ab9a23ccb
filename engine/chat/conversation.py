"""A conversation: its messages, the model's template, fitting the context, and the runtime
that answers. Every interface (terminal, GUI, server) drives a chat through this one object.

Each turn renders the whole conversation; the runtime reuses the cached prefix, so only the
new tokens are evaluated. When the conversation outgrows the context, whole old turns are
dropped (the system prompt stays), and a text runtime drops their tokens from its cache in
place, so what remains is not evaluated again. (An answer that itself outruns the context
keeps going on the runtime's sliding window; the turn after it starts from a fresh cache.)

A runtime that holds its conversation elsewhere (a server, --backend openai) is sent the
messages themselves: the server applies the template and fits its own context.

A message with pictures goes to the vision runtime (llama.cpp with a projector), the text
history with it. From then until `reset` every turn goes there, so follow-up questions still
see the pictures: the vision runtime keeps them in its context and evaluates only what each
turn adds.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace

from ..errors import ContextFullError, MiniappError
from ..kv.cache import common_prefix
from ..modelfile.template import ChatTemplate, Message
from ..runtimes.base import MessageRuntime, Prefill, Runtime, VisionRuntime
from ..tokens.events import Finished, GenerationEvent, GenerationStats, TextDelta
from .generation import GenerationRequest, generate


class Conversation:
    def __init__(
        self,
        runtime: Runtime | MessageRuntime | Callable[[], Runtime | MessageRuntime],
        system_prompt: str | None = None,
        request: GenerationRequest | None = None,
        *,
        vision: Callable[[], VisionRuntime] | None = None,
        history: Sequence[Message] = (),
    ):
        """`runtime` answers turns without pictures: a runtime, or a function that opens it
        on first use (so a chat that starts with a picture never loads it). `vision` opens
        the vision runtime when a picture first needs it; a vision runtime given as
        `runtime` serves both. `history` is the conversation so far (pictures included)."""
        self._text = runtime if isinstance(runtime, Runtime | MessageRuntime) else None
        self._open_text = runtime if self._text is None else None
        self._vision = runtime if isinstance(runtime, VisionRuntime) else None
        self._open_vision = vision
        self._templates: dict[int, ChatTemplate] = {}
        self.system_prompt = system_prompt
        self.request = request or GenerationRequest()
        self.messages: list[Message] = list(history)
        # Whether turns go to the vision runtime: from the first picture until a reset.
        self.on_vision = self.sees_pictures and any(m.pictures for m in self.messages)
        self.last_stats: GenerationStats | None = None
        self.dropped_turns = 0

    @property
    def sees_pictures(self) -> bool:
        if isinstance(self._text, MessageRuntime):
            return self._text.accepts_images
        return self._vision is not None or self._open_vision is not None

    @property
    def runtime(self) -> Runtime | MessageRuntime:
        """The runtime that answers the next turn without pictures (opened if need be)."""
        return self._answering(pictures=False)

    def reset(self) -> None:
        """A new conversation: history gone, and turns back on the text runtime. The vision
        runtime's context is emptied too (its pictures are not needed again)."""
        self.messages.clear()
        self.last_stats = None
        self.dropped_turns = 0
        self.on_vision = False
        if self._vision is not None:
            self._vision.reset()

    def send(
        self,
        text: str | Message,
        pictures: Sequence[bytes] = (),
        request: GenerationRequest | None = None,
        should_stop: Callable[[], bool] = lambda: False,
    ) -> Iterator[GenerationEvent]:
        """Add a user message (with PNG `pictures`) and stream the answer; the answer, even a
        partial one, is kept. A Message (a spoken one carries its word times) is kept as it
        is. A message that cannot be evaluated (too long, a picture llama.cpp refuses) is
        not kept, and the conversation goes on."""
        request = request or self.request
        message = _user_message(text, pictures)
        if message.pictures and not self.sees_pictures:
            raise MiniappError("this message has pictures, but no vision model is loaded")
        runtime = self._answering(pictures=bool(message.pictures))
        if isinstance(runtime, MessageRuntime):
            yield from self._send_messages(runtime, message, request, should_stop)
            return
        self.on_vision = isinstance(runtime, VisionRuntime)
        self.messages.append(message)
        try:
            prompt, prefill = self._fit(runtime, min(request.max_tokens, runtime.n_ctx // 4))
        except Exception:
            self.messages.pop()
            raise
        answer: list[str] = []
        try:
            for event in generate(runtime, prompt, request, should_stop):
                if isinstance(event, TextDelta):
                    answer.append(event.text)
                elif isinstance(event, Finished):
                    if prefill is not None:
                        event = replace(event, stats=prefill.applied_to(event.stats))
                    self.last_stats = event.stats
                yield event
        finally:
            self.messages.append(Message("assistant", "".join(answer)))

    def _send_messages(
        self,
        runtime: MessageRuntime,
        message: Message,
        request: GenerationRequest,
        should_stop: Callable[[], bool],
    ) -> Iterator[GenerationEvent]:
        """The conversation as messages to a server. Its answer, even a partial one, is
        kept; a request that failed before any answer is not, so the message can be sent
        again as it was."""
        self.messages.append(message)
        answer: list[str] = []
        answered = False
        try:
            for event in runtime.chat(self._with_system(self.messages), request, should_stop):
                if isinstance(event, TextDelta):
                    answer.append(event.text)
                elif isinstance(event, Finished):
                    self.last_stats = event.stats
                    answered = True
                yield event
        finally:
            if answer or answered:
                self.messages.append(Message("assistant", "".join(answer)))
            else:
                self.messages.pop()

    def _with_system(self, messages: Sequence[Message]) -> list[Message]:
        chat = list(messages)
        if self.system_prompt:
            chat.insert(0, Message("system", self.system_prompt))
        return chat

    # -- the prompt --------------------------------------------------------------------------

    def render(self, messages: Sequence[Message]) -> str:
        """The prompt text for these messages on the answering runtime: system prompt and
        template included, and a media marker where each picture goes on a vision runtime."""
        return self._render(self.runtime, messages)

    def preview(self, text: str | Message, pictures: int = 0) -> str:
        """The prompt the next send(text) with that many pictures renders (before any old
        turns are dropped to fit the context): what `--show-prompt` prints."""
        runtime = self._answering(pictures=pictures > 0)
        message = _user_message(text, (b"",) * pictures)
        if isinstance(runtime, MessageRuntime):  # the server renders it: show the messages
            chat = self._with_system([*self.messages, message])
            return "\n".join(
                f"[{m.role}] {m.content}" + " [picture]" * len(m.pictures) for m in chat
            )
        return self._render(runtime, [*self.messages, message])

    def prompt_tokens(self, messages: Sequence[Message]) -> list[int]:
        return self.runtime.tokenizer.encode_chat(self.render(messages))

    def _render(self, runtime: Runtime, messages: Sequence[Message]) -> str:
        chat = self._with_system(messages)
        if isinstance(runtime, VisionRuntime):
            chat = [Message(m.role, _with_markers(runtime, m)) for m in chat]
        return self._template(runtime).render(chat)

    def _template(self, runtime: Runtime) -> ChatTemplate:
        key = id(runtime)
        if key not in self._templates:
            self._templates[key] = ChatTemplate.for_model(
                runtime.chat_template, runtime.tokenizer, runtime.architecture
            )
        return self._templates[key]

    # -- fitting the context -----------------------------------------------------------------

    def _answering(self, pictures: bool) -> Runtime | MessageRuntime:
        if isinstance(self._text, MessageRuntime):  # the server answers every turn
            return self._text
        if pictures or self.on_vision:
            if self._vision is None:
                assert self._open_vision is not None
                self._vision = self._open_vision()
            return self._vision
        if self._text is None:
            assert self._open_text is not None
            self._text = self._open_text()
        return self._text

    def _fit(self, runtime: Runtime, reserve: int) -> tuple[list[int], Prefill | None]:
        if isinstance(runtime, VisionRuntime):
            prefill = self._fit_with_pictures(runtime, reserve)
            return prefill.prompt, prefill
        return self._fit_tokens(runtime, reserve), None

    def _fit_tokens(self, runtime: Runtime, reserve: int) -> list[int]:
        """Tokens of the conversation, dropping the oldest whole turns until it fits."""

        def tokens_now() -> list[int]:
            return runtime.tokenizer.encode_chat(self._render(runtime, self.messages))

        full = tokens = tokens_now()
        while len(tokens) + reserve > runtime.n_ctx:
            if len(self.messages) <= 1 and len(tokens) < runtime.n_ctx:
                break  # fits, with less room to answer
            if not self._drop_oldest_turn():
                raise ContextFullError(
                    f"message of {len(tokens)} tokens does not fit the context of "
                    f"{runtime.n_ctx}; raise --ctx"
                )
            tokens = tokens_now()
        if tokens is not full:
            _forget_dropped(runtime, full, tokens)
        return tokens

    def _fit_with_pictures(self, runtime: VisionRuntime, reserve: int) -> Prefill:
        """Evaluate the conversation, text and pictures, after what the context already
        holds of it, dropping the oldest whole turns while it leaves fewer than `reserve`
        positions to answer in."""
        while True:
            pictures = [png for message in self.messages for png in message.pictures]
            prefill = runtime.prefill(self._render(runtime, self.messages), pictures)
            if prefill is not None and len(prefill.prompt) < runtime.n_ctx:
                alone = len(self.messages) <= 1
                if len(prefill.prompt) + reserve <= runtime.n_ctx or alone:
                    return prefill
            if not self._drop_oldest_turn():
                raise ContextFullError(
                    f"this message and its images do not fit the context of {runtime.n_ctx} "
                    "tokens; raise --ctx"
                )

    def _drop_oldest_turn(self) -> bool:
        """Remove the first user message and the answers that followed it; False if only
        the new message is left."""
        if len(self.messages) <= 1:
            return False
        del self.messages[0]
        while len(self.messages) > 1 and self.messages[0].role != "user":
            del self.messages[0]
        self.dropped_turns += 1
        return True


def _forget_dropped(runtime: Runtime, before: list[int], after: list[int]) -> None:
    """Drop the tokens of the dropped turns from the runtime's cache, if `after` is `before`
    with one span cut out (as it is for templates that delimit messages)."""
    start = common_prefix(before, after)
    end = start + len(before) - len(after)
    if end > start and before[end:] == after[start:]:
        runtime.forget(start, end)


def _user_message(text: str | Message, pictures: Sequence[bytes]) -> Message:
    if isinstance(text, Message):
        return replace(text, pictures=tuple(pictures)) if pictures else text
    return Message("user", text, tuple(pictures))


def _with_markers(runtime: VisionRuntime, message: Message) -> str:
    """The message's text for a vision runtime: a marker line per picture, then the text
    (a marker typed in it is not a picture)."""
    markers = "".join(f"{runtime.media_marker}\n" for _ in message.pictures)
    return markers + runtime.typed(message.content)
