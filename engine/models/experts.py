"""The mixture-of-experts feed-forward (Qwen3-MoE, Qwen2-MoE, OLMoE, Mixtral): a router picks
`used` of `count` SiLU-gated experts for each token, and their outputs, weighted by the
router's probabilities, are summed; Qwen2-MoE adds a shared expert behind a sigmoid gate.

Routing follows llama.cpp's graph: a softmax over the router's logits, the top k by
probability (ties go to the lower expert number here, so a row's choice is deterministic),
their probabilities as weights, divided by their sum where the architecture normalises them
(the sum clamped below at 2^-14, as llama.cpp's is).

On the CPU the native kernel routes (`NativeExperts.route`) and runs the experts in one
call (`native/moe.py`: each chosen expert's weights read once a call, whatever rows chose
it), and the fused decode layer calls the same two (decoder.py); elsewhere (a GPU, float
weights, no native library) torch routes, and runs one expert at a time over the rows that
chose it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ...native.moe import NativeExperts
from ..ops.layers import Linear

# llama.cpp clamps the sum of the chosen weights to the smallest normal fp16 before dividing.
MIN_WEIGHT_SUM = 6.103515625e-5


def route(logits: torch.Tensor, used: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits fp32 [n, count] -> (ids int64 [n, used], weights fp32 [n, used]): each
    row's top `used` experts by softmax probability, highest first, ties to the lower id."""
    probs = torch.softmax(logits.float(), dim=-1)
    ranked = torch.sort(probs, dim=-1, descending=True, stable=True)
    ids = ranked.indices[:, :used]
    weights = ranked.values[:, :used]
    if normalize:
        weights = weights / weights.sum(-1, keepdim=True).clamp_min(MIN_WEIGHT_SUM)
    return ids, weights


class Router:
    """The router: fp32 weights [count, dim]. Its logits are float64 dot products rounded to
    fp32: a float32 matmul rounds differently for different numbers of rows, and a row's
    choice of experts must not depend on what else shares its pass (batched and
    verification rows equal lone runs). The native kernel routes from `weight` itself;
    `forward` is the torch path's (and the reference's) float64 matmul."""

    def __init__(self, weight: torch.Tensor):
        self.weight = weight.float().contiguous()  # [count, dim]
        self.nbytes = self.weight.numel() * 4  # a file's F32 router, what a step reads
        self._double: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._double is None:
            self._double = self.weight.double()
        return (x.double() @ self._double.T).float()

    __call__ = forward


@dataclass
class TorchExpert:
    """One expert as torch linears: gate|up (plain, 2 * ffn outputs) and down."""

    gate_up: Linear
    down: Linear
    ffn_dim: int

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up.forward(x).float()
        hidden = F.silu(gate_up[:, : self.ffn_dim]).mul_(gate_up[:, self.ffn_dim :])
        return self.down.forward(hidden).float()

    @property
    def nbytes(self) -> int:
        return self.gate_up.nbytes + self.down.nbytes


class TorchExperts:
    """A layer's experts run one at a time in torch, each over the rows that chose it, each
    row summing its experts in its own choice order (as the native kernel does)."""

    def __init__(self, experts: Sequence[TorchExpert]):
        self.experts = list(experts)
        self.n_experts = len(self.experts)

    def expert_bytes(self, expert: int) -> int:
        return self.experts[expert].nbytes

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        n, k = ids.shape
        outputs = torch.zeros(n, k, x.shape[1], device=x.device)
        flat = ids.reshape(-1)
        for expert in torch.unique(flat).tolist():
            where = (flat == expert).nonzero().squeeze(1)
            rows = where // k
            outputs.view(n * k, -1)[where] = self.experts[expert].forward(x[rows])
        y = outputs[:, 0] * weights[:, :1]
        for j in range(1, k):
            y = y + outputs[:, j] * weights[:, j : j + 1]
        return y

    __call__ = forward


Experts = NativeExperts | TorchExperts


class SharedExpert:
    """Qwen2-MoE's shared expert: a SiLU-gated feed-forward every token runs, scaled by
    sigmoid(gate . x)."""

    def __init__(self, feed_forward, gate: torch.Tensor):
        self.feed_forward = feed_forward  # decoder.FeedForward
        # [dim, 1], in float64 for the router's reason: the same bits for a row in any pass
        self.gate = gate.double().reshape(-1, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The sigmoid in float64 too: torch's vectorised float32 sigmoid and its scalar tail
        # round differently, so a row's scale would depend on its place in the pass.
        scale = torch.sigmoid(x.double() @ self.gate).float()
        return self.feed_forward.forward(x).float().mul_(scale)

    @property
    def nbytes(self) -> int:
        ffn = self.feed_forward
        return ffn.w_gate_up.nbytes + ffn.w_down.nbytes + self.gate.numel() * 4


class MixtureFeedForward:
    """x [n, dim] (normed) -> fp32 [n, dim]: routed experts, plus the shared expert if any.

    `expert_device`: where the experts run (the CPU when a GPU model keeps them there,
    llama.cpp's --cpu-moe); the router and the shared expert run on x's device."""

    def __init__(
        self,
        router: Router,
        experts: Experts,
        used: int,
        normalize: bool,
        shared: SharedExpert | None = None,
        expert_device: torch.device | None = None,
    ):
        self.router, self.experts, self.used, self.normalize = router, experts, used, normalize
        self.shared = shared
        self.expert_device = expert_device
        # The native kernel routes too where the experts and the router share the CPU (then
        # the experts run where x is, and the fused decode layer may take the mixture).
        self.native_route = isinstance(experts, NativeExperts) and router.weight.is_cpu
        # The last pass's choices [n, used] (tests and the byte count of a step read them).
        self.last_ids: torch.Tensor | None = None

    def forward(self, x: torch.Tensor, rows=None) -> torch.Tensor:
        """`rows` (the pass's rows, for LoRA) is accepted for the FeedForward interface:
        adapters on experts are refused when an adapter is bound."""
        if self.native_route and x.is_cpu:
            ids, weights = self.experts.route(self.router.weight, x, self.used, self.normalize)
        else:
            ids, weights = route(self.router.forward(x), self.used, self.normalize)
        self.last_ids = ids
        device = x.device
        if self.expert_device is not None and self.expert_device != device:
            y = self.experts.forward(
                x.to(self.expert_device), ids.to(self.expert_device), weights.to(self.expert_device)
            ).to(device)
        else:
            y = self.experts.forward(x, ids, weights)
        if self.shared is not None:
            y = y.add_(self.shared.forward(x))
        return y

    __call__ = forward

    def bytes_per_token(self) -> int:
        """Bytes of weights one decode step reads here: the router, the shared expert, and
        `used` experts of average size."""
        total = sum(self.experts.expert_bytes(e) for e in range(self.experts.n_experts))
        shared = self.shared.nbytes if self.shared is not None else 0
        return self.router.nbytes + shared + total * self.used // self.experts.n_experts

    def bytes_for(self, ids: torch.Tensor) -> int:
        """Bytes of weights a pass whose rows chose `ids` reads here: each chosen expert once."""
        chosen = torch.unique(ids).tolist()
        shared = self.shared.nbytes if self.shared is not None else 0
        return self.router.nbytes + shared + sum(self.experts.expert_bytes(e) for e in chosen)
