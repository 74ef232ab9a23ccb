"""Deciding how many drafted tokens the full model keeps, so that the output is exactly what
plain decoding would produce.

Greedy: a draft survives while it equals the target's own choice. Sampling: rejection
sampling (accept draft d with probability min(1, p(d) / q(d)); on a reject, draw from
normalize(max(p - q, 0)); after a fully accepted draft, draw a bonus token from p). That
keeps every emitted token distributed exactly as the target's p, whatever the drafter's q.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Verdict:
    accepted: int  # leading drafted tokens kept
    next_token: int  # the target's token after them: a correction, or the bonus


def accept_greedy(drafts: Sequence[int], target_token: Callable[[int], int]) -> Verdict:
    """`target_token(j)`: the target's choice after the prefix plus drafts[:j]."""
    for j, draft in enumerate(drafts):
        chosen = target_token(j)
        if chosen != draft:
            return Verdict(j, chosen)
    return Verdict(len(drafts), target_token(len(drafts)))


def accept_sampled(
    drafts: Sequence[int],
    draft_probs: Sequence[torch.Tensor | None],
    target_probs: Callable[[int], torch.Tensor],
    uniform: Callable[[], float],
    draw: Callable[[torch.Tensor], int],
) -> Verdict:
    """`draft_probs[j]`: the drafter's dense distribution for drafts[j], or None when the
    drafter proposed it with certainty (prompt lookup); `target_probs(j)`: the target's
    distribution after the prefix plus drafts[:j]."""
    for j, draft in enumerate(drafts):
        p, q = target_probs(j), draft_probs[j]
        q_draft = 1.0 if q is None else float(q[draft])
        if uniform() * q_draft < float(p[draft]):  # probability min(1, p/q)
            continue
        if q is None:
            residual = p.clone()
            residual[draft] = 0.0
        else:
            residual = (p - q).clamp_(min=0.0)
        total = float(residual.sum())
        if total <= 0.0:  # only by rounding: p and q agree wherever p has mass
            residual, total = p, float(p.sum())
        return Verdict(j, draw(residual / total))
    return Verdict(len(drafts), draw(target_probs(len(drafts))))
