"""The exit adapter: a small residual MLP that maps the layer-E residual stream toward the
last layer's, so that drafts from early layers agree more often with the full model.

Trained by self-distillation (`miniapp calibrate --train-adapter`): on the model's own
greedy answers, minimise KL(full model || head(norm(adapter(h_E)))).
"""

from __future__ import annotations

import pickle
from pathlib import Path

import torch
import torch.nn.functional as F


class ExitAdapterModule:
    def __init__(
        self, norm_weight: torch.Tensor, w_in: torch.Tensor, w_out: torch.Tensor, eps: float = 1e-5
    ):
        self.norm_weight, self.w_in, self.w_out, self.eps = norm_weight, w_in, w_out, eps

    @classmethod
    def initial(cls, dim: int, hidden: int, seed: int = 0) -> ExitAdapterModule:
        generator = torch.Generator().manual_seed(seed)
        w_in = torch.randn(hidden, dim, generator=generator) / dim**0.5
        w_out = torch.zeros(dim, hidden)  # starts as the identity map
        return cls(torch.ones(dim), w_in, w_out)

    def to(self, device: torch.device) -> ExitAdapterModule:
        if self.w_in.device == device:
            return self
        moved = (t.to(device) for t in self.parameters())
        return ExitAdapterModule(*moved, eps=self.eps)

    def parameters(self) -> list[torch.Tensor]:
        return [self.norm_weight, self.w_in, self.w_out]

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        normed = F.rms_norm(hidden, (hidden.shape[-1],), self.norm_weight, self.eps)
        return hidden + F.linear(F.silu(F.linear(normed, self.w_in)), self.w_out)

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        torch.save({"norm": self.norm_weight, "w_in": self.w_in, "w_out": self.w_out}, tmp)
        tmp.replace(path)

    @classmethod
    def load(cls, path: Path, dim: int) -> ExitAdapterModule | None:
        try:
            data = torch.load(path, weights_only=True)
        except (OSError, RuntimeError, ValueError, EOFError, pickle.UnpicklingError):
            return None
        if data["norm"].shape != (dim,):
            return None
        return cls(data["norm"], data["w_in"], data["w_out"])
