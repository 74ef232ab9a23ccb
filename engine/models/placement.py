"""Where a model's parts live (`Placement`: layers on a GPU or the CPU) and how its caches
behave (`CachePolicy`: streaming with attention sinks, or a fixed context)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..kv.cache import Cache, KVCache, RotatingKVCache
from ..kv.policies import COMPACT_POLICY, WINDOW_POLICY
from ..kv.scored import ScoredKVCache
from ..kv.types import F32, KVSetting
from ..ops.layers import CPU_INT4, Rope, WeightTarget
from .config import DecoderConfig

CPU = torch.device("cpu")
PREFILL_CHUNK = 512  # bounds the attention mask and activations of a long prompt
ROLLBACK_SLACK = 64  # tokens a rotating cache can trim exactly (speculative roll-back)


@dataclass(frozen=True)
class CachePolicy:
    """How the caches of the global (full-attention) layers behave.

    Streaming (the default) keeps `sinks` first tokens plus the last `window` in constant
    memory, so generation never stops at a full context. Without it, a fixed cache of `ctx`
    positions refuses to overflow (evaluation on chunks that fit). Sliding-window layers
    always get a ring the size of their own window. Every cache stores keys and values as
    `kv_type` says. `kv_policy` (policies.py) chooses which tokens a streaming cache keeps:
    the most recent (a ring) or those attention uses (ScoredKVCache, global layers only).
    """

    ctx: int
    sinks: int = 4
    window: int | None = None  # default: ctx - sinks
    streaming: bool = True
    kv_type: KVSetting = F32
    kv_policy: str = WINDOW_POLICY

    @property
    def window_size(self) -> int:
        return self.window if self.window is not None else max(self.ctx - self.sinks, 1)

    def _compact_from(self, config: DecoderConfig) -> int:
        """The position from which a scored cache rotates what it keeps into contiguous
        positions: at once with attention-compact, else once a sink's distance to a query
        could pass the trained context."""
        if self.kv_policy == COMPACT_POLICY:
            return 0
        return max(config.context_length - self.sinks - self.window_size, 0)

    def make_caches(
        self,
        config: DecoderConfig,
        ropes: dict[bool, Rope],
        devices: Sequence[torch.device],
    ) -> list[Cache]:
        """One cache per layer (`ropes` by whether a layer is sliding-window, `devices` per
        layer). Local layers get a ring the size of their window; global ones follow the
        policy."""
        c = config
        caches: list[Cache] = []
        for i, device in enumerate(devices):
            if c.is_local(i):
                cache = RotatingKVCache(
                    c.n_kv_heads,
                    c.head_dim,
                    sinks=0,
                    window=c.sliding_window,
                    slack=PREFILL_CHUNK,
                    rope=ropes[True],
                    kv_type=self.kv_type,
                    device=device,
                )
            elif self.streaming and self.kv_policy != WINDOW_POLICY:
                cache = ScoredKVCache(
                    c.n_kv_heads,
                    c.head_dim,
                    sinks=self.sinks,
                    window=self.window_size,
                    max_chunk=PREFILL_CHUNK,
                    prompt_capacity=self.ctx,
                    rope=ropes[False],
                    kv_type=self.kv_type,
                    device=device,
                    compact_from=self._compact_from(c),
                )
            elif self.streaming:
                cache = RotatingKVCache(
                    c.n_kv_heads,
                    c.head_dim,
                    sinks=self.sinks,
                    window=self.window_size,
                    slack=ROLLBACK_SLACK,
                    rope=ropes[False],
                    kv_type=self.kv_type,
                    device=device,
                )
            else:
                cache = KVCache(
                    c.n_kv_heads,
                    c.head_dim,
                    self.ctx,
                    rope=ropes[False],
                    kv_type=self.kv_type,
                    device=device,
                )
            caches.append(cache)
        return caches


@dataclass(frozen=True)
class Placement:
    """Where each part of the model lives: the first `gpu_layers` layers on `gpu` (with the
    final norm and output head when every layer is there), the rest and the token embedding
    on the CPU. GPU weights are 4-bit for the device's int4 kernel, or dense bf16. With
    `experts_on_cpu`, a mixture of experts keeps its experts on the CPU (--cpu-moe)."""

    gpu: torch.device | None = None
    gpu_layers: int = 0
    dense_on_gpu: bool = False
    experts_on_cpu: bool = False

    def layer_target(self, layer: int) -> WeightTarget:
        if self.gpu is None or layer >= self.gpu_layers:
            return CPU_INT4
        return WeightTarget(self.gpu, self.dense_on_gpu, self.experts_on_cpu)

    def head_target(self, n_layers: int) -> WeightTarget:
        return self.layer_target(0) if self.gpu_layers >= n_layers else CPU_INT4


CPU_PLACEMENT = Placement()
