"""A trained block on a shallow exit (Kangaroo's idea): the model's own first `layer` layers,
then one small attention + feed-forward block of ours, then the model's final norm and its
output rows for a small draft vocabulary.

    a = norm_a(h);  q|k|v = W_qkv a, rotated by position
    x = h + W_o attention(q; the keys and values of the last `window` positions)
    x = x + W_down (silu(gate) * up),  gate|up = W_gate_up norm_f(x)
    draft logits = head[vocab] final_norm(x)

Drafting feeds each token through the first layers exactly as a decode step does, so their
KV entries are final and verification runs only the layers above the exit, over the saved
exit states (as early exit does). The block attends over exit-layer states; their keys and
values live in an `ExitMemory` per sequence that a tap on the model fills however a position
was fed (prompt chunk, plain step, drafted row, a lookup verification), so the block sees the
context training showed it. Weights are trained in fp32 (`shallow_training.py`) and run as
int4 matmuls, like the model's own.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from ..ops.layers import RMSNorm, Rope, apply_rope
from .draft_head import GatedDraft, gated_int4_linear, int4_linear, read_tensors, store_tensors
from .drafter import Draft, Verified
from .early_exit import EarlyExitDrafter

if TYPE_CHECKING:
    from ..kv.cache import Cache
    from ..models.decoder import DecoderModel
    from ..ops.layers import Linear
    from ..tokens.sampler import Sampler

SHALLOW_FORMAT = 1  # bumped when the stored tensors change meaning
HEAD_DIM = 64  # the block's attention heads: dim // HEAD_DIM of them
WINDOW = 64  # positions the block attends over (its own, the newest)
ROPE_BASE = 10000.0


def block_rope() -> Rope:
    return Rope(HEAD_DIM, HEAD_DIM, ROPE_BASE, interleaved=False)


def window_mask(queries: int, first: int, keys: int, window: int) -> torch.Tensor:
    """Boolean [queries, keys]: query i (at position first + i; key j at position j) sees
    keys at its own position and the `window - 1` before it."""
    query_pos = torch.arange(first, first + queries)[:, None]
    key_pos = torch.arange(keys)[None]
    return (key_pos <= query_pos) & (key_pos > query_pos - window)


@dataclass
class BlockWeights:
    """The trained tensors (fp32, CPU). `layer`: the exit layer, whose output the block
    reads; `vocab`: draft token ids, most frequent first."""

    norm_a: torch.Tensor  # [dim]
    w_qkv: torch.Tensor  # [3 heads * HEAD_DIM, dim]
    w_o: torch.Tensor  # [dim, heads * HEAD_DIM]
    norm_f: torch.Tensor  # [dim]
    w_gate_up: torch.Tensor  # [2 hidden, dim]
    w_down: torch.Tensor  # [dim, hidden]
    vocab: torch.Tensor  # int64 [n]
    layer: int
    window: int = WINDOW
    eps: float = 1e-5

    TRAINED = ("norm_a", "w_qkv", "w_o", "norm_f", "w_gate_up", "w_down")

    @classmethod
    def initial(
        cls,
        dim: int,
        hidden: int,
        vocab: torch.Tensor,
        layer: int,
        window: int = WINDOW,
        seed: int = 0,
    ) -> BlockWeights:
        """A block that passes the exit state through (zero outputs): the untrained exit."""
        generator = torch.Generator().manual_seed(seed)
        width = heads_for(dim) * HEAD_DIM
        return cls(
            torch.ones(dim),
            torch.randn(3 * width, dim, generator=generator) / dim**0.5,
            torch.zeros(dim, width),
            torch.ones(dim),
            torch.randn(2 * hidden, dim, generator=generator) / dim**0.5,
            torch.zeros(dim, hidden),
            vocab,
            layer,
            window,
        )

    @property
    def dim(self) -> int:
        return self.norm_a.shape[0]

    @property
    def heads(self) -> int:
        return self.w_o.shape[1] // HEAD_DIM

    def parameters(self) -> list[torch.Tensor]:
        return [getattr(self, name) for name in self.TRAINED]

    def forward(self, h: torch.Tensor, rope: Rope, first: int = 0) -> torch.Tensor:
        """Training-time forward in fp32 over one sequence's exit states h [n, dim] at
        positions first..first+n-1 (each row attends within the sequence) -> [n, dim]."""
        n, dim = h.shape[0], self.dim
        heads = (F.rms_norm(h, (dim,), self.norm_a, self.eps) @ self.w_qkv.T).view(n, -1, HEAD_DIM)
        tables = rope.tables(first, n)
        q, k = apply_rope(heads[:, : 2 * self.heads], tables).split(self.heads, 1)
        v = heads[:, 2 * self.heads :]
        mask = window_mask(n, 0, n, self.window)
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask
        )
        x = h + out.transpose(0, 1).reshape(n, -1) @ self.w_o.T
        gate, up = (F.rms_norm(x, (dim,), self.norm_f, self.eps) @ self.w_gate_up.T).chunk(2, -1)
        return x + (F.silu(gate) * up) @ self.w_down.T

    def save(self, path: Path, meta: dict) -> None:
        """Stored in bf16 (the block runs in int4 anyway), with `meta`."""
        extra = {"eps": self.eps, "layer": self.layer, "window": self.window, "meta": meta}
        store_tensors(path, self, SHALLOW_FORMAT, extra)

    @classmethod
    def load(cls, path: Path, dim: int, n_layers: int) -> tuple[BlockWeights, dict] | None:
        """(weights, meta), or None when the file is missing, unreadable or for another
        shape of model."""
        data = read_tensors(path, SHALLOW_FORMAT, cls.TRAINED)
        if data is None:
            return None
        try:
            trained = (data[name] for name in cls.TRAINED)
            weights = cls(
                *trained,
                vocab=data["vocab"],
                layer=int(data["layer"]),
                window=int(data["window"]),
                eps=data["eps"],
            )
        except (KeyError, TypeError, ValueError):
            return None
        if weights.norm_a.shape != (dim,) or not 0 < weights.layer < n_layers:
            return None
        return weights, dict(data.get("meta") or {})


def heads_for(dim: int) -> int:
    return max(1, dim // HEAD_DIM)


class ExitMemory:
    """One sequence's keys and values for the block, by position: a ring of `window`
    slots. A position fed again (after a roll-back) overwrites its slot; reads take only
    positions in the window behind the query, so rows rolled back are never read."""

    def __init__(self, heads: int, window: int):
        self.window = window
        self.keys = torch.zeros(window, heads, HEAD_DIM)
        self.values = torch.zeros(window, heads, HEAD_DIM)
        self.positions = torch.full((window,), -1, dtype=torch.long)
        self.newest = -1, torch.zeros(heads, HEAD_DIM)  # the newest position and its query

    def write(
        self, first: int, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor
    ) -> None:
        """Rows [n <= window, heads, HEAD_DIM] at positions first..first+n-1."""
        n = keys.shape[0]
        positions = torch.arange(first, first + n)
        slots = positions % self.window
        self.keys[slots], self.values[slots] = keys, values
        self.positions[slots] = positions
        self.newest = first + n - 1, queries[-1]

    def attend(self, query: torch.Tensor, position: int) -> torch.Tensor:
        """One query [heads, HEAD_DIM] at `position` over the window behind it -> [heads *
        HEAD_DIM]."""
        seen = (self.positions <= position) & (self.positions > position - self.window)
        keys, values = self.keys[seen], self.values[seen]  # [m, heads, HEAD_DIM]
        scores = torch.einsum("hd,mhd->hm", query, keys) / math.sqrt(HEAD_DIM)
        return torch.einsum("hm,mhd->hd", torch.softmax(scores, -1), values).reshape(-1)


class ShallowBlock:
    """The block as drafting runs it (int4 matmuls on the CPU), the model's final norm and
    its output rows for the draft vocabulary, and the chain policy calibration chose. It is
    also the model's exit tap: `record` sees the exit layer's output of every pass."""

    def __init__(
        self,
        weights: BlockWeights,
        model: DecoderModel,
        head_rows: Linear,
        threshold: float = 0.0,
        max_draft: int | None = None,
    ):
        self.weights, self.model = weights, model
        self.layer, self.window, self.heads = weights.layer, weights.window, weights.heads
        self.vocab, self.head_rows = weights.vocab, head_rows
        self.threshold, self.max_draft = threshold, max_draft
        self.softcap = model.config.final_logit_softcap
        self.rope = block_rope()
        self.norm_a = RMSNorm(weights.norm_a, weights.eps)
        self.norm_f = RMSNorm(weights.norm_f, weights.eps)
        self.w_qkv = int4_linear(weights.w_qkv)
        self.w_o = int4_linear(weights.w_o)
        self.w_gate_up = gated_int4_linear(weights.w_gate_up) or int4_linear(weights.w_gate_up)
        self.w_down = int4_linear(weights.w_down)
        # Per sequence: its exit-layer cache -> the block's memory for it.
        self._memories: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def record(self, x: torch.Tensor, cache: Cache) -> None:
        """The exit layer's output x [n, dim] for the positions just appended to `cache`:
        their keys and values go into that sequence's memory (x is not changed). Only the
        newest `window` rows of a prompt chunk can ever be read."""
        x = x[-self.window :]
        n = x.shape[0]
        first = cache.offset - n
        qkv = self.w_qkv.forward(self.norm_a(x.float().contiguous())).float()
        qkv = qkv.view(n, 3 * self.heads, HEAD_DIM)
        qk = apply_rope(qkv[:, : 2 * self.heads].contiguous(), self.rope.tables(first, n))
        heads = self.heads
        self.memory(cache).write(first, qk[:, :heads], qk[:, heads:], qkv[:, 2 * heads :])

    def memory(self, cache: Cache) -> ExitMemory:
        memory = self._memories.get(cache)
        if memory is None:
            memory = self._memories[cache] = ExitMemory(self.heads, self.window)
        return memory

    def draft_logits(self, state: torch.Tensor, cache: Cache) -> torch.Tensor:
        """Logits over the draft vocabulary [len(vocab)] for the position whose exit state
        [1, dim] was just recorded through `cache`."""
        memory = self.memory(cache)
        position, query = memory.newest
        attended = memory.attend(query, position)[None]
        x = state.float() + self.w_o.forward(attended).float()
        fed = self.w_gate_up.forward(self.norm_f(x))
        if not getattr(self.w_gate_up, "gated", False):
            gate, up = fed.float().chunk(2, -1)
            fed = F.silu(gate) * up
        x = x + self.w_down.forward(fed).float()
        logits = self.head_rows.forward(self.model.final_norm(x)).float()[0]
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits


class ShallowExitDrafter(EarlyExitDrafter):
    """Drafts a chain through the first layers and the block, while the block's probability
    for its own token clears the threshold calibration chose (at most `max_draft`).
    Verification runs the layers above the exit over the chain's exit states."""

    name = "shallow"

    def __init__(self, model: DecoderModel, block: ShallowBlock):
        super().__init__(model, block.layer, None, block.max_draft)
        self.block, self.threshold = block, block.threshold
        self._full = torch.full((model.config.vocab_size,), -math.inf)

    def draft(
        self,
        caches: Sequence[Cache],
        pending: int,
        count: int,
        sampler: Sampler,
        history: Sequence[int],
    ) -> Draft:
        """Up to `count` drafts after `pending`; the exit states of [pending, *drafts] (the
        last draft is fed through the first layers too: verification needs it)."""
        tokens: list[int] = []
        probs: list[torch.Tensor] = []
        states = [self.early_state(pending, caches)]
        exit_cache = caches[self.layer - 1]
        gate = GatedDraft(self.block.vocab, self._full, self.threshold)
        for _ in range(count):
            logits = self.block.draft_logits(states[-1], exit_cache)
            chosen = gate.choose(logits, sampler, [*history, *tokens])
            if chosen is None:
                break
            token, q = chosen
            tokens.append(token)
            if q is not None:
                probs.append(q)
            states.append(self.early_state(token, caches))
        return Draft(tokens, probs or None, torch.cat(states), pending=pending)

    def verify(self, caches: Sequence[Cache], draft: Draft) -> Verified:
        model = self.model
        out = model.run_layers(
            draft.states, caches, self.layer, model.config.n_layers, exact_rows=True
        )
        normed = model.final_norm(out)
        return Verified(normed, model.logits(normed))
