"""A trained drafting head on the model's last hidden state (EAGLE's idea, without its
attention): from the final-normed state h_t that predicted token t+1, and the embedding of
that token, one small residual block estimates h_{t+1}; the model's own output rows for a
small draft vocabulary turn the estimate into draft logits for token t+2. The estimate feeds
the next draft in a chain, so one verified state yields several drafts.

    x = W_in [norm(h) * g_h ; norm(e) * g_e]
    x = x + W_down (silu(gate) * up),  gate|up = W_gate_up (norm(x) * g_x)
    draft logits = head[vocab] x

Weights are trained in fp32 (`head_training.py`) and run here as int4 matmuls, like the
model's own. The draft vocabulary is the most frequent tokens of the model's own answers; the
full model verifies over its whole vocabulary, so output never depends on the head.
"""

from __future__ import annotations

import math
import pickle
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from ..ops.layers import Int4Linear, Linear, RMSNorm, _Int4Packer, pack_gated
from ..ops.quant import KERNEL_GROUP, PLAIN, AffineCodes, Int4Groups, to_int4
from .drafter import Draft, VerifiedFromTokens

if TYPE_CHECKING:
    from ..kv.cache import Cache
    from ..models.decoder import DecoderModel
    from ..tokens.sampler import Sampler
    from .controller import DraftController

HEAD_FORMAT = 1  # bumped when the stored tensors change meaning


@dataclass
class HeadWeights:
    """The trained tensors (fp32, CPU). `vocab`: draft token ids, most frequent first."""

    norm_h: torch.Tensor  # [dim]
    norm_e: torch.Tensor  # [dim]
    w_in: torch.Tensor  # [dim, 2 dim]
    norm_x: torch.Tensor  # [dim]
    w_gate_up: torch.Tensor  # [2 hidden, dim]
    w_down: torch.Tensor  # [dim, hidden]
    vocab: torch.Tensor  # int64 [n]
    eps: float = 1e-5

    TRAINED = ("norm_h", "norm_e", "w_in", "norm_x", "w_gate_up", "w_down")

    @classmethod
    def initial(cls, dim: int, hidden: int, vocab: torch.Tensor, seed: int = 0) -> HeadWeights:
        generator = torch.Generator().manual_seed(seed)
        # Start as "the next state is the current one": the input map passes h through.
        w_in = torch.cat([torch.eye(dim), torch.randn(dim, dim, generator=generator) * 0.01], 1)
        return cls(
            torch.ones(dim),
            torch.ones(dim),
            w_in,
            torch.ones(dim),
            torch.randn(2 * hidden, dim, generator=generator) / dim**0.5,
            torch.zeros(dim, hidden),
            vocab,
        )

    @property
    def dim(self) -> int:
        return self.w_in.shape[0]

    def parameters(self) -> list[torch.Tensor]:
        return [getattr(self, name) for name in self.TRAINED]

    def forward(self, h: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        """Training-time forward in fp32: states [n, dim], embeddings [n, dim] -> [n, dim]."""
        dim, eps = self.dim, self.eps
        joined = torch.cat(
            [F.rms_norm(h, (dim,), self.norm_h, eps), F.rms_norm(e, (dim,), self.norm_e, eps)], -1
        )
        x = joined @ self.w_in.T
        gate, up = (F.rms_norm(x, (dim,), self.norm_x, eps) @ self.w_gate_up.T).chunk(2, -1)
        return x + (F.silu(gate) * up) @ self.w_down.T

    def save(self, path: Path, meta: dict) -> None:
        """Stored in bf16 (half the size; the head runs in int4 anyway), with `meta`."""
        store_tensors(path, self, HEAD_FORMAT, {"eps": self.eps, "meta": meta})

    @classmethod
    def load(cls, path: Path, dim: int) -> tuple[HeadWeights, dict] | None:
        """(weights, meta) or None when the file is missing, unreadable or for another shape."""
        data = read_tensors(path, HEAD_FORMAT, cls.TRAINED)
        if data is None:
            return None
        try:
            trained = (data[name] for name in cls.TRAINED)
            weights = cls(*trained, vocab=data["vocab"], eps=data["eps"])
        except (KeyError, AttributeError):
            return None
        if weights.w_in.shape != (dim, 2 * dim) or weights.norm_h.shape != (dim,):
            return None
        return weights, dict(data.get("meta") or {})


def store_tensors(path: Path, weights, version: int, extra: dict) -> None:
    """A trained head's `TRAINED` tensors in bf16 and its `vocab`, with `extra` (written to
    a temporary file first, so a reader never sees half a head)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tensors = {name: getattr(weights, name).to(torch.bfloat16) for name in weights.TRAINED}
    torch.save({"format": version, "vocab": weights.vocab, **extra, **tensors}, tmp)
    tmp.replace(path)


def read_tensors(path: Path, version: int, trained: Sequence[str]) -> dict | None:
    """What `store_tensors` wrote, the trained tensors as fp32 and `vocab` as int64; None
    when the file is missing, unreadable, of another version or lacks a tensor."""
    try:
        data = torch.load(path, weights_only=True)
    except (OSError, RuntimeError, ValueError, EOFError, pickle.UnpicklingError):
        return None
    if not isinstance(data, dict) or data.get("format") != version:
        return None
    try:
        data.update({name: data[name].float() for name in trained}, vocab=data["vocab"].long())
    except (KeyError, AttributeError):
        return None
    return data


def int4_linear(weight: torch.Tensor) -> Int4Linear:
    """A dense [out, in] fp32 matrix as an int4 linear (min/max codes per group of 32), for
    the kernel that runs the model's own weights."""
    packer = _Int4Packer(torch.device("cpu"), _library())
    packer.add(_int4_groups(weight))
    return packer.linear(PLAIN, None)


def gated_int4_linear(weight: torch.Tensor) -> Linear | None:
    """Gate rows then up rows [2 ffn, in] as one int4 linear giving silu(gate) * up [ffn],
    the native kernel's fused form of the model's own feed-forwards; None without it."""
    library = _library()
    if library is None:
        return None
    gate, up = weight.chunk(2)
    return pack_gated(
        [(_int4_groups(gate), _int4_groups(up))], gate.shape[0], weight.shape[1], library
    )


def _int4_groups(weight: torch.Tensor) -> Int4Groups:
    rows, cols = weight.shape
    grouped = weight.float().reshape(rows, cols // KERNEL_GROUP, KERNEL_GROUP)
    low, high = grouped.amin(-1), grouped.amax(-1)
    scale = ((high - low) / 15).clamp_min(1e-8)
    codes = ((grouped - low[..., None]) / scale[..., None]).round_().clamp_(0, 15)
    return to_int4(
        AffineCodes(codes.to(torch.uint8).reshape(rows, cols), scale, low, 4, KERNEL_GROUP)
    )


def _library():
    from ..platform.kernels import cpu_int4_kernel

    return cpu_int4_kernel().library


class DraftHead:
    """The head as the drafter runs it: int4 matmuls on the CPU, the model's output rows for
    the draft vocabulary, and the model's soft-cap where it has one. `threshold` and
    `max_draft`: the chain policy calibration chose (see `HeadDrafter`)."""

    def __init__(
        self,
        weights: HeadWeights,
        head_rows: Linear,
        softcap: float = 0.0,
        threshold: float = 0.0,
        max_draft: int | None = None,
    ):
        self.weights, self.softcap = weights, softcap
        self.threshold, self.max_draft = threshold, max_draft
        self.vocab = weights.vocab
        self.norm_h = RMSNorm(weights.norm_h, weights.eps)
        self.norm_e = RMSNorm(weights.norm_e, weights.eps)
        self.norm_x = RMSNorm(weights.norm_x, weights.eps)
        self.w_in = int4_linear(weights.w_in)
        # silu(gate) * up in one call where the native kernel runs, as the model's own layers.
        self.w_gate_up = gated_int4_linear(weights.w_gate_up) or int4_linear(weights.w_gate_up)
        self.w_down = int4_linear(weights.w_down)
        self.head_rows = head_rows
        self._embedded: torch.Tensor | None = None  # the draft vocabulary's embeddings
        self._row_of: dict[int, int] = {}

    def state(self, h: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        """The estimated next state [n, dim] from states h and the next tokens' embeddings e
        (fp32 [n, dim] each)."""
        joined = torch.cat([self.norm_h(h.contiguous()), self.norm_e(e.contiguous())], -1)
        x = self.w_in.forward(joined).float()
        fed = self.w_gate_up.forward(self.norm_x(x))
        if not getattr(self.w_gate_up, "gated", False):
            gate, up = fed.float().chunk(2, -1)
            fed = F.silu(gate) * up
        return x + self.w_down.forward(fed).float()

    def embed(self, model: DecoderModel, token: int) -> torch.Tensor:
        """A token's embedding [1, dim]: drafted tokens are all in the draft vocabulary,
        whose embeddings are dequantized once (a single GGUF row costs ~150 us each time)."""
        if self._embedded is None:
            self._embedded = model.embed_tokens(self.vocab)
            self._row_of = {int(t): i for i, t in enumerate(self.vocab.tolist())}
        row = self._row_of.get(token)
        if row is None:
            return model.embed_tokens(torch.tensor([token]))
        return self._embedded[row : row + 1]

    def draft_logits(self, x: torch.Tensor) -> torch.Tensor:
        """Estimated states [n, dim] -> logits over the draft vocabulary [n, len(vocab)]."""
        logits = self.head_rows.forward(x).float()
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits


# The draft controller's memory for the head's acceptance, per verification (its default
# forgets in about 7): the head's gate already picks the steps worth drafting, so the
# controller only has to notice a lasting drop (text unlike what it was trained on).
HEAD_ACCEPTANCE_MEMORY = 0.97


class HeadDrafter(VerifiedFromTokens):
    """Drafts a chain from the last verified state: each link is one pass of the head and
    its small-vocabulary logits. The chain stops at the controller's length (at most the
    head's `max_draft`) or as soon as the head's probability for its own token falls below
    the head's `threshold` (chosen by calibration: below it, a draft is rejected more often
    than its row is worth). One per generation: it holds that generation's last state."""

    name = "head"

    def __init__(self, model: DecoderModel, head: DraftHead):
        self.model, self.head = model, head
        self.threshold, self.max_draft = head.threshold, head.max_draft
        self.state: torch.Tensor | None = None
        self._full = torch.full((model.config.vocab_size,), -math.inf)

    def observe(self, tokens: Sequence[int]) -> None:
        pass  # it drafts from the model's state, not from the text

    def observe_state(self, state: torch.Tensor) -> None:
        self.state = state

    def propose(
        self,
        pending: int,
        controller: DraftController,
        caches: Sequence[Cache],
        sampler: Sampler,
        history: Sequence[int],
    ) -> Draft | None:
        state, self.state = self.state, None  # a state is good for one step only
        if state is None:
            return None
        count = controller.draft_length(self.name, self.max_draft)
        if not count:
            return None
        start = time.perf_counter()
        tokens, probs = self._chain(state, pending, count, sampler, history)
        if not tokens:
            return None
        seconds = time.perf_counter() - start
        return Draft(tokens, probs, pending=pending, key=self.name, seconds=seconds)

    def _chain(self, state, pending, count, sampler, history):
        """Up to `count` drafts and, when sampling, the distributions they were drawn from
        (each link gated by `GatedDraft`)."""
        tokens: list[int] = []
        probs: list[torch.Tensor] = []
        x, token = state.float(), pending
        gate = GatedDraft(self.head.vocab, self._full, self.threshold)
        for _ in range(count):
            x = self.head.state(x, self.head.embed(self.model, token))
            logits = self.head.draft_logits(x)[0]
            chosen = gate.choose(logits, sampler, [*history, *tokens])
            if chosen is None:
                break
            token, q = chosen
            tokens.append(token)
            if q is not None:
                probs.append(q)
        return tokens, (probs or None)


@dataclass(frozen=True)
class GatedDraft:
    """A draft token from logits over a draft vocabulary, or none when the drafter is less
    sure than `threshold`. The decision reads the drafter's distribution before a token is
    drawn (its largest probability), never the drawn token: rejection sampling needs the
    proposal to be exactly that distribution. `full`: -inf over the whole vocabulary."""

    vocab: torch.Tensor
    full: torch.Tensor
    threshold: float

    def choose(
        self, logits: torch.Tensor, sampler: Sampler, context: Sequence[int]
    ) -> tuple[int, torch.Tensor | None] | None:
        """(token, the distribution it was drawn from when sampling) or None."""
        if sampler.params.greedy:
            best = int(logits.argmax())
            if float(torch.softmax(logits, -1)[best]) < self.threshold:
                return None
            return int(self.vocab[best]), None
        full = self.full.clone()
        full[self.vocab] = logits
        q = sampler.distribution(full, context)
        if float(q.max()) < self.threshold:
            return None
        return sampler.draw(q), q
