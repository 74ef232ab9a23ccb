"""Building blocks shared by the architectures: quantized linears, embedding, norms, RoPE.

A quantized linear owns its packed buffers and calls one kernel, so a model file reads like the
maths it implements.

These are plain classes, not torch.nn.Modules: a decode step touches ~30 of their attributes
per layer, and nn.Module's attribute lookup costs ~0.5 us each (about 3% of a SmolLM2 token).
Each has `forward`, also callable as the object itself.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from gguf.constants import GGMLQuantizationType

from ...native import ggml as native_ggml
from ...native import int4 as native_int4
from ..platform.kernels import (
    cpu_int4_kernel,
    cpu_row_ops,
    ggml_direct_types,
    ggml_interleave_enabled,
)
from .quant import (
    FLOAT_TYPES,
    PLAIN,
    QUANT_TYPES,
    Int4Groups,
    KernelLayout,
    decode,
    dequantize_rows,
    expand_input,
    layout_for,
    row_bytes,
    shared_layout,
    to_int4,
)

Q = GGMLQuantizationType
# torch's CPU int4 matmul is fast only in bf16 (about 40x slower in fp16 or fp32), so linear layers
# take and return bf16; the residual stream and norms stay fp32.
COMPUTE_DTYPE = torch.bfloat16
# The torch.* binding skips the op-overload lookup of torch.ops.aten.* (~1 us a call).
_int4_mm_cpu = torch._weight_int4pack_mm_for_cpu
INT4_ZERO_CODE = 8  # padding rows decode to zero weights
_PACK_ROW_ALIGN = 16  # torch's CPU int4 packer needs the row count to be a multiple of 16
_PACK_CHUNK_ROWS = 4096  # convert big matrices in slices so temporary copies stay small
# torch's CUDA int4 packer tiles K by inner_k_tiles * 16 columns; it takes 2, 4 or 8.
_CUDA_INNER_K_TILES = (8, 4, 2)
_CUDA_K_TILE = 16


@dataclass(frozen=True)
class WeightTarget:
    """Where a linear layer's weights live and in what form: 4-bit codes for the device's
    int4 kernel, or dequantized to dense bf16 (a GPU without that kernel)."""

    device: torch.device = torch.device("cpu")
    dense: bool = False
    # A mixture of experts' experts stay on the CPU (llama.cpp's --cpu-moe): the rest of the
    # layer on `device`.
    experts_on_cpu: bool = False

    @property
    def on_cpu(self) -> bool:
        return self.device.type == "cpu"


CPU_INT4 = WeightTarget()


class Int4Linear:
    """y = x @ W.T (+ bias) for W held as 4-bit codes with a bf16 scale and zero per group of 32.

    Wider codes are held as interleaved 4-bit planes; `layout` says how the kernel's groups
    and input are laid out for them (see `quant.KernelLayout`).

    On the CPU the weight is packed either for torch's int4 kernel (`packed`, `scales_zeros`)
    or for our own (`native`, see `kernels.py`), never both: one copy of the weights.
    """

    def __init__(
        self,
        packed: torch.Tensor,
        scales_zeros: torch.Tensor | None,
        out_features: int,
        layout: KernelLayout = PLAIN,
        bias: torch.Tensor | None = None,
        native: native_int4.PackedInt4 | None = None,
    ):
        self.packed, self.scales_zeros, self.bias = packed, scales_zeros, bias
        self.native = native
        slots = native.shape.k if native is not None else scales_zeros.shape[0] * layout.group
        self.in_features = slots // 2 if layout.interleave else slots
        self.out_features = out_features
        self.layout = layout
        self.group = layout.group
        self.plain = not layout.interleave
        # forward gives silu(gate) * up of gate|up rows (see `linear_from_raw`)
        self.gated = native is not None and native.shape.gated
        self._mm = _int4_mm_cpu if packed.device.type == "cpu" else torch._weight_int4pack_mm
        if native is not None and self.plain and bias is None:
            self.forward = native.forward  # the common case, without a Python frame between

    @property
    def nbytes(self) -> int:
        """Bytes of weights a forward pass reads (codes, scales and zeros)."""
        extra = 0 if self.scales_zeros is None else _bytes(self.scales_zeros)
        return _bytes(self.packed) + extra

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [tokens, in_features] (any float dtype) -> [tokens, out_features]: fp32 from our
        own kernel or with a bias, bf16 from torch's kernel without one."""
        if self.native is not None:
            y = self.native.forward(x if self.plain else expand_input(x, self.layout))
            return y if self.bias is None else y + self.bias
        if x.dtype is not COMPUTE_DTYPE:
            x = x.to(COMPUTE_DTYPE)
        if not self.plain:
            x = expand_input(x, self.layout)
        y = self._mm(x, self.packed, self.group, self.scales_zeros)
        if y.shape[-1] != self.out_features:
            y = y[:, : self.out_features]
        if self.bias is not None:
            y = y + self.bias
        return y

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward(x)


class _Int4Packer:
    """Packs Int4Groups row blocks into torch's layout for the target device as they arrive,
    so converting a large matrix never holds more than one block of unpacked codes.
    With a native library, packs into our own kernel's layout instead."""

    def __init__(self, device: torch.device, native: native_int4.Library | None = None):
        self.device = device
        self.native = native
        self._pending: list[Int4Groups] = []
        self._pending_rows = 0
        self._packed: list[torch.Tensor] = []
        self._scales_zeros: list[torch.Tensor] = []
        self._columns = 0
        self.rows = 0

    def add(self, groups: Int4Groups) -> None:
        self._pending.append(groups)
        self._pending_rows += groups.shape[0]
        self.rows += groups.shape[0]
        if self._pending_rows >= _PACK_CHUNK_ROWS:
            self._flush(final=False)

    def finish(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        self._flush(final=True)
        if self.native is not None:
            return torch.cat(self._packed), None
        return torch.cat(self._packed), torch.cat(self._scales_zeros, dim=1)

    def linear(self, layout: KernelLayout, bias: torch.Tensor | None) -> Int4Linear:
        packed, scales_zeros = self.finish()
        native = None
        if self.native is not None:
            k = layout.kernel_columns(self._columns)
            shape = native_int4.PackedShape(self.rows, k, layout.group)
            native = native_int4.PackedInt4(self.native, packed, shape)
        return Int4Linear(packed, scales_zeros, self.rows, layout, bias, native)

    def _flush(self, final: bool) -> None:
        if not self._pending:
            return
        block = Int4Groups.concat_rows(self._pending)
        rows = block.shape[0]
        keep = rows if final else rows - rows % _PACK_ROW_ALIGN
        self._pending = [block.slice_rows(keep, rows)] if keep < rows else []
        self._pending_rows = rows - keep
        block = block.slice_rows(0, keep)
        self._columns = block.shape[1] // 2 if block.layout.interleave else block.shape[1]
        if self.native is not None:
            self._packed.append(native_int4.pack(block.codes, block.scale, block.zero))
            return
        if final and keep % _PACK_ROW_ALIGN:
            block = block.pad_rows(_PACK_ROW_ALIGN - keep % _PACK_ROW_ALIGN, INT4_ZERO_CODE)
        self._packed.append(pack_int4(block.codes, self.device))
        # torch wants [groups, rows, (scale, zero)]
        scales_zeros = torch.stack([block.scale, block.zero], dim=-1).transpose(0, 1)
        self._scales_zeros.append(scales_zeros.to(self.device, COMPUTE_DTYPE).contiguous())


def pack_int4(codes: torch.Tensor, device: torch.device) -> torch.Tensor:
    """4-bit codes [rows, cols] (values 0..15) in the layout of the device's int4 kernel."""
    if device.type == "cpu":
        return torch._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1)
    pairs = code_pairs(codes).to(device)
    return torch._convert_weight_to_int4pack(pairs, cuda_inner_k_tiles(codes.shape[1]))


def code_pairs(codes: torch.Tensor) -> torch.Tensor:
    """[rows, cols] codes -> uint8 [rows, cols / 2], two codes a byte, the first in the high
    nibble: the input of torch's CUDA int4 packer."""
    codes = codes.to(torch.uint8)
    return codes[:, 0::2] << 4 | codes[:, 1::2]


def cuda_inner_k_tiles(columns: int) -> int:
    """The largest tiling torch's CUDA int4 kernel accepts for this many input columns."""
    for tiles in _CUDA_INNER_K_TILES:
        if columns % (tiles * _CUDA_K_TILE) == 0:
            return tiles
    raise ValueError(f"{columns} input columns do not tile for the CUDA int4 kernel")


class GgmlLinear:
    """y = x @ W.T (+ bias) for W kept as the file's own GGML blocks (one or more tensors
    stacked by rows), read by the native kernel (`native/ggml.py`) in place or, for the
    types that have one, in an interleaved copy of the same bytes: a step reads each weight
    at the file's own bits per weight.
    With `gated`, W holds gate and up rows and forward gives silu(gate) * up. Returns fp32."""

    bias = None  # added inside the kernel
    plain = True

    def __init__(self, native: native_ggml.PackedGgml):
        self.native = native
        self.in_features = native.shape.k
        self.out_features = native.shape.outputs
        self.gated = native.shape.gated
        self.forward = native.forward

    @property
    def nbytes(self) -> int:
        """Bytes of weights a forward pass reads: the file's own, for these tensors."""
        return self.native.nbytes

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward(x)


class DenseLinear:
    """y = x @ W.T (+ bias) for weights stored unquantized, kept in their stored dtype.

    F32 weights compute in fp32. BF16 weights multiply bf16 activations (like our int4
    path). F16 weights multiply fp16 activations when decoding, as llama.cpp does; torch's
    CPU fp16 GEMM is slow for more rows, so prompt chunks upcast the weights instead.
    Returns fp32.
    """

    FP16_MAX_ROWS = 4

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        self.weight, self.bias = weight.contiguous(), bias
        self.out_features, self.in_features = weight.shape

    @property
    def nbytes(self) -> int:
        return _bytes(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        if weight.dtype is torch.float16 and x.shape[0] > self.FP16_MAX_ROWS:
            weight = weight.float()
        y = F.linear(x.to(weight.dtype), weight).float()
        return y if self.bias is None else y + self.bias

    __call__ = forward


RawWeight = tuple[torch.Tensor, GGMLQuantizationType]  # uint8 rows [n, row_bytes], type

_STORED_DTYPE = {Q.F32: torch.float32, Q.F16: torch.float16, Q.BF16: torch.bfloat16}


def linear_from_raw(
    parts: list[RawWeight],
    n_cols: int,
    bias: torch.Tensor | None = None,
    target: WeightTarget = CPU_INT4,
    gated: bool = False,
    release: Callable[[torch.Tensor], None] | None = None,
) -> Linear:
    """One linear from one or more weights sharing an input (stacked by rows, e.g. Q|K|V).

    Quantized weights stay 4 to 8 bits a weight (unless the target wants them dense); float
    weights become a dense matmul. Parts that need different kernel layouts become separate
    kernels, concatenated.

    `gated`: the rows are the gate and then the up projection of a SiLU-gated feed-forward
    (two parts, or one part holding both). Where our own CPU kernel runs them, the result
    computes silu(gate) * up in the same call (`Int4Linear.gated`); elsewhere it is the
    plain gate|up linear and the caller applies the activation.

    `release`, if given, is called with each slice of a part once it has been copied (a
    memory map's pages can then be dropped while the rest is read).
    """
    types = {t for _, t in parts}
    if bias is not None:
        bias = bias.to(target.device)
    if (direct := _ggml_linear(parts, n_cols, bias, target, gated, release)) is not None:
        return direct
    if (packed := _native_q4(parts, n_cols, bias, target, gated)) is not None:
        return packed
    if gated and bias is None and (fused := _gated_int4(parts, n_cols, target)) is not None:
        return fused
    if types <= QUANT_TYPES and target.dense:
        weight = torch.cat([_dense_bf16(raw, t, n_cols, target.device) for raw, t in parts])
        return DenseLinear(weight, bias)
    if types <= QUANT_TYPES and (layout := shared_layout(types)) is not None:
        if len({layout_for(t) for t in types}) == 1 or one_product_across_layouts(target):
            return _packed_int4(parts, layout, bias, target)
    if types <= FLOAT_TYPES:
        weight = torch.cat([dequantize_rows(raw, t, n_cols) for raw, t in parts])
        stored = _STORED_DTYPE[next(iter(types))] if len(types) == 1 else torch.float32
        return DenseLinear(weight.to(target.device, stored), bias)
    runs = _runs_of_one_kernel(parts)
    return _ConcatLinear([linear_from_raw(run, n_cols, target=target) for run in runs], bias)


def one_product_across_layouts(target: WeightTarget) -> bool:
    """Whether parts whose codes want different kernel layouts (Qwen's Q4_K Q|K beside a
    Q6_K V) still make one product, the 4-bit parts widened to the other's layout. Off the
    CPU, yes: a product's launch there costs more than reading those parts' slots twice.
    A CPU's time goes on the bytes it reads, so there they stay separate products."""
    return not target.on_cpu


def _packed_int4(
    parts: list[RawWeight], layout: KernelLayout, bias: torch.Tensor | None, target: WeightTarget
) -> Int4Linear:
    packer = _Int4Packer(target.device, cpu_int4_kernel().library if target.on_cpu else None)
    for raw, ggml_type in parts:
        for start in range(0, raw.shape[0], _PACK_CHUNK_ROWS):
            packer.add(to_int4(decode(raw[start : start + _PACK_CHUNK_ROWS], ggml_type), layout))
    return packer.linear(layout, bias)


def _runs_of_one_kernel(parts: list[RawWeight]) -> list[list[RawWeight]]:
    """Consecutive parts that one product computes: quantized parts of one kernel layout,
    or float parts of one type."""
    runs: list[list[RawWeight]] = []
    kind = None
    for raw, ggml_type in parts:
        this = layout_for(ggml_type) if ggml_type in QUANT_TYPES else ggml_type
        if runs and this == kind:
            runs[-1].append((raw, ggml_type))
        else:
            runs.append([(raw, ggml_type)])
        kind = this
    return runs


def _native_library(target: WeightTarget) -> native_int4.Library | None:
    """The native library, where weights for `target` may use it: the CPU, not dense."""
    return cpu_int4_kernel().library if target.on_cpu and not target.dense else None


def _ggml_linear(
    parts: list[RawWeight],
    n_cols: int,
    bias: torch.Tensor | None,
    target: WeightTarget,
    gated: bool,
    release: Callable[[torch.Tensor], None] | None = None,
) -> GgmlLinear | None:
    """The weights as they are in the file, for the native GGML kernel: where it runs (the
    CPU with the native library) and takes every part's type; None elsewhere."""
    library = _native_library(target)
    direct = ggml_direct_types()
    if library is None or not all(t in direct and native_ggml.takes(t, n_cols) for _, t in parts):
        return None
    if gated and len(parts) == 1:  # Phi-3: one tensor, gate rows first
        raw, ggml_type = parts[0]
        half = raw.shape[0] // 2
        parts = [(raw[:half], ggml_type), (raw[half:], ggml_type)]
    if len(parts) > native_ggml.MAX_PARTS or (gated and len(parts) != 2):
        return None
    return GgmlLinear(packed_ggml(library, parts, n_cols, bias, gated, release))


def packed_ggml(
    library: native_int4.Library,
    parts: list[RawWeight],
    n_cols: int,
    bias: torch.Tensor | None = None,
    gated: bool = False,
    release: Callable[[torch.Tensor], None] | None = None,
) -> native_ggml.PackedGgml:
    """File rows bound for the GGML kernel on the path this CPU runs, interleaved where the
    setting says (a dense linear's weights, an expert's)."""
    # The int4 kernel's path says what this CPU (or a simulated one) runs: AVX2 there too.
    isa = native_ggml.ISA_AVX2 if library.isa == native_int4.ISA_AVX2 else native_ggml.ISA_AUTO
    interleave = ggml_interleave_enabled()
    return native_ggml.PackedGgml(
        library, parts, n_cols, bias, gated, isa, interleave=interleave, release=release
    )


def _native_q4(
    parts: list[RawWeight],
    n_cols: int,
    bias: torch.Tensor | None,
    target: WeightTarget,
    gated: bool,
) -> Int4Linear | None:
    """Q4_0 or Q4_1 weights packed for the native int4 kernel in one native pass over the
    file's rows (the same bytes as decoding and packing them in torch, in a fraction of the
    time); None where that does not apply."""
    library = _native_library(target)
    types = {int(t) for _, t in parts}
    if library is None or len(types) != 1 or not types <= set(native_int4.Q4_BLOCK_BYTES):
        return None
    if n_cols % PLAIN.group:
        return None
    ggml_type = types.pop()
    raws = [raw for raw, _ in parts]
    if gated and bias is None:
        rows = sum(raw.shape[0] for raw in raws)
        if len(raws) > 2 or rows % 2 or (rows // 2) % native_int4.GATE_ROWS:
            return None
        if len(raws) == 2 and raws[0].shape[0] != raws[1].shape[0]:
            return None
        order = native_int4.gate_up_order(rows)
        data = native_int4.pack_q4_rows(library, raws, ggml_type, n_cols, order)
        shape = native_int4.PackedShape(rows, n_cols, PLAIN.group, gated=True)
        native = native_int4.PackedInt4(library, data, shape)
        return Int4Linear(data, None, rows // 2, PLAIN, None, native)
    data = native_int4.pack_q4_rows(library, raws, ggml_type, n_cols)
    rows = sum(raw.shape[0] for raw in raws)
    native = native_int4.PackedInt4(
        library, data, native_int4.PackedShape(rows, n_cols, PLAIN.group)
    )
    return Int4Linear(data, None, rows, PLAIN, bias, native)


def _gated_int4(parts: list[RawWeight], n_cols: int, target: WeightTarget) -> Int4Linear | None:
    """gate|up rows packed for the native kernel's silu(gate) * up, a slice at a time; None
    where that does not apply (torch's kernel, wider codes, odd shapes)."""
    library = cpu_int4_kernel().library if target.on_cpu else None
    if library is None or any(t not in QUANT_TYPES or layout_for(t) != PLAIN for _, t in parts):
        return None
    if len(parts) == 1:  # Phi-3: one tensor, gate rows first
        raw, ggml_type = parts[0]
        half = raw.shape[0] // 2
        parts = [(raw[:half], ggml_type), (raw[half:], ggml_type)]
    if len(parts) != 2:
        return None
    (gate, gate_type), (up, up_type) = parts
    ffn = gate.shape[0]
    if up.shape[0] != ffn or ffn % native_int4.GATE_ROWS:
        return None
    slices = (
        (
            to_int4(decode(gate[start : start + _PACK_CHUNK_ROWS], gate_type)),
            to_int4(decode(up[start : start + _PACK_CHUNK_ROWS], up_type)),
        )
        for start in range(0, ffn, _PACK_CHUNK_ROWS)
    )
    return pack_gated(slices, ffn, n_cols, library)


def pack_gated(
    slices: Iterable[tuple[Int4Groups, Int4Groups]], ffn: int, n_cols: int, library
) -> Int4Linear:
    """Gate and up rows (a slice of each at a time, in order, `ffn` rows of each in all),
    packed for the native kernel's silu(gate) * up."""
    packed = []
    for gate, up in slices:
        both = Int4Groups.concat_rows([gate, up])
        order = native_int4.gate_up_order(both.shape[0])
        packed.append(native_int4.pack(both.codes[order], both.scale[order], both.zero[order]))
    data = torch.cat(packed)
    shape = native_int4.PackedShape(2 * ffn, n_cols, PLAIN.group, gated=True)
    return Int4Linear(data, None, ffn, PLAIN, None, native_int4.PackedInt4(library, data, shape))


def _dense_bf16(
    raw: torch.Tensor, ggml_type: GGMLQuantizationType, n_cols: int, device: torch.device
) -> torch.Tensor:
    """Quantized rows dequantized to bf16 on `device`, a slice at a time so the fp32 copy
    stays small."""
    slices = [
        dequantize_rows(raw[start : start + _PACK_CHUNK_ROWS], ggml_type, n_cols)
        .to(COMPUTE_DTYPE)
        .to(device)
        for start in range(0, raw.shape[0], _PACK_CHUNK_ROWS)
    ]
    return torch.cat(slices)


class _ConcatLinear:
    def __init__(self, parts: list[Linear], bias: torch.Tensor | None = None):
        self.parts, self.bias = parts, bias
        self.out_features = sum(p.out_features for p in parts)
        self.in_features = parts[0].in_features

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.cat([p.forward(x).float() for p in self.parts], dim=-1)
        return y if self.bias is None else y + self.bias

    __call__ = forward


Linear = Int4Linear | GgmlLinear | DenseLinear | _ConcatLinear


def _bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


class BlockEmbedding:
    """Token embedding kept in its GGML block format; only looked-up rows are dequantized.

    With `order` (see `tied_to`), `raw` is an output head's interleaved copy of the same
    table, and each looked-up row's file bytes are gathered back out of its group first."""

    def __init__(
        self,
        raw: torch.Tensor,
        ggml_type: GGMLQuantizationType,
        dim: int,
        order: torch.Tensor | None = None,
    ):
        if raw.shape[1] != row_bytes(ggml_type, dim):
            raise ValueError("embedding rows do not match the model dimension")
        self.raw = raw
        self.ggml_type = ggml_type
        self.dim = dim
        self.order = order
        if order is not None:  # [groups, blocks per row, the 8 rows' block]
            group_rows, block = order.shape
            self._groups = raw.view(raw.shape[0] // group_rows, -1, group_rows * block)

    @classmethod
    def tied_to(cls, head: Linear, dim: int) -> BlockEmbedding | None:
        """The embedding read from an output head that holds the same table interleaved
        (one copy in memory, not two); None where the head holds it otherwise."""
        if not isinstance(head, GgmlLinear) or len(head.native.parts) != 1:
            return None
        raw, stored = head.native.parts[0]
        file_type = {v: k for k, v in native_ggml.INTERLEAVED.items()}.get(stored)
        if file_type is None:
            return None
        order = native_ggml.group_byte_order(head.native.library, file_type)
        if order is None:
            return None
        return cls(raw, GGMLQuantizationType(file_type), dim, order)

    def to(self, device: torch.device) -> BlockEmbedding:
        """The same table on `device` (itself where it is there already)."""
        if self.raw.device == device:
            return self
        order = None if self.order is None else self.order.to(device)
        return BlockEmbedding(self.raw.to(device), self.ggml_type, self.dim, order)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens: int64 [n] -> fp32 [n, dim]."""
        if self.order is None:
            rows = self.raw.index_select(0, tokens)
        else:
            group_rows, block = self.order.shape
            blocks = self._groups.index_select(0, tokens // group_rows)
            where = self.order[tokens % group_rows].unsqueeze(1).expand(-1, blocks.shape[1], -1)
            rows = torch.gather(blocks, 2, where).reshape(len(tokens), -1)
        return dequantize_rows(rows, self.ggml_type, self.dim)

    __call__ = forward


class RMSNorm:
    """x / sqrt(mean(x^2) + eps) * w.

    On the CPU with the native library, one call of its row kernel. Otherwise computed as a
    layer norm of [x, -x]: that has mean zero and variance mean(x^2), so layer_norm's single
    fused kernel gives exactly the RMS norm; torch's own rms_norm runs ~15 small ops on the
    CPU and is slower.
    """

    def __init__(self, weight: torch.Tensor, eps: float):
        self.dim = weight.shape[0]
        self.doubled_weight = torch.cat([weight, weight]).float().contiguous()
        self.eps = eps
        self.native = cpu_row_ops() if weight.device.type == "cpu" else None

    @property
    def weight(self) -> torch.Tensor:
        return self.doubled_weight[: self.dim]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.native is not None and _native_rows(x):
            return self.native.rms_norm(x, self.doubled_weight, self.eps)
        mirrored = torch.cat([x, x.neg()], dim=-1)
        normed = F.layer_norm(mirrored, (2 * self.dim,), self.doubled_weight, None, self.eps)
        return normed[..., : self.dim]

    __call__ = forward

    def add_and_norm(self, x: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """x += delta (the residual stream, in place), then the norm of x: one native call."""
        if self.native is not None and _native_rows(x) and _native_rows(delta):
            return self.native.rms_norm(x, self.doubled_weight, self.eps, add=delta)
        x.add_(delta)
        return self.forward(x)


def _native_rows(x: torch.Tensor) -> bool:
    """Whether the native row kernels take x as it is: fp32 [rows, dim] on the CPU."""
    return x.dtype is torch.float32 and x.dim() == 2 and x.stride(1) == 1 and x.is_cpu


def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) over the last dimension (RMSNorm without its weight)."""
    dim = x.shape[-1]
    mirrored = torch.cat([x, x.neg()], dim=-1)
    return F.layer_norm(mirrored, (2 * dim,), None, None, eps)[..., :dim]


class Rope:
    """Rotary position embedding: cos/sin tables shared by every layer.

    For a position p, RoPE rotates each pair of head dimensions (a, b) by angle p * theta_i:
    a' = a cos - b sin, b' = a sin + b cos. With `swap` mapping each dimension to its pair
    partner, that is x * cos + swap(x) * signed_sin, where signed_sin is -sin at the first
    member of a pair and +sin at the second: three tensor ops per layer for Q and K together.

    `interleaved` pairs (2i, 2i+1), llama.cpp's "normal" RoPE used by `llama` GGUFs; otherwise
    pairs are (i, i + rotary_dim/2) ("neox"). Dimensions past `rotary_dim` are not rotated.
    Tables are built for a block of positions at a time, and the most recently used blocks
    are kept, so decoding rarely builds any: also when a batch's sequences sit at positions
    far apart (one block kept would be built again for each of them, every step).
    """

    BLOCK = 64  # positions per cached block of tables
    BLOCKS_KEPT = 64  # blocks of tables kept, least recently used let go first

    def __init__(
        self,
        head_dim: int,
        rotary_dim: int,
        base: float,
        interleaved: bool,
        position_scale: float = 1.0,
        freq_factors: torch.Tensor | None = None,
    ):
        exponents = torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim
        # Linear scaling multiplies positions; frequency factors divide each frequency.
        inv_freq = position_scale / (base**exponents)
        if freq_factors is not None:
            inv_freq = inv_freq / freq_factors.to(torch.float64)
        half = rotary_dim // 2
        # Frequency and sign of the sine term for every head dimension (tail: frequency 0).
        per_dim = torch.zeros(head_dim, dtype=torch.float64)
        sign = torch.zeros(head_dim, dtype=torch.float64)
        if interleaved:
            per_dim[0:rotary_dim:2] = per_dim[1:rotary_dim:2] = inv_freq
            sign[0:rotary_dim:2], sign[1:rotary_dim:2] = -1.0, 1.0
        else:
            per_dim[:half] = per_dim[half:rotary_dim] = inv_freq
            sign[:half], sign[half:rotary_dim] = -1.0, 1.0
        self.per_dim_freq, self.sin_sign = per_dim, sign
        self.interleaved, self.rotary_dim, self.head_dim = interleaved, rotary_dim, head_dim
        self._blocks: OrderedDict[int, tuple[torch.Tensor, torch.Tensor]] = OrderedDict()

    def tables(self, start: int, count: int) -> RopeTables:
        """cos and signed sin, fp32 [count, 1, head_dim], for positions start..start+count-1."""
        block_start = start - start % self.BLOCK
        if start + count <= block_start + self.BLOCK:
            cos, sin = self._block(block_start)
            lo = start - block_start
            return RopeTables(cos[lo : lo + count], sin[lo : lo + count], self)
        return RopeTables(*self._build(start, count), self)

    def _block(self, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        blocks = self._blocks
        block = blocks.get(start)
        if block is None:
            block = blocks[start] = self._build(start, self.BLOCK)
            if len(blocks) > self.BLOCKS_KEPT:
                blocks.popitem(last=False)
        elif next(reversed(blocks)) != start:
            blocks.move_to_end(start)
        return block

    def shift_tables(self, delta: int) -> RopeTables:
        """Tables that rotate by `delta` positions (any sign): RoPE(a) RoPE(b) = RoPE(a + b)."""
        return RopeTables(*self._build(delta, 1), self)

    def each_shift_tables(self, deltas: torch.Tensor) -> RopeTables:
        """Tables, fp32 deltas.shape + [head_dim], that rotate each element by its own
        number of positions (int64 `deltas`, any shape, any sign)."""
        # Angles in float64: positions reach 1e5+ and fp32 would lose the low bits.
        angles = deltas.to(torch.float64)[..., None] * self.per_dim_freq
        cos = angles.cos().float()
        sin = (angles.sin() * self.sin_sign).float()
        return RopeTables(cos, sin, self)

    def _build(self, start: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        tables = self.each_shift_tables(torch.arange(start, start + count)[:, None])
        return tables.cos, tables.signed_sin

    def swap(self, x: torch.Tensor) -> torch.Tensor:
        """Each rotated dimension replaced by its pair partner (the tail is left in place)."""
        if self.interleaved:
            return x.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)
        half, rot = self.rotary_dim // 2, self.rotary_dim
        parts = [x[..., half:rot], x[..., :half]]
        if rot < self.head_dim:
            parts.append(x[..., rot:])
        return torch.cat(parts, dim=-1)


@dataclass(frozen=True)
class RopeTables:
    cos: torch.Tensor
    signed_sin: torch.Tensor
    rope: Rope

    def to(self, device: torch.device) -> RopeTables:
        if self.cos.device == device:
            return self
        return RopeTables(self.cos.to(device), self.signed_sin.to(device), self.rope)


def apply_rope(heads: torch.Tensor, tables: RopeTables) -> torch.Tensor:
    """heads: fp32 [tokens, n_heads, head_dim] rotated by the tables' positions."""
    return torch.addcmul(heads * tables.cos, tables.rope.swap(heads), tables.signed_sin)
