"""The torch engine's token sampler: penalties, top-k, top-p, min-p, temperature, seeded draws
on logits (the settings themselves are `SamplingParams`, in sampling.py).

The order follows llama.cpp's default chain (penalties -> top-k -> top-p -> min-p ->
temperature -> draw), so the same settings mean the same thing on both backends.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from .constraints import TokenGuide, token_guide
from .sampling import SamplingParams, TokenLogprob
from .tokenizer import Tokenizer


class Sampler:
    def __init__(self, params: SamplingParams, guide: TokenGuide | None = None):
        self.params = params
        self.guide = guide  # the constraint's matcher, when the answer has one
        self._generator = torch.Generator()
        if params.seed is not None:
            self._generator.manual_seed(params.seed)
        else:
            self._generator.seed()

    def __call__(self, logits: torch.Tensor, history: Sequence[int]) -> int:
        """logits: fp32 [vocab]; history: all tokens so far (for the repetition penalty)."""
        if self.params.greedy:
            return self._greedy(logits, history)
        logits = self._penalized(self._guided(logits, history), history)
        final, ids = self._candidates(logits)
        # By inverse CDF of one uniform, as a GPU's step draws (device_sampler.py): a seeded
        # answer is the same whichever of the two drew each of its tokens.
        return int(ids[inverse_cdf(final, torch.tensor(self.uniform()))])

    def distribution(self, logits: torch.Tensor, history: Sequence[int]) -> torch.Tensor:
        """The probabilities __call__ draws from, dense fp32 [vocab] (speculative decoding
        compares the drafter's with the target's). Sampling only, not greedy."""
        final, ids = self._candidates(self._penalized(self._guided(logits, history), history))
        return torch.zeros(logits.shape[-1]).index_put_((ids,), final)

    def draw(self, probs: torch.Tensor) -> int:
        """One token from a dense distribution, with this sampler's random stream."""
        return int(torch.multinomial(probs, 1, generator=self._generator))

    def uniform(self) -> float:
        """A draw from U[0, 1) on this sampler's random stream (acceptance tests)."""
        return float(torch.rand((), generator=self._generator))

    def rewind_point(self) -> Callable[[], None]:
        """A call that puts this sampler's random stream back where it is now: draws made
        for a step queued ahead, then undone, are drawn again by the step that replaces it
        (so a seeded answer does not depend on whether steps overlapped)."""
        state = self._generator.get_state()
        return lambda: self._generator.set_state(state)

    def _greedy(self, logits: torch.Tensor, history: Sequence[int]) -> int:
        """The best token. Under a constraint, the unmasked best is asked about first: when
        the constraint allows it, it is also the masked best (ties too: argmax takes the
        first), and the whole mask, a pass over the vocabulary, is skipped."""
        logits = self._penalized(logits, history)  # -inf stays -inf, so before masking too
        best = int(torch.argmax(logits))
        guide = self.guide
        if guide is None or (not guide.steers(history) and guide.allows(history, best)):
            return best
        return int(torch.argmax(guide.mask_logits(logits, history)))

    def _guided(self, logits: torch.Tensor, history: Sequence[int]) -> torch.Tensor:
        return logits if self.guide is None else self.guide.mask_logits(logits, history)

    def _penalized(self, logits: torch.Tensor, history: Sequence[int]) -> torch.Tensor:
        p = self.params
        if p.repeat_last_n == 0 or not history:
            return logits
        recent = history[-p.repeat_last_n :]
        if p.repeat_penalty != 1.0:
            logits = apply_repeat_penalty(logits, recent, p.repeat_penalty)
        if p.presence_penalty or p.frequency_penalty:
            logits = apply_presence_frequency(
                logits, recent, p.presence_penalty, p.frequency_penalty
            )
        return logits

    def _candidates(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(probabilities, token ids) of the tokens that survive top-k/top-p/min-p."""
        p = self.params
        values, ids = _top_k(logits, p.top_k)
        probs = torch.softmax(values, dim=-1)
        keep = _top_p_mask(probs, p.top_p) & _min_p_mask(probs, p.min_p)
        values, ids = values[keep], ids[keep]
        if p.temperature < SHIFTED_BELOW_TEMPERATURE:  # logits / a tiny temperature overflow
            return torch.softmax((values - values[0]) / p.temperature, dim=-1), ids
        return torch.softmax(values / p.temperature, dim=-1), ids


# Below this temperature the candidates' logits are shifted by the best one's before they
# are divided (values[0]: they are sorted), so that none overflows; above it they are divided
# as they are, which keeps the draws of ordinary settings as they have always been.
SHIFTED_BELOW_TEMPERATURE = 1e-3
MIN_REPEAT_PENALTY = 1e-6


def inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """For each row of `probs` (sorted by decreasing probability along the last dim, not
    necessarily normalised) and its uniform in [0, 1): the index of the first candidate whose
    cumulative mass passes the uniform's share of the total."""
    cdf = probs.cumsum(-1)
    target = uniforms.unsqueeze(-1).to(cdf.dtype) * cdf[..., -1:]
    pick = torch.searchsorted(cdf, target, right=True)
    # A uniform rounded up to 1 carries the target past the last candidate: stay on one that
    # has mass (the probabilities do not increase along the order: those with mass lead).
    last = ((probs > 0).sum(-1, keepdim=True) - 1).clamp_min(0)
    return torch.minimum(pick, last).squeeze(-1)


def sampler_for(params: SamplingParams, tokenizer: Tokenizer, prompt_tokens: int) -> Sampler:
    """A sampler for one generation after a prompt of `prompt_tokens` (with its constraint's
    matcher, when the answer must match one)."""
    if params.constraint is None:
        return Sampler(params)
    return Sampler(params, token_guide(params.constraint, tokenizer, prompt_tokens))


def token_logprob(logits: torch.Tensor, token: int, top: int) -> TokenLogprob:
    """`token`'s log-probability under the model's distribution (fp32 logits [vocab]), and
    the `top` most likely tokens'."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    best = torch.topk(logprobs, top) if top > 0 else None
    alternatives = (
        ()
        if best is None
        else tuple((int(t), float(lp)) for lp, t in zip(best.values, best.indices, strict=True))
    )
    return TokenLogprob(token, float(logprobs[token]), alternatives)


def apply_repeat_penalty(
    logits: torch.Tensor, recent: Sequence[int], penalty: float
) -> torch.Tensor:
    """llama.cpp's rule: divide positive logits of recent tokens by the penalty, multiply others."""
    ids = torch.tensor(sorted(set(recent)), dtype=torch.long)
    penalty = max(penalty, MIN_REPEAT_PENALTY)  # a logit divided by ~0 is infinite
    logits = logits.clone()
    chosen = logits[ids]
    logits[ids] = torch.where(chosen > 0, chosen / penalty, chosen * penalty)
    return logits


def apply_presence_frequency(
    logits: torch.Tensor, recent: Sequence[int], presence: float, frequency: float
) -> torch.Tensor:
    """Subtract presence (once) and frequency (per occurrence) from recent tokens' logits."""
    ids, counts = torch.unique(torch.tensor(list(recent), dtype=torch.long), return_counts=True)
    logits = logits.clone()
    logits[ids] -= presence + frequency * counts.to(logits.dtype)
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
    keep = mass_before < top_p
    keep[0] = True  # a top_p that float32 rounds to 0 keeps nothing else
    return keep


def _min_p_mask(sorted_probs: torch.Tensor, min_p: float) -> torch.Tensor:
    """Keep candidates at least min_p times as likely as the best one."""
    if min_p <= 0.0:
        return torch.ones_like(sorted_probs, dtype=torch.bool)
    return sorted_probs >= min_p * sorted_probs[0]
