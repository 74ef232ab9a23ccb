"""Running a fixed-shape step as a graph: captured once, then replayed (CUDA, and ROCm
through the same API), or as ordinary code where there is no graph (a CPU, a simulated
GPU). The step itself is built elsewhere (engine/models/static_step.py)."""

from __future__ import annotations

from collections.abc import Callable

import torch

WARMUP_STEPS = 2  # eager runs on a side stream before capture, as torch's graph docs advise

Runner = Callable[[Callable[[], None]], Callable[[], None]]


def eager_runner(body: Callable[[], None]) -> Callable[[], None]:
    """Runs the static step as ordinary code (CPU, simulated GPUs)."""
    return body


class CudaGraphRunner:
    """Captures the static step into a CUDA graph on first use (after warm-up runs on a side
    stream), then replays it. ROCm builds of torch capture HIP graphs the same way."""

    def __init__(self, body: Callable[[], None]):
        self.body = body
        self.graph: torch.cuda.CUDAGraph | None = None

    def __call__(self) -> None:
        if self.graph is None:
            self._capture()
        self.graph.replay()

    def _capture(self) -> None:
        # Warm-up and capture both run the step on the inputs already in place: writes land
        # in the same cache slot the replay then overwrites with the same values.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(WARMUP_STEPS):
                self.body()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: CUDA work on other threads (a GUI, speech) does not spoil the capture.
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            self.body()
        self.graph = graph
