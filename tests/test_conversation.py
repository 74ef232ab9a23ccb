from __future__ import annotations

import pytest

from miniapp.engine.chat.conversation import Conversation
from miniapp.engine.chat.generation import GenerationRequest
from miniapp.engine.errors import ContextFullError
from miniapp.engine.runtimes.torch_runtime import TorchRuntime
from miniapp.engine.tokens.events import Finished, FinishReason, TextDelta
from miniapp.engine.tokens.sampling import GREEDY

REQUEST = GenerationRequest(max_tokens=16, sampling=GREEDY)


@pytest.fixture(scope="module")
def small_ctx_runtime(default_model):
    return TorchRuntime(default_model, n_ctx=160)


def _say(session, text):
    events = list(session.send(text))
    assert isinstance(events[-1], Finished)
    return "".join(e.text for e in events if isinstance(e, TextDelta))


def test_history_and_template(torch_runtime):
    session = Conversation(torch_runtime, system_prompt="You are terse.", request=REQUEST)
    _say(session, "Hello")
    assert [m.role for m in session.messages] == ["user", "assistant"]
    prompt = session.runtime.tokenizer.decode(session.prompt_tokens(session.messages))
    assert "You are terse." in prompt and "Hello" in prompt


def test_long_chat_drops_whole_old_turns_and_keeps_system(small_ctx_runtime):
    session = Conversation(small_ctx_runtime, system_prompt="Be brief.", request=REQUEST)
    for i in range(8):
        _say(session, f"Tell me fact number {i} about the sea, please, in a sentence or two.")
    assert session.dropped_turns > 0
    assert session.messages[0].role == "user"  # a turn is dropped whole
    assert "number 7" in session.messages[-2].content
    prompt = session.prompt_tokens(session.messages)
    assert len(prompt) < small_ctx_runtime.n_ctx
    assert "Be brief." in small_ctx_runtime.tokenizer.decode(prompt)


def test_message_larger_than_context_is_refused_and_not_kept(small_ctx_runtime):
    session = Conversation(small_ctx_runtime, request=REQUEST)
    with pytest.raises(ContextFullError):
        list(session.send("word " * 400))
    assert session.messages == []


def test_cancelled_answer_is_kept_in_history(torch_runtime):
    session = Conversation(torch_runtime, request=GenerationRequest(max_tokens=64, sampling=GREEDY))
    checks = iter(range(100))
    events = list(session.send("Count from one to fifty.", should_stop=lambda: next(checks) >= 4))
    assert events[-1].reason == FinishReason.CANCELLED
    assert session.messages[-1].role == "assistant" and session.messages[-1].content
