"""Where a model's parts live (`Placement`: layers on a GPU or the CPU) and how its caches
behave (`CachePolicy`: streaming with attention sinks, or a fixed context)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..layers import CPU_INT4, WeightTarget

CPU = torch.device("cpu")


@dataclass(frozen=True)
class CachePolicy:
    """How the caches of the global (full-attention) layers behave.

    Streaming (the default) keeps `sinks` first tokens plus the last `window` in constant
    memory, so generation never stops at a full context. Without it, a fixed cache of `ctx`
    positions refuses to overflow (evaluation on chunks that fit). Sliding-window layers
    always get a ring the size of their own window.
    """

    ctx: int
    sinks: int = 4
    window: int | None = None  # default: ctx - sinks
    streaming: bool = True

    @property
    def window_size(self) -> int:
        return self.window if self.window is not None else max(self.ctx - self.sinks, 1)


@dataclass(frozen=True)
class Placement:
    """Where each part of the model lives: the first `gpu_layers` layers on `gpu` (with the
    final norm and output head when every layer is there), the rest and the token embedding
    on the CPU. GPU weights are 4-bit for the device's int4 kernel, or dense bf16."""

    gpu: torch.device | None = None
    gpu_layers: int = 0
    dense_on_gpu: bool = False

    def layer_target(self, layer: int) -> WeightTarget:
        if self.gpu is None or layer >= self.gpu_layers:
            return CPU_INT4
        return WeightTarget(self.gpu, self.dense_on_gpu)

    def head_target(self, n_layers: int) -> WeightTarget:
        return self.layer_target(0) if self.gpu_layers >= n_layers else CPU_INT4


CPU_PLACEMENT = Placement()
