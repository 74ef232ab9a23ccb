"""Drafting what the constraint forces: where a JSON schema or grammar allows only one
continuation (the next key of an object, a closing quote and colon), those tokens are the
draft. The masked target can choose nothing else, so they are always accepted, and the full
model evaluates them in one pass instead of one step each."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from .drafter import Draft, VerifiedFromTokens

if TYPE_CHECKING:
    from ..kv.cache import Cache
    from ..models.decoder import DecoderModel
    from ..tokens.sampler import Sampler
    from .controller import DraftController


class GrammarDrafter(VerifiedFromTokens):
    name = "grammar"

    def __init__(self, model: DecoderModel):
        self.model = model

    def observe(self, tokens: Sequence[int]) -> None:
        pass  # it drafts from the constraint, not from the text so far

    def propose(
        self,
        pending: int,
        controller: DraftController,
        caches: Sequence[Cache],
        sampler: Sampler,
        history: Sequence[int],
    ) -> Draft | None:
        if sampler.guide is None:
            return None
        # Certain tokens always pay for their verification row, so the controller's
        # acceptance estimate is not asked; only its length cap applies.
        forced = sampler.guide.forced_after(history)[: controller.max_draft]
        return Draft(forced, pending=pending, key=self.name) if forced else None
