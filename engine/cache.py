"""Per-layer key/value caches, passed into the model explicitly (never hidden module state).

Interface every cache provides (the sliding-window and speculative issues build on it):
* `update_and_fetch(k, v)`: append this step's keys/values, return everything to attend to;
* `offset`: how many positions the cache holds;
* `trim(n)`: forget the newest n positions (prompt-prefix reuse, speculative roll-back);
* `make_mask(n_new)`: the attention mask for the next `n_new` queries;
* `state` / `restore(state)`: snapshot and reload, for chat sessions.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .errors import ContextFullError


@dataclass(frozen=True)
class KVState:
    keys: torch.Tensor  # [1, kv_heads, offset, head_dim]
    values: torch.Tensor


class KVCache:
    """A preallocated cache of `max_tokens` positions for one attention layer."""

    def __init__(
        self,
        n_kv_heads: int,
        head_dim: int,
        max_tokens: int,
        dtype: torch.dtype = torch.float32,
    ):
        shape = (1, n_kv_heads, max_tokens, head_dim)
        self.keys = torch.zeros(shape, dtype=dtype)
        self.values = torch.zeros(shape, dtype=dtype)
        self.max_tokens = max_tokens
        self.offset = 0

    def update_and_fetch(
        self, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        n_new = k.shape[2]
        end = self.offset + n_new
        if end > self.max_tokens:
            raise ContextFullError(
                f"context full: {end} tokens do not fit in a context of {self.max_tokens}"
            )
        self.keys[:, :, self.offset : end] = k
        self.values[:, :, self.offset : end] = v
        self.offset = end
        return self.keys[:, :, :end], self.values[:, :, :end]

    def trim(self, n: int) -> int:
        """Drop the newest `n` positions; returns how many were dropped."""
        n = max(0, min(n, self.offset))
        self.offset -= n
        return n

    def make_mask(self, n_new: int) -> torch.Tensor | None:
        """Boolean [n_new, offset + n_new]: query i sees keys up to its own position.

        A single query may see the whole cache, so decoding needs no mask at all.
        """
        if n_new == 1:
            return None
        total = self.offset + n_new
        query_pos = torch.arange(self.offset, total).unsqueeze(1)
        return torch.arange(total).unsqueeze(0) <= query_pos

    @property
    def state(self) -> KVState:
        return KVState(
            self.keys[:, :, : self.offset].clone(), self.values[:, :, : self.offset].clone()
        )

    def restore(self, state: KVState) -> None:
        n = state.keys.shape[2]
        if n > self.max_tokens:
            raise ContextFullError(f"saved state of {n} tokens exceeds cache of {self.max_tokens}")
        self.keys[:, :, :n] = state.keys
        self.values[:, :, :n] = state.values
        self.offset = n
