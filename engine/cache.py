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
    """A cache of up to `max_tokens` positions for one attention layer.

    Storage grows by doubling (from `INITIAL_TOKENS`) up to `max_tokens`, so a short chat with
    a large --ctx does not hold the whole context's memory from the start.

    With a `window` (sliding-window attention), a query at position p sees only keys at
    positions p - window + 1 .. p: fetches return just that span and masks enforce it.
    """

    INITIAL_TOKENS = 256

    def __init__(
        self,
        n_kv_heads: int,
        head_dim: int,
        max_tokens: int,
        dtype: torch.dtype = torch.float32,
        window: int | None = None,
    ):
        self.max_tokens = max_tokens
        self.window = window
        self.offset = 0
        shape = (1, n_kv_heads, min(max_tokens, self.INITIAL_TOKENS), head_dim)
        self.keys = torch.zeros(shape, dtype=dtype)
        self.values = torch.zeros(shape, dtype=dtype)

    @property
    def capacity(self) -> int:
        return self.keys.shape[2]

    def _grow_to(self, needed: int) -> None:
        capacity = self.capacity
        while capacity < needed:
            capacity *= 2
        capacity = min(capacity, self.max_tokens)
        for name in ("keys", "values"):
            old = getattr(self, name)
            new = old.new_zeros(old.shape[0], old.shape[1], capacity, old.shape[3])
            new[:, :, : self.offset] = old[:, :, : self.offset]
            setattr(self, name, new)

    def update_and_fetch(
        self, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        n_new = k.shape[2]
        end = self.offset + n_new
        if end > self.capacity:
            if end > self.max_tokens:
                raise ContextFullError(
                    f"context full: {end} tokens do not fit in a context of {self.max_tokens}"
                )
            self._grow_to(end)
        first = self._first_visible(self.offset)
        self.keys[:, :, self.offset : end] = k
        self.values[:, :, self.offset : end] = v
        self.offset = end
        return self.keys[:, :, first:end], self.values[:, :, first:end]

    def _first_visible(self, query_position: int) -> int:
        """The oldest position the query at `query_position` may attend to."""
        if self.window is None:
            return 0
        return max(0, query_position - self.window + 1)

    def trim(self, n: int) -> int:
        """Drop the newest `n` positions; returns how many were dropped."""
        n = max(0, min(n, self.offset))
        self.offset -= n
        return n

    def make_mask(self, n_new: int) -> torch.Tensor | None:
        """Boolean [n_new, fetched keys] for the next `n_new` queries: each sees keys up to its
        own position (and within the window, if any).

        A single query sees exactly what `update_and_fetch` returns, so decoding needs none.
        """
        if n_new == 1:
            return None
        total = self.offset + n_new
        query_pos = torch.arange(self.offset, total).unsqueeze(1)
        key_pos = torch.arange(self._first_visible(self.offset), total).unsqueeze(0)
        visible = key_pos <= query_pos
        if self.window is not None:
            visible &= query_pos - key_pos < self.window
        return visible

    @property
    def state(self) -> KVState:
        return KVState(
            self.keys[:, :, : self.offset].clone(), self.values[:, :, : self.offset].clone()
        )

    def restore(self, state: KVState) -> None:
        n = state.keys.shape[2]
        if n > self.max_tokens:
            raise ContextFullError(f"saved state of {n} tokens exceeds cache of {self.max_tokens}")
        if n > self.capacity:
            self._grow_to(n)
        self.keys[:, :, :n] = state.keys
        self.values[:, :, :n] = state.values
        self.offset = n
