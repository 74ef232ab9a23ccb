"""Long conversations on a small context: every answer finishes, old turns leave the cache
without the rest being evaluated again, and an answer longer than the context keeps going."""

from __future__ import annotations

import pytest

from miniapp.engine.chat.conversation import Conversation
from miniapp.engine.chat.generation import GenerationRequest
from miniapp.engine.runtimes.torch_runtime import TorchRuntime
from miniapp.engine.tokens.events import Finished, FinishReason
from miniapp.engine.tokens.sampling import GREEDY

CTX = 192


@pytest.fixture(scope="module")
def runtime(default_model):
    return TorchRuntime(default_model, n_ctx=CTX)


def test_scripted_chat_of_many_contexts_finishes_every_answer(runtime):
    session = Conversation(
        runtime,
        system_prompt="You answer in one or two sentences.",
        request=GenerationRequest(max_tokens=40, sampling=GREEDY),
    )
    total_tokens, reasons, reevaluated = 0, [], []
    topics = [
        "the sea",
        "bread",
        "trains",
        "gardens",
        "music",
        "rain",
        "maps",
        "bridges",
        "clocks",
        "winter",
        "bees",
        "lamps",
        "rivers",
        "paper",
        "stars",
        "salt",
    ]
    for topic in topics:
        events = list(session.send(f"Tell me one fact about {topic}."))
        finished = events[-1]
        assert isinstance(finished, Finished)
        reasons.append(finished.reason)
        stats = finished.stats
        total_tokens += stats.generated_tokens + stats.prompt_tokens - stats.cached_prompt_tokens
        reevaluated.append(stats.prompt_tokens - stats.cached_prompt_tokens)
    assert total_tokens > 3 * CTX
    assert session.dropped_turns > 0
    assert all(r in (FinishReason.END_OF_TURN, FinishReason.MAX_TOKENS) for r in reasons)
    # Dropping turns never re-evaluates the remaining history: each turn evaluates about
    # its own new message (plus the template's few tokens around it), not the context.
    assert max(reevaluated[1:]) < CTX // 3, reevaluated
    assert session.messages[0].role == "user" and "salt" in session.messages[-2].content


def test_answer_longer_than_the_context_keeps_going(runtime):
    session = Conversation(
        runtime,
        request=GenerationRequest(max_tokens=3 * CTX, sampling=GREEDY, ignore_end_of_turn=True),
    )
    finished = list(session.send("Count upwards from one, forever."))[-1]
    assert finished.reason == FinishReason.MAX_TOKENS
    assert finished.stats.generated_tokens == 3 * CTX
    # The next turn still works (its cache starts afresh: the old one rotated).
    again = list(session.send("Thanks. Now say hello."))[-1]
    assert again.reason in (FinishReason.END_OF_TURN, FinishReason.MAX_TOKENS)
