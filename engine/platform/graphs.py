"""Running a fixed-shape step as a graph: captured once, then replayed (CUDA, and ROCm
through the same API), or as ordinary code where there is no graph (a CPU, a simulated
GPU). The step itself is built elsewhere (engine/models/static_step.py).

Before capture, the step can be compiled (`compiled_runner`): torch.compile's inductor fuses
everything between the matmuls and attention - RMSNorm with the residual add, RoPE with the
KV write, SiLU times up, the casts - into generated kernels (Triton on CUDA and ROCm, C++ on a
CPU), about ten a layer instead of thirty-odd ops. Generated rather than hand-written: the
fusions follow the model code as it is (every architecture, cache type and sampler), and the
int4 matmuls and SDPA stay torch's own kernels.
"""

from __future__ import annotations

import collections
import logging
import os
from collections.abc import Callable

import torch

log = logging.getLogger("miniapp.engine")

CACHE_DIR_ENV = "MINIAPP_CACHE_DIR"  # the folder the calibration files use too

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


# Each sampling choice and span bucket can be one more compilation of the same step code:
# torch's default limit of 8 would silently leave the later ones uncompiled.
COMPILED_VARIANTS = 64
# Verifications of one row count (in one span bucket) captured as written before that
# count's step is compiled: a drafter tries many counts once or twice, and each is a
# compilation of its own (tens of seconds, once a machine: inductor keeps the kernels).
VERIFY_COMPILE_AFTER = 16
# The same for batched decode steps of one row count: a count in use for this many steps -
# under a second of serving - is compiled, one that a client's arrival or departure only
# passes through is not. Each count compiles once: a new set of sequences of that count
# reuses the code.
BATCH_COMPILE_AFTER = 64


class compiled_runner:  # noqa: N801 - used as a function: runner = compiled_runner(capture)
    """A runner that compiles a lone sequence's step (inductor, whole graph), then hands it
    to `capture` (a CUDA graph on a GPU).

    A lone step compiles twice in a chat's life: once, and once more with the span length
    symbolic, when the chat reaches its second span bucket (torch's automatic dynamic
    shapes; every later bucket reuses it). A new chat's step over other caches reuses the
    compiled code too. Batched steps (`batching`) unroll their attention per row, so each
    row count is a compilation of its own (a minute or more, while every client waits):
    a count is compiled once it is in use, and captured as written until then."""

    def __init__(self, capture: Runner = eager_runner):
        self.capture = capture
        # Verifications run so far of each row count, by every verification step of it
        # (a chat's caches, and so its steps, are new after each reset).
        self.verifications: collections.Counter[int] = collections.Counter()
        self.batches: collections.Counter[int] = collections.Counter()  # the same, by rows

    def __call__(self, body: Callable[[], None]) -> Callable[[], None]:
        return self.capture(CompiledStep(body))

    def batching(self, rows: int) -> Runner:
        """The runner of batched decode steps of `rows` rows: compiled once that row count
        has run `BATCH_COMPILE_AFTER` steps, by any step of it (the sets of sequences
        batched together change as clients come and go)."""
        return lambda body: _CompiledOnceHot(
            body, self.capture, self.batches, rows, BATCH_COMPILE_AFTER, "a batched step"
        )

    def verifying(self, rows: int) -> Runner:
        """The runner of verification steps of `rows` rows: one sequence's rows in one pass
        whose only loop over rows is attention's, so it compiles like a decode step. It is
        compiled once that row count is in use (`VERIFY_COMPILE_AFTER` verifications by
        any step of it), captured as written until then."""
        return lambda body: _CompiledOnceHot(
            body, self.capture, self.verifications, rows, VERIFY_COMPILE_AFTER, "a verification"
        )


def uncompiled(runner: Runner) -> Runner:
    """What `runner` hands its compiled steps to (a graph capturer), or itself."""
    return getattr(runner, "capture", runner)


def batched_runner(runner: Runner, rows: int) -> Runner:
    """The runner for batched decode steps of `rows` rows: `runner`'s `batching` where it
    has one, else itself."""
    batching = getattr(runner, "batching", None)
    return runner if batching is None else batching(rows)


def verifying_runner(runner: Runner, rows: int) -> Runner:
    """The runner for verification steps of `rows` rows: `runner`'s `verifying` where it
    has one, else itself."""
    verifying = getattr(runner, "verifying", None)
    return runner if verifying is None else verifying(rows)


class _CompiledOnceHot:
    """Runs `body` captured as written until `uses[key]` (counted by every such run) reaches
    `after`, then compiled and captured again (the first capture dropped)."""

    def __init__(
        self,
        body: Callable[[], None],
        capture: Runner,
        uses: collections.Counter,
        key: int,
        after: int,
        what: str,
    ):
        self.body, self.capture, self.uses, self.key = body, capture, uses, key
        self.after, self.what = after, what
        self.compiled = False
        self.run: Callable[[], None] | None = None

    def __call__(self) -> None:
        if not self.compiled and self.uses[self.key] >= self.after:
            self.run = self.capture(CompiledStep(self.body, f"{self.what} of {self.key} rows"))
            self.compiled = True
        elif self.run is None:
            self.run = self.capture(self.body)
        self.uses[self.key] += 1
        self.run()


class CompiledStep:
    """The step compiled on its first run. If compiling fails there (an op inductor cannot
    generate on this device), the step runs as written from then on, with a warning: the
    graph still pays, only the fusion is lost."""

    def __init__(self, body: Callable[[], None], what: str = "the decode step"):
        import torch._dynamo

        _keep_compiled_kernels()
        config = torch._dynamo.config
        config.recompile_limit = max(config.recompile_limit, COMPILED_VARIANTS)
        self.body, self.what = body, what
        # Casts kept where the model code rounds (to bf16, say): the same numbers as the
        # uncompiled step, which the CPU's answers are checked against.
        options = {"emulate_precision_casts": True}
        self.compiled: Callable[[], None] | None = torch.compile(
            body, fullgraph=True, options=options
        )
        self.ran = False  # compiled once: a later failure is the step's own

    def __call__(self) -> None:
        if self.compiled is not None:
            try:
                if not self.ran:
                    log.info("compiling %s (a minute the first time on a machine)", self.what)
                self.compiled()
                self.ran = True
                return
            except torch.OutOfMemoryError:
                raise
            except Exception as exc:
                if self.ran:
                    raise
                log.warning("%s runs uncompiled: %s", self.what, _first_line(exc))
                self.compiled = None
        self.body()


def _keep_compiled_kernels() -> None:
    """Inductor's caches in miniapp's cache folder rather than in /tmp, which a reboot
    empties: the next session's compilation then takes seconds, not a minute. A folder the
    user chose stays (importing torch._dynamo writes torch's default into the variable, so
    that one is taken as unset)."""
    import platformdirs
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    if os.environ.get("TORCHINDUCTOR_CACHE_DIR", default_cache_dir()) != default_cache_dir():
        return

    root = os.environ.get(CACHE_DIR_ENV) or platformdirs.user_cache_dir("miniapp")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(root, "inductor")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
