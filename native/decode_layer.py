"""One decoder layer's one-token step, or a verification's few rows, in one native call
(`miniapp_decode_layer` in `decode_layer.cpp`): RMS norm, the fused Q|K|V projection, RoPE, the
new keys and values written into the cache's storage, attention over the cache, the output
projection, the residual add and norm, the SiLU-gated feed-forward (or a mixture of
experts: its router and experts) and the last residual add; with Q/K norms between the
projection and RoPE where the layer has them. The same kernels the layer runs one by one
from Python, in the same order, so the result is bit-identical; the engine uses it for
decode steps and verification rows of layers shaped for it (engine/models/decoder.py).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from .attention import TiledKeys
from .int4 import Library, PackedInt4
from .moe import NativeExperts

_i64, _f32, _i32, _ptr = ctypes.c_int64, ctypes.c_float, ctypes.c_int32, ctypes.c_void_p
MAX_ROWS = 64  # rows a call takes (kMaxLayerRows)


class _Weights(ctypes.Structure):
    _fields_ = [
        ("qkv", _ptr),
        ("out", _ptr),
        ("gate_up", _ptr),
        ("down", _ptr),
        ("attn_norm", _ptr),
        ("ffn_norm", _ptr),
        ("eps", _f32),
        ("scale", _f32),
        ("dim", _i64),
        ("n_heads", _i64),
        ("kv_heads", _i64),
        ("head_dim", _i64),
        ("rotary_dim", _i64),
        ("ffn_dim", _i64),
        ("interleaved", _i32),
        ("q_norm", _ptr),
        ("k_norm", _ptr),
        ("qk_norm_whole", _i32),
        ("moe", _ptr),
    ]


class _MoeLayer(ctypes.Structure):
    """MoeLayer in decode_layer.cpp."""

    _fields_ = [
        ("gate_up", _ptr),
        ("down", _ptr),
        ("n_experts", _i64),
        ("ffn", _i64),
        ("k", _i64),
        ("router", _ptr),
        ("normalize", _i32),
        ("ids", _ptr),
        ("weights", _ptr),
    ]


@dataclass(frozen=True)
class QkNorms:
    """Query and key norm weights (fp32, contiguous): one head's each, or with `whole` all
    query heads' [n_heads * head_dim] and all key heads' [kv_heads * head_dim]."""

    q: torch.Tensor
    k: torch.Tensor
    whole: bool


@dataclass(frozen=True)
class MoeFeedForward:
    """A mixture of experts in place of the gated feed-forward: the experts (moe.py), the
    router's fp32 weights [n_experts, dim], the experts a token uses, and whether their
    weights are divided by their sum."""

    experts: NativeExperts
    router: torch.Tensor
    used: int
    normalize: bool


class _Step(ctypes.Structure):
    _fields_ = [
        ("cos", _ptr),
        ("signed_sin", _ptr),
        ("key_slot", _ptr),
        ("value_slot", _ptr),
        ("keys", _ptr),
        ("values", _ptr),
        ("key_head_stride", _i64),
        ("value_head_stride", _i64),
        ("n_keys", _i64),
        ("mask", _ptr),
        ("key_type", _i32),
        ("value_type", _i32),
        ("lead", _ptr),
        ("lead_rows", _i64),
        ("lead_head_stride", _i64),
        ("recent", _ptr),
        ("recent_head_stride", _i64),
        ("own_tile", _i64),
        ("rows", _i64),
        ("key_slot_row_stride", _i64),
        ("value_slot_row_stride", _i64),
    ]


@dataclass(frozen=True)
class LayerShape:
    """What the fused step needs to know about a layer besides its weights."""

    dim: int
    n_heads: int
    kv_heads: int
    head_dim: int
    rotary_dim: int
    interleaved: bool  # RoPE pairs (2i, 2i + 1), else (i, i + rotary_dim / 2)
    eps: float  # of both norms
    scale: float  # of the attention scores


class NativeDecodeLayer:
    """A layer's weights bound once; `step` runs one token through it, or a few consecutive
    tokens of one sequence, each row exactly as its own step would; `step_sequences` runs the
    rows of several sequences, each over its own cache."""

    def __init__(
        self,
        library: Library,
        shape: LayerShape,
        qkv: PackedInt4,
        out: PackedInt4,
        gate_up: PackedInt4 | None,
        down: PackedInt4 | None,
        attn_norm: torch.Tensor,
        ffn_norm: torch.Tensor,
        qk_norms: QkNorms | None = None,
        moe: MoeFeedForward | None = None,
    ):
        """`gate_up` and `down`: the gated feed-forward, or None with `moe` instead."""
        if moe is None and (gate_up is None or not gate_up.shape.gated):
            raise ValueError("the fused step takes a SiLU-gated feed-forward")
        attn_norm, ffn_norm = attn_norm.contiguous(), ffn_norm.contiguous()
        # Kept alive with the structure that points at them.
        self._held = (qkv, out, gate_up, down, attn_norm, ffn_norm, qk_norms, moe)
        self._weights = _Weights(
            qkv._address,
            out._address,
            None if gate_up is None else gate_up._address,
            None if down is None else down._address,
            attn_norm.data_ptr(),
            ffn_norm.data_ptr(),
            shape.eps,
            shape.scale,
            shape.dim,
            shape.n_heads,
            shape.kv_heads,
            shape.head_dim,
            shape.rotary_dim,
            0 if gate_up is None else gate_up.shape.outputs,
            int(shape.interleaved),
        )
        if qk_norms is not None:
            self._weights.q_norm = qk_norms.q.data_ptr()
            self._weights.k_norm = qk_norms.k.data_ptr()
            self._weights.qk_norm_whole = int(qk_norms.whole)
        self.choices: torch.Tensor | None = None  # a mixture's choices, [MAX_ROWS, used]
        if moe is not None:
            router = moe.router.float().contiguous()
            self.choices = torch.zeros(MAX_ROWS, moe.used, dtype=torch.int32)
            self._choice_weights = torch.zeros(MAX_ROWS, moe.used)
            self._moe = _MoeLayer(
                ctypes.addressof(moe.experts._gate_up),
                ctypes.addressof(moe.experts._down),
                moe.experts.n_experts,
                moe.experts.ffn,
                moe.used,
                router.data_ptr(),
                int(moe.normalize),
                self.choices.data_ptr(),
                self._choice_weights.data_ptr(),
            )
            self._held += (router,)
            self._weights.moe = ctypes.addressof(self._moe)
        self._step = _Step()
        self._function = library.cdll.miniapp_decode_layer
        self._function.argtypes = [_ptr, _ptr, _ptr, _ptr, ctypes.c_int]
        self._function.restype = ctypes.c_int
        self._batch_function = library.cdll.miniapp_decode_layer_batch
        self._batch_function.argtypes = [_ptr, _ptr, _i64, _ptr, _ptr, _ptr, _ptr, ctypes.c_int]
        self._batch_function.restype = ctypes.c_int
        self._weights_address = ctypes.addressof(self._weights)
        self._step_address = ctypes.addressof(self._step)

    def step(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        signed_sin: torch.Tensor,
        where: SequenceRows,
        lora: ctypes.Structure | None = None,
    ) -> torch.Tensor:
        """x fp32 [rows, dim] (contiguous), the residual stream of one sequence's rows,
        updated in place and returned; cos and signed_sin: the RoPE tables of their
        positions [rows, head_dim] (fp32, contiguous); `where`: their cache rows (see
        SequenceRows); `lora`: the rows' adapters at this layer (lora.LoraCallStruct)."""
        _fill(self._step, x.shape[0], where)
        self._step.cos, self._step.signed_sin = cos.data_ptr(), signed_sin.data_ptr()
        status = self._function(
            self._weights_address,
            self._step_address,
            x.data_ptr(),
            None if lora is None else ctypes.addressof(lora),
            torch.get_num_threads(),
        )
        if status:
            raise ValueError("the native decode layer refused its step")
        return x

    def step_sequences(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        signed_sin: torch.Tensor,
        sequences: list[tuple[int, SequenceRows]],
        lora: ctypes.Structure | None = None,
    ) -> torch.Tensor:
        """Rows of several sequences in one call (continuous batching): `sequences` holds,
        in the order of x's rows, how many rows each sequence owns and where they go (as
        `step` takes them for one sequence). Every row comes out as its own sequence's
        `step` would give it; the matmuls read the weights once for all of them."""
        steps = (_Step * len(sequences))()
        for step, (rows, where) in zip(steps, sequences, strict=True):
            _fill(step, rows, where)
        status = self._batch_function(
            self._weights_address,
            ctypes.addressof(steps),
            len(sequences),
            cos.data_ptr(),
            signed_sin.data_ptr(),
            x.data_ptr(),
            None if lora is None else ctypes.addressof(lora),
            torch.get_num_threads(),
        )
        if status:
            raise ValueError("the native decode layer refused its batched step")
        return x


@dataclass(frozen=True)
class SequenceRows:
    """One sequence's part of a fused step. `slots`: the storage rows [1, kv_heads, rows,
    width] its keys and values go into; `stored`: the keys and values its last row attends
    [1, kv_heads, n, width] (its own included, heads as far apart as in the slots; row r of
    `rows` sees the first n - (rows - 1 - r)); or, instead of both, their `addresses`.
    `mask`: bool [1, n] or None (all visible; several rows take no mask); the cache's
    storage type codes; keys stored as q4 tiles (one row only): `tiled` says the rest, and
    the key slot is the token's fp32 row of tiled.recent (the caller encodes the tile it
    completes)."""

    slots: tuple[torch.Tensor, torch.Tensor] | None
    stored: tuple[torch.Tensor, torch.Tensor] | None
    mask: torch.Tensor | None
    kv_types: tuple[int, int]
    tiled: TiledKeys | None = None
    # (key slot, value slot, keys, values, key and value head strides, keys the last row
    # sees, key and value slot strides), bytes: engine/kv/storage.py's SlotAddresses.
    addresses: tuple[int, ...] | None = None


def _fill(step: _Step, rows: int, where: SequenceRows) -> None:
    """The native step structure for `rows` rows of one sequence (RoPE tables apart): it
    runs for every layer of every step."""
    mask, tiled, at = where.mask, where.tiled, where.addresses
    if at is not None:
        step.key_slot, step.value_slot, step.keys, step.values = at[0], at[1], at[2], at[3]
        step.key_head_stride, step.value_head_stride, step.n_keys = at[4], at[5], at[6]
        step.key_slot_row_stride, step.value_slot_row_stride = at[7], at[8]
    else:
        keys, values = where.stored
        key_slots, value_slots = where.slots
        step.keys, step.values = keys.data_ptr(), values.data_ptr()
        step.key_slot, step.value_slot = key_slots.data_ptr(), value_slots.data_ptr()
        step.key_head_stride = keys.stride(1) * keys.element_size()
        step.value_head_stride = values.stride(1) * values.element_size()
        step.n_keys = keys.shape[2]
        step.key_slot_row_stride = key_slots.stride(2) * key_slots.element_size()
        step.value_slot_row_stride = value_slots.stride(2) * value_slots.element_size()
    step.rows = rows
    step.mask = None if mask is None else mask.view(torch.uint8).data_ptr()
    step.key_type, step.value_type = where.kv_types
    if tiled is not None:
        lead = tiled.lead
        step.lead = None if lead is None else lead.data_ptr()
        step.lead_rows = tiled.lead_rows
        step.lead_head_stride = 0 if lead is None else lead.stride(0)
        step.recent, step.recent_head_stride = tiled.recent.data_ptr(), tiled.recent.stride(0)
        step.own_tile = int(tiled.own_tiles[0])
        step.n_keys += tiled.lead_rows
    else:
        step.lead, step.recent, step.lead_rows = None, None, 0
