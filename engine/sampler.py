"""Token sampling on logits: penalties, top-k, top-p, min-p, temperature, seeded draws.

The order follows llama.cpp's default chain (penalties -> top-k -> top-p -> min-p ->
temperature -> draw), so the same settings mean the same thing on both backends.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .sampling import SamplingParams


class Sampler:
    def __init__(self, params: SamplingParams):
        self.params = params
        self._generator = torch.Generator()
        if params.seed is not None:
            self._generator.manual_seed(params.seed)
        else:
            self._generator.seed()

    def __call__(self, logits: torch.Tensor, history: Sequence[int]) -> int:
        """logits: fp32 [vocab]; history: all tokens so far (for the repetition penalty)."""
        p = self.params
        if p.repeat_penalty != 1.0 and p.repeat_last_n != 0 and history:
            logits = apply_repeat_penalty(logits, history[-p.repeat_last_n :], p.repeat_penalty)
        if p.greedy:
            return int(torch.argmax(logits))
        values, ids = _top_k(logits, p.top_k)
        probs = torch.softmax(values, dim=-1)
        keep = _top_p_mask(probs, p.top_p) & _min_p_mask(probs, p.min_p)
        values, ids = values[keep], ids[keep]
        final = torch.softmax(values / p.temperature, dim=-1)
        choice = torch.multinomial(final, 1, generator=self._generator)
        return int(ids[choice])


def apply_repeat_penalty(
    logits: torch.Tensor, recent: Sequence[int], penalty: float
) -> torch.Tensor:
    """llama.cpp's rule: divide positive logits of recent tokens by the penalty, multiply others."""
    ids = torch.tensor(sorted(set(recent)), dtype=torch.long)
    logits = logits.clone()
    chosen = logits[ids]
    logits[ids] = torch.where(chosen > 0, chosen / penalty, chosen * penalty)
    return logits


def _top_k(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Candidates sorted by descending logit: the k best, or all of them."""
    if 0 < k < logits.shape[-1]:
        return torch.topk(logits, k)
    return torch.sort(logits, descending=True)


def _top_p_mask(sorted_probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest prefix whose probability mass reaches top_p (always at least one)."""
    if top_p >= 1.0:
        return torch.ones_like(sorted_probs, dtype=torch.bool)
    mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
    return mass_before < top_p


def _min_p_mask(sorted_probs: torch.Tensor, min_p: float) -> torch.Tensor:
    """Keep candidates at least min_p times as likely as the best one."""
    if min_p <= 0.0:
        return torch.ones_like(sorted_probs, dtype=torch.bool)
    return sorted_probs >= min_p * sorted_probs[0]
