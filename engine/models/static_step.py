"""The one-token decode step over fixed-shape buffers, so that a GPU can replay it as a graph.

An ordinary decode step builds tensors whose shapes follow the conversation: keys fetched
grow with every token, masks appear once the window is full, sinks re-rotate when the frame
moves. A CUDA graph (or a compiled function) needs the same shapes and addresses on every
call. So here every cache is allocated at full size once (`reserve`), attention reads the
whole storage span with a mask instead of the filled prefix, and everything that changes from
step to step - the token's id, RoPE tables, the slot its keys go to, the mask, the sinks'
frame - is copied into small static input buffers before the step runs (the step looks the
token up in a copy of the embedding table on its own device). The Python
bookkeeping of the caches (positions, ring head, frame) still runs eagerly, so eager passes
(prompts, speculative verification, roll-back) and static steps share the same caches.

Reading the whole reserved cache every step would make a short chat pay for the longest
one, so attention reads a prefix of the span rounded up to a power of two (`span_bucket`),
and each bucket gets its own graph: a handful of captures over a long conversation.

A step can also draw each row's next token on the device (`sampled`): the sampler of
tokens/device_sampler.py runs at the end of the same graph, over settings and uniforms copied
into static buffers, and only the token ids [rows] come back to the host instead of the
logits [rows, vocab]. `launch` queues such a step without waiting for its ids, and may feed
it the ids the step drew last, still on the device: the host queues step n+1 before it
reads step n's tokens, so its work overlaps the GPU's (`take_back` undoes such a step when
its tokens turn out not to be wanted).

On a CPU the static step is plain eager code (it is how the simulated GPUs run it, and how the
tests check it against the ordinary step); `CudaGraphRunner` captures it once per span
bucket and replays it on CUDA and ROCm.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..kv.cache import Cache, StaticCache, StaticStep
from ..kv.codec import TILE_ROWS, KVCodec
from ..kv.types import F32
from ..ops.layers import Rope, RopeTables, apply_rope
from ..platform.graphs import Runner, eager_runner
from ..tokens.device_sampler import SCALARS, SamplingTensors, sample
from .attention_backends import kernel_takes_heads, stored_attention_runs, write_static_rows
from .decoder import DecoderModel
from .pass_metadata import PassMetadata, RowKind, RowSpan
from .placement import CPU

MIN_SPAN = 256  # the smallest prefix of the cache attention reads


def span_bucket(needed: int, full: int) -> int:
    """The prefix of a cache span (of `full` slots) a step reads when `needed` are in use:
    a power of two from MIN_SPAN, so a conversation goes through few of them."""
    span = MIN_SPAN
    while span < needed:
        span *= 2
    return min(span, full)


class _TileRows:
    """For q4 keys in tiles (engine/kv/key_tiles.py), which fp32 rows a step uses, as one int64
    device buffer filled from the host: the row of `KeyTiles.recent` its key goes to, then
    the ring rows of its own tile (the one its query reads exactly), then where those rows
    sit in `recent`."""

    SIZE = 1 + 2 * TILE_ROWS

    def __init__(self, rows: torch.Tensor, host_rows: torch.Tensor):
        self.rows, self._host_rows = rows, host_rows  # int64 [SIZE]: the step's, the host's
        self.key_row = self.rows[:1]
        self.own_rows = self.rows[1 : 1 + TILE_ROWS]
        self.own_recent = self.rows[1 + TILE_ROWS :]
        self._offsets = torch.arange(TILE_ROWS)

    def point_at(self, slot: int) -> None:
        """Aim at ring slot `slot` (KeyTiles keeps tile t in half t % 2 of `recent`)."""
        first = slot // TILE_ROWS * TILE_ROWS
        half = first % (2 * TILE_ROWS)
        rows = torch.cat(
            [torch.tensor([slot % (2 * TILE_ROWS)]), first + self._offsets, half + self._offsets]
        )
        self._host_rows.copy_(rows)


class _Staging:
    """The step's small inputs - RoPE tables, slots, masks, tile rows, sampling settings -
    as views of one device buffer. The host writes them into a mirror of it (pinned memory
    on a GPU) and `send` copies the whole in one transfer a step, instead of one transfer
    per input (each costs the host driver time, and waits for the GPU where the host memory
    is pageable). On a CPU the mirror is the buffer itself and nothing is copied."""

    ALIGN = 16  # bytes: every view starts aligned for any dtype
    # Whether the mirror is apart from the buffer (None: on a GPU). Tests set it on a CPU to
    # check that every input reaches the step through `send`.
    apart: bool | None = None

    def __init__(self, capacity: int, device: torch.device):
        on_gpu = device.type != "cpu"
        self.buffer = torch.zeros(capacity, dtype=torch.uint8, device=device)
        self.mirror = self.buffer
        if on_gpu if self.apart is None else self.apart:
            self.mirror = torch.zeros(capacity, dtype=torch.uint8, pin_memory=on_gpu)
        self.used = 0
        self.sends = 0  # transfers made (tests count them against steps)
        self._sent = None  # the last transfer's event, until the host waits for it (GPU)

    @property
    def mirrored(self) -> bool:
        """Whether the host writes a mirror apart from the step's buffer."""
        return self.mirror is not self.buffer

    @classmethod
    def bytes_for(cls, parts: list[tuple[int, torch.dtype]]) -> int:
        """Room for these parts (element counts and dtypes), each aligned."""
        return sum(-(-n * dtype.itemsize // cls.ALIGN) * cls.ALIGN for n, dtype in parts)

    def take(self, shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """A new input: (the step's view, the host's view) of its bytes."""
        size = math.prod(shape) * dtype.itemsize
        if self.used + size > self.buffer.numel():
            raise ValueError("the step's inputs overflow their staging buffer")
        start, self.used = self.used, self.used + -(-size // self.ALIGN) * self.ALIGN

        def view(buffer: torch.Tensor) -> torch.Tensor:
            return buffer[start : start + size].view(dtype).view(shape)

        step = view(self.buffer)
        host = step if self.mirror is self.buffer else view(self.mirror)
        return step, host

    def send(self) -> None:
        """Copy what the host wrote to the device (in stream order: the step's kernels
        queued after it read the new values). The copy runs when the GPU gets to it, maybe
        after the host has gone on to the next step: `wait_sent` before writing again."""
        if self.mirrored:
            self.buffer[: self.used].copy_(self.mirror[: self.used], non_blocking=True)
            self._sent = _recorded(self.buffer.device)
        self.sends += 1

    def wait_sent(self) -> None:
        """Wait until the last `send` has read the mirror, so that the host may write it
        (a step launched before the previous one's tokens were read: that send may still be
        queued behind the running step)."""
        if self._sent is not None:
            self._sent.synchronize()
            self._sent = None


@dataclass
class _KindInputs:
    """Static inputs shared by the layers of one kind (global or sliding-window): all their
    caches hold the same positions, so they write to the same slot and see the same mask."""

    rope: Rope
    rotation: RopeTables  # the new token's cos / signed sin, [1, 1, head_dim]
    sink_shift: RopeTables  # rotates each sink from its own position into the frame
    write_at: torch.Tensor  # int64 [1]: storage index of the new keys and values
    mask: torch.Tensor  # bool [1, full span]: what the new token's query sees
    tiles: _TileRows | None  # for q4 keys in tiles
    # The same inputs as the host writes them (the staging mirror); None: these tensors.
    host: _KindInputs | None = None

    @property
    def written(self) -> _KindInputs:
        """The tensors the host writes this step's values into."""
        return self if self.host is None else self.host


class _StaticCacheView:
    """A cache as the static step sees it: `update_and_fetch` writes at the slot held in a
    device tensor and returns the first `length` slots of its span (q4 keys in tiles: as
    fp32, decoded the way a decode step reads them)."""

    def __init__(self, cache: StaticCache, inputs: _KindInputs, length: int):
        self.keys, self.values = cache.keys, cache.values
        self.key_codec, self.value_codec = cache.key_codec, cache.value_codec
        self.inputs = inputs
        self.sinks = cache.sinks
        self.start, self.stop = cache.static_span()[0], cache.static_span()[0] + length
        self.key_tiles = getattr(cache, "key_tiles", None)
        if self.key_tiles is not None:
            self.lead = getattr(cache, "lead", None)
            self.key_codec = KVCodec(F32, self.key_tiles.head_dim, self.keys.device)
        # Where Triton runs, one kernel writes new q8 or q4 rows as stored (RoPE, rotation
        # and quantization in one pass, the sinks' frame too): torch's encode takes several
        # kernels a layer. 16-bit rows stay with torch, whose RoPE, cast and copy fuse into
        # one kernel: through the write kernel a SmolLM2 step counts the same 274 kernels.
        self.kernel_writes = (
            self.key_tiles is None
            and (cache.key_codec.rotated or cache.value_codec.rotated)
            and stored_attention_runs(self.keys.device)
            and kernel_takes_heads(self.key_codec.head_dim)
        )

    def stored(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values the step's query reads, as stored: its span's first
        `length` slots."""
        return self.keys[:, :, self.start : self.stop], self.values[:, :, self.start : self.stop]

    def update_and_fetch(self, k: torch.Tensor, v: torch.Tensor, written: bool = False):
        """`written`: the decoder wrote k and v (and the sinks' frame) already, with other
        rows', by the kernels."""
        inputs, codec = self.inputs, self.key_codec
        values = self.values[:, :, self.start : self.stop]
        if self.kernel_writes:
            if not written:
                write_static_rows([self], k[0].transpose(0, 1), v[0].transpose(0, 1))
            return self.stored()
        self.values.index_copy_(2, inputs.write_at, self.value_codec.encode(v))
        if self.key_tiles is not None:
            return self._tiled_keys(k), values
        self.keys.index_copy_(2, inputs.write_at, codec.encode(k))
        if self.sinks:  # sinks re-rotated into the newest query's frame (idempotent)
            own = codec.decode(self.keys[:, :, : self.sinks])[0].transpose(0, 1)
            framed = apply_rope(own, inputs.sink_shift).transpose(0, 1)[None]
            self.keys[:, :, self.sinks : 2 * self.sinks].copy_(codec.encode(framed))
        return self.keys[:, :, self.start : self.stop], values

    def _tiled_keys(self, k: torch.Tensor) -> torch.Tensor:
        """The key goes into its fp32 row of the newest tiles; returns fp32 keys [1, kv_heads,
        length, head_dim] as the native kernel reads them: fp32 frame sinks, complete tiles
        decoded, the query's own tile exact. The host encodes a tile the key completes,
        after the step (StaticStep.written)."""
        tiles, rows = self.key_tiles, self.inputs.tiles
        tiles.recent.index_copy_(1, rows.key_row, k[0].float())
        used = self.stop - self.start - self.sinks  # ring rows read
        whole = -(-used // TILE_ROWS) * TILE_ROWS
        keys = tiles.decode(self.keys[:, :, 2 * self.sinks :][:, :, :whole])
        keys.index_copy_(2, rows.own_rows, tiles.recent.index_select(1, rows.own_recent)[None])
        keys = keys[:, :, :used]
        if not self.sinks:
            return keys
        own = self.lead[0, :, : self.sinks].transpose(0, 1)
        framed = apply_rope(own, self.inputs.sink_shift).transpose(0, 1)[None]
        self.lead[:, :, self.sinks :].copy_(framed)  # as the host keeps them
        return torch.cat([framed, keys], dim=2)

    def tiled_keys(self, rows: int) -> None:
        return None  # update_and_fetch returned them all, in fp32

    def decode_keys(self, keys: torch.Tensor, row: int | None = None) -> torch.Tensor:
        return self.key_codec.decode(keys)


def _recorded(device: torch.device):
    """An event recorded now on `device`'s current stream (None on a CPU, where every
    operation has finished when it returns)."""
    if device.type != "cuda":  # ROCm's devices are "cuda" too
        return None
    event = torch.cuda.Event()
    event.record()
    return event


class DrawnTokens:
    """The ids a launched step draws, on their way to the host: `ids()` waits for that step
    alone, so the host can launch the next step first (`StaticDecodeStep.launch`)."""

    def __init__(self, step: StaticDecodeStep, host_ids: torch.Tensor, ready):
        self.step, self._host_ids, self._ready = step, host_ids, ready

    def ids(self) -> list[int]:
        """One id a sequence."""
        if self._ready is not None:
            self._ready.synchronize()
            self._ready = None
        return self._host_ids.tolist()


def _row(tables: RopeTables, row: int) -> RopeTables:
    return RopeTables(tables.cos[row : row + 1], tables.signed_sin[row : row + 1], tables.rope)


def static_step_unsupported(model: DecoderModel, caches: list[Cache]) -> str | None:
    """Why this model and these caches cannot take static steps (None: they can)."""
    devices = {*model.layer_devices, model.head_device}
    if len(devices) != 1:
        return "the model is split between devices"
    if not all(isinstance(cache, StaticCache) for cache in caches):
        return "a kind of cache without fixed-shape steps"
    return None


class StaticDecodeStep:
    """Decode steps of `model` over `caches` with fixed shapes. Build it after `reserve`-ing
    the caches; `ready()` says whether the next step can be static (the sinks are filled and
    nothing needs to grow); otherwise the caller takes an ordinary step.

    `batch`: the caches of several sequences instead, one token each a step (the
    scheduler's decode rows): their rows share every matmul and each attends its own caches,
    through the same layer loop continuous batching uses; a step then takes one token per
    sequence, in order, and returns one row of logits each. Each sequence once: a batch
    padded to a bucket of rows by repeating a sequence would still compile apart from a
    full one (torch guards on which rows share tensors), so batches are not padded."""

    # Whether rows may share caches (a verification's rows are one sequence's tokens).
    rows_share_caches = False

    def __init__(
        self,
        model: DecoderModel,
        caches: list[Cache] | None = None,
        runner: Runner = eager_runner,
        batch: list[list[Cache]] | None = None,
    ):
        sequences = [caches] if batch is None else list(batch)
        for one in sequences:
            reason = static_step_unsupported(model, one)
            if reason is not None:
                raise ValueError(reason)
        if not self.rows_share_caches and len({id(one) for one in sequences}) < len(sequences):
            raise ValueError("a sequence can take only one row of a batched step")
        self.model, self.runner = model, runner
        self.sequences = sequences
        self.batched = batch is not None
        self.device = model.head_device
        config = model.config
        self._local = [config.is_local(i) for i in range(config.n_layers)]
        self._layers_of_kind = {
            kind: [i for i, local in enumerate(self._local) if local == kind]
            for kind in sorted(set(self._local))
        }
        rows = len(sequences)
        self._staging = _Staging(self._staged_bytes(), self.device)
        # Each kind's RoPE tables for all rows, one row a sequence: its inputs write there.
        self._host_rotations: dict[bool, RopeTables] = {}
        self.rotations: dict[bool, RopeTables] = {}
        for kind in self._layers_of_kind:
            self.rotations[kind], self._host_rotations[kind] = self._tables(kind, rows)
        self.inputs = [
            {
                kind: self._kind_inputs(kind, one[layers[0]], row)
                for kind, layers in self._layers_of_kind.items()
            }
            for row, one in enumerate(sequences)
        ]
        # The tokens' ids, staged: the step looks them up in the device's copy of the table
        # (`DecoderModel.device_embedding`) into the residual stream `x`, which the layers
        # update in place (a compiled step cannot mutate a view of the staged bytes).
        self.tokens, self._host_tokens = self._staging.take((rows,), torch.long)
        self._embedding = model.device_embedding()
        self.x = torch.zeros(rows, config.dim, device=self.device)
        self.logits = torch.zeros(rows, config.vocab_size, device=self.device)
        # The final-normed states [rows, dim], kept only where a caller reads them (a
        # verification step's drafters do): a decode step spends no copy on them.
        self.states: torch.Tensor | None = None
        # Sampling on the device (`sampled`): its settings, one uniform a row, the ids drawn.
        self._sampling: SamplingTensors | None = None  # made on the first sampled step
        self.uniforms, self._host_uniforms = self._staging.take((rows,), torch.float32)
        self._scalars, self._host_scalars = self._staging.take((len(SCALARS), rows), torch.float32)
        self.chosen = torch.zeros(rows, dtype=torch.long, device=self.device)
        # The ids come back through two host buffers in turn: a step's copy may land while
        # the host still reads the previous step's (pinned, so that the copy is queued).
        pinned = self.device.type != "cpu"
        self._host_chosen = [torch.zeros(rows, dtype=torch.long, pin_memory=pinned) for _ in "ab"]
        self._storage = self._storage_addresses()
        # Each row's storage span of each kind (`_shared_spans`), fixed once reserved.
        self._full_spans = [
            one[layers[0]].static_span()[1]
            for one in sequences
            for layers in self._layers_of_kind.values()
        ]
        self._kind_firsts = [
            one[layers[0]] for one in sequences for layers in self._layers_of_kind.values()
        ]
        # (span lengths, sampled) -> the step built for them (a graph, on a GPU)
        self._runs: dict[tuple[tuple[int, ...], bool], Callable[[], None]] = {}
        self._frames_written: dict[int, int] = {}  # sink rotation buffer -> its frame
        self.replays = 0  # steps taken (tests count them against captures)
        self.draws = 0  # of which drew their tokens on the device

    def _staged_bytes(self) -> int:
        """Room for every staged input (`_Staging`): the token ids, each kind's RoPE tables
        for all rows, and each row's sink rotation, slot, mask and tile rows; the sampling
        settings."""
        rows, head_dim = len(self.sequences), self.model.config.head_dim
        f32, i64 = torch.float32, torch.long
        parts = [(rows, i64), (rows, f32), (len(SCALARS) * rows, f32)]
        for layers in self._layers_of_kind.values():
            parts += [(rows * head_dim, f32)] * 2
            for one in self.sequences:
                cache = one[layers[0]]
                parts += [(head_dim, f32)] * 2 + [(1, i64), (cache.static_span()[1], torch.bool)]
                parts += [(_TileRows.SIZE, i64)] if cache.key_codec.tiled else []
        return _Staging.bytes_for(parts)

    def _tables(self, kind: bool, rows: int) -> tuple[RopeTables, RopeTables]:
        """RoPE tables for `rows` rows, staged: (the step's, the host's), the identity."""
        rope, shape = self.model.ropes[kind], (rows, 1, self.model.config.head_dim)
        cos, host_cos = self._staging.take(shape, torch.float32)
        sin, host_sin = self._staging.take(shape, torch.float32)
        for table in (cos, host_cos):
            table.fill_(1.0)
        return RopeTables(cos, sin, rope), RopeTables(host_cos, host_sin, rope)

    def _kind_inputs(self, kind: bool, cache: Cache, row: int) -> _KindInputs:
        _, span = cache.static_span()
        shift, host_shift = self._tables(kind, 1)
        write_at, host_write_at = self._staging.take((1,), torch.long)
        mask, host_mask = self._staging.take((1, span), torch.bool)
        tiles = None
        if cache.key_codec.tiled:
            tiles = _TileRows(*self._staging.take((_TileRows.SIZE,), torch.long))
        step, host = (
            _KindInputs(
                self.model.ropes[kind], _row(tables[kind], row), sink_shift, at, seen, tiles
            )
            for tables, sink_shift, at, seen in (
                (self.rotations, shift, write_at, mask),
                (self._host_rotations, host_shift, host_write_at, host_mask),
            )
        )
        step.host = host if self._staging.mirrored else None
        return step

    def _storage_addresses(self) -> list[int]:
        return [cache.keys.data_ptr() for one in self.sequences for cache in one]

    @property
    def captured(self) -> int:
        """How many span buckets have a step built (graphs, on a GPU)."""
        return len(self._runs)

    def ready(self) -> bool:
        """Whether the next token can go through the static step: every cache reserved at
        the addresses it was built for and in its steady state. A kind's first cache of each
        sequence answers for the kind's others (they hold the same positions, and were
        reserved together: their storage has not moved), which saves the host a call a
        layer and sequence every step."""
        return all(first.static_ready() for first in self._kind_firsts) and (
            self._storage_addresses() == self._storage
        )

    def __call__(self, token: int) -> torch.Tensor:
        """Feed one token (one sequence's step); returns its fp32 logits [1, vocab] on the
        CPU."""
        return self.step([token])

    def step(self, tokens: list[int]) -> torch.Tensor:
        """Feed one token to each sequence; returns fp32 logits [sequences, vocab] on the
        CPU."""
        self._run_step(self._one_each(tokens), sampled=False)
        return self.logits.to(CPU, copy=True)  # overwritten next step

    def _one_each(self, values: list) -> list:
        """`values`, checked to hold one a sequence."""
        if len(values) != len(self.sequences):
            raise ValueError(f"{len(values)} values for {len(self.sequences)} sequences")
        return values

    def sampled(
        self, tokens: list[int], settings: SamplingTensors, uniforms: list[float]
    ) -> list[int]:
        """Feed one token to each sequence and draw each one's next token on the device
        with `settings` (one row a sequence) and the row's uniform in [0, 1): only the ids
        cross to the host."""
        return self.launch(tokens, settings, uniforms).ids()

    def launch(
        self, tokens: list[int] | None, settings: SamplingTensors, uniforms: list[float]
    ) -> DrawnTokens:
        """`sampled` without waiting for the ids. `tokens` None: each sequence is fed the
        token this step drew last, still on the device, so the host can launch step n+1
        before it reads step n's tokens (the settings must not depend on them: no
        penalties, no grammar). `take_back` undoes a launch whose tokens are not wanted."""
        self._staging.wait_sent()
        if self._sampling is None:
            rows, vocab = self.logits.shape
            self._sampling = SamplingTensors.buffers(rows, vocab, self.device, self._scalars)
        self._sampling.fill_(settings, scalars=False)  # the scalars go with the staged inputs
        self._host_scalars.copy_(settings.scalars)
        self._host_uniforms.copy_(torch.tensor(self._one_each(uniforms), dtype=torch.float32))
        self._run_step(None if tokens is None else self._one_each(tokens), sampled=True)
        self.draws += 1
        host_ids = self._host_chosen[self.draws % 2]
        host_ids.copy_(self.chosen, non_blocking=True)
        return DrawnTokens(self, host_ids, _recorded(self.device))

    def take_back(self) -> None:
        """Undo the latest step, its tokens unread: once it has run, every sequence's
        caches forget the token it fed (a launch ahead whose sequences stopped or changed).
        The device's `chosen` no longer matches the caches: the next step is given its
        tokens."""
        done = _recorded(self.device)
        try:
            if done is not None:
                done.synchronize()
        finally:
            for one in self.sequences:
                for cache in one:
                    cache.trim(1)

    def _run_step(self, tokens: list[int] | None, sampled: bool) -> None:
        """One step: `tokens` one a row, or None for the ids the step drew last."""
        if self.model.fault_hook is not None:
            self.model.fault_hook()
        self._staging.wait_sent()
        if tokens is not None:
            self._host_tokens.copy_(torch.tensor(tokens))
        written: list[Callable[[], None]] = []
        lengths = []
        for inputs, one in zip(self.inputs, self.sequences, strict=True):
            for kind, layers in self._layers_of_kind.items():
                step, span = self._advance_kind(one, layers, written)
                self._write_inputs(inputs[kind], step, one[layers[0]])
                lengths.append(span)
        spans = self._shared_spans(lengths) if self.batched else tuple(lengths)
        try:
            self._staging.send()
            if tokens is None:  # after the send, which wrote the staged ids' bytes too
                self.tokens.copy_(self.chosen)
            run = self._runs.get((spans, sampled)) or self._build_run(spans, sampled)
            run()
            self.replays += 1
            for encode_tile in written:  # q4 keys: the tiles this step's keys completed
                encode_tile()
        except BaseException:
            for one in self.sequences:  # as if the tokens had never come
                for cache in one:
                    cache.trim(1)
            raise

    def _shared_spans(self, lengths: list[int]) -> tuple[int, ...]:
        """The rows' span buckets (row by row, kind by kind) each raised to the longest row's
        of its kind, within the row's own storage: a row's mask hides the slots it does not
        hold. The batched step then has a graph per longest bucket, not one per combination
        of the rows' buckets, which on a GPU would be a compilation each time any row of a
        server's batch crossed into its next bucket."""
        kinds = len(self._layers_of_kind)
        longest = [max(lengths[kind::kinds]) for kind in range(kinds)]
        return tuple(min(longest[at % kinds], full) for at, full in enumerate(self._full_spans))

    def _advance_kind(
        self, caches: list[Cache], layers: list[int], written: list[Callable[[], None]]
    ) -> tuple[StaticStep, int]:
        """Cache bookkeeping for the new token in one kind's layers; returns the step the
        first cache of the kind describes for all (they hold the same positions) and the
        span bucket its attention reads, and adds to `written` what to call after the
        step."""
        first = caches[layers[0]]
        step = first.advance_one()
        done = [step.written] + [caches[layer].advance_alike() for layer in layers[1:]]
        written += [encode_tile for encode_tile in done if encode_tile is not None]
        return step, span_bucket(first.static_extent(), first.static_span()[1])

    def _write_inputs(self, inputs: _KindInputs, step: StaticStep, first: Cache) -> None:
        """The kind's static inputs for the step `first` (the kind's first cache) took."""
        host = inputs.written
        if inputs.tiles is not None:
            inputs.tiles.point_at(step.write_at - 2 * first.sinks)
        rotation = inputs.rope.tables(first.offset - 1, 1)
        host.rotation.cos.copy_(rotation.cos)
        host.rotation.signed_sin.copy_(rotation.signed_sin)
        self._write_shift(host.sink_shift, step.frame)
        host.write_at.fill_(step.write_at)
        host.mask.copy_(step.mask)

    def _write_shift(self, shift: RopeTables, frame: int) -> None:
        """The sinks' rotation into `frame`, written where it is not already: without sinks
        the frame is always 0, and building the tables is most of the host's time on them."""
        where = shift.cos.data_ptr()
        if self._frames_written.get(where) != frame:
            tables = shift.rope.shift_tables(frame)
            shift.cos.copy_(tables.cos)
            shift.signed_sin.copy_(tables.signed_sin)
            self._frames_written[where] = frame

    def _build_run(self, lengths: tuple[int, ...], sampled: bool) -> Callable[[], None]:
        kinds = list(self._layers_of_kind)
        spans = [
            dict(zip(kinds, lengths[row * len(kinds) : (row + 1) * len(kinds)], strict=True))
            for row in range(len(self.sequences))
        ]
        views = [
            [
                _StaticCacheView(cache, inputs[kind], span[kind])
                for cache, kind in zip(one, self._local, strict=True)
            ]
            for one, inputs, span in zip(self.sequences, self.inputs, spans, strict=True)
        ]
        # One decode row a sequence, as a batched pass of one token each would have them.
        metadata = PassMetadata(
            spans=[RowSpan(row, 1, RowKind.DECODE) for row in range(len(views))],
            caches=views,
            rotations=self.rotations,
            masks={
                kind: [
                    inputs[kind].mask[:, : span[kind]]
                    for inputs, span in zip(self.inputs, spans, strict=True)
                ]
                for kind in kinds
            },
        )
        run = self.runner(functools.partial(self._body, metadata, sampled))
        self._runs[lengths, sampled] = run
        return run

    def _body(self, metadata: PassMetadata, sampled: bool) -> None:
        """The step itself, through the model's own layer loop and head (and the sampler):
        it reads only the static inputs, so it can be captured."""
        model = self.model
        embedded = model.embed_tokens(self.tokens, self._embedding)
        normed = model.final_norm(model.apply_layers(self.x.copy_(embedded), metadata))
        if self.states is not None:
            self.states.copy_(normed)
        self.logits.copy_(model.project(normed))
        if sampled:
            assert self._sampling is not None
            self.chosen.copy_(sample(self.logits, self._sampling, self.uniforms))


class StaticVerifyStep(StaticDecodeStep):
    """`rows` tokens of one sequence in one fixed-shape step: speculative verification of
    [pending, *drafts] replayed as a graph instead of taken op by op.

    The host's bookkeeping advances the caches once per row, in order, as `rows` decode
    steps would, so each row gets the slot, mask and RoPE tables its own decode step gets
    (the per-row inputs are views into one buffer a kind: slots [rows], masks [rows, span]).
    The step then writes all rows' keys and values in one go (one copy a layer, not one a
    row) and each row attends under its own mask, over keys decoded once (rows of kind
    EXACT with a mask tensor, `Attention._attend_masked_rows`). That is each row's decode
    step, bit for bit, while:
    - no row overwrites a key an earlier row still sees, and the sinks' frame stays put (the
      caches' `static_rows_ready`: a sliding-window layer's ring always, once it has slack
      for the rows; a ring with sinks until it holds its window);
    - all rows read the same span bucket (a verification that crosses into the next bucket
      is rare: once per doubling);
    - keys are not packed in q4 tiles (a tile one row completes is encoded on the host only
      after the step).
    `ready()` says so; otherwise the caller verifies op by op. A step is built per row count,
    and each keeps a graph per span bucket, as a decode step does."""

    def __init__(
        self, model: DecoderModel, caches: list[Cache], rows: int, runner: Runner = eager_runner
    ):
        self._joint: dict[bool, _KindInputs] = {}  # each kind's inputs for all rows
        super().__init__(model, runner=runner, batch=[caches] * rows)
        self.batched = False  # one sequence's rows
        self.states = torch.zeros(rows, model.config.dim, device=self.device)

    @property
    def rows(self) -> int:
        return len(self.sequences)

    rows_share_caches = True  # every row a token of its own, over the same caches

    @property
    def caches(self) -> list[Cache]:
        return self.sequences[0]  # every row's

    def _storage_addresses(self) -> list[int]:
        return [cache.keys.data_ptr() for cache in self.caches]

    def ready(self) -> bool:
        # Each cache once (not once a row): `static_rows_ready` implies `static_ready`.
        return (
            self._storage_addresses() == self._storage
            and all(
                not cache.key_codec.tiled and cache.static_rows_ready(self.rows)
                for cache in self.caches
            )
            and all(
                self._one_bucket(self.caches[layers[0]]) for layers in self._layers_of_kind.values()
            )
        )

    def _one_bucket(self, cache: Cache) -> bool:
        """Whether the first and the last row read the same span bucket of `cache`."""
        extent, full = cache.static_extent(), cache.static_span()[1]
        return span_bucket(extent + 1, full) == span_bucket(extent + self.rows, full)

    def verify(self, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Feed `tokens` (one a row) to the caches; returns the rows' final-normed states
        [rows, dim] and fp32 logits [rows, vocab], on the CPU."""
        self._run_step(tokens, sampled=False)
        return self.states.to(CPU, copy=True), self.logits.to(CPU, copy=True)

    def _kind_inputs(self, kind: bool, cache: Cache, row: int) -> _KindInputs:
        """Row `row`'s inputs: its slot and mask are rows of the kind's joint buffers. One
        sink frame serves every row (`ready` sees to it)."""
        joint = self._joint.get(kind)
        if joint is None:
            rows, span = len(self.sequences), cache.static_span()[1]
            shift, host_shift = self._tables(kind, 1)
            write_at, host_write_at = self._staging.take((rows,), torch.long)
            mask, host_mask = self._staging.take((rows, span), torch.bool)
            rope = self.model.ropes[kind]
            joint = _KindInputs(rope, self.rotations[kind], shift, write_at, mask, None)
            host = _KindInputs(
                rope, self._host_rotations[kind], host_shift, host_write_at, host_mask, None
            )
            joint.host = host if self._staging.mirrored else None
            self._joint[kind] = joint
        step, host = (
            _KindInputs(
                inputs.rope,
                _row(inputs.rotation, row),
                inputs.sink_shift,
                inputs.write_at[row : row + 1],
                inputs.mask[row : row + 1],
                None,
            )
            for inputs in (joint, joint.written)
        )
        step.host = None if joint.host is None else host
        return step

    def _build_run(self, lengths: tuple[int, ...], sampled: bool) -> Callable[[], None]:
        span = dict(zip(self._layers_of_kind, lengths, strict=False))  # every row's (`ready`)
        views = [
            _StaticCacheView(cache, self._joint[kind], span[kind])
            for cache, kind in zip(self.caches, self._local, strict=True)
        ]
        metadata = PassMetadata(
            spans=[RowSpan(0, self.rows, RowKind.EXACT)],
            caches=[views],
            rotations=self.rotations,
            masks={kind: [joint.mask[:, : span[kind]]] for kind, joint in self._joint.items()},
        )
        run = self.runner(functools.partial(self._body, metadata, sampled))
        self._runs[lengths, sampled] = run
        return run
