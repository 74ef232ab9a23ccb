"""Constrained decoding on the bundled SmolLM2: answers that must match a JSON schema, any
JSON object, a pattern or a list of choices, checked with the `jsonschema` package, on the
plain, speculative and batching paths."""

from __future__ import annotations

import json
import re
import threading

import jsonschema
import pytest

from miniapp.engine.chat.generation import GenerationRequest, generate
from miniapp.engine.runtimes.torch_runtime import TorchRuntime
from miniapp.engine.tokens.constraints import ConstraintError, OutputConstraint, token_guide
from miniapp.engine.tokens.events import Finished, FinishReason, TextDelta
from miniapp.engine.tokens.sampling import SamplingParams

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "hobbies": {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 3},
        "email": {"type": ["string", "null"]},
    },
    "required": ["name", "age", "hobbies"],
    "additionalProperties": False,
}
ORDER = {
    "type": "object",
    "properties": {
        "id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"},
        "status": {"enum": ["open", "shipped", "closed"]},
        "lines": {
            "type": "array",
            "minItems": 1,
            "maxItems": 2,
            "items": {
                "type": "object",
                "properties": {
                    "sku": {"type": "string", "minLength": 2, "maxLength": 8},
                    "quantity": {"type": "integer", "exclusiveMinimum": 0, "maximum": 9},
                    "price": {"type": "number", "minimum": 0},
                },
                "required": ["sku", "quantity", "price"],
                "additionalProperties": False,
            },
        },
        "gift": {"type": "boolean"},
    },
    "required": ["id", "status", "lines"],
    "additionalProperties": False,
}
ASKED = {
    "person": (PERSON, "Describe a person named Ana as JSON."),
    "order": (ORDER, "Write a shop order with two items as JSON."),
}


def _chat(runtime, text: str) -> list[int]:
    rendered = f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"
    return runtime.tokenizer.encode_chat(rendered)


def _answer(
    runtime, prompt, constraint, temperature=0.0, seed=None, max_tokens=160, on_tokens=None
):
    sampling = SamplingParams(temperature=temperature, seed=seed, constraint=constraint)
    request = GenerationRequest(max_tokens, sampling)
    events = list(generate(runtime, prompt, request, on_tokens=on_tokens))
    finished = events[-1]
    assert isinstance(finished, Finished)
    return "".join(e.text for e in events if isinstance(e, TextDelta)), finished


@pytest.fixture(scope="module")
def plain(default_model):
    return TorchRuntime(default_model, n_ctx=1024, threads=2, spec="off")


@pytest.fixture(scope="module")
def speculative(default_model):
    return TorchRuntime(default_model, n_ctx=1024, threads=2, spec="auto")


@pytest.mark.parametrize("name", sorted(ASKED))
def test_a_schema_answer_validates_and_speculation_gives_the_same_text(plain, speculative, name):
    schema, question = ASKED[name]
    constraint = OutputConstraint.json_schema(schema)
    text, finished = _answer(plain, _chat(plain, question), constraint)
    assert finished.reason is FinishReason.END_OF_TURN, text  # the value ended the answer
    jsonschema.validate(json.loads(text), schema)
    again, _ = _answer(speculative, _chat(speculative, question), constraint)
    assert again == text


def test_any_json_object_a_pattern_and_choices(plain):
    question = "Return a JSON object with the name and colour of a fruit."
    text, _ = _answer(plain, _chat(plain, question), OutputConstraint.json_object())
    assert isinstance(json.loads(text), dict)
    pattern = r"[0-9]{3}-[0-9]{4}"
    text, _ = _answer(plain, _chat(plain, "A phone number?"), OutputConstraint("regex", pattern))
    assert re.fullmatch(pattern, text), text
    options = ["red", "green", "blue"]
    text, _ = _answer(plain, _chat(plain, "Sky colour?"), OutputConstraint.choices(options))
    assert text in options
    gbnf = 'root ::= "The answer is " ("yes" | "no") "."'
    text, _ = _answer(plain, _chat(plain, "Is water wet?"), OutputConstraint("gbnf", gbnf))
    assert text in ("The answer is yes.", "The answer is no."), text


def test_sampled_answers_validate_and_a_seed_repeats_one(plain):
    schema, question = ASKED["order"]
    constraint = OutputConstraint.json_schema(schema)
    prompt = _chat(plain, question)
    answers = [_answer(plain, prompt, constraint, temperature=1.0, seed=s)[0] for s in (1, 2, 3)]
    for text in answers:
        jsonschema.validate(json.loads(text), schema)
    assert _answer(plain, prompt, constraint, temperature=1.0, seed=2)[0] == answers[1]


def test_batched_sequences_each_follow_their_own_constraint(default_model, plain):
    """Two answers at once on the batching engine, one constrained and one free: each is
    the answer it gets alone."""
    together = TorchRuntime(default_model, n_ctx=1024, threads=2, spec="auto", parallel=2)
    schema, question = ASKED["person"]
    jobs = [
        (_chat(plain, question), OutputConstraint.json_schema(schema)),
        (_chat(plain, "Name three fruits."), None),
    ]
    alone = [_answer(plain, prompt, c, max_tokens=60)[0] for prompt, c in jobs]
    results: dict[int, str] = {}
    # Neither reads (and so steps) before both are queued: the first step holds both, however
    # long the other's grammar takes to build on a slow CPU.
    both_queued = threading.Barrier(2)

    def caller(i: int) -> None:
        queued = lambda _stream: both_queued.wait(timeout=120)  # noqa: E731
        results[i] = _answer(together, *jobs[i], max_tokens=60, on_tokens=queued)[0]

    threads = [threading.Thread(target=caller, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert [results[0], results[1]] == alone
    assert together.scheduler.peak_batch == 2


@pytest.mark.parametrize(
    ("constraint", "named"),
    [
        (OutputConstraint("json_schema", "{not json"), "invalid json_schema"),
        (OutputConstraint.json_schema({"type": "strng"}), "strng"),
        (OutputConstraint("regex", "a(b"), "unclosed group"),
        (OutputConstraint.choices([]), "non-empty list"),
        (OutputConstraint("lark", "start: missing_rule"), "missing_rule"),
        (OutputConstraint("gbnf", "root ::= undefined_rule"), "undefined_rule"),
    ],
)
def test_a_bad_constraint_is_one_line_naming_the_problem(plain, constraint, named):
    with pytest.raises(ConstraintError) as raised:
        token_guide(constraint, plain.tokenizer, 0)
    message = str(raised.value)
    assert named in message and "\n" not in message


def test_an_unknown_kind_is_refused():
    with pytest.raises(ConstraintError, match="unknown kind"):
        OutputConstraint("xml")


def test_the_llamacpp_backend_follows_the_same_constraint(llamacpp_runtime):
    """The oracle backend masks through llama-cpp-python's logits processors."""
    schema, question = ASKED["order"]
    prompt = _chat(llamacpp_runtime, question)
    text, finished = _answer(llamacpp_runtime, prompt, OutputConstraint.json_schema(schema))
    assert finished.reason is FinishReason.END_OF_TURN, text
    jsonschema.validate(json.loads(text), schema)


def test_the_grammar_drafter_proposes_what_the_schema_forces(plain):
    """After `{"` the schema's first key is the only way on: the grammar drafter proposes
    it (verification then accepts it, since the masked target can choose nothing else)."""
    from miniapp.engine.speculative.controller import DraftController
    from miniapp.engine.speculative.grammar import GrammarDrafter
    from miniapp.engine.tokens.sampler import sampler_for

    tokenizer = plain.tokenizer
    prompt = _chat(plain, "A person?")
    constraint = OutputConstraint.json_schema(PERSON)
    sampler = sampler_for(
        SamplingParams(temperature=0, constraint=constraint), tokenizer, len(prompt)
    )
    opening = tokenizer.encode('{"', add_bos=False)
    history = [*prompt, *opening]
    drafter = GrammarDrafter(plain.model)
    draft = drafter.propose(history[-1], DraftController(), [], sampler, history)
    assert draft is not None and draft.pending == history[-1]
    assert tokenizer.decode(draft.tokens).startswith("name"), draft.tokens
    free = sampler_for(SamplingParams(temperature=0), tokenizer, len(prompt))
    assert drafter.propose(history[-1], DraftController(), [], free, history) is None


# An answer with no end of its own: a list of any length of strings of any length.
ENDLESS = {
    "type": "object",
    "properties": {"fruits": {"type": "array", "items": {"type": "string"}}},
    "additionalProperties": {"type": "number"},
}


@pytest.mark.parametrize(("required", "max_tokens"), [(["fruits"], 24), (["fruits", "count"], 40)])
def test_an_answer_near_its_budget_closes_its_value_instead_of_being_cut(
    plain, speculative, required, max_tokens
):
    """Asked for an endless list, the answer fills its budget; in the budget's last tokens
    the guide steers it to close the list (and write the required key still missing), so
    the answer ends its turn in time with a valid value, on the plain and speculative paths."""
    schema = {**ENDLESS, "required": required}
    prompt = _chat(plain, "List every fruit you know, as JSON.")
    constraint = OutputConstraint.json_schema(schema)
    text, finished = _answer(plain, prompt, constraint, max_tokens=max_tokens)
    assert finished.reason is FinishReason.END_OF_TURN, text
    assert finished.stats.generated_tokens <= max_tokens
    jsonschema.validate(json.loads(text), schema)
    assert len(json.loads(text)["fruits"]) >= 2  # the model answered before it was steered
    again, _ = _answer(
        speculative,
        _chat(speculative, "List every fruit you know, as JSON."),
        constraint,
        max_tokens=max_tokens,
    )
    assert again == text


def test_text_that_a_constraint_allows_is_not_cut_short_near_the_budget(plain):
    """Steering is for JSON values (and tagged calls): an answer in text, which a grammar
    may allow to end anywhere, runs to its budget as a free answer would."""
    prompt = _chat(plain, "Describe the sea in a long paragraph.")
    text, finished = _answer(
        plain, prompt, OutputConstraint("regex", "[A-Za-z ,.]+"), max_tokens=16
    )
    assert finished.reason is FinishReason.MAX_TOKENS, text
    assert finished.stats.generated_tokens == 16


def test_a_long_budget_leaves_an_answer_alone(plain):
    """Steering starts only in the budget's last quarter (at most 64 tokens): an answer that
    ends well before it is the same whatever the budget."""
    schema, question = ASKED["person"]
    constraint = OutputConstraint.json_schema(schema)
    prompt = _chat(plain, question)
    text, finished = _answer(plain, prompt, constraint, max_tokens=160)
    used = finished.stats.generated_tokens
    budget = used + 64  # the closing steps start after the answer's last token
    assert _answer(plain, prompt, constraint, max_tokens=budget)[0] == text
    assert _answer(plain, prompt, constraint, max_tokens=1000)[0] == text


def test_the_greedy_check_picks_what_the_whole_mask_picks(plain):
    """A greedy step asks the constraint about the model's best token before masking; over
    random logits along a valid answer, it chooses exactly what masking first chooses."""
    import torch

    from miniapp.engine.tokens.sampler import sampler_for

    schema, question = ASKED["order"]
    prompt = _chat(plain, question)
    constraint = OutputConstraint.json_schema(schema)
    text, _ = _answer(plain, prompt, constraint)
    answer = plain.tokenizer.encode(text, add_bos=False)
    sampler = sampler_for(
        SamplingParams(temperature=0, constraint=constraint), plain.tokenizer, len(prompt)
    )
    masked = token_guide(constraint, plain.tokenizer, len(prompt))
    generator = torch.Generator().manual_seed(0)
    checked = 0
    for step in range(len(answer)):
        history = prompt + answer[:step]
        for scale in (0.5, 8.0):  # flat logits: the best token is often refused; peaked: not
            logits = torch.randn(plain.tokenizer.n_vocab, generator=generator) * scale
            logits[answer[step]] += 3 * scale
            expected = int(torch.argmax(masked.mask_logits(logits, history)))
            assert sampler(logits, history) == expected
            checked += expected == int(torch.argmax(logits))
    assert 0 < checked < 2 * len(answer)  # both ways were taken


def test_closing_tokens_rank_what_ends_the_value_soonest_inside_and_outside_strings():
    import numpy as np

    from miniapp.engine.tokens.constraints import ClosingTokens

    pieces = [b"", b"}", b'"', b",", b"\n  ", b"abc", b'"]', b": [", b'",', b'""', b'""}', b'"a']
    closing = ClosingTokens(pieces, ends=[0])

    def best(generated: list[int], *allowed: int) -> list[int]:
        mask = np.zeros(len(pieces), dtype=bool)
        mask[list(allowed)] = True
        return np.flatnonzero(closing.best(mask, generated)).tolist()

    everything = range(len(pieces))
    assert best([], *everything) == [0]  # the end of the answer first
    outside, inside = [1], [2, 5]  # after `}`; after `"abc`
    assert not closing.in_string(outside) and closing.in_string(inside)
    assert closing.in_string([2, 5, 3, 6]) is False  # `"abc,"]`: closed by the second quote
    # Outside a string a quote opens one, so `"]` and `",` are not closers there.
    assert best(outside, *everything[1:]) == [1, 10]  # a brace, also after an empty string
    assert best(outside, 2, 3, 5, 6, 8, 9, 11) == [9]  # an empty string
    assert best(outside, 1, 3) == [1] and best(outside, 3, 7) == [3]  # a comma comes last
    assert best(outside, 2, 3, 4, 5, 7) == [3]  # a comma
    assert best(outside, 2, 4, 5, 11) == [2, 5, 11]  # anything but whitespace
    assert best(outside, 4) == [4]
    # Inside one, punctuation is text: only a quote ends it.
    assert best(inside, *everything[1:]) == [6]  # the quote, then the bracket
    assert best(inside, 1, 2, 3, 5, 8) == [2]  # a comma would ask for another item
    assert best(inside, 3, 5, 8) == [8]
    assert best(inside, 1, 3, 4, 5) == [1, 3, 5]  # no way out yet: the model's choice
