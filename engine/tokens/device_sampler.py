"""Sampling on the device, for a batch of rows at once: the maths of sampler.py (grammar mask ->
penalties -> top-k -> top-p -> min-p -> temperature -> draw, llama.cpp's order) written so
that it can run inside a captured CUDA graph.

The host `Sampler` works on one row with Python control flow and data-dependent shapes
(`values[keep]`, `torch.unique`, `int(...)`), each of which waits for the device. Here every
tensor has a fixed shape and no value comes back to the host: each row is sorted once, top-k,
top-p and min-p become masks over ranks and cumulative mass, removed candidates are set to
-inf before the final softmax, and the draw is an inverse CDF of a given uniform over the
sorted probabilities. Rows may mix greedy and sampled settings; only the token ids [rows]
need to cross to the host.

The per-row settings live in `SamplingTensors`, built on the host from `SamplingParams` and
histories (outside the graph) and copied into a captured graph's static buffers with `fill_`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from .sampler import MIN_REPEAT_PENALTY, SHIFTED_BELOW_TEMPERATURE, inverse_cdf
from .sampling import SamplingParams

NEG_INF = float("-inf")


# The per-row settings, packed as the rows of one fp32 tensor [len(SCALARS), rows], so that a
# step sends them to the device in one copy (each small copy costs a GPU its own transfer).
SCALARS = (
    "temperature",  # <= 0 greedy
    "top_k",  # <= 0 disables (exact in fp32 up to 2**24, past any vocabulary)
    "top_p",  # >= 1 disables
    "min_p",  # <= 0 disables
    "repeat_penalty",  # 1 disables
    "presence_penalty",  # 0 disables
    "frequency_penalty",  # 0 disables
)


@dataclass
class SamplingTensors:
    """Sampling settings of each row on the device (see `SamplingParams` for their meaning):
    the scalars, one [rows] row each of `scalars`, read by name (`settings.top_p`); plus
    what the penalties and a grammar need."""

    scalars: torch.Tensor  # fp32 [len(SCALARS), rows]
    # fp32 [rows, vocab]: how often each token occurs among the row's last repeat_last_n
    # tokens (the host keeps it up to date); penalties apply where it is > 0. None: no row
    # has a penalty (nothing to copy to the device).
    counts: torch.Tensor | None = None
    allowed: torch.Tensor | None = None  # bool [rows, vocab], True: the grammar allows it
    # Whether the counts and the mask buffers hold none seen and all allowed (`fill_` then
    # skips writing them again): a buffer's state, not a setting.
    neutral: set[str] = field(default_factory=set, compare=False)

    def __getattr__(self, name: str) -> torch.Tensor:
        if name in SCALARS:
            return self.scalars[SCALARS.index(name)]
        raise AttributeError(name)

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        histories: Sequence[Sequence[int]],
        vocab: int,
        allowed: torch.Tensor | None = None,
        device: torch.device | str | None = None,
    ) -> SamplingTensors:
        """Settings for one row per `params`, after the tokens in `histories` (host side)."""
        counts = None
        if any(penalizes(p) for p in params):
            counts = torch.zeros(len(params), vocab)
            for row, (p, history) in enumerate(zip(params, histories, strict=True)):
                recent = list(history[-p.repeat_last_n :]) if penalizes(p) else []
                if recent:  # sampler.py's window, so that the same settings penalise the same
                    counts[row] = torch.bincount(torch.tensor(recent), minlength=vocab)[:vocab]
        scalars = [[float(getattr(p, name)) for p in params] for name in SCALARS]
        return cls(
            scalars=torch.tensor(scalars, dtype=torch.float32, device=device),
            counts=None if counts is None else counts.to(device),
            allowed=None if allowed is None else allowed.to(device=device, dtype=torch.bool),
        )

    @classmethod
    def buffers(
        cls,
        rows: int,
        vocab: int,
        device: torch.device | str | None = None,
        scalars: torch.Tensor | None = None,
    ):
        """Settings buffers for `fill_` (a captured graph's static inputs), with counts and
        a grammar mask, so that one graph serves rows with and without either. `scalars`:
        a buffer of the caller's for them (which it then fills itself)."""
        return cls(
            scalars=torch.zeros(len(SCALARS), rows, device=device) if scalars is None else scalars,
            counts=torch.zeros(rows, vocab, device=device),
            allowed=torch.ones(rows, vocab, dtype=torch.bool, device=device),
            neutral={"counts", "allowed"},
        )

    def fill_(self, other: SamplingTensors, scalars: bool = True) -> SamplingTensors:
        """Copy `other`'s settings into these tensors in place (a captured graph reads them
        at fixed addresses). Rows and vocabulary must match; where `other` has no counts
        (no penalties) or no grammar mask, these are set to none seen and all allowed.
        `scalars=False`: all but the scalars, which the caller sends with its own inputs."""
        if scalars:
            self.scalars.copy_(other.scalars, non_blocking=True)
        for name, neutral_value in (("counts", False), ("allowed", True)):
            mine, theirs = getattr(self, name), getattr(other, name)
            if mine is None:
                if theirs is not None:
                    raise ValueError(f"these settings have no {name} buffer to fill")
            elif theirs is not None:
                mine.copy_(theirs, non_blocking=True)
                self.neutral.discard(name)
            elif name not in self.neutral:
                mine.fill_(neutral_value)
                self.neutral.add(name)
        return self


def penalizes(p: SamplingParams) -> bool:
    """Whether the settings penalise tokens already seen (sampler.py's condition)."""
    if p.repeat_last_n == 0:
        return False
    return p.repeat_penalty != 1.0 or bool(p.presence_penalty) or bool(p.frequency_penalty)


def sample(logits: torch.Tensor, settings: SamplingTensors, uniforms: torch.Tensor) -> torch.Tensor:
    """One token id per row (int64 [rows]) from fp32 logits [rows, vocab], drawn with the
    row's uniform in [0, 1) by inverse CDF; greedy rows take their best token."""
    probs, ids, best = _sorted_candidates(logits, settings)
    token = ids.gather(-1, inverse_cdf(probs, uniforms)[:, None]).squeeze(-1)
    return torch.where(settings.temperature <= 0, best, token)


def distribution(logits: torch.Tensor, settings: SamplingTensors) -> torch.Tensor:
    """The dense probabilities [rows, vocab] `sample` draws from (sampler.py's
    `Sampler.distribution`); for a greedy row, one-hot at its best token."""
    probs, ids, best = _sorted_candidates(logits, settings)
    dense = torch.zeros_like(probs).scatter_(-1, ids, probs)
    one_hot = torch.zeros_like(probs).scatter_(-1, best[:, None], 1.0)
    return torch.where(settings.temperature[:, None] <= 0, one_hot, dense)


def _sorted_candidates(
    logits: torch.Tensor, s: SamplingTensors
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(final probabilities in descending-logit order, their token ids, the best token) of
    each row; candidates removed by top-k, top-p or min-p have probability 0."""
    logits = _penalized(logits.float(), s)
    values, ids = torch.sort(logits, dim=-1, descending=True, stable=True)
    vocab = logits.shape[-1]
    rank = torch.arange(vocab, device=logits.device)
    top_k = torch.where(s.top_k > 0, s.top_k, vocab)[:, None]
    values = values.masked_fill(rank >= top_k, NEG_INF)
    # top-p and min-p judge the top-k candidates' probabilities before the temperature.
    probs = torch.softmax(values, dim=-1)
    mass_before = probs.cumsum(-1) - probs
    top_p, min_p = s.top_p[:, None], s.min_p[:, None]
    keep = (mass_before < top_p) | (top_p >= 1.0) | (rank == 0)  # the best always stays
    keep &= (probs >= min_p * probs[:, :1]) | (min_p <= 0.0)
    values = values.masked_fill(~keep, NEG_INF)
    greedy = s.temperature[:, None] <= 0
    temperature = torch.where(greedy, 1.0, s.temperature[:, None])  # greedy rows: unused
    # Logits divided by a tiny temperature overflow: shift by the best one's first.
    shift = torch.where(temperature < SHIFTED_BELOW_TEMPERATURE, values[:, :1], 0.0)
    final = torch.softmax((values - shift) / temperature, dim=-1)
    return final, ids, logits.argmax(-1)


def _penalized(logits: torch.Tensor, s: SamplingTensors) -> torch.Tensor:
    """The grammar mask, then sampler.py's penalties on the tokens each row has seen."""
    if s.allowed is not None:
        logits = logits.masked_fill(~s.allowed, NEG_INF)
    if s.counts is None:
        return logits
    seen = s.counts > 0
    penalty = s.repeat_penalty.clamp_min(MIN_REPEAT_PENALTY)[:, None]
    repeated = torch.where(logits > 0, logits / penalty, logits * penalty)
    logits = torch.where(seen, repeated, logits)
    subtract = s.presence_penalty[:, None] + s.frequency_penalty[:, None] * s.counts
    return torch.where(seen, logits - subtract, logits)
