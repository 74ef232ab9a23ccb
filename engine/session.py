"""A chat: message history, the model's template, and generation with prefix reuse.

Each turn renders the whole conversation; the runtime reuses the cached prefix, so only the
new tokens are evaluated. When the conversation outgrows the context, whole old turns are
dropped (the system prompt stays), and the runtime drops their tokens from its cache in
place, so what remains is not evaluated again. (An answer that itself outruns the context
keeps going on the runtime's sliding window; the turn after it starts from a fresh cache.)
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from .chat_template import ChatTemplate, Message
from .errors import ContextFullError
from .events import Finished, GenerationEvent, GenerationStats, TextDelta
from .generation import GenerationRequest, generate
from .runtimes.base import Runtime, common_prefix


class ChatSession:
    def __init__(
        self,
        runtime: Runtime,
        system_prompt: str | None = None,
        request: GenerationRequest | None = None,
    ):
        self.runtime = runtime
        tokenizer = runtime.tokenizer
        self.template = ChatTemplate.for_model(
            runtime.chat_template, tokenizer, runtime.architecture
        )
        self.system_prompt = system_prompt
        self.request = request or GenerationRequest()
        self.messages: list[Message] = []
        self.last_stats: GenerationStats | None = None
        self.dropped_turns = 0

    def reset(self) -> None:
        self.messages.clear()
        self.last_stats = None
        self.dropped_turns = 0

    def send(
        self,
        text: str | Message,
        request: GenerationRequest | None = None,
        should_stop: Callable[[], bool] = lambda: False,
    ) -> Iterator[GenerationEvent]:
        """Add a user message and stream the answer; the answer (even a partial one) is kept.
        A Message (e.g. a spoken one, which carries its word times) is kept as it is."""
        request = request or self.request
        self.messages.append(_user_message(text))
        try:
            prompt = self._fit_prompt(reserve=min(request.max_tokens, self.runtime.n_ctx // 4))
        except ContextFullError:
            self.messages.pop()
            raise
        answer: list[str] = []
        try:
            for event in generate(self.runtime, prompt, request, should_stop):
                if isinstance(event, TextDelta):
                    answer.append(event.text)
                elif isinstance(event, Finished):
                    self.last_stats = event.stats
                yield event
        finally:
            self.messages.append(Message("assistant", "".join(answer)))

    def render(self, messages: list[Message]) -> str:
        """The prompt text for these messages, system prompt and template included."""
        return self.template.render(self._with_system(messages))

    def preview(self, text: str | Message) -> str:
        """The prompt the next send(text) renders (before any old turns are dropped to fit
        the context): what `--show-prompt` prints."""
        return self.render([*self.messages, _user_message(text)])

    def prompt_tokens(self, messages: list[Message]) -> list[int]:
        return self.runtime.tokenizer.encode_chat(self.render(messages))

    def _with_system(self, messages: list[Message]) -> list[Message]:
        if self.system_prompt:
            return [Message("system", self.system_prompt), *messages]
        return list(messages)

    def _fit_prompt(self, reserve: int) -> list[int]:
        """Tokens of the conversation, dropping the oldest whole turns until it fits."""
        full = tokens = self.prompt_tokens(self.messages)
        while len(tokens) + reserve > self.runtime.n_ctx:
            if len(self.messages) <= 1:
                if len(tokens) < self.runtime.n_ctx:
                    break  # fits, with less room to answer
                raise ContextFullError(
                    f"message of {len(tokens)} tokens does not fit the context of "
                    f"{self.runtime.n_ctx}; raise --ctx"
                )
            self._drop_oldest_turn()
            tokens = self.prompt_tokens(self.messages)
        if tokens is not full:
            self._forget_dropped(full, tokens)
        return tokens

    def _forget_dropped(self, before: list[int], after: list[int]) -> None:
        """Drop the tokens of the dropped turns from the runtime's cache, if `after` is
        `before` with one span cut out (as it is for templates that delimit messages)."""
        start = common_prefix(before, after)
        end = start + len(before) - len(after)
        if end > start and before[end:] == after[start:]:
            self.runtime.forget(start, end)

    def _drop_oldest_turn(self) -> None:
        """Remove the first user message and the answers that followed it."""
        del self.messages[0]
        while self.messages and self.messages[0].role != "user":
            del self.messages[0]
        self.dropped_turns += 1


def _user_message(text: str | Message) -> Message:
    return text if isinstance(text, Message) else Message("user", text)
