"""The one-token decode step over fixed-shape buffers, so that a GPU can replay it as a graph.

An ordinary decode step builds tensors whose shapes follow the conversation: keys fetched
grow with every token, masks appear once the window is full, sinks re-rotate when the frame
moves. A CUDA graph (or a compiled function) needs the same shapes and addresses on every
call. So here every cache is allocated at full size once (`reserve`), attention reads the
whole storage span with a mask instead of the filled prefix, and everything that changes from
step to step - the token's embedding, RoPE tables, the slot its keys go to, the mask, the
sinks' frame - is copied into small static input buffers before the step runs. The Python
bookkeeping of the caches (positions, ring head, frame) still runs eagerly, so eager passes
(prompts, speculative verification, roll-back) and static steps share the same caches.

Reading the whole reserved cache every step would make a short chat pay for the longest
one, so attention reads a prefix of the span rounded up to a power of two (`span_bucket`),
and each bucket gets its own graph: a handful of captures over a long conversation.

On a CPU the static step is plain eager code (it is how the simulated GPUs run it, and how the
tests check it against the ordinary step); `CudaGraphRunner` captures it once per span
bucket and replays it on CUDA and ROCm.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..cache import Cache, StaticCache
from ..layers import Rope, RopeTables, apply_rope
from .decoder import DecoderModel
from .placement import CPU

WARMUP_STEPS = 2  # eager runs on a side stream before capture, as torch's graph docs advise
MIN_SPAN = 256  # the smallest prefix of the cache attention reads


def span_bucket(needed: int, full: int) -> int:
    """The prefix of a cache span (of `full` slots) a step reads when `needed` are in use:
    a power of two from MIN_SPAN, so a conversation goes through few of them."""
    span = MIN_SPAN
    while span < needed:
        span *= 2
    return min(span, full)


@dataclass
class _KindInputs:
    """Static inputs shared by the layers of one kind (global or sliding-window): all their
    caches hold the same positions, so they write to the same slot and see the same mask."""

    rope: Rope
    rotation: RopeTables  # the new token's cos / signed sin, [1, 1, head_dim]
    sink_shift: RopeTables  # rotates each sink from its own position into the frame
    write_at: torch.Tensor  # int64 [1]: storage index of the new keys and values
    mask: torch.Tensor  # bool [1, full span]: what the new token's query sees


class _StaticCacheView:
    """A cache as the static step sees it: `update_and_fetch` writes at the slot held in a
    device tensor and returns the first `length` slots of its span."""

    def __init__(self, cache: StaticCache, inputs: _KindInputs, length: int):
        self.keys, self.values = cache.keys, cache.values
        self.key_codec, self.value_codec = cache.key_codec, cache.value_codec
        self.inputs = inputs
        self.sinks = cache.sinks
        self.start, self.stop = cache.static_span()[0], cache.static_span()[0] + length

    def update_and_fetch(self, k: torch.Tensor, v: torch.Tensor):
        inputs, codec = self.inputs, self.key_codec
        self.keys.index_copy_(2, inputs.write_at, codec.encode(k))
        self.values.index_copy_(2, inputs.write_at, self.value_codec.encode(v))
        if self.sinks:  # sinks re-rotated into the newest query's frame (idempotent)
            own = codec.decode(self.keys[:, :, : self.sinks])[0].transpose(0, 1)
            framed = apply_rope(own, inputs.sink_shift).transpose(0, 1)[None]
            self.keys[:, :, self.sinks : 2 * self.sinks].copy_(codec.encode(framed))
        return self.keys[:, :, self.start : self.stop], self.values[:, :, self.start : self.stop]

    def tiled_keys(self, rows: int) -> None:
        return None  # tiled caches take no static steps

    def decode_keys(self, keys: torch.Tensor, row: int | None = None) -> torch.Tensor:
        return self.key_codec.decode(keys)


def static_step_unsupported(model: DecoderModel, caches: list[Cache]) -> str | None:
    """Why this model and these caches cannot take static steps (None: they can)."""
    devices = {*model.layer_devices, model.head_device}
    if len(devices) != 1:
        return "the model is split between devices"
    if not all(isinstance(cache, StaticCache) for cache in caches):
        return "a kind of cache without fixed-shape steps"
    if any(cache.key_codec.tiled for cache in caches):
        return "q4 keys, whose tiles are encoded by the host as they complete"
    return None


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


class StaticDecodeStep:
    """Decode steps of `model` over `caches` with fixed shapes. Build it after `reserve`-ing
    the caches; `ready()` says whether the next step can be static (the sinks are filled and
    nothing needs to grow); otherwise the caller takes an ordinary step."""

    def __init__(self, model: DecoderModel, caches: list[Cache], runner: Runner = eager_runner):
        reason = static_step_unsupported(model, caches)
        if reason is not None:
            raise ValueError(reason)
        self.model, self.caches, self.runner = model, caches, runner
        self.device = model.head_device
        config = model.config
        self._local = [config.is_local(i) for i in range(config.n_layers)]
        self._layers_of_kind = {
            kind: [i for i, local in enumerate(self._local) if local == kind]
            for kind in sorted(set(self._local))
        }
        self.kinds = {
            kind: self._kind_inputs(model.ropes[kind], caches[layers[0]])
            for kind, layers in self._layers_of_kind.items()
        }
        self.x = torch.zeros(1, config.dim, device=self.device)
        self.logits = torch.zeros(1, config.vocab_size, device=self.device)
        self._storage = self._storage_addresses()
        self._runs: dict[tuple[int, ...], Callable[[], None]] = {}  # span lengths -> step

    def _kind_inputs(self, rope: Rope, cache: Cache) -> _KindInputs:
        head_dim = self.model.config.head_dim

        def tables() -> RopeTables:
            shape = (1, 1, head_dim)
            return RopeTables(torch.ones(shape, device=self.device),
                              torch.zeros(shape, device=self.device), rope)  # fmt: skip

        _, span = cache.static_span()
        return _KindInputs(
            rope, tables(), tables(),
            torch.zeros(1, dtype=torch.long, device=self.device),
            torch.zeros(1, span, dtype=torch.bool, device=self.device),
        )  # fmt: skip

    def _storage_addresses(self) -> list[int]:
        return [cache.keys.data_ptr() for cache in self.caches]

    @property
    def captured(self) -> int:
        """How many span buckets have a step built (graphs, on a GPU)."""
        return len(self._runs)

    def ready(self) -> bool:
        """Whether the next token can go through the static step: every cache reserved at
        the addresses it was built for and in its steady state."""
        return all(c.static_ready() for c in self.caches) and (
            self._storage_addresses() == self._storage
        )

    def __call__(self, token: int) -> torch.Tensor:
        """Feed one token; returns its fp32 logits [1, vocab] on the CPU."""
        if self.model.fault_hook is not None:
            self.model.fault_hook()
        self.x.copy_(self.model.embed_tokens(torch.tensor([token])))
        lengths = tuple(
            self._advance_kind(self.kinds[kind], layers)
            for kind, layers in self._layers_of_kind.items()
        )
        try:
            run = self._runs.get(lengths) or self._build_run(lengths)
            run()
        except BaseException:
            for cache in self.caches:  # as if the token had never come
                cache.trim(1)
            raise
        return self.logits.to(CPU, copy=True)  # the buffer is overwritten next step

    def _advance_kind(self, inputs: _KindInputs, layers: list[int]) -> int:
        """Cache bookkeeping for the new token, and the kind's static inputs for it; returns
        the span bucket its attention reads. The first cache of the kind answers for all
        (they hold the same positions)."""
        first = self.caches[layers[0]]
        step = first.advance_one()
        for layer in layers[1:]:
            self.caches[layer].advance_one(with_mask=False)
        rotation = inputs.rope.tables(first.offset - 1, 1)
        inputs.rotation.cos.copy_(rotation.cos)
        inputs.rotation.signed_sin.copy_(rotation.signed_sin)
        shift = inputs.rope.shift_tables(step.frame)
        inputs.sink_shift.cos.copy_(shift.cos)
        inputs.sink_shift.signed_sin.copy_(shift.signed_sin)
        inputs.write_at.fill_(step.write_at)
        inputs.mask.copy_(step.mask)
        return span_bucket(first.static_extent(), inputs.mask.shape[1])

    def _build_run(self, lengths: tuple[int, ...]) -> Callable[[], None]:
        span = dict(zip(self._layers_of_kind, lengths, strict=True))
        views = [
            _StaticCacheView(cache, self.kinds[kind], span[kind])
            for cache, kind in zip(self.caches, self._local, strict=True)
        ]
        masks = {kind: inputs.mask[:, : span[kind]] for kind, inputs in self.kinds.items()}
        run = self.runner(functools.partial(self._body, views, masks))
        self._runs[lengths] = run
        return run

    def _body(self, views: list[_StaticCacheView], masks: dict[bool, torch.Tensor]) -> None:
        """The step itself, through the model's own layer loop and head: it reads only the
        static inputs, so it can be captured."""
        model = self.model
        rotations = {kind: inputs.rotation for kind, inputs in self.kinds.items()}
        x = model.apply_layers(self.x, views, rotations, masks)
        self.logits.copy_(model.project(model.final_norm(x)))
