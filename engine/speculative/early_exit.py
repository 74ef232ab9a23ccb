"""Self-speculative drafting from the model's own first layers (LayerSkip-style).

A draft token comes from the residual stream after `layer` layers, through an optional exit
adapter, the final norm and the output head. Drafting runs those first layers one token at a
time, exactly as decoding would, so their KV entries are already final: verification runs
only the remaining layers, over the drafted positions' saved layer-`layer` states.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Protocol

import torch

from ..kv.cache import Cache
from ..models.decoder import DecoderModel
from ..tokens.sampler import Sampler
from .drafter import Draft, Verified

if TYPE_CHECKING:
    from .controller import DraftController


class ExitAdapter(Protocol):
    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """Layer-E residual stream [n, dim] -> an estimate of the last layer's [n, dim]."""
        ...

    def to(self, device: torch.device) -> ExitAdapter:
        """The adapter with its weights on `device`."""
        ...


class EarlyExitDrafter:
    name = "early-exit"

    def __init__(
        self,
        model: DecoderModel,
        layer: int,
        adapter: ExitAdapter | None = None,
        max_draft: int | None = None,
    ):
        if not 0 < layer < model.config.n_layers:
            raise ValueError(f"exit layer {layer} outside 1..{model.config.n_layers - 1}")
        if adapter is not None:  # it runs beside the output head
            adapter = adapter.to(model.head_device)
        self.model, self.layer, self.adapter = model, layer, adapter
        self.max_draft = max_draft  # None: as many as the controller likes

    def observe(self, tokens: Sequence[int]) -> None:
        pass  # drafts come from the model's own layers, not from the history

    def propose(
        self,
        pending: int,
        controller: DraftController,
        caches: Sequence[Cache],
        sampler: Sampler,
        history: Sequence[int],
    ) -> Draft | None:
        count = controller.draft_length(self.name, self.max_draft)
        if not count:
            return None
        start = time.perf_counter()
        draft = self.draft(caches, pending, count, sampler, history)
        if not draft.tokens:  # a gate closed at once: a plain step feeds `pending` again
            for cache in caches[: self.layer]:
                cache.trim(1)
            return None
        return replace(draft, key=self.name, seconds=time.perf_counter() - start)

    def exit_logits(self, states: torch.Tensor) -> torch.Tensor:
        """Draft logits [n, vocab] from layer-E states [n, dim]."""
        states = states.to(self.model.head_device)
        if self.adapter is not None:
            states = self.adapter.forward(states)
        return self.model.logits(self.model.final_norm(states))

    def draft(
        self,
        caches: Sequence[Cache],
        pending: int,
        count: int,
        sampler: Sampler,
        history: Sequence[int],
    ) -> Draft:
        """Feed `pending` and then each draft through the first layers; `count` drafts."""
        tokens: list[int] = []
        probs: list[torch.Tensor] = []
        states = []
        token = pending
        for _ in range(count):
            state = self.early_state(token, caches)
            states.append(state)
            logits = self.exit_logits(state)[0]
            context = [*history, *tokens]
            if sampler.params.greedy:
                token = sampler(logits, context)
            else:
                q = sampler.distribution(logits, context)
                probs.append(q)
                token = sampler.draw(q)
            tokens.append(token)
        return Draft(tokens, probs if probs else None, torch.cat(states), pending=pending)

    def verify(self, caches: Sequence[Cache], draft: Draft) -> Verified:
        """The full model over [pending, *drafts]: the last draft still needs the first
        layers; every row then needs the remaining ones."""
        states = torch.cat([draft.states, self.early_state(draft.tokens[-1], caches)])
        model = self.model
        out = model.run_layers(states, caches, self.layer, model.config.n_layers, exact_rows=True)
        normed = model.final_norm(out)
        return Verified(normed, model.logits(normed))

    def early_state(self, token: int, caches: Sequence[Cache]) -> torch.Tensor:
        """Feed one token through the first layers (a decode step's exact computation)."""
        model = self.model
        x = model.embed_tokens(torch.tensor([token]))
        return model.run_layers(x, caches, 0, self.layer)
