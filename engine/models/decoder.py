"""The decoder-only transformer that every supported architecture is an instance of: the
maths of a pass (attention, feed-forward, blocks, the model's layer loop and head).

Each architecture file turns GGUF metadata into a `DecoderConfig` (config.py, the only place
hyper-parameters come from); loading.py builds the model from the file's tensors and
placement.py says where its parts live and how its caches behave. Weights stay in their GGML
formats: Q/K/V are fused into one matmul, as are gate/up, so a decode step makes 4 weight
calls per layer. llama.cpp's graph for each architecture is the reference for the maths.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Protocol

import torch
import torch.nn.functional as F

from ...native.decode_layer import (
    LayerShape,
    MoeFeedForward,
    NativeDecodeLayer,
    QkNorms,
    SequenceRows,
)
from ...native.lora import DOWN, GATE_UP, OUT, QKV
from ..kv.cache import Cache, Slots
from ..kv.codec import TILE_ROWS
from ..lora.rows import PassLora
from ..ops.layers import (
    BlockEmbedding,
    GgmlLinear,
    Int4Linear,
    Linear,
    RawWeight,
    RMSNorm,
    Rope,
    RopeTables,
    apply_rope,
    linear_from_raw,
    rms_normalize,
)
from ..platform.kernels import (
    cpu_attention_kernel,
    cpu_int4_kernel,
    cpu_row_ops,
    fused_layers_enabled,
)
from .attention_backends import (
    AttentionBackend,
    NativeCpuAttention,
    StoredAttention,
    StoredRow,
    TorchAttention,
    kernel_types,
    stored_attention_runs,
    write_static_rows,
)
from .config import DecoderConfig, RopeConfig
from .exact_rows import RowMasks
from .experts import MixtureFeedForward
from .pass_metadata import LayerRows, PassMetadata, RowKind, RowSpan, build_pass_metadata
from .placement import CPU, CPU_PLACEMENT, PREFILL_CHUNK, CachePolicy, Placement


class ExitTap(Protocol):
    layer: int

    def record(self, x: torch.Tensor, cache: Cache) -> None:
        """Layer `layer - 1`'s output [n, dim] for the positions just appended to `cache`."""
        ...


class Attention:
    def __init__(
        self,
        config: DecoderConfig,
        wqkv: Linear,
        wo: Linear,
        qk_norm_weight: torch.Tensor | None,
    ):
        """`qk_norm_weight`: [n_heads + n_kv_heads, head_dim], one norm per head; or, with
        `config.qk_norm_whole` (OLMoE), [(n_heads + n_kv_heads) * head_dim]: one norm over all
        query heads together and one over all key heads."""
        self.wqkv, self.wo = wqkv, wo
        self.qk_norm_whole = config.qk_norm_whole
        self.n_heads, self.n_kv_heads = config.n_heads, config.n_kv_heads
        self.head_dim = config.head_dim
        # Q and K sit side by side in the fused projection, so one matmul rotates both.
        self.n_rotated = config.n_heads + config.n_kv_heads
        self.scale = config.attention_scale or 1.0 / math.sqrt(config.head_dim)
        self.norm_eps = config.norm_eps
        # [n_heads + n_kv_heads, head_dim]: the query norm's weight per query head, then the
        # key norm's per key head, so one normalisation covers both.
        self.qk_norm_weight = qk_norm_weight
        # The same norms as the native row kernel takes them: the query heads' weight and
        # the key heads' (one head's, or all heads' with qk_norm_whole).
        self.q_norm = self.k_norm = None
        if qk_norm_weight is not None:
            if self.qk_norm_whole:
                q_width = config.n_heads * config.head_dim
                q_norm, k_norm = qk_norm_weight[:q_width], qk_norm_weight[q_width:]
            else:
                q_norm, k_norm = qk_norm_weight[0], qk_norm_weight[config.n_heads]
            self.q_norm, self.k_norm = q_norm.contiguous(), k_norm.contiguous()
        native = cpu_attention_kernel()
        takes = native is not None and native.takes(
            config.n_heads, config.n_kv_heads, config.head_dim
        )
        self.native = native if takes else None
        self.native_backend = (
            None if self.native is None else NativeCpuAttention(native, self.scale)
        )
        self.torch_backend = TorchAttention(self.scale)
        self.stored_backend = StoredAttention(self.scale, self.torch_backend, self.head_dim)
        self.row_ops = cpu_row_ops()

    def forward(self, x: torch.Tensor, rotation: RopeTables, rows: LayerRows) -> torch.Tensor:
        """x: [tokens, dim] -> [tokens, dim]. Each sequence's rows attend over its own cache
        as their kind says; the device's backend does the attending."""
        n_tokens = x.shape[0]
        projected = project(self.wqkv, x, rows, QKV).view(n_tokens, -1, self.head_dim)
        decoded = self._attend_in_kernels(projected, rotation, rows)
        if decoded is not None:
            return project(self.wo, decoded.reshape(n_tokens, -1), rows, OUT)
        # RoPE and the cache's codec run in fp32; so does attention on the CPU, where torch's
        # attention and small bmm are several times faster in fp32 than in bf16 at decode
        # sizes (off the CPU, see attention_backends.attention_dtype).
        heads = projected.float()
        qk = heads[:, : self.n_rotated]
        if self.qk_norm_weight is None:
            pass
        elif self._native_rows(heads):
            # In place, by the kernel the fused layer calls: both paths give the same bits.
            self.row_ops.qk_norm_(
                heads,
                self.n_heads,
                self.n_kv_heads,
                self.q_norm,
                self.k_norm,
                self.qk_norm_whole,
                self.norm_eps,
            )
        else:
            qk = self._normed(qk)
        # [tokens, heads, head_dim] -> [heads, tokens, head_dim]
        qk = self._rotate(qk, rotation).transpose(0, 1)
        v = heads[:, self.n_rotated :].transpose(0, 1)
        if rows.alone:
            span, cache, mask = next(iter(rows))
            out = self._attend_span(qk, v, span, cache, mask)
        else:
            out = self._attend_sequences(qk, v, rows)
        return project(self.wo, out[0].transpose(0, 1).reshape(n_tokens, -1), rows, OUT)

    def _attend_in_kernels(
        self, heads: torch.Tensor, rotation: RopeTables, rows: LayerRows
    ) -> torch.Tensor | None:
        """A static step's rows over caches the Triton kernels write (all of one kind): a
        decode row a sequence, or one sequence's verification rows under their mask rows.
        The new keys and values are written straight from the projection, the write
        kernel applying the keys' RoPE, and attention applies the queries' as it loads
        them: RoPE and the copies feeding the two kernels cost no kernel of their own, and
        verification rows turn as their decode steps do, bit for bit. heads [tokens, all
        heads, head_dim] as projected; returns [tokens, heads, head_dim], or None where
        the rows do not qualify."""
        if not getattr(rows.caches[0], "kernel_writes", False):  # the usual case, quickly
            return None
        taken = _kernel_rows(list(rows), heads)
        if taken is None or not self.stored_backend.reads_one_each(taken[0]):
            return None
        stored, caches = taken
        qk = heads  # queries, keys and values as projected (a compiled step makes it once)
        if self.qk_norm_weight is not None:
            qk = self._normed(heads[:, : self.n_rotated].float())
        heads_from = (self.n_heads, self.n_rotated)
        write_static_rows(caches, qk, heads, rotation, heads_from)
        return self.stored_backend.attend_with_rope(qk[:, : self.n_heads], stored, rotation)

    def _normed(self, qk: torch.Tensor) -> torch.Tensor:
        """Queries and keys [tokens, heads, head_dim] through the model's q/k norms."""
        if self.qk_norm_whole:
            return self._norm_whole(qk)
        return rms_normalize(qk, self.norm_eps) * self.qk_norm_weight

    def _native_rows(self, heads: torch.Tensor) -> bool:
        return (
            self.row_ops is not None
            and heads.is_cpu
            and heads.dtype is torch.float32
            and heads.is_contiguous()
        )

    def _norm_whole(self, qk: torch.Tensor) -> torch.Tensor:
        """[tokens, heads, head_dim]: the queries normed as one vector, the keys as another."""
        n_tokens, q_width = qk.shape[0], self.n_heads * self.head_dim
        q = rms_normalize(qk[:, : self.n_heads].reshape(n_tokens, -1), self.norm_eps)
        k = rms_normalize(qk[:, self.n_heads :].reshape(n_tokens, -1), self.norm_eps)
        weight = self.qk_norm_weight
        normed = torch.cat([q * weight[:q_width], k * weight[q_width:]], dim=1)
        return normed.view(n_tokens, self.n_rotated, self.head_dim)

    def _rotate(self, qk: torch.Tensor, rotation: RopeTables) -> torch.Tensor:
        """RoPE over [tokens, heads, head_dim]: in place by the native row kernel on the CPU
        (one call instead of five torch ops; qk is this pass's own projection output)."""
        if self.row_ops is not None and qk.is_cpu and qk.dtype is torch.float32:
            rope = rotation.rope
            return self.row_ops.rope_(
                qk, rotation.cos, rotation.signed_sin, rope.rotary_dim, rope.interleaved
            )
        return apply_rope(qk, rotation)

    def _backend(self, keys: torch.Tensor, rows: int) -> AttentionBackend:
        """Our native kernel for a few query rows on the CPU; otherwise (a GPU, or a long
        prompt chunk, which torch batches better) the Triton kernel where it runs, torch's
        attention where it does not."""
        if self.native_backend is not None and keys.is_cpu and rows <= NATIVE_ATTENTION_ROWS:
            return self.native_backend
        return self._kernel_backend(keys)

    def _kernel_backend(self, keys: torch.Tensor) -> AttentionBackend:
        """The backend off the native kernel: Triton's reading the stored rows where it runs
        (it hands long prompt chunks on to torch's itself)."""
        if stored_attention_runs(keys.device):
            return self.stored_backend
        return self.torch_backend

    def _attend_span(self, qk, v, span: RowSpan, cache: Cache, mask) -> torch.Tensor:
        """One sequence's rows over its cache -> [1, heads, rows, head_dim]."""
        if span.kind is RowKind.EXACT and isinstance(mask, torch.Tensor):
            return self._attend_masked_rows(qk, v, cache, mask)
        if span.kind is RowKind.EXACT:
            return self._attend_rows(qk, v, cache, mask)
        return self._attend(qk, v, cache, mask)

    def _attend(self, qk, v, cache: Cache, mask: torch.Tensor | None) -> torch.Tensor:
        """Rows that see the keys as one mask says (a decode step, a prompt chunk)."""
        keys, values = cache.update_and_fetch(qk[self.n_heads :][None], v[None])
        queries = qk[: self.n_heads]
        backend = self._backend(keys, queries.shape[1])
        out = backend.attend(queries, keys, values, cache, mask=mask)
        _observe(cache, queries, self.scale)
        return out

    def _attend_sequences(self, qk, v, rows: LayerRows) -> torch.Tensor:
        """Rows of several sequences: each sequence's rows over its own cache, as a pass over
        that sequence alone would attend them. The decode rows of all sequences go to the
        backend in one call."""
        outs: list[torch.Tensor | None] = []
        decodes: list[tuple[int, int, torch.Tensor, torch.Tensor, torch.Tensor | None, Cache]] = []
        written = self._write_decode_rows(qk, v, rows)
        for index, (span, cache, mask) in enumerate(rows):
            if mask is not None:  # built on the CPU, like a pass's masks
                mask = mask.to(qk.device)
            if span.kind is RowKind.DECODE:
                k_row, v_row = qk[self.n_heads :, span.rows][None], v[:, span.rows][None]
                if index in written:
                    keys, values = cache.update_and_fetch(k_row, v_row, written=True)
                else:
                    keys, values = cache.update_and_fetch(k_row, v_row)
                decodes.append((len(outs), span.first, keys, values, mask, cache))
                outs.append(None)
            else:
                outs.append(self._attend_span(qk[:, span.rows], v[:, span.rows], span, cache, mask))
        if decodes:
            queries = qk[: self.n_heads, [d[1] for d in decodes]]
            backend = self._backend(decodes[0][2], 1)
            attended = backend.attend_one_each(queries, [d[2:] for d in decodes])
            for j, (index, *_, cache) in enumerate(decodes):
                outs[index] = attended[:, :, j : j + 1]
                _observe(cache, queries[:, j : j + 1], self.scale)
        return torch.cat(outs, dim=2)

    def _write_decode_rows(self, qk, v, rows: LayerRows) -> set[int]:
        """The decode rows' new keys and values, written as stored in one launch for every
        row whose cache lets the Triton kernel write it (a static step's caches, all of one
        kind), their sinks turned into the frame by the same launch; the others write
        their own. Returns the indices in `rows` of those written: positions, not the
        caches' ids, which a compiled step would guard on, compiling again for each new set
        of sequences in a batch."""
        writable = [
            (index, span, cache)
            for index, (span, cache, _) in enumerate(rows)
            if span.kind is RowKind.DECODE
            and span.count == 1
            and getattr(cache, "kernel_writes", False)
        ]
        caches = [cache for *_, cache in writable]
        if len(writable) < 2 or not _of_one_kind(caches):
            return set()
        picked = [span.first for _, span, _ in writable]
        new_keys = qk[self.n_heads :, picked].transpose(0, 1)
        write_static_rows(caches, new_keys, v[:, picked].transpose(0, 1))
        return {index for index, *_ in writable}

    def _attend_rows(self, qk, v, cache: Cache, masks: RowMasks) -> torch.Tensor:
        """One token at a time, exactly as decoding would: a batched attention call rounds
        differently, and speculative verification must reproduce plain decoding bit for bit.
        Rows go one by one until the rest can share one storage (a fresh cache's first
        rows fill its sinks first), then the rest go together."""
        n_rows, outs = qk.shape[1], []
        for row in range(n_rows):
            rest = n_rows - row
            if cache.rows_share_storage(rest):
                outs.append(self._attend_shared_rows(qk[:, row:], v[:, row:], cache))
                break
            mask = masks.get(row, cache)
            outs.append(self._attend(qk[:, row : row + 1], v[:, row : row + 1], cache, mask))
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)

    def _attend_masked_rows(self, qk, v, cache: Cache, masks: torch.Tensor) -> torch.Tensor:
        """Exact rows whose slots and masks [rows, keys] a fixed-shape step prepared
        (verification replayed as a graph): written at once, then each row attends under
        its own mask row as its decode step would."""
        keys, values = cache.update_and_fetch(qk[self.n_heads :][None], v[None])
        queries = qk[: self.n_heads]
        out = self._backend(keys, 1).attend_rows(queries, keys, values, cache, masks)
        _observe(cache, queries, self.scale)
        return out

    def _attend_shared_rows(self, qk, v, cache: Cache) -> torch.Tensor:
        """Each row's decode step would see a prefix of one storage: write all rows at once,
        then attend each row over its prefix."""
        n_rows = qk.shape[1]
        keys, values = cache.update_and_fetch(qk[self.n_heads :][None], v[None])
        before = values.shape[2] - n_rows  # tiled keys: their lead rows are apart
        # The native backend takes as many rows as there are here (a decode step runs that
        # kernel too, so every row matches it bit for bit).
        if keys.is_cpu and self.native_backend is not None:
            backend = self.native_backend
        else:
            backend = self._kernel_backend(keys)
        out = backend.attend_prefixes(qk[: self.n_heads], keys, values, cache, before)
        _observe(cache, qk[: self.n_heads], self.scale)
        return out


def _kernel_rows(rows: list, heads: torch.Tensor) -> tuple[list[StoredRow], list[Cache]] | None:
    """Each query row's (keys, values, mask, cache) where a static step's rows all go to
    the Triton kernels (see Attention._attend_in_kernels), pass row r being row r:
    sequences of one decode row each, or one sequence's rows under a mask row each; and
    the caches that take the new keys, each once. None otherwise. (Told apart by the rows'
    layout, not by the caches' ids, which a compiled step would guard on: it would compile
    again for each new set of sequences in a batch.)"""
    caches = [cache for _, cache, _ in rows]
    if not all(getattr(cache, "kernel_writes", False) for cache in caches):
        return None
    if not _of_one_kind(caches):
        return None
    if len(rows) == 1 and rows[0][0].kind is RowKind.EXACT:
        span, cache, masks = rows[0]
        if span.first != 0 or not isinstance(masks, torch.Tensor):
            return None
        masks = masks.to(heads.device)
        return [(*cache.stored(), masks[r : r + 1], cache) for r in range(span.count)], [cache]
    if not all(
        span.kind is RowKind.DECODE and span.count == 1 and span.first == row
        for row, (span, _, _) in enumerate(rows)
    ):
        return None
    stored = [
        (*cache.stored(), None if mask is None else mask.to(heads.device), cache)
        for _, cache, mask in rows
    ]
    return stored, caches


def _of_one_kind(caches: list[Cache]) -> bool:
    """Whether one launch of the write kernel takes all these caches: one stored type
    and one number of sinks."""
    return len({(kernel_types(cache), cache.sinks) for cache in caches}) == 1


def _observe(cache: Cache, queries: torch.Tensor, scale: float) -> None:
    """Tell a cache that chooses its tokens by attention (ScoredKVCache) the step's queries,
    once the step has attended: it may evict now."""
    observe = getattr(cache, "observe", None)
    if observe is not None:
        observe(queries, scale)


class FeedForward:
    def __init__(self, w_gate_up: Linear, w_down: Linear, ffn_dim: int, activation: str):
        self.w_gate_up, self.w_down, self.ffn_dim = w_gate_up, w_down, ffn_dim
        self.gelu = activation == "gelu_tanh"
        # Our own CPU kernel applies the SiLU gating itself (one call instead of four ops).
        self.fused = getattr(w_gate_up, "gated", False)

    def bytes_per_token(self) -> int:
        """Bytes of weights one decode step reads here."""
        return self.w_gate_up.nbytes + self.w_down.nbytes

    def forward(self, x: torch.Tensor, rows: LayerRows | None = None) -> torch.Tensor:
        """`rows`: the pass's rows at this layer, for their LoRA adapters (None: none)."""
        if rows is not None and rows.lora is not None:
            return self._forward_adapted(x, rows)
        if self.fused:
            return self.w_down.forward(self.w_gate_up.forward(x))
        gate_up = self.w_gate_up.forward(x)
        gate, up = gate_up[:, : self.ffn_dim], gate_up[:, self.ffn_dim :]
        gate = F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)
        return self.w_down.forward(gate.mul_(up))

    def _forward_adapted(self, x: torch.Tensor, rows: LayerRows) -> torch.Tensor:
        gate_up = project(self.w_gate_up, x, rows, GATE_UP)
        if not self.fused:
            gate, up = gate_up[:, : self.ffn_dim].float(), gate_up[:, self.ffn_dim :].float()
            gate = F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)
            gate_up = gate.mul_(up)
        return project(self.w_down, gate_up, rows, DOWN)


def project(linear: Linear, x: torch.Tensor, rows: LayerRows, projection: int) -> torch.Tensor:
    """`linear` over x, plus the LoRA updates of the rows that carry adapters: added to
    W x before a gated kernel's SiLU epilogue (as the fused layer adds them), after the
    product otherwise."""
    lora = rows.lora
    if lora is None:
        return linear.forward(x)
    gated = getattr(linear, "gated", False)
    n_out = 2 * linear.out_features if gated else linear.out_features
    delta = lora.delta(rows.layer, projection, x, n_out)
    if delta is None:
        return linear.forward(x)
    if gated:
        return linear.native.forward(x, pre=delta)
    y = linear.forward(x)
    return y.add_(delta) if y.dtype is torch.float32 else y.float().add_(delta)


class Block:
    def __init__(self, attn_norm, attention, ffn_norm, feed_forward, post_attn_norm, post_ffn_norm):
        self.attn_norm, self.attention = attn_norm, attention
        self.ffn_norm, self.feed_forward = ffn_norm, feed_forward
        self.post_attn_norm, self.post_ffn_norm = post_attn_norm, post_ffn_norm
        # The whole layer as one native call for one-token steps and verification rows
        # (DecoderModel sets it where the layer's shape allows; see `fused_layer`).
        self.fused: NativeDecodeLayer | None = None

    def forward(self, x: torch.Tensor, rotation: RopeTables, rows: LayerRows) -> torch.Tensor:
        """Updates the residual stream `x` (fp32 [tokens, dim]) in place and returns it. The
        sequences whose rows the fused layer takes go through it in one call, the rest layer
        by layer; every row comes out as its own sequence's pass would give it, whichever way
        it goes."""
        fused, rest = self._take_fused(x, rows)
        if not fused:
            return self._forward_layer_by_layer(x, rotation, rows)
        if not rest:
            self._step_fused(x, rotation.cos, rotation.signed_sin, fused, rows.lora, rows.layer)
            return x
        # Mixed: each part runs on its own rows (gathered), then goes back in place.
        fused_rows = torch.cat(
            [torch.arange(span.first, span.first + span.count) for span, _ in fused]
        )
        part = x.index_select(0, fused_rows)
        cos = rotation.cos.index_select(0, fused_rows).contiguous()
        sin = rotation.signed_sin.index_select(0, fused_rows).contiguous()
        at, renumbered = 0, []
        for span, where in fused:
            renumbered.append((RowSpan(at, span.count, span.kind), where))
            at += span.count
        left = set(rest)
        taken = [index for index in range(len(rows)) if index not in left]
        lora = None if rows.lora is None else rows.lora.subset(taken)
        self._step_fused(part, cos, sin, renumbered, lora, rows.layer)
        x.index_copy_(0, fused_rows, part)
        others = rows.subset(rest)
        other_rows = torch.cat(
            [
                torch.arange(rows.spans[i].first, rows.spans[i].first + rows.spans[i].count)
                for i in rest
            ]
        )
        other = x.index_select(0, other_rows)
        tables = RopeTables(
            rotation.cos.index_select(0, other_rows),
            rotation.signed_sin.index_select(0, other_rows),
            rotation.rope,
        )
        self._forward_layer_by_layer(other, tables, others)
        x.index_copy_(0, other_rows, other)
        return x

    def _take_fused(self, x: torch.Tensor, rows: LayerRows):
        """(span, SequenceRows) of each sequence the fused layer takes, and the indices of the
        others. It takes a decode row, or the exact rows of a sequence that each see a prefix
        of one storage (verification), up to the call's limits. Taking a sequence's slots
        advances its cache, so none is taken unless the call will run."""
        fused, rest, total = [], [], 0
        usable = self.fused is not None and x.is_cpu
        for index, (span, cache, mask) in enumerate(rows):
            taken = None
            fits = span.count <= FUSED_ROWS and total + span.count <= FUSED_BATCH_ROWS
            if usable and fits and span.kind is not RowKind.CHUNK:
                taken = _take_slots(cache, span.count)
            if taken is None:
                rest.append(index)
                continue
            # A decode row's mask goes with it; exact rows each see a prefix, unmasked.
            one_mask = (
                mask.contiguous() if span.kind is RowKind.DECODE and mask is not None else None
            )
            kinds = kernel_types(cache)
            where = SequenceRows(
                taken.slots, taken.stored, one_mask, kinds, taken.tiled, taken.addresses
            )
            fused.append((span, (where, taken)))
            total += span.count
        return fused, rest

    def _step_fused(self, x: torch.Tensor, cos, sin, fused, lora: PassLora | None, layer: int):
        call = None if lora is None else lora.call(layer)
        if len(fused) == 1:  # one sequence: the single-sequence call, a little leaner
            self.fused.step(x, cos, sin, fused[0][1][0], call)
        else:
            self.fused.step_sequences(
                x, cos, sin, [(span.count, where) for span, (where, _) in fused], call
            )
        for _, (_, taken) in fused:
            if taken.written is not None:
                taken.written()
        if self.fused.choices is not None:  # a mixture: what the rows chose, as its own pass
            rows = sum(span.count for span, _ in fused)
            self.feed_forward.last_ids = self.fused.choices[:rows].clone()

    def _forward_layer_by_layer(self, x, rotation: RopeTables, rows: LayerRows):
        attended = self.attention.forward(self.attn_norm.forward(x), rotation, rows)
        if self.post_attn_norm is not None:
            attended = self.post_attn_norm.forward(attended.float())
        fed = self.feed_forward.forward(self.ffn_norm.add_and_norm(x, attended), rows)
        if self.post_ffn_norm is not None:
            fed = self.post_ffn_norm.forward(fed.float())
        return x.add_(fed)


def _take_slots(cache: Cache, count: int) -> Slots | None:
    """The cache slots of `count` rows for the fused layer (None leaves the cache untouched
    for the layer-by-layer path). The static step's cache views take none."""
    if count == 1:
        take_one = getattr(cache, "take_one", None)
        return take_one(addresses=True) if take_one is not None else None
    take_rows = getattr(cache, "take_rows", None)
    return take_rows(count) if take_rows is not None else None


# Up to this many exact rows of one sequence (a verification's, a prompt chunk's) run
# through the fused layer in one call; up to FUSED_BATCH_ROWS rows of a batched step (the
# native call's own limit).
FUSED_ROWS = 16
FUSED_BATCH_ROWS = 64

# Up to this many query rows (decode steps, verification) attend through the native kernel on
# the CPU; longer prompt chunks go through torch's attention, which batches them better.
NATIVE_ATTENTION_ROWS = 16


class DecoderModel:
    def __init__(
        self,
        config: DecoderConfig,
        embed,
        layers,
        norm,
        output,
        freq_factors: torch.Tensor | None = None,
        placement: Placement = CPU_PLACEMENT,
    ):
        self.config = config
        self.embed, self.layers, self.norm, self.output = embed, layers, norm, output
        self._device_embedding: BlockEmbedding | None = None
        self.placement = placement
        self.layer_devices = [placement.layer_target(i).device for i in range(config.n_layers)]
        self.head_device = placement.head_target(config.n_layers).device
        # The one layer where the residual stream leaves the GPU for the CPU (a split model).
        split = placement.gpu_layers if placement.gpu is not None else 0
        self._split_at = split if 0 < split < config.n_layers else -1
        self.ropes = {
            False: _rope(config, config.rope, freq_factors),
            True: _rope(config, config.local_rope or config.rope, freq_factors),
        }
        # The first layer of each kind (global / sliding-window): all caches of a kind hold
        # the same positions, so one of them answers for masks and chunk sizes.
        self._layer_is_local = [config.is_local(i) for i in range(config.n_layers)]
        self._kinds: dict[bool, int] = {}
        for index, local in enumerate(self._layer_is_local):
            self._kinds.setdefault(local, index)
        for index, block in enumerate(layers):
            if self.layer_devices[index] == CPU:
                block.fused = fused_layer(block, self.ropes[self._layer_is_local[index]])
        # Called before every pass over layers; a simulated device injects its failures here.
        self.fault_hook: Callable[[], None] | None = None
        # The output head's stored rows (memory-mapped), for a drafter's small vocabulary.
        self.head_weight: RawWeight | None = None
        # A drafter that reads a shallow layer's output of every pass (the shallow-exit
        # block): `record(x, cache)` after layer `layer - 1`, for one sequence's passes.
        self.exit_tap: ExitTap | None = None

    def weight_bytes_per_token(self) -> int:
        """Bytes of weights one decode step reads: every layer's linears and the output head
        (an embedding look-up reads one row, left out). Plain decoding cannot run faster
        than memory bandwidth divided by this."""
        total = self.output.nbytes
        for block in self.layers:
            attention = block.attention
            total += attention.wqkv.nbytes + attention.wo.nbytes
            total += block.feed_forward.bytes_per_token()
        return total

    def make_caches(self, policy: CachePolicy) -> list[Cache]:
        """One cache per layer, on the layer's device, as the policy says."""
        return policy.make_caches(self.config, self.ropes, self.layer_devices)

    def max_chunk(self, caches: list[Cache], exact_rows: bool = False) -> int:
        """Tokens the next forward pass may take (the most constrained kind of layer). Exact
        rows over keys in q4 tiles: at most a tile's worth, so that the chunk touches at most
        the two newest tiles, the ones kept in fp32 (a row reads its own tile from there)."""
        limits = [caches[index].max_chunk() for index in self._kinds.values()]
        if exact_rows and any(caches[index].key_codec.tiled for index in self._kinds.values()):
            limits.append(TILE_ROWS)
        return max(1, min(PREFILL_CHUNK, *limits))

    def forward(
        self, tokens: torch.Tensor, caches: list[Cache], all_logits: bool = False
    ) -> torch.Tensor:
        """tokens: int64 [n]. Returns fp32 logits [n, vocab] if `all_logits`, else [1, vocab]."""
        hidden = self.hidden_states(tokens, caches)
        return self.logits(hidden if all_logits else hidden[-1:])

    __call__ = forward

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final hidden states [n, dim] -> fp32 logits [n, vocab], on the CPU (sampling and
        acceptance run there whatever device the model is on)."""
        return self.project(hidden.to(self.head_device)).to(CPU)

    def project(self, normed: torch.Tensor) -> torch.Tensor:
        """Normed states [n, dim] on the head's device -> fp32 logits [n, vocab] there: the
        output head, then Gemma's soft-cap (the fixed-shape GPU step calls this too)."""
        logits = self.output.forward(normed).float()
        if self.config.final_logit_softcap:
            cap = self.config.final_logit_softcap
            logits = torch.tanh(logits / cap) * cap
        return logits

    def head_rows(self, ids: torch.Tensor) -> Linear:
        """The output head restricted to the rows `ids`, as its own linear on the CPU: a
        drafter that scores a small vocabulary reads only those rows."""
        if self.head_weight is None:
            raise ValueError("this model was built without its head's stored rows")
        raw, ggml_type = self.head_weight
        return linear_from_raw([(raw.index_select(0, ids), ggml_type)], self.config.dim)

    def final_norm(self, x: torch.Tensor) -> torch.Tensor:
        """The final norm, on the output head's device."""
        return self.norm.forward(x.to(self.head_device))

    def hidden_states(
        self, tokens: torch.Tensor, caches: list[Cache], exact_rows: bool = False
    ) -> torch.Tensor:
        """Run the layers over `tokens`, appending to the caches; returns the final-normed
        hidden states [n, dim] (fp32). With `exact_rows`, every row comes out bit-identical
        to feeding the tokens one at a time (speculative verification)."""
        x = self.embed_tokens(tokens)
        x = self.run_layers(x, caches, 0, self.config.n_layers, exact_rows)
        return self.final_norm(x)

    def hidden_segments(
        self, segments: Sequence[tuple[Sequence[int], list[Cache]]]
    ) -> torch.Tensor:
        """Several sequences in one pass (continuous batching): each (tokens, caches) pair
        appends its tokens to its own caches. The rows of all of them share every matmul;
        attention runs each sequence over its own keys, and every row comes out exactly as
        feeding its sequence one token at a time would give it. Returns the final-normed
        hidden states of all rows, in order [rows, dim]."""
        if self.fault_hook is not None:
            self.fault_hook()
        rows = [t for tokens, _ in segments for t in tokens]
        x = self.embed_tokens(torch.tensor(rows, dtype=torch.long))
        counts = [len(tokens) for tokens, _ in segments]
        caches = [caches for _, caches in segments]
        metadata = build_pass_metadata(counts, caches, True, self._kinds, self.ropes)
        return self.final_norm(self.apply_layers(x, metadata))

    def embed_tokens(
        self, tokens: torch.Tensor, table: BlockEmbedding | None = None
    ) -> torch.Tensor:
        """int64 [n] -> the residual stream entering layer 0, fp32 [n, dim]. `table`: another
        copy of the embedding to look them up in (`device_embedding`)."""
        x = (table or self.embed)(tokens)
        if self.config.embed_scale != 1.0:
            x.mul_(self.config.embed_scale)
        return x

    def device_embedding(self) -> BlockEmbedding:
        """The token table on the head's device: the one table where that is the CPU, else
        a copy made on first use (the GGML blocks, as the file holds them). A fixed-shape
        step looks its tokens up inside its graph, so that no host work on the token stands
        between two steps."""
        if self._device_embedding is None:
            self._device_embedding = self.embed.to(self.head_device)
        return self._device_embedding

    def run_layers(
        self,
        x: torch.Tensor,
        caches: list[Cache],
        start: int,
        stop: int,
        exact_rows: bool = False,
    ) -> torch.Tensor:
        """Layers start..stop-1 over the residual stream x [n, dim] (updated in place and
        returned), appending to those layers' caches. Early-exit drafting runs the first
        layers alone, so layers may sit at different offsets: each kind of layer takes its
        positions and mask from its first cache in the range."""
        if self.fault_hook is not None:
            self.fault_hook()
        kinds: dict[bool, int] = {}
        for layer in range(start, stop):
            kinds.setdefault(self._layer_is_local[layer], layer)
        metadata = build_pass_metadata([x.shape[0]], [caches], exact_rows, kinds, self.ropes)
        return self.apply_layers(x, metadata, start, stop)

    def apply_layers(
        self, x: torch.Tensor, metadata: PassMetadata, start: int = 0, stop: int | None = None
    ) -> torch.Tensor:
        """The layer loop itself, given the pass's metadata: `run_layers` and
        `hidden_segments` build it from the caches, the fixed-shape step from its static
        inputs."""
        stop = self.config.n_layers if stop is None else stop
        x, metadata = _on_device(self.layer_devices[start], x, metadata)
        tap = self.exit_tap if len(metadata.spans) == 1 else None  # one sequence's passes
        for layer in range(start, stop):
            if layer == self._split_at and layer != start:
                x, metadata = _on_device(CPU, x, metadata)
            local = self._layer_is_local[layer]
            rows = metadata.layer(layer, local)
            x = self.layers[layer].forward(x, metadata.rotations[local], rows)
            if tap is not None and layer + 1 == tap.layer:
                tap.record(x, rows.caches[0])
        return x


def fused_layer(block: Block, rope: Rope) -> NativeDecodeLayer | None:
    """The native one-call step for a block, where its shape is one the call takes: on the
    CPU with the native kernels, a fused Q|K|V run by our kernels (biases only where the
    GGML kernel adds them inside), any Q/K norms, no post-norms, and a SiLU-gated
    feed-forward run by our kernels or a mixture of experts run by the native MoE kernel
    without a shared expert (SmolLM2, Qwen2, Qwen3, OLMoE, Qwen3-MoE, Mixtral and the
    other llama-shaped models; Gemma 3 and Qwen2-MoE keep the layer-by-layer path)."""
    attention, feed_forward = block.attention, block.feed_forward
    library = cpu_int4_kernel().library
    norms = (block.attn_norm, block.ffn_norm)
    moe = _fused_mixture(feed_forward)
    if moe is None and not (isinstance(feed_forward, FeedForward) and feed_forward.fused):
        return None
    linears = [attention.wqkv, attention.wo]
    if moe is None:
        linears += [feed_forward.w_gate_up, feed_forward.w_down]
    if (
        library is None
        or not fused_layers_enabled()
        or attention.native is None
        or (attention.qk_norm_weight is not None and attention.row_ops is None)
        or block.post_attn_norm is not None
        or block.post_ffn_norm is not None
        or not all(_plain_native(linear) for linear in linears)
        or not all(isinstance(norm, RMSNorm) and norm.native is not None for norm in norms)
        or block.attn_norm.eps != block.ffn_norm.eps
        or attention.norm_eps != block.attn_norm.eps
    ):
        return None
    shape = LayerShape(
        dim=block.attn_norm.dim,
        n_heads=attention.n_heads,
        kv_heads=attention.n_kv_heads,
        head_dim=attention.head_dim,
        rotary_dim=rope.rotary_dim,
        interleaved=rope.interleaved,
        eps=block.attn_norm.eps,
        scale=attention.scale,
    )
    qk_norms = None
    if attention.qk_norm_weight is not None:
        qk_norms = QkNorms(attention.q_norm, attention.k_norm, attention.qk_norm_whole)
    gate_up, down = (None, None) if moe is not None else (linears[2].native, linears[3].native)
    return NativeDecodeLayer(
        library,
        shape,
        linears[0].native,
        linears[1].native,
        gate_up,
        down,
        block.attn_norm.doubled_weight,
        block.ffn_norm.doubled_weight,
        qk_norms=qk_norms,
        moe=moe,
    )


def _fused_mixture(feed_forward) -> MoeFeedForward | None:
    """A mixture of experts as the fused step takes it: native experts and routing on the
    CPU, no shared expert; None for anything else."""
    if not isinstance(feed_forward, MixtureFeedForward):
        return None
    if not feed_forward.native_route or feed_forward.shared is not None:
        return None
    return MoeFeedForward(
        feed_forward.experts,
        feed_forward.router.weight,
        feed_forward.used,
        feed_forward.normalize,
    )


def _plain_native(linear) -> bool:
    if isinstance(linear, GgmlLinear):
        return True  # any bias is added inside the kernel
    return (
        isinstance(linear, Int4Linear)
        and linear.native is not None
        and linear.plain
        and linear.bias is None
    )


def _on_device(device: torch.device, x: torch.Tensor, metadata: PassMetadata):
    """The residual stream and the pass's tables and masks, moved to `device`."""
    if x.device == device and device == CPU:
        return x, metadata  # the usual case: nothing to move
    return x.to(device), metadata.to(device)


def _rope(config: DecoderConfig, rope: RopeConfig, freq_factors: torch.Tensor | None) -> Rope:
    return Rope(
        config.head_dim,
        rope.rotary_dim,
        rope.base,
        rope.interleaved,
        position_scale=rope.position_scale,
        freq_factors=freq_factors,
    )
