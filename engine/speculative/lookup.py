"""Prompt-lookup drafting: when the last few tokens occurred before (in the prompt or the
answer so far), propose the tokens that followed them then. Free to draft, and right often
on input-grounded answers (summaries, quotes, code edits)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from .drafter import Draft, VerifiedFromTokens

if TYPE_CHECKING:
    from ..kv.cache import Cache
    from ..models.decoder import DecoderModel
    from ..tokens.sampler import Sampler
    from .controller import DraftController

MAX_NGRAM = 4  # longest suffix matched; longer matches are tried first
MIN_NGRAM = 2  # a single-token match proposes too much noise to be worth verifying


class PromptLookup:
    def __init__(self, max_ngram: int = MAX_NGRAM, min_ngram: int = MIN_NGRAM):
        self.sizes = range(max_ngram, min_ngram - 1, -1)
        self.history: list[int] = []
        # n-gram -> where the token after its latest occurrence sits in the history.
        self._next_after: dict[tuple[int, ...], int] = {}

    def extend(self, tokens: Iterable[int]) -> None:
        for token in tokens:
            self.history.append(token)
            end = len(self.history) - 1  # the n-grams ending here are followed by `token`
            for n in self.sizes:
                if end >= n:
                    self._next_after[tuple(self.history[end - n : end])] = end

    def propose(self, max_tokens: int) -> tuple[list[int], int]:
        """Up to `max_tokens` tokens that followed the longest earlier match of the current
        suffix, and the match's length (longer matches are right more often); ([], 0) when
        the suffix is new."""
        for n in self.sizes:
            if len(self.history) < n:
                continue
            start = self._next_after.get(tuple(self.history[-n:]))
            if start is not None:
                return self.history[start : start + max_tokens], n
        return [], 0


class LookupDrafter(VerifiedFromTokens):
    """Prompt lookup as a drafter: proposals cost nothing, and the full model verifies
    [pending, *drafts] in one pass. Acceptance is tracked per match length, since a 4-token
    match that recurs in a quote is worth verifying even when 2-token matches in free text
    are not."""

    name = "lookup"

    def __init__(self, model: DecoderModel):
        self.model = model
        self.lookup = PromptLookup()

    def observe(self, tokens: Sequence[int]) -> None:
        self.lookup.extend(tokens)

    def propose(
        self,
        pending: int,
        controller: DraftController,
        caches: Sequence[Cache],
        sampler: Sampler,
        history: Sequence[int],
    ) -> Draft | None:
        proposal, match = self.lookup.propose(controller.max_draft)
        key = f"{self.name}:{match}"
        count = controller.draft_length(key, len(proposal))
        return Draft(proposal[:count], pending=pending, key=key) if count else None
