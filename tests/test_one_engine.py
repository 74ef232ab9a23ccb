"""One engine: every torch generation goes through the one scheduler and its model runner, so
a prompt's greedy answer is the same at any --parallel, alone or beside other requests, with
every KV type. (The terminal, the GUI and the server against each other: test_gui.py and
test_serve.py.)"""

from __future__ import annotations

import pytest
from generation_helpers import first_tokens

from miniapp.engine.evaluation.calibrate import prompt_tokens
from miniapp.engine.runtimes.torch_runtime import TorchRuntime
from miniapp.engine.tokens.sampling import GREEDY

# Long enough to diverge between a prompt pass and exact rows (the terminal's and the
# server's answers to the first parted at its 14th token on the q8 cache).
QUESTIONS = [
    "Name three colours.",
    "Why is the sky blue?",
    "Write a short poem about the sea.",
    "What is the capital of France, and what is it known for?",
]
TOKENS = 48


def _together(runtime: TorchRuntime, prompts: list[list[int]], n: int) -> list[list[int]]:
    """Every prompt submitted at once, their streams read in turn: rows of several sequences
    share steps, and prompt chunks run beside decode rows."""
    streams = [runtime.generate_tokens(prompt, GREEDY) for prompt in prompts]
    answers: list[list[int]] = [[] for _ in prompts]
    try:
        for _ in range(n):
            for answer, stream in zip(answers, streams, strict=True):
                answer.append(next(stream))
    finally:
        for stream in streams:
            stream.close()
    return answers


@pytest.mark.parametrize(
    ("kv", "spec"),
    [
        ("f32", "off"),
        ("f16", "off"),
        ("bf16", "off"),
        ("q8", "off"),
        ("q4", "off"),
        ("q8/q4", "off"),
        ("q8", "lookup"),
    ],
)
def test_a_greedy_answer_is_the_same_alone_and_beside_other_requests(default_model, kv, spec):
    alone = TorchRuntime(default_model, n_ctx=512, threads=2, spec=spec, kv=kv)
    prompts = [prompt_tokens(alone, question) for question in QUESTIONS]
    want = [first_tokens(alone, prompt, TOKENS) for prompt in prompts]
    shared = TorchRuntime(default_model, n_ctx=512, threads=2, spec=spec, parallel=4, kv=kv)
    assert _together(shared, prompts, TOKENS) == want
    assert shared.scheduler.peak_batch == len(prompts)
    # And one at a time on the shared runtime, each prompt's start reused from the pool.
    assert [first_tokens(shared, prompt, TOKENS) for prompt in prompts] == want
