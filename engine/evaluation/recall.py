"""Recall past a full KV cache (`miniapp eval recall`): what each `--kv-policy` keeps.

Once a stream outgrows the cache's budget (S sinks + W more tokens), a policy decides which
W tokens stay. This benchmark measures what that costs in recall: a key/value fact ("The
lock code of the red gate is 4817.") sits at a chosen depth of a filler document some
multiple of the budget long, and the model is asked for the value. Everything is generated
at run time from a seed (word lists and random four-digit numbers, which every bundled
tokenizer splits into single digits), so nothing is tuned to any policy.

Each document holds two facts: the asked one (fact A, at the depth under test) and a second
one (fact B) half the document away. Three kinds of question, all about fact A:

* `inside`: one prompt, the document and then the question; the whole prompt streams
  through the cache, so a policy that chooses at prompt time sees the question.
* `after`: a chat. The document goes first as a turn of its own (the assistant's reply is a
  fixed "OK."), and that turn is evaluated alone, so the cache is compressed before the
  question arrives; the question's turn continues the same caches (the batching scheduler's
  prefix reuse: `cached_prompt_tokens` of the question's generation says how many tokens it
  found cached, and the result reports it).
* `two`: the same chat, first asked about fact B (answered greedily by the model, its answer
  kept in the chat), then about fact A.

Every question's prompt ends with the start of the answer ("The lock code of the red gate
is"), as RULER's needle tasks do, so the value comes next. Each question is scored twice:
exact match (the greedy answer, at most `max_answer_tokens` tokens, contains the value's
digits) and the value's teacher-forced log-probability (the sum of log p over its tokens,
the space before it included). The log-probability comes from the same generation path: a
greedy answer that starts with the value already reports it (SamplingParams.logprobs);
otherwise the value is forced by a one-choice constraint and its tokens' log-probabilities
(the model's own, before the constraint's mask) are read the same way.

Conditions: each policy under test, `window` always among them, and `full`, a cache whose
window covers the whole chat (the upper bound). Each runtime serves every case of its
budget. The caches are emptied before each case's `inside` prompt and again before its chat,
so no case sees another's cache, and the chat never sees a cache that read a question in the
same prompt as the document. The `two` chat starts from the `after` chat's document turn:
the scheduler takes the caches back to it (a rotating ring trims exactly within its slack; a
cache that cannot go back says so, and the turn is then evaluated alone again, counted in
`redone_turns`).

The summary per budget: each condition's exact matches per depth (every question type
pooled), and over the questions whose fact lies outside the window's reach (fact A ends more
than W tokens before the end of the question's prompt) its exact-match rate and mean
log-probability, with each policy's rate over the window's. With `ppl`, each policy's
streaming perplexity on a long text at the same budget (`streaming_perplexity`) and its
ratio to the window's."""

from __future__ import annotations

import logging
import math
import random
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, replace

from ..errors import InputFileError, MiniappError
from ..kv.policies import KV_POLICIES, WINDOW_POLICY
from ..modelfile.template import ChatTemplate, Message
from ..runtimes.base import DEFAULT_SINKS, Runtime
from ..tokens.constraints import OutputConstraint
from ..tokens.sampling import GREEDY
from .perplexity import streaming_perplexity

log = logging.getLogger("miniapp.eval")

FULL = "full"  # the condition whose cache holds everything
QUESTION_TYPES = ("inside", "after", "two")
DEFAULT_BUDGETS = (256, 512, 1024)
DEFAULT_DEPTHS = (0.1, 0.3, 0.5, 0.7, 0.9)
DEFAULT_LENGTHS = (2.0, 4.0)
DEFAULT_POLICIES = ("window", "attention")
MIN_WINDOW = 16  # a budget must leave at least this many tokens beside the sinks
MAX_ANSWER_TOKENS = 8
FULL_MARGIN = 128  # tokens the full cache's window has beyond the longest chat
# A chat turn that finds all but this many of its document turn's tokens cached counts as
# reused (q4 keys evaluate a partly written tile's rows again: 32 of them at most).
REUSE_SHORTFALL = 32

# The facts' words. The filler below never uses any of them, nor digits.
ATTRIBUTES = ("secret code", "pass number", "lock code", "serial number", "ticket number")
COLORS = ("red", "blue", "green", "yellow", "purple", "orange", "silver", "golden", "pink")
THINGS = ("door", "box", "lamp", "boat", "bell", "chest", "gate", "kite", "drum", "vase")

SUBJECTS = (
    "The old farmer",
    "A young teacher",
    "The tired baker",
    "My neighbour",
    "The quiet student",
    "A travelling singer",
    "The night watchman",
    "An elderly fisherman",
    "The village doctor",
    "A curious child",
    "The shopkeeper",
    "Our gardener",
)
VERBS = (
    "walked along",
    "talked about",
    "looked at",
    "cleaned",
    "wrote a letter about",
    "dreamed of",
    "sang about",
    "read a story about",
    "visited",
    "remembered",
    "forgot about",
    "cycled past",
)
PLACES = (
    "the river",
    "a small garden",
    "the market square",
    "the long road",
    "an empty field",
    "the mountain path",
    "the harbour",
    "a quiet forest",
    "the library",
    "the old bridge",
    "a sunny meadow",
    "the busy station",
)
TAILS = (
    "in the morning",
    "after lunch",
    "before the rain came",
    "with great care",
    "for many hours",
    "late at night",
    "during the summer",
    "on a cold day",
    "without a word",
    "with a friend",
    "once again",
    "as usual",
)

DOCUMENT_NOTE = "Remember this text; I will ask you about it."
DOCUMENT_REPLY = "OK."


# -- the generated cases -------------------------------------------------------------------


@dataclass(frozen=True)
class Fact:
    attribute: str
    color: str
    thing: str
    value: str  # four digits

    @property
    def key(self) -> str:
        """'the lock code of the red gate'"""
        return f"the {self.attribute} of the {self.color} {self.thing}"

    @property
    def sentence(self) -> str:
        return f"{self.answer_prefix} {self.value}."

    @property
    def question(self) -> str:
        return f"What is {self.key}?"

    @property
    def answer_prefix(self) -> str:
        """What the assistant's answer starts with in every prompt: the value comes next."""
        return self.key[0].upper() + self.key[1:] + " is"

    @property
    def answer(self) -> str:
        """The text scored after the prefix."""
        return " " + self.value


@dataclass(frozen=True)
class RecallCase:
    """One document: fact A (asked by every question type) at `depth`, fact B (asked first
    in the `two` chat) at `other_depth`. Positions are token indices in the document's own
    tokens (no BOS)."""

    seed: int
    budget: int
    length: float  # the document's length in budgets
    depth: float
    index: int
    document: str
    facts: tuple[Fact, Fact]
    other_depth: float
    doc_tokens: int
    fact_starts: tuple[int, int]  # each fact sentence's first token
    fact_ends: tuple[int, int]  # one past each fact sentence's last token

    @property
    def fact(self) -> Fact:
        return self.facts[0]

    @property
    def position(self) -> float:
        """Fact A's depth as placed: the fraction of the rest of the document (every token
        but its own) that comes before it."""
        own = self.fact_ends[0] - self.fact_starts[0]
        return self.fact_starts[0] / (self.doc_tokens - own)


def other_depth(depth: float) -> float:
    """Fact B's depth: half the document away from fact A's."""
    return round(depth + 0.5 if depth < 0.5 else depth - 0.5, 6)


def _count(tokenizer, text: str) -> int:
    return len(tokenizer.encode(text, add_bos=False, parse_special=False))


def _filler_sentence(rng: random.Random) -> str:
    return f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(PLACES)} {rng.choice(TAILS)}."


def _filler(tokenizer, rng: random.Random, tokens: int) -> list[tuple[str, int]]:
    """Filler sentences, each with its token count (as it stands in running text, after a
    space), until they hold at least `tokens` tokens."""
    sentences, total = [], 0
    while total < tokens:
        sentence = _filler_sentence(rng)
        n = _count(tokenizer, " " + sentence)
        sentences.append((sentence, n))
        total += n
    return sentences


def filler_text(tokenizer, tokens: int, seed: int) -> str:
    """Generated filler of about `tokens` tokens (the perplexity text)."""
    rng = random.Random(f"recall-filler:{seed}:{tokens}")
    return " ".join(s for s, _ in _filler(tokenizer, rng, tokens))


def _facts(rng: random.Random) -> tuple[Fact, Fact]:
    colors = rng.sample(COLORS, 2)
    things = rng.sample(THINGS, 2)
    values = rng.sample(range(1000, 10000), 2)
    return tuple(
        Fact(rng.choice(ATTRIBUTES), color, thing, str(value))
        for color, thing, value in zip(colors, things, values, strict=True)
    )


def make_case(
    tokenizer, budget: int, length: float, depth: float, seed: int, index: int = 0
) -> RecallCase:
    """A document of about length * budget tokens with fact A at `depth` (the fraction of
    the document's other tokens that come before it) and fact B at `other_depth(depth)`;
    the same arguments give the same case."""
    rng = random.Random(f"recall:{seed}:{budget}:{length}:{depth}:{index}")
    facts = _facts(rng)
    fact_sizes = [_count(tokenizer, " " + f.sentence) for f in facts]
    target = max(1, round(length * budget))
    sentences = _filler(tokenizer, rng, max(1, target - sum(fact_sizes)))
    total = sum(n for _, n in sentences) + sum(fact_sizes)
    depths = (depth, other_depth(depth))
    # Fact by fact in order of depth: the sentence boundary whose position in the final
    # document (earlier facts included) is nearest the depth asked.
    starts = [0] + [0] * len(sentences)
    for i, (_, n) in enumerate(sentences):
        starts[i + 1] = starts[i] + n
    slots: dict[int, int] = {}  # fact -> the boundary it goes before
    placed = 0
    lowest = 0
    for which in sorted(range(2), key=lambda k: depths[k]):
        want = depths[which] * (total - fact_sizes[which])
        boundary = min(
            range(lowest, len(sentences) + 1), key=lambda b: abs(starts[b] + placed - want)
        )
        slots[which] = boundary
        placed += fact_sizes[which]
        lowest = boundary
    pieces: list[str] = []
    marks: dict[int, int] = {}  # fact -> its index in pieces
    for b in range(len(sentences) + 1):
        for which in sorted(slots, key=lambda k: depths[k]):
            if slots[which] == b:
                marks[which] = len(pieces)
                pieces.append(facts[which].sentence)
        if b < len(sentences):
            pieces.append(sentences[b][0])
    document = " ".join(pieces)
    fact_starts, fact_ends = [], []
    for which in range(2):
        before = " ".join(pieces[: marks[which]])
        with_fact = " ".join(pieces[: marks[which] + 1])
        fact_starts.append(_count(tokenizer, before) if before else 0)
        fact_ends.append(_count(tokenizer, with_fact))
    return RecallCase(
        seed=seed,
        budget=budget,
        length=length,
        depth=depth,
        index=index,
        document=document,
        facts=facts,
        other_depth=depths[1],
        doc_tokens=_count(tokenizer, document),
        fact_starts=tuple(fact_starts),
        fact_ends=tuple(fact_ends),
    )


def make_cases(
    tokenizer, budget: int, lengths: Iterable[float], depths: Iterable[float], n: int, seed: int
) -> list[RecallCase]:
    return [
        make_case(tokenizer, budget, length, depth, seed, index)
        for length in lengths
        for depth in depths
        for index in range(n)
    ]


# -- prompts -------------------------------------------------------------------------------


@dataclass(frozen=True)
class CasePrompts:
    """A case's token prompts on one model: the `inside` prompt, the chat's document turn
    (evaluated alone first), and the question turns that continue it."""

    inside: list[int]
    document_turn: list[int]
    after: list[int]  # document turn + "OK." + the question about fact A
    two_first: list[int]  # document turn + "OK." + the question about fact B
    fact_end: int  # one past fact A's last token (the same in every prompt of the case)
    # The messages of the `two` chat up to its first question (the second is rendered once
    # the first is answered).
    two_messages: tuple[Message, ...]


class PromptBuilder:
    """Renders cases with the model's chat template, as the app's chats are."""

    def __init__(self, runtime: Runtime):
        self.tokenizer = runtime.tokenizer
        self.template = ChatTemplate.for_model(
            runtime.chat_template, runtime.tokenizer, runtime.architecture
        )

    def _prompt(self, messages: Sequence[Message], prefix: str) -> str:
        return self.template.render(list(messages), add_generation_prompt=True) + prefix

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer.encode_chat(text)

    def extend(self, tokens: list[int], text_before: str, text_after: str) -> list[int]:
        """Tokens of `text_after`, which extends `text_before` (whose tokens are `tokens`):
        the new part encoded alone after them, so that the cached tokens stay a prefix (as
        a chat that reuses its cache sends them). Encoded whole if the template rewrote the
        earlier text."""
        if not text_after.startswith(text_before):
            return self._encode(text_after)
        rest = text_after[len(text_before) :]
        return tokens + self.tokenizer.encode(rest, add_bos=False, parse_special=True)

    def build(self, case: RecallCase) -> CasePrompts:
        a, b = case.facts
        doc = case.document
        inside_text = self._prompt([Message("user", f"{doc}\n\nQuestion: {a.question}")], "")
        inside = self._encode(inside_text + a.answer_prefix)
        # Where fact A ends: the prompt's text up to the end of its sentence.
        fact_at = inside_text.index(a.sentence) + len(a.sentence)
        fact_end = len(self._encode(inside_text[:fact_at]))
        first = Message("user", f"{doc}\n\n{DOCUMENT_NOTE}")
        doc_text = self._prompt([first], "")
        document_turn = self._encode(doc_text)
        chat = (first, Message("assistant", DOCUMENT_REPLY))
        after_text = self._prompt([*chat, Message("user", f"Question: {a.question}")], "")
        after = self.extend(document_turn, doc_text, after_text + a.answer_prefix)
        two_messages = (*chat, Message("user", f"Question: {b.question}"))
        two_text = self._prompt(two_messages, "")
        two_first = self.extend(document_turn, doc_text, two_text + b.answer_prefix)
        return CasePrompts(inside, document_turn, after, two_first, fact_end, two_messages)

    def second_question(
        self, prompts: CasePrompts, case: RecallCase, answer_tokens: list[int]
    ) -> list[int]:
        """The `two` chat's prompt for its second question: the first question's prompt,
        the model's answer (its tokens as generated) and the question about fact A."""
        a, b = case.facts
        first_text = self._prompt(prompts.two_messages, b.answer_prefix)
        answer = self.tokenizer.decode(answer_tokens)
        history = (
            *prompts.two_messages,
            Message("assistant", b.answer_prefix + answer),
            Message("user", f"Question: {a.question}"),
        )
        text = self._prompt(history, a.answer_prefix)
        tokens = prompts.two_first + list(answer_tokens)
        return self.extend(tokens, first_text + answer, text)


# -- answering -----------------------------------------------------------------------------


@dataclass
class _Generated:
    tokens: list[int]
    logprobs: list[float]
    cached: int  # prompt tokens the generation found in the cache
    fed: int  # of `tokens`, those evaluated into the cache (a cut answer's last one is not)


def _generate(runtime: Runtime, prompt: list[int], max_new: int, constraint=None) -> _Generated:
    """Greedy tokens (end of turn left out) with their log-probabilities."""
    params = replace(GREEDY, logprobs=0, constraint=constraint)
    stream = runtime.generate_tokens(prompt, params)
    tokens: list[int] = []
    eog = runtime.tokenizer.eog_ids
    ended = False  # by the end of turn, sampled after every kept token was evaluated
    try:
        for token in stream:
            if token in eog:
                ended = True
                break
            tokens.append(token)
            if len(tokens) >= max_new:
                break
    finally:
        stream.close()
    logprobs = [entry.logprob for entry in (stream.logprobs or [])[: len(tokens)]]
    fed = len(tokens) if ended else max(0, len(tokens) - 1)
    return _Generated(tokens, logprobs, stream.cached_prompt_tokens, fed)


def _evaluate(runtime: Runtime, prompt: list[int]) -> int:
    """Evaluate a prompt alone (a chat turn the user sends, its reply left out); returns the
    prompt tokens found cached."""
    stream = runtime.generate_tokens(prompt, GREEDY)
    try:
        next(stream, None)
    finally:
        stream.close()
    return stream.cached_prompt_tokens


def _without_trailing_space(tokenizer, tokens: list[int]) -> list[int]:
    """An answer as the chat keeps it: trailing blank tokens left out (templates that trim
    a message would drop them, and the cached tokens would no longer be a prefix)."""
    kept = list(tokens)
    while kept and not tokenizer.decode(kept[-1:]).strip():
        kept.pop()
    return kept


@dataclass(frozen=True)
class QuestionScore:
    condition: str  # a policy, or FULL
    budget: int
    length: float
    depth: float
    case: int
    qtype: str
    value: str  # fact A's
    exact: bool
    logprob: float  # the value's teacher-forced log-probability (nats)
    answer: str  # the greedy answer after the prompt's answer prefix
    outside: bool  # fact A is older than the window's W tokens where the question ends
    forced: bool  # the log-probability needed the value forced (the greedy answer missed)
    # Chat turns: the prompt tokens the question's generation found cached, and the tokens
    # of the chat evaluated before it (the document turn; in `two`, the chat up to the first
    # answer, less that answer's last token if it was cut at the limit: never evaluated).
    cached_tokens: int | None = None
    chat_tokens: int | None = None
    first_exact: bool | None = None  # `two`: the first question's (fact B's) exact match


class _Asker:
    """One condition's runtime answering cases' questions."""

    def __init__(self, runtime: Runtime, builder: PromptBuilder, max_answer: int):
        self.runtime, self.builder, self.max_answer = runtime, builder, max_answer
        self.limit: int | None = None  # the full cache's window: no prompt may outgrow it
        self.forced_runs = 0
        self.redone_turns = 0  # document turns evaluated alone again (see `_generate`)

    def _generate(
        self, prompt: list[int], max_new: int, document_turn: list[int] | None, constraint=None
    ) -> _Generated:
        """A chat question (`document_turn` given) must find the document turn in the cache,
        evaluated alone before the question came. If the scheduler could not reuse it (its
        pooled caches could not go back to it), the answer is thrown away, the document turn
        evaluated alone again, and the question asked once more. (Keys in q4 tiles may give
        back a few tokens less: a tile's rows are evaluated again.)"""
        if self.limit is not None and len(prompt) + max_new > self.limit:
            raise MiniappError(
                f"a prompt of {len(prompt)} tokens outgrows the full cache's {self.limit}"
            )
        out = _generate(self.runtime, prompt, max_new, constraint)
        if document_turn is not None and out.cached < len(document_turn) - REUSE_SHORTFALL:
            self.redone_turns += 1
            self.runtime.reset()
            _evaluate(self.runtime, document_turn)
            out = _generate(self.runtime, prompt, max_new, constraint)
        return out

    def ask(
        self, prompt: list[int], fact: Fact, document_turn: list[int] | None = None
    ) -> tuple[bool, float, str, _Generated, bool]:
        """(exact match, the value's log-probability, the greedy answer, its generation,
        whether the value had to be forced)."""
        tokenizer = self.runtime.tokenizer
        greedy = self._generate(prompt, self.max_answer, document_turn)
        text = tokenizer.decode(greedy.tokens)
        exact = fact.value in text
        value = tokenizer.encode(fact.answer, add_bos=False, parse_special=False)
        if greedy.tokens[: len(value)] == value and len(greedy.logprobs) >= len(value):
            return exact, sum(greedy.logprobs[: len(value)]), text, greedy, False
        # The same prompt again (its cached prefix reused), the answer held to the value.
        self.forced_runs += 1
        choice = OutputConstraint.choices([fact.answer])
        forced = self._generate(prompt, len(value) + 4, document_turn, choice)
        logprob, shown = 0.0, ""
        for token, token_logprob in zip(forced.tokens, forced.logprobs, strict=False):
            logprob += token_logprob
            shown += tokenizer.decode([token])
            if len(shown) >= len(fact.answer):
                break
        return exact, logprob, text, greedy, True

    def case(
        self, condition: str, case: RecallCase, prompts: CasePrompts, window: int
    ) -> list[QuestionScore]:
        """The case's three questions: `inside` and the `after` chat each from empty caches;
        the `two` chat continues from the `after` chat's document turn."""
        runtime = self.runtime
        a, b = case.facts
        common = dict(
            condition=condition,
            budget=case.budget,
            length=case.length,
            depth=case.depth,
            case=case.index,
            value=a.value,
        )

        def outside(prompt: list[int]) -> bool:
            """Whether fact A (at the same place in every prompt of the case) lies more than
            the window's W tokens before the prompt's end."""
            return prompts.fact_end <= len(prompt) - window

        scores = []

        runtime.reset()
        exact, logprob, text, _, forced = self.ask(prompts.inside, a)
        scores.append(
            QuestionScore(
                qtype="inside",
                **common,
                exact=exact,
                logprob=logprob,
                answer=text,
                forced=forced,
                outside=outside(prompts.inside),
            )
        )

        runtime.reset()
        _evaluate(runtime, prompts.document_turn)
        exact, logprob, text, greedy, forced = self.ask(prompts.after, a, prompts.document_turn)
        scores.append(
            QuestionScore(
                qtype="after",
                **common,
                outside=outside(prompts.after),
                exact=exact,
                logprob=logprob,
                answer=text,
                forced=forced,
                cached_tokens=greedy.cached,
                chat_tokens=len(prompts.document_turn),
            )
        )

        # The `two` chat starts from the same document turn: the caches go back to it (the
        # prefix reuse of a chat whose user asks something else), or if they cannot,
        # `_generate` evaluates it alone again.
        first = self._generate(prompts.two_first, self.max_answer, prompts.document_turn)
        answer = _without_trailing_space(runtime.tokenizer, first.tokens)
        # The second question continues the chat the first answer left in the cache.
        second = self.builder.second_question(prompts, case, answer)
        exact, logprob, text, greedy, forced = self.ask(second, a, prompts.document_turn)
        scores.append(
            QuestionScore(
                qtype="two",
                **common,
                # Judged at the first question's prompt, the same for every condition (the
                # second one's, after the model's answer, is longer still).
                outside=outside(prompts.two_first),
                exact=exact,
                logprob=logprob,
                answer=text,
                forced=forced,
                cached_tokens=greedy.cached,
                chat_tokens=len(prompts.two_first) + min(len(answer), first.fed),
                first_exact=b.value in runtime.tokenizer.decode(first.tokens),
            )
        )
        return scores


# -- settings and results ------------------------------------------------------------------


def parse_list(text: str, kind: type, flag: str) -> tuple:
    """'256,512' -> (256, 512); one line naming the flag if it is not such a list."""
    try:
        values = tuple(kind(part.strip()) for part in text.split(",") if part.strip())
    except ValueError:
        noun = "whole numbers" if kind is int else "numbers"
        raise MiniappError(f"{flag}: expected comma-separated {noun}, got {text!r}") from None
    if not values:
        raise MiniappError(f"{flag}: expected at least one value, got {text!r}")
    return values


@dataclass(frozen=True)
class RecallSettings:
    budgets: tuple[int, ...] = DEFAULT_BUDGETS  # S + W each
    depths: tuple[float, ...] = DEFAULT_DEPTHS
    lengths: tuple[float, ...] = DEFAULT_LENGTHS  # documents, in budgets
    cases: int = 4  # per (length, depth)
    seed: int = 0
    sinks: int = DEFAULT_SINKS
    policies: tuple[str, ...] = DEFAULT_POLICIES
    ppl: bool = True
    max_answer_tokens: int = MAX_ANSWER_TOKENS

    def __post_init__(self):
        for name in self.policies:
            if name not in KV_POLICIES:
                raise MiniappError(
                    f"--policies: unknown KV policy {name!r} (choose from "
                    f"{', '.join(KV_POLICIES)}; the full cache is always measured)"
                )
        policies = [WINDOW_POLICY] + [p for p in self.policies if p != WINDOW_POLICY]
        object.__setattr__(self, "policies", tuple(dict.fromkeys(policies)))
        for budget in self.budgets:
            if budget < self.sinks + MIN_WINDOW:
                raise MiniappError(
                    f"--budgets: {budget} leaves under {MIN_WINDOW} tokens beside "
                    f"{self.sinks} sinks (use at least {self.sinks + MIN_WINDOW})"
                )
        for depth in self.depths:
            if not 0.0 <= depth <= 1.0 or math.isnan(depth):
                raise MiniappError(f"--depths: {depth} is outside 0..1")
        for length in self.lengths:
            if not length >= 1.0:
                raise MiniappError(f"--lengths: {length} is under 1 (a multiple of the budget)")
        if self.cases < 1:
            raise MiniappError(f"--cases: {self.cases} is under 1")

    @property
    def conditions(self) -> tuple[str, ...]:
        return (FULL, *self.policies)


@dataclass(frozen=True)
class CellScore:
    """One (condition, budget, depth, question type): its questions pooled over lengths and
    cases."""

    condition: str
    budget: int
    depth: float
    qtype: str
    questions: int
    exact: int
    exact_rate: float
    mean_logprob: float
    outside: int  # questions whose fact lies outside the window


@dataclass(frozen=True)
class BudgetSummary:
    budget: int
    sinks: int
    window: int
    # condition -> depth (as text, for JSON) -> exact-match rate over every question type
    exact_by_depth: dict[str, dict[str, float]]
    # Depths at which fact A lies outside the window in every case.
    outside_depths: list[float]
    # condition -> exact-match rate over the questions whose fact lies outside the window
    # (None: no such question), and each policy's rate over the window's.
    outside_exact: dict[str, float | None]
    outside_questions: int
    ratio_to_window: dict[str, float | None]
    outside_logprob: dict[str, float | None]  # the same questions' mean log-probability
    logprob_over_window: dict[str, float | None]  # each policy's mean less the window's
    # Chat turns: prompt tokens found cached, and the chat before the turn, summed over
    # every question of that type (all conditions).
    reuse: dict[str, dict[str, int]]
    ppl: dict[str, float] | None = None  # policy -> streaming perplexity
    ppl_ratio_to_window: dict[str, float] | None = None
    ppl_tokens: int | None = None  # tokens scored
    seconds: float = 0.0


@dataclass(frozen=True)
class RecallResult:
    model: str
    backend: str
    settings: dict
    questions: list[QuestionScore]
    cells: list[CellScore]
    budgets: list[BudgetSummary]
    forced_runs: int
    redone_turns: int
    ppl_text: str  # "generated", or the given text's name
    seconds: float

    def to_dict(self) -> dict:
        return asdict(self)


def _rate(hits: Sequence[bool]) -> float | None:
    return sum(hits) / len(hits) if hits else None


def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _cells(questions: Sequence[QuestionScore]) -> list[CellScore]:
    groups: dict[tuple, list[QuestionScore]] = {}
    for q in questions:
        groups.setdefault((q.condition, q.budget, q.depth, q.qtype), []).append(q)
    cells = []
    for (condition, budget, depth, qtype), group in groups.items():
        exact = sum(q.exact for q in group)
        cells.append(
            CellScore(
                condition,
                budget,
                depth,
                qtype,
                len(group),
                exact,
                exact / len(group),
                sum(q.logprob for q in group) / len(group),
                sum(q.outside for q in group),
            )
        )
    return cells


def _summary(
    budget: int,
    sinks: int,
    conditions: Sequence[str],
    questions: Sequence[QuestionScore],
    ppl: dict[str, float] | None,
    ppl_tokens: int | None,
    seconds: float,
) -> BudgetSummary:
    mine = [q for q in questions if q.budget == budget]
    depths = sorted({q.depth for q in mine})
    exact_by_depth = {
        c: {
            str(d): _rate([q.exact for q in mine if q.condition == c and q.depth == d]) or 0.0
            for d in depths
        }
        for c in conditions
    }
    outside_depths = [d for d in depths if all(q.outside for q in mine if q.depth == d)]
    outside_exact, outside_logprob = {}, {}
    for c in conditions:
        out = [q for q in mine if q.condition == c and q.outside]
        outside_exact[c] = _rate([q.exact for q in out])
        outside_logprob[c] = _mean([q.logprob for q in out])
    base = outside_exact.get(WINDOW_POLICY)
    ratio = {
        c: (outside_exact[c] / base if base and outside_exact[c] is not None else None)
        for c in conditions
        if c not in (FULL, WINDOW_POLICY)
    }
    window_logprob = outside_logprob.get(WINDOW_POLICY)
    gain = {
        c: (
            outside_logprob[c] - window_logprob
            if outside_logprob[c] is not None and window_logprob is not None
            else None
        )
        for c in ratio
    }
    reuse = {}
    for qtype in ("after", "two"):
        turns = [q for q in mine if q.qtype == qtype]
        reuse[qtype] = {
            "cached_tokens": sum(q.cached_tokens or 0 for q in turns),
            "chat_tokens": sum(q.chat_tokens or 0 for q in turns),
            "turns": len(turns),
            "fully_cached": sum((q.cached_tokens or 0) >= (q.chat_tokens or 0) for q in turns),
        }
    ppl_ratio = None
    if ppl and ppl.get(WINDOW_POLICY):
        ppl_ratio = {p: v / ppl[WINDOW_POLICY] for p, v in ppl.items() if p != WINDOW_POLICY}
    return BudgetSummary(
        budget,
        sinks,
        budget - sinks,
        exact_by_depth,
        outside_depths,
        outside_exact,
        sum(q.outside for q in mine if q.condition == FULL),
        ratio,
        outside_logprob,
        gain,
        reuse,
        ppl,
        ppl_ratio,
        ppl_tokens,
        seconds,
    )


# -- the run -------------------------------------------------------------------------------

# (ctx, sinks, window, policy) -> a runtime whose streaming cache is that
RuntimeOpener = Callable[[int, int, int, str], Runtime]


def run_recall(
    open_runtime: RuntimeOpener,
    settings: RecallSettings,
    text: str | None = None,
    text_name: str = "given",
) -> RecallResult:
    """Every budget: cases, each condition's answers to them, and (with settings.ppl) each
    policy's streaming perplexity on `text` (None: generated filler of max(lengths) budgets;
    `text_name` names a given one in the report)."""
    started = time.perf_counter()
    s = settings
    questions: list[QuestionScore] = []
    summaries: list[BudgetSummary] = []
    forced_runs = redone = 0
    model = backend = ""
    for budget in s.budgets:
        budget_started = time.perf_counter()
        window = budget - s.sinks
        first = open_runtime(budget, s.sinks, window, WINDOW_POLICY)
        model, backend = first.model_path.name, first.backend
        if s.ppl and text is not None:
            _check_text(first, text, max(s.budgets) - s.sinks)
        builder = PromptBuilder(first)
        cases = make_cases(first.tokenizer, budget, s.lengths, s.depths, s.cases, s.seed)
        prompts = [builder.build(case) for case in cases]
        # The full cache's window holds the longest chat: the `two` chat's first question,
        # its answer, and the second question's turn (the margin covers that turn).
        longest = max(max(len(p.two_first), len(p.inside)) for p in prompts)
        full_window = longest + s.max_answer_tokens + FULL_MARGIN
        ppl: dict[str, float] | None = {} if s.ppl else None
        ppl_tokens = None
        ppl_text = text
        if s.ppl and ppl_text is None:
            ppl_text = filler_text(first.tokenizer, round(max(s.lengths) * budget), s.seed)
        for condition in s.conditions:
            if condition == WINDOW_POLICY:
                runtime = first
            elif condition == FULL:
                runtime = open_runtime(s.sinks + full_window, s.sinks, full_window, WINDOW_POLICY)
            else:
                # The same budget; a context that holds a whole chat, so that a policy that
                # chooses at a prompt's end (--kv-policy attention) sees all of it first.
                runtime = open_runtime(s.sinks + full_window, s.sinks, window, condition)
            asker = _Asker(runtime, builder, s.max_answer_tokens)
            if condition == FULL:
                asker.limit = full_window
            condition_started = time.perf_counter()
            for case, case_prompts in zip(cases, prompts, strict=True):
                questions.extend(asker.case(condition, case, case_prompts, window))
            forced_runs += asker.forced_runs
            redone += asker.redone_turns
            log.info(
                "budget %d, %s: %d cases in %.1f s",
                budget,
                condition,
                len(cases),
                time.perf_counter() - condition_started,
            )
            if ppl is not None and condition != FULL:
                result = streaming_perplexity(runtime, ppl_text, s.sinks, window)
                ppl[condition], ppl_tokens = result.ppl, result.tokens
            if runtime is not first:
                runtime.close()
        first.close()
        summaries.append(
            _summary(
                budget,
                s.sinks,
                s.conditions,
                questions,
                ppl,
                ppl_tokens,
                time.perf_counter() - budget_started,
            )
        )
    return RecallResult(
        model=model,
        backend=backend,
        settings=asdict(s),
        questions=questions,
        cells=_cells(questions),
        budgets=summaries,
        forced_runs=forced_runs,
        redone_turns=redone,
        ppl_text=text_name if text is not None else "generated",
        seconds=time.perf_counter() - started,
    )


def _check_text(runtime: Runtime, text: str, window: int) -> None:
    """The perplexity text must outgrow the largest window (checked before the long part)."""
    tokens = len(runtime.tokenizer.encode(text, parse_special=False))
    if tokens <= window + 1:
        raise InputFileError(
            f"--text has {tokens} tokens; a window of {window} needs more to score any"
        )


# -- the report ----------------------------------------------------------------------------


def format_report(result: RecallResult) -> str:
    """A table per budget (rows: depth; per condition: exact matches and mean answer
    log-probability over every question type), then its summary lines."""
    s = result.settings
    conditions = (FULL, *s["policies"])
    lines = [
        f"{result.model}, {result.backend}: recall of a four-digit value; "
        f"{s['cases']} case(s) per depth and length (lengths {_numbers(s['lengths'])} x the "
        f"budget), 3 questions each (inside, after, two); greedy, seed {s['seed']}"
    ]
    for summary in result.budgets:
        mine = [c for c in result.cells if c.budget == summary.budget]
        lines.append("")
        lines.append(
            f"budget {summary.budget} ({summary.sinks} sinks + window {summary.window}): "
            "exact matches / mean log p(value)"
        )
        header = f"  {'depth':>5}  {'outside':>7}" + "".join(f"  {c:>16}" for c in conditions)
        lines.append(header)
        for depth in sorted({c.depth for c in mine}):
            row = [c for c in mine if c.depth == depth]
            base = [c for c in row if c.condition == FULL]
            total = sum(c.questions for c in base)
            outside = sum(c.outside for c in base)
            line = f"  {depth:>5.2f}  {outside:>3}/{total:<3}"
            for condition in conditions:
                cells = [c for c in row if c.condition == condition]
                n = sum(c.questions for c in cells)
                hits = sum(c.exact for c in cells)
                mean = sum(c.mean_logprob * c.questions for c in cells) / n
                line += f"  {f'{hits}/{n}':>7} {mean:>8.2f}"
            lines.append(line)
        by_type = []
        for qtype in QUESTION_TYPES:
            parts = []
            for condition in conditions:
                cells = [c for c in mine if c.condition == condition and c.qtype == qtype]
                parts.append(
                    f"{condition} {sum(c.exact for c in cells)}/{sum(c.questions for c in cells)}"
                )
            by_type.append(f"{qtype}: " + ", ".join(parts))
        lines.append("  by question: " + "; ".join(by_type))
        out, logprob = summary.outside_exact, summary.outside_logprob
        lines.append(
            f"  fact outside the window ({summary.outside_questions} questions a condition): "
            + ", ".join(f"{c} {_pct(out[c])}" for c in conditions)
            + "".join(f"; {p}/window {_ratio(r)}" for p, r in summary.ratio_to_window.items())
            + "; mean log p(value) "
            + ", ".join(f"{c} {_logprob(logprob[c])}" for c in conditions)
            + "".join(
                f" ({p} {_logprob(g, signed=True)} over window)"
                for p, g in summary.logprob_over_window.items()
            )
        )
        for qtype, reuse in summary.reuse.items():
            lines.append(
                f"  {qtype} turns: {reuse['cached_tokens']}/{reuse['chat_tokens']} tokens of "
                f"the chat before them found cached ({reuse['fully_cached']}/{reuse['turns']} "
                "turns whole)"
            )
        if summary.ppl:
            lines.append(
                f"  perplexity ({result.ppl_text}, {summary.ppl_tokens} tokens scored): "
                + ", ".join(
                    f"{p} {v:.3f}"
                    + (
                        f" ({summary.ppl_ratio_to_window[p]:.3f}x window)"
                        if summary.ppl_ratio_to_window and p in summary.ppl_ratio_to_window
                        else ""
                    )
                    for p, v in summary.ppl.items()
                )
            )
    lines.append(
        f"values forced for their log-probability: {result.forced_runs}; document turns "
        f"evaluated again: {result.redone_turns}; {result.seconds:.1f} s"
    )
    return "\n".join(lines)


def _numbers(values: Sequence[float]) -> str:
    return ",".join(f"{v:g}" for v in values)


def _pct(rate: float | None) -> str:
    return "-" if rate is None else f"{rate:.0%}"


def _logprob(value: float | None, signed: bool = False) -> str:
    return "-" if value is None else f"{value:+.2f}" if signed else f"{value:.2f}"


def _ratio(rate: float | None) -> str:
    return "-" if rate is None else f"{rate:.2f}"
