"""Constrained decoding: answers that must match a JSON schema, any JSON object, a regular
expression, a list of choices, or a Lark or GBNF grammar.

llguidance (the grammar engine llama.cpp uses for JSON schemas) compiles the constraint and,
at every step, says which tokens may come next; the sampler sets every other token's logit to
-inf before it chooses. It reads our own llama.cpp vocabulary, so its tokens are ours.

A `TokenGuide` follows one generation. It is told the whole history at each call, not fed
token by token, so speculative verification (which asks about drafts that may be rejected)
and the drafters (which ask about their own drafts) need nothing special: the guide rolls its
matcher back to the common prefix and consumes the rest.
"""

from __future__ import annotations

import functools
import json
import threading
import warnings
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import TYPE_CHECKING

import numpy as np

from ..errors import MiniappError

if TYPE_CHECKING:
    from .tokenizer import Tokenizer


# Between JSON tokens: nothing, one space, or one line break and an indent of up to 20 (the
# rule llama.cpp's JSON grammars use). llguidance's default allows any run of whitespace, and
# a small model then spends its answer on blank lines or never closes the value.
JSON_OPTIONS = {"whitespace_flexible": True, "whitespace_pattern": r"( |\n[ \t]{0,20})?"}


class ConstraintError(MiniappError):
    """A schema, pattern or grammar that cannot be compiled (one line naming the problem)."""


class ConstraintKind(StrEnum):
    JSON_SCHEMA = "json_schema"  # source: the schema, as JSON text
    JSON = "json"  # any JSON object; source unused
    REGEX = "regex"
    CHOICES = "choices"  # source: a JSON list of strings
    LARK = "lark"
    GBNF = "gbnf"  # llama.cpp's grammar format, converted to Lark by llguidance


@dataclass(frozen=True)
class OutputConstraint:
    """What the answer must match. Hashable and plain, so it travels in SamplingParams."""

    kind: ConstraintKind
    source: str = ""
    # The answer's token budget (max_tokens): in its last `closing_reserve` tokens the guide
    # steers toward ending the value, so a budget-cut answer still parses. None: no budget.
    within_tokens: int | None = None

    def __post_init__(self):
        try:
            object.__setattr__(self, "kind", ConstraintKind(self.kind))
        except ValueError:
            raise ConstraintError(f"unknown kind of constraint: {self.kind!r}") from None

    @classmethod
    def json_schema(cls, schema: dict | bool) -> OutputConstraint:
        return cls(ConstraintKind.JSON_SCHEMA, json.dumps(schema))

    @classmethod
    def json_object(cls) -> OutputConstraint:
        return cls(ConstraintKind.JSON)

    @classmethod
    def choices(cls, options: Sequence[str]) -> OutputConstraint:
        return cls(ConstraintKind.CHOICES, json.dumps(list(options)))

    def grammar(self) -> str:
        """The llguidance grammar, checked: ConstraintError (one line) if it is not valid.
        Compiled once per constraint: a request checks it, then its generation builds on it."""
        return _checked_grammar(replace(self, within_tokens=None))

    def within(self, max_tokens: int) -> OutputConstraint:
        """The same constraint for an answer of at most `max_tokens` tokens."""
        return replace(self, within_tokens=max_tokens)

    def _compile(self) -> str:
        import llguidance

        try:
            grammar = self._grammar(llguidance.LLMatcher)
        except Exception as exc:  # the converters raise their own kinds for bad input
            raise ConstraintError(f"invalid {self.kind.value}: {_one_line(exc)}") from None
        problem = llguidance.LLMatcher.validate_grammar(grammar)
        if problem:
            raise ConstraintError(f"invalid {self.kind.value}: {_one_line(problem)}")
        return grammar

    def _grammar(self, matcher) -> str:
        if self.kind is ConstraintKind.JSON_SCHEMA:
            return matcher.grammar_from_json_schema(json.loads(self.source), JSON_OPTIONS)
        if self.kind is ConstraintKind.JSON:
            return matcher.grammar_from_json_schema({"type": "object"}, JSON_OPTIONS)
        if self.kind is ConstraintKind.REGEX:
            return matcher.grammar_from_regex(self.source)
        if self.kind is ConstraintKind.CHOICES:
            options = json.loads(self.source)
            if not options or not all(isinstance(o, str) for o in options):
                raise ValueError("choices must be a non-empty list of strings")
            return matcher.grammar_from_lark("start: " + " | ".join(json.dumps(o) for o in options))
        if self.kind is ConstraintKind.GBNF:
            from llguidance.gbnf_to_lark import gbnf_to_lark

            return matcher.grammar_from_lark(gbnf_to_lark(self.source))
        return matcher.grammar_from_lark(self.source)


@functools.lru_cache(maxsize=64)
def _checked_grammar(constraint: OutputConstraint) -> str:
    return constraint._compile()


def _one_line(exc: object) -> str:
    return " ".join(str(exc).split())[:300]


def closing_reserve(max_tokens: int) -> int:
    """How many of an answer's last tokens steer toward closing its value: a quarter of the
    budget, between 8 and 64 (enough to close nested objects and write the required keys
    left; measured on assets/schemas, docs/BENCHMARKS.md)."""
    return min(64, max(8, max_tokens // 4))


class ClosingTokens:
    """The tokens that bring a JSON value nearer its end, best first. What a token does
    depends on whether the text so far is inside a string, so there are two rankings:

    - inside a string: a quote that ends it, then a closing bracket or brace (`"]`, `"}`),
      then such a quote and a comma (`"],`), then the quote alone (`"`), then `",`;
    - outside: a closing bracket or brace with only blanks, colons and empty strings around
      it (`}`, `]}`, `""}`), then the same with a comma (`],`), then an empty string (`""`),
      then a comma or colon, alone or after an empty string.

    A comma ranks low because it asks for another item or key. The end of the answer comes
    before all of them, and anything but pure whitespace after. Only answers that are JSON
    values or tagged calls are steered (`structured`): a grammar's text may end anywhere."""

    _PUNCTUATION = frozenset(b",:]} \t\r\n")
    _RANKS = 5  # the end of the answer, then four kinds of punctuation

    def __init__(self, pieces: Sequence[bytes], ends: Sequence[int]):
        n = len(pieces)
        self._pieces = pieces
        self._inside = [np.zeros(n, dtype=bool) for _ in range(self._RANKS)]
        self._outside = [np.zeros(n, dtype=bool) for _ in range(self._RANKS)]
        self._blank = np.zeros(n, dtype=bool)
        for ranks in (self._inside, self._outside):
            ranks[0][list(ends)] = True
        for token, piece in enumerate(pieces):
            if not piece or token in ends:
                continue
            self._blank[token] = not piece.strip()
            if piece[:1] == b'"':
                self._place(self._inside, token, piece[1:], quoted=True)
            if piece.strip():
                self._place(self._outside, token, piece.replace(b'""', b""), b'""' in piece)

    @classmethod
    def _place(cls, ranks: list[np.ndarray], token: int, rest: bytes, quoted: bool) -> None:
        """Rank a token by `rest`, what it holds besides the quote(s) that end or make a
        string: punctuation only, else it is not a closer."""
        if not cls._PUNCTUATION.issuperset(rest):
            return
        comma = b"," in rest
        if b"]" in rest or b"}" in rest:
            ranks[2 if comma else 1][token] = True
        elif quoted and not comma:
            ranks[3][token] = True
        elif comma or b":" in rest or quoted:
            ranks[4][token] = True

    def best(self, allowed: np.ndarray, generated: Sequence[int]) -> np.ndarray:
        """The best-ranked non-empty part of `allowed`, after the tokens `generated`."""
        n = len(allowed)
        ranks = self._inside if self.in_string(generated) else self._outside
        for rank in ranks:
            chosen = allowed & rank[:n]
            if chosen.any():
                return chosen
        solid = allowed & ~self._blank[:n]
        return solid if solid.any() else allowed

    def structured(self, tokens: Sequence[int]) -> bool:
        """Whether the text of `tokens` begins as a JSON object, array or string, or as
        calls in <tool_call> tags: the answers the rankings are for."""
        text = self._text(tokens).lstrip()
        return text[:1] in (b"{", b"[", b'"') or text.startswith(b"<tool_call>")

    def _text(self, tokens: Sequence[int]) -> bytes:
        return b"".join(self._pieces[t] for t in tokens)

    def in_string(self, tokens: Sequence[int]) -> bool:
        """Whether the text of `tokens` ends inside a JSON string."""
        inside = escaped = False
        for byte in self._text(tokens):
            if escaped:
                escaped = False
            elif inside and byte == 0x5C:  # a backslash escapes the next character
                escaped = True
            elif byte == 0x22:  # a quote opens or closes a string
                inside = not inside
        return inside


class TokenGuide:
    """One generation's matcher: which tokens may follow the tokens generated so far.

    Given a budget, the guide narrows the allowed tokens in the budget's last
    `closing_reserve` tokens to those that end the value soonest (`ClosingTokens`), in
    answers that are JSON values or tagged calls: a small model looping inside a number or
    a string would otherwise be cut mid-value."""

    def __init__(
        self,
        matcher,
        n_vocab: int,
        prompt_tokens: int,
        budget: int | None = None,
        closing: Callable[[], ClosingTokens] | None = None,
    ):
        self._matcher = matcher
        self._n_vocab = n_vocab
        self._start = prompt_tokens  # history[:start] is the prompt, not constrained
        self._consumed: list[int] = []
        self._closing_from = None if budget is None else budget - closing_reserve(budget)
        self._closing = closing

    def mask_logits(self, logits, history: Sequence[int]):
        """torch `logits` [vocab] for the token after `history`, forbidden tokens at -inf."""
        import torch  # here, so that the constraint itself stays importable without torch

        allowed = torch.from_numpy(self.allowed_after(history))
        n = min(len(allowed), logits.shape[-1])
        masked = logits.clone()
        masked[:n].masked_fill_(~allowed[:n], float("-inf"))
        masked[n:] = float("-inf")
        return masked

    def mask_scores(self, history: Sequence[int], scores: np.ndarray) -> np.ndarray:
        """The same for numpy scores (llama-cpp-python's logits processors)."""
        allowed = self.allowed_after(history)
        n = min(len(allowed), scores.shape[-1])
        masked = np.full_like(scores, -np.inf)
        masked[:n] = np.where(allowed[:n], scores[:n], masked[:n])
        return masked

    def allowed_after(self, history: Sequence[int]) -> np.ndarray:
        """bool [vocab]: the tokens the constraint allows after `history` (near the end of
        the budget, only those that close the value soonest)."""
        self._follow(history[self._start :])
        allowed = self.allowed()
        if self.steers(history):
            return self._closing().best(allowed, self._consumed)
        return allowed

    def steers(self, history: Sequence[int]) -> bool:
        """Whether the token after `history` is steered toward closing: in the budget's last
        `closing_reserve` tokens, and only in an answer that is a JSON value or tagged calls
        (text, which a grammar may also allow, is not cut short)."""
        generated = len(history) - self._start
        if self._closing_from is None or generated < self._closing_from:
            return False
        self._follow(history[self._start :])
        return self._closing().structured(self._consumed)

    def allows(self, history: Sequence[int], token: int) -> bool:
        """Whether `token` may follow `history`, without computing the whole mask (so only
        where the guide does not steer: there the mask is not the matcher's alone)."""
        if self.steers(history):
            raise ValueError("allows() does not apply where the guide steers")
        self._follow(history[self._start :])
        return self._matcher.validate_tokens([token]) == 1

    def forced_after(self, history: Sequence[int]) -> list[int]:
        """The tokens the constraint forces after `history` (none where it allows a choice)."""
        self._follow(history[self._start :])
        return list(self._matcher.compute_ff_tokens())

    def allowed(self) -> np.ndarray:
        """bool [vocab]: the tokens the constraint allows next."""
        bits = np.frombuffer(self._matcher.compute_bitmask(), dtype=np.uint8)
        return np.unpackbits(bits, bitorder="little")[: self._n_vocab].astype(bool)

    def _follow(self, generated: Sequence[int]) -> None:
        kept = 0
        for a, b in zip(self._consumed, generated, strict=False):
            if a != b:
                break
            kept += 1
        if kept < len(self._consumed):
            self._matcher.rollback(len(self._consumed) - kept)
            del self._consumed[kept:]
        for token in map(int, generated[kept:]):
            if not self._matcher.consume_token(token):
                raise ConstraintError(
                    f"token {token} broke the constraint: {_one_line(self._matcher.get_error())}"
                )
            self._consumed.append(token)


# Building llguidance's view of a vocabulary reads every token (about a second for 260k), so
# each tokenizer's is built once.
_LL_TOKENIZERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_LL_LOCK = threading.Lock()


def _ll_tokenizer(tokenizer: Tokenizer):
    from llguidance.llamacpp import lltokenizer_from_vocab

    with _LL_LOCK:
        built = _LL_TOKENIZERS.get(tokenizer)
        if built is None:
            with warnings.catch_warnings():  # it calls a deprecated name once per token
                warnings.simplefilter("ignore", DeprecationWarning)
                ends = _end_tokens(tokenizer)
                built = lltokenizer_from_vocab(tokenizer.vocab_handle, eos_token=ends)
            _LL_TOKENIZERS[tokenizer] = built
        return built


def _end_tokens(tokenizer: Tokenizer) -> list[int]:
    """Any end-of-generation token ends a constrained answer (an instruct model's end of
    turn, not only its end of text)."""
    return sorted(tokenizer.eog_ids) or [tokenizer.eos_id]


_CLOSING: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _closing_tokens(tokenizer: Tokenizer) -> ClosingTokens:
    """The tokenizer's ClosingTokens, built the first time an answer needs them (half a
    second for 260k tokens)."""
    with _LL_LOCK:
        built = _CLOSING.get(tokenizer)
        if built is None:
            built = ClosingTokens(tokenizer.pieces(), _end_tokens(tokenizer))
            _CLOSING[tokenizer] = built
        return built


def token_guide(
    constraint: OutputConstraint, tokenizer: Tokenizer, prompt_tokens: int
) -> TokenGuide:
    """A fresh guide for one generation whose prompt is `prompt_tokens` long."""
    import llguidance

    matcher = llguidance.LLMatcher(_ll_tokenizer(tokenizer), constraint.grammar(), log_level=0)
    if matcher.is_error():
        raise ConstraintError(f"invalid {constraint.kind.value}: {_one_line(matcher.get_error())}")
    closing = functools.partial(_closing_tokens, tokenizer)
    return TokenGuide(matcher, tokenizer.n_vocab, prompt_tokens, constraint.within_tokens, closing)
