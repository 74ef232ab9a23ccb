"""Building blocks shared by the architectures: quantized linears, embedding, norms, RoPE.

A quantized linear owns its packed buffers and calls one kernel, so a model file reads like the
maths it implements.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from gguf.constants import GGMLQuantizationType
from torch import nn

from .quant import (
    FLOAT_TYPES,
    GROUP_SIZE,
    INT4_TYPES,
    Int4Groups,
    dequantize_rows,
    int4_groups_from_raw,
    q8_0_to_int4_pair,
    row_bytes,
)

Q = GGMLQuantizationType
# torch's CPU int4 matmul is fast only in bf16 (about 40x slower in fp16 or fp32), so linear layers
# take and return bf16; the residual stream and norms stay fp32.
COMPUTE_DTYPE = torch.bfloat16
# The torch.* binding skips the op-overload lookup of torch.ops.aten.* (~1 us a call).
_int4_mm = torch._weight_int4pack_mm_for_cpu
INT4_ZERO_CODE = 8  # padding rows decode to zero weights
_PACK_ROW_ALIGN = 16  # torch's CPU int4 packer needs the row count to be a multiple of 16
_PACK_CHUNK_ROWS = 4096  # convert big matrices in slices so temporary copies stay small


class Int4Linear(nn.Module):
    """y = x @ W.T for W held as 4-bit codes with a bf16 scale and zero per group of 32.

    `input_copies` is 2 for Q8_0 weights held as a hi/lo pair of 4-bit planes: the kernel then
    sees the input twice, side by side (see `quant.q8_0_to_int4_pair`).
    """

    def __init__(
        self,
        packed: torch.Tensor,
        scales_zeros: torch.Tensor,
        out_features: int,
        input_copies: int = 1,
    ):
        super().__init__()
        self.register_buffer("packed", packed, persistent=False)
        self.register_buffer("scales_zeros", scales_zeros, persistent=False)
        self.in_features = scales_zeros.shape[0] * GROUP_SIZE // input_copies
        self.out_features = out_features
        self.input_copies = input_copies

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [tokens, in_features] (any float dtype) -> bf16 [tokens, out_features]."""
        x = x.to(COMPUTE_DTYPE)
        if self.input_copies == 2:
            x = torch.cat([x, x], dim=-1)
        y = _int4_mm(x, self.packed, GROUP_SIZE, self.scales_zeros)
        if y.shape[-1] != self.out_features:
            y = y[:, : self.out_features]
        return y


class _Int4Packer:
    """Packs Int4Groups row blocks into torch's layout as they arrive, so converting a large
    matrix never holds more than one block of unpacked codes."""

    def __init__(self):
        self._pending: list[Int4Groups] = []
        self._pending_rows = 0
        self._packed: list[torch.Tensor] = []
        self._scales_zeros: list[torch.Tensor] = []
        self.rows = 0

    def add(self, groups: Int4Groups) -> None:
        self._pending.append(groups)
        self._pending_rows += groups.shape[0]
        self.rows += groups.shape[0]
        if self._pending_rows >= _PACK_CHUNK_ROWS:
            self._flush(final=False)

    def finish(self) -> tuple[torch.Tensor, torch.Tensor]:
        self._flush(final=True)
        return torch.cat(self._packed), torch.cat(self._scales_zeros, dim=1)

    def _flush(self, final: bool) -> None:
        if not self._pending:
            return
        block = Int4Groups.concat_rows(self._pending)
        rows = block.shape[0]
        keep = rows if final else rows - rows % _PACK_ROW_ALIGN
        self._pending = [block.slice_rows(keep, rows)] if keep < rows else []
        self._pending_rows = rows - keep
        block = block.slice_rows(0, keep)
        if final and keep % _PACK_ROW_ALIGN:
            block = block.pad_rows(_PACK_ROW_ALIGN - keep % _PACK_ROW_ALIGN, INT4_ZERO_CODE)
        self._packed.append(
            torch.ops.aten._convert_weight_to_int4pack_for_cpu(block.codes.to(torch.int32), 1)
        )
        # torch wants [groups, rows, (scale, zero)]
        scales_zeros = torch.stack([block.scale, block.zero], dim=-1).transpose(0, 1)
        self._scales_zeros.append(scales_zeros.to(COMPUTE_DTYPE).contiguous())


class DenseLinear(nn.Module):
    """y = x @ W.T for weights stored unquantized, kept in their stored dtype (F32/F16/BF16).

    Computes and returns fp32, so float models keep llama.cpp's precision.
    """

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.register_buffer("weight", weight.contiguous(), persistent=False)
        self.out_features, self.in_features = weight.shape

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.float(), self.weight.float())


RawWeight = tuple[torch.Tensor, GGMLQuantizationType]  # uint8 rows [n, row_bytes], type


def linear_from_raw(parts: list[RawWeight], n_cols: int) -> nn.Module:
    """One linear from one or more weights sharing an input (stacked by rows, e.g. Q|K|V).

    4-bit and 8-bit weights stay 4 or 8 bits; float weights become a dense matmul.
    """
    types = {t for _, t in parts}
    if types <= INT4_TYPES or types == {Q.Q8_0}:
        pair = types == {Q.Q8_0}
        packer = _Int4Packer()
        for raw, ggml_type in parts:
            for start in range(0, raw.shape[0], _PACK_CHUNK_ROWS):
                rows = raw[start : start + _PACK_CHUNK_ROWS]
                packer.add(
                    q8_0_to_int4_pair(rows) if pair else int4_groups_from_raw(rows, ggml_type)
                )
        out_features = packer.rows
        packed, scales_zeros = packer.finish()
        return Int4Linear(packed, scales_zeros, out_features, input_copies=2 if pair else 1)
    if types <= FLOAT_TYPES:
        stored = {Q.F16: torch.float16, Q.BF16: torch.bfloat16}.get(
            next(iter(types)), torch.float32
        )
        weight = torch.cat([dequantize_rows(raw, t, n_cols) for raw, t in parts])
        return DenseLinear(weight.to(stored if len(types) == 1 else torch.float32))
    # Mixed 4-bit and 8-bit parts: separate kernels, outputs concatenated.
    return _ConcatLinear([linear_from_raw([part], n_cols) for part in parts])


class _ConcatLinear(nn.Module):
    def __init__(self, parts: list[nn.Module]):
        super().__init__()
        self.parts = nn.ModuleList(parts)
        self.out_features = sum(p.out_features for p in parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([p(x) for p in self.parts], dim=-1)


class BlockEmbedding(nn.Module):
    """Token embedding kept in its GGML block format; only looked-up rows are dequantized."""

    def __init__(self, raw: torch.Tensor, ggml_type: GGMLQuantizationType, dim: int):
        super().__init__()
        if raw.shape[1] != row_bytes(ggml_type, dim):
            raise ValueError("embedding rows do not match the model dimension")
        self.register_buffer("raw", raw, persistent=False)
        self.ggml_type = ggml_type
        self.dim = dim

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens: int64 [n] -> fp32 [n, dim]."""
        return dequantize_rows(self.raw.index_select(0, tokens), self.ggml_type, self.dim)


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * w, computed as a layer norm of [x, -x].

    [x, -x] has mean zero and variance mean(x^2), so layer_norm's single fused kernel gives
    exactly the RMS norm; torch's own rms_norm runs ~15 small ops on the CPU and is slower.
    """

    def __init__(self, weight: torch.Tensor, eps: float):
        super().__init__()
        self.dim = weight.shape[0]
        doubled = torch.cat([weight, weight]).float().contiguous()
        self.register_buffer("doubled_weight", doubled, persistent=False)
        self.eps = eps

    @property
    def weight(self) -> torch.Tensor:
        return self.doubled_weight[: self.dim]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mirrored = torch.cat([x, x.neg()], dim=-1)
        normed = F.layer_norm(mirrored, (2 * self.dim,), self.doubled_weight, None, self.eps)
        return normed[..., : self.dim]


class Rope:
    """Rotary position embedding as one small matmul per layer.

    For a position p, RoPE rotates each pair of head dimensions (a, b) by angle p * theta_i.
    That is a block-diagonal [head_dim, head_dim] matrix R_p, so rotating the query and key
    heads of a token is `heads @ R_p`. Matrices are built for a block of positions at a time
    and shared by every layer, which costs far fewer tensor ops per decode step than the usual
    split/multiply/concatenate in each layer.

    `interleaved` pairs (2i, 2i+1), llama.cpp's "normal" RoPE used by `llama` GGUFs; otherwise
    pairs are (i, i + d/2) ("neox"). Dimensions past `rotary_dim` are left unrotated.
    """

    BLOCK = 64  # positions per cached block of decode-step matrices

    def __init__(self, head_dim: int, rotary_dim: int, base: float, interleaved: bool):
        exponents = torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim
        self.inv_freq = 1.0 / (base**exponents)
        if interleaved:
            self.first = torch.arange(0, rotary_dim, 2)
            self.second = self.first + 1
        else:
            self.first = torch.arange(rotary_dim // 2)
            self.second = self.first + rotary_dim // 2
        self.head_dim = head_dim
        self.identity_tail = torch.arange(rotary_dim, head_dim)
        self._block_start = -1
        self._block = torch.empty(0)

    def matrices(self, start: int, count: int) -> torch.Tensor:
        """fp32 [count, head_dim, head_dim] rotations for positions start..start+count-1."""
        block_start = start - start % self.BLOCK
        if start + count <= block_start + self.BLOCK:
            if block_start != self._block_start:
                self._block = self._build(torch.arange(block_start, block_start + self.BLOCK))
                self._block_start = block_start
            return self._block[start - block_start : start - block_start + count]
        return self._build(torch.arange(start, start + count))

    def _build(self, positions: torch.Tensor) -> torch.Tensor:
        # Angles in float64: positions reach 1e5+ and fp32 would lose the low bits.
        angles = positions.to(torch.float64)[:, None] * self.inv_freq[None, :]
        cos, sin = angles.cos(), angles.sin()
        rot = torch.zeros(positions.shape[0], self.head_dim, self.head_dim, dtype=torch.float64)
        a, b = self.first, self.second
        rot[:, a, a] = cos
        rot[:, b, b] = cos
        rot[:, b, a] = -sin  # new_a = x_a cos - x_b sin
        rot[:, a, b] = sin  # new_b = x_a sin + x_b cos
        rot[:, self.identity_tail, self.identity_tail] = 1.0
        return rot.to(torch.float32)


def apply_rope(heads: torch.Tensor, rotation: torch.Tensor) -> torch.Tensor:
    """heads: [n_tokens, n_heads, head_dim]; rotation: [n_tokens, head_dim, head_dim]."""
    return torch.bmm(heads, rotation)
