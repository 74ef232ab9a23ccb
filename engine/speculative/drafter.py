"""What a drafter is: it proposes tokens after the pending one, and says how the full model
verifies them. The speculative decoder asks its drafters in turn and verifies the first
proposal through one path; a new drafter is a new class here and a line in `build_drafters`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from ..tokens.spec_modes import SpecMode

if TYPE_CHECKING:
    from ..kv.cache import Cache
    from ..models.decoder import DecoderModel
    from ..tokens.sampler import Sampler
    from .controller import DraftController
    from .draft_head import DraftHead
    from .early_exit import EarlyExitDrafter
    from .shallow_head import ShallowBlock


@dataclass
class Draft:
    tokens: list[int]
    probs: list[torch.Tensor] | None = None  # the drafter's distributions (sampling only)
    # What verification reuses (early exit: the layer-E residual stream of the fed tokens,
    # [pending, drafts[:-1]]); None when verification starts from the tokens.
    states: torch.Tensor | None = None
    pending: int = -1  # the token fed before the drafts
    key: str = ""  # what the controller measures acceptance under
    seconds: float = 0.0  # time spent drafting


class Drafter(Protocol):
    name: str

    def observe(self, tokens: Sequence[int]) -> None:
        """Tokens appended to the history (first the prompt, then each accepted token)."""
        ...

    def propose(
        self,
        pending: int,
        controller: DraftController,
        caches: Sequence[Cache],
        sampler: Sampler,
        history: Sequence[int],
    ) -> Draft | None:
        """Drafts after `pending`, as many as the controller allows; None to pass."""
        ...

    def verify(self, caches: Sequence[Cache], draft: Draft) -> Verified:
        """The full model over [pending, *drafts], each row exactly as a decode step computes
        it; the caches then hold every row (trimmed after)."""
        ...


@dataclass(frozen=True)
class Verified:
    states: torch.Tensor  # final-normed states [drafts + 1, dim]
    logits: torch.Tensor  # fp32 [drafts + 1, vocab]


class VerifiedFromTokens:
    """For drafters whose drafts the full model verifies from the tokens alone: one pass
    over [pending, *drafts], each row exactly as a decode step computes it."""

    model: DecoderModel

    def verify(self, caches: Sequence[Cache], draft: Draft) -> Verified:
        rows = torch.tensor([draft.pending, *draft.tokens])
        states = self.model.hidden_states(rows, caches, exact_rows=True)
        return Verified(states, self.model.logits(states))


def build_drafters(
    mode: SpecMode,
    model: DecoderModel,
    early_exit: EarlyExitDrafter | None,
    head: DraftHead | ShallowBlock | None = None,
) -> list[Drafter]:
    """The drafters one generation asks, in order: what a constraint forces and prompt
    lookup (both free to draft) where the mode allows them, then the trained drafting head
    (either form) and early exit where calibration (or `--spec`) made them."""
    from .grammar import GrammarDrafter
    from .lookup import LookupDrafter

    drafters: list[Drafter] = []
    if mode in (SpecMode.AUTO, SpecMode.LOOKUP):
        drafters += [GrammarDrafter(model), LookupDrafter(model)]
    if head is not None:
        from .draft_head import HeadDrafter
        from .shallow_head import ShallowBlock, ShallowExitDrafter

        if isinstance(head, ShallowBlock):
            drafters.append(ShallowExitDrafter(model, head))
        else:
            drafters.append(HeadDrafter(model, head))  # its own: it keeps this sequence's state
    if early_exit is not None:
        drafters.append(early_exit)
    return drafters
