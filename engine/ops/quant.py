"""GGML block formats as torch tensors.

Every quantized GGML type decodes to `AffineCodes`: small unsigned integer codes with, per
group of 16 or 32 columns, `w = scale * code + offset`. That form serves two purposes:
* the pure-torch reference dequantizer (tests, and embedding look-ups of a few rows);
* conversion into torch's int4 matmul format, where each group of 32 weights holds 4-bit
  codes and computes w = (q - 8) * scale + zero (`Int4Groups`).

Codes of up to 4 bits map directly. Wider codes (Q5_*, Q6_K, Q8_0) are split into a high and
a low 4-bit plane, c = 16*hi + lo, so they stay 8 bits a weight and still run on the int4
kernel: each source group of g columns becomes one kernel group of 2g slots, its g hi codes
fed 16*x and then its g lo codes fed x, so both planes share the group's one scale and zero
(`KernelLayout.interleave`). Groups of 32 (Q5_*, Q8_0) use kernel groups of 64; Q6_K's
groups of 16 use kernel groups of 32. The hi plane is shifted per group so that the zero term
stays within 8 scale steps: bf16 rounding of the zero then costs no more than for a plain
4-bit group.

Block layouts are GGML's (see gguf-py's reference dequantizers, which the tests compare to).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

Q = GGMLQuantizationType
KERNEL_GROUP = 32  # torch's CPU int4 kernel supports groups of 32 and more, not 16
INT4_OFFSET = 8  # torch's int4 kernel subtracts 8 from every code

FLOAT_TYPES = frozenset({Q.F32, Q.F16, Q.BF16})
QUANT_TYPES = frozenset({Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q5_0, Q.Q5_1, Q.Q5_K, Q.Q6_K, Q.Q8_0})
SUPPORTED_TYPES = FLOAT_TYPES | QUANT_TYPES


@dataclass(frozen=True)
class KernelLayout:
    """Where a weight's codes sit in the int4 kernel's input."""

    group: int  # the kernel's group size: one scale and zero per `group` slots
    interleave: int = 0  # 0: one slot per column; g: per g columns, g hi slots then g lo

    def kernel_columns(self, columns: int) -> int:
        return 2 * columns if self.interleave else columns


PLAIN = KernelLayout(KERNEL_GROUP)


@dataclass
class AffineCodes:
    """w = scale * code + offset, per group of `group` consecutive columns."""

    codes: torch.Tensor  # uint8 [rows, cols]
    scale: torch.Tensor  # float32 [rows, cols // group]
    offset: torch.Tensor  # float32 [rows, cols // group]
    bits: int
    group: int

    def dequantize(self) -> torch.Tensor:
        rows, cols = self.codes.shape
        grouped = self.codes.view(rows, cols // self.group, self.group).float()
        return (grouped * self.scale[..., None] + self.offset[..., None]).view(rows, cols)


@dataclass
class Int4Groups:
    """A weight matrix as the int4 kernel holds it: 4-bit codes [rows, slots] with a scale
    and zero per group of `layout.group` slots."""

    codes: torch.Tensor  # uint8 [rows, slots], values 0..15
    scale: torch.Tensor  # float32 [rows, slots // group]
    zero: torch.Tensor  # float32 [rows, slots // group]
    layout: KernelLayout = PLAIN

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)  # type: ignore[return-value]

    def dequantize(self) -> torch.Tensor:
        """The kernel's weights, slot by slot (interleaved planes not yet combined)."""
        rows, slots = self.codes.shape
        group = self.layout.group
        grouped = self.codes.view(rows, slots // group, group).float()
        weights = (grouped - INT4_OFFSET) * self.scale[..., None] + self.zero[..., None]
        return weights.view(rows, slots)

    def _with(self, codes, scale, zero) -> Int4Groups:
        return Int4Groups(codes, scale, zero, self.layout)

    def slice_rows(self, start: int, end: int) -> Int4Groups:
        return self._with(self.codes[start:end], self.scale[start:end], self.zero[start:end])

    def pad_rows(self, n: int, code: int) -> Int4Groups:
        """Append n rows of `code` with zero scale and zero: they decode to 0."""
        pad = torch.nn.functional.pad
        return self._with(
            pad(self.codes, (0, 0, 0, n), value=code),
            pad(self.scale, (0, 0, 0, n)),
            pad(self.zero, (0, 0, 0, n)),
        )

    @staticmethod
    def concat_rows(parts: list[Int4Groups]) -> Int4Groups:
        if len(parts) == 1:
            return parts[0]
        return parts[0]._with(
            torch.cat([p.codes for p in parts]),
            torch.cat([p.scale for p in parts]),
            torch.cat([p.zero for p in parts]),
        )


def row_bytes(ggml_type: GGMLQuantizationType, n_cols: int) -> int:
    block, size = GGML_QUANT_SIZES[ggml_type]
    return n_cols // block * size


def layout_for(ggml_type: GGMLQuantizationType) -> KernelLayout:
    if ggml_type in (Q.Q4_0, Q.Q4_1, Q.Q4_K):
        return PLAIN
    if ggml_type == Q.Q6_K:
        return KernelLayout(group=32, interleave=16)
    if ggml_type in QUANT_TYPES:
        return KernelLayout(group=64, interleave=32)
    raise ValueError(f"{ggml_type.name} is not a quantized type")


# ----------------------------------------------------------------------------- decoding


def _blocks(raw: torch.Tensor, ggml_type: GGMLQuantizationType) -> torch.Tensor:
    """View raw rows uint8 [rows, row_bytes] as [rows, n_blocks, block_bytes]."""
    return raw.reshape(raw.shape[0], -1, GGML_QUANT_SIZES[ggml_type][1])


def _f16(blocks: torch.Tensor, at: int) -> torch.Tensor:
    """The fp16 at byte `at` of every block, as float32 [rows, n_blocks]."""
    return blocks[..., at : at + 2].contiguous().view(torch.float16).squeeze(-1).float()


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., n] -> [..., 2n]: all low nibbles, then all high nibbles."""
    return torch.cat([packed & 0x0F, packed >> 4], dim=-1)


def _bits(packed: torch.Tensor, count: int) -> torch.Tensor:
    """Little-endian bit k of a byte string [..., count // 8] -> uint8 [..., count]."""
    return (_shifted(packed, 1) & 1).reshape(*packed.shape[:-1], count)


def _shifted(packed: torch.Tensor, width: int) -> torch.Tensor:
    """uint8 [...] -> [..., 8 // width]: each byte shifted right by 0, width, 2 * width...
    Python shifts, not a tensor of them: a table looked up on a GPU (inside a captured
    step) must not copy constants from the host."""
    return torch.stack([packed >> shift for shift in range(0, 8, width)], dim=-1)


def _per_block(values: torch.Tensor, rows: int) -> torch.Tensor:
    return values.reshape(rows, -1)


def _decode_q4_0(b, rows):
    d = _f16(b, 0)
    return _nibbles(b[..., 2:18]), d, -8 * d, 4, 32


def _decode_q4_1(b, rows):
    return _nibbles(b[..., 4:20]), _f16(b, 0), _f16(b, 2), 4, 32


def _decode_q5_0(b, rows):
    d = _f16(b, 0)
    codes = _nibbles(b[..., 6:22]) | (_bits(b[..., 2:6], 32) << 4)
    return codes, d, -16 * d, 5, 32


def _decode_q5_1(b, rows):
    codes = _nibbles(b[..., 8:24]) | (_bits(b[..., 4:8], 32) << 4)
    return codes, _f16(b, 0), _f16(b, 2), 5, 32


def _decode_q8_0(b, rows):
    d = _f16(b, 0)
    codes = (b[..., 2:34].view(torch.int8).to(torch.int16) + 128).to(torch.uint8)
    return codes, d, -128 * d, 8, 32


def _k_scales_mins(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 8 six-bit scales and mins packed in 12 bytes (Q4_K, Q5_K)."""
    low, high, mixed = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    scales = torch.cat([low & 63, (mixed & 0x0F) | ((low >> 6) << 4)], dim=-1)
    mins = torch.cat([high & 63, (mixed >> 4) | ((high >> 6) << 4)], dim=-1)
    return scales.float(), mins.float()


def _k_low_nibbles(qs: torch.Tensor) -> torch.Tensor:
    """Q4_K/Q5_K: 128 bytes -> 256 codes; each 32-byte chunk holds two 32-code groups."""
    chunks = qs.reshape(*qs.shape[:-1], 4, 32)
    return torch.stack([chunks & 0x0F, chunks >> 4], dim=-2).reshape(*qs.shape[:-1], 256)


def _decode_q4_k(b, rows):
    d, dmin = _f16(b, 0), _f16(b, 2)
    scales, mins = _k_scales_mins(b[..., 4:16])
    return _k_low_nibbles(b[..., 16:144]), d[..., None] * scales, -dmin[..., None] * mins, 4, 32


def _decode_q5_k(b, rows):
    d, dmin = _f16(b, 0), _f16(b, 2)
    scales, mins = _k_scales_mins(b[..., 4:16])
    # Bit j of qh[l] is the fifth bit of element l of group j.
    high = _shifted(b[..., 16:48], 1) & 1  # [.., 32 l, 8 j]
    codes = _k_low_nibbles(b[..., 48:176]) | (
        high.transpose(-1, -2).reshape(*b.shape[:-1], 256) << 4
    )
    return codes, d[..., None] * scales, -dmin[..., None] * mins, 5, 32


def _decode_q6_k(b, rows):
    lead = b.shape[:-1]
    ql = b[..., 0:128].reshape(*lead, 2, 64)  # two halves of 128 elements
    qh = b[..., 128:192].reshape(*lead, 2, 32)
    low = torch.stack([ql & 0x0F, ql >> 4], dim=-2).reshape(*lead, 2, 4, 32)
    high = _shifted(qh, 2).transpose(-1, -2) & 3  # [.., 2, 4, 32]
    codes = (low | (high << 4)).reshape(*lead, 256)
    scale = _f16(b, 208)[..., None] * b[..., 192:208].view(torch.int8).float()
    return codes, scale, -32 * scale, 6, 16


_DECODERS = {
    Q.Q4_0: _decode_q4_0,
    Q.Q4_1: _decode_q4_1,
    Q.Q5_0: _decode_q5_0,
    Q.Q5_1: _decode_q5_1,
    Q.Q8_0: _decode_q8_0,
    Q.Q4_K: _decode_q4_k,
    Q.Q5_K: _decode_q5_k,
    Q.Q6_K: _decode_q6_k,
}


def decode(raw: torch.Tensor, ggml_type: GGMLQuantizationType) -> AffineCodes:
    """Raw quantized rows uint8 [rows, row_bytes] -> AffineCodes."""
    rows = raw.shape[0]
    codes, scale, offset, bits, group = _DECODERS[ggml_type](_blocks(raw, ggml_type), rows)
    return AffineCodes(
        codes.reshape(rows, -1), _per_block(scale, rows), _per_block(offset, rows), bits, group
    )


def dequantize_rows(
    raw: torch.Tensor, ggml_type: GGMLQuantizationType, n_cols: int
) -> torch.Tensor:
    """Reference dequantizer: raw rows uint8 [rows, row_bytes] -> float32 [rows, n_cols]."""
    rows = raw.shape[0]
    if ggml_type == Q.F32:
        return raw.contiguous().view(torch.float32).reshape(rows, n_cols)
    if ggml_type == Q.F16:
        return raw.contiguous().view(torch.float16).reshape(rows, n_cols).float()
    if ggml_type == Q.BF16:
        return raw.contiguous().view(torch.bfloat16).reshape(rows, n_cols).float()
    if ggml_type in QUANT_TYPES:
        return decode(raw, ggml_type).dequantize()
    raise ValueError(f"no dequantizer for {ggml_type.name}")


# Where each block keeps its fp16 scale (d) and, for the affine types, its minimum (m or
# dmin): every other byte is an integer code or sub-scale, which cannot be NaN.
_FLOAT_FIELDS = {
    Q.Q4_0: (0,),
    Q.Q4_1: (0, 2),
    Q.Q5_0: (0,),
    Q.Q5_1: (0, 2),
    Q.Q8_0: (0,),
    Q.Q4_K: (0, 2),
    Q.Q5_K: (0, 2),
    Q.Q6_K: (208,),
}


_F16_EXPONENT = 0x7C


def all_finite(raw: torch.Tensor, ggml_type: GGMLQuantizationType) -> bool:
    """Whether every value (float types) or every block scale (quantized types) of raw rows
    uint8 [rows, row_bytes] is finite. Types we do not decode count as finite."""
    if ggml_type in FLOAT_TYPES:
        dtype = {Q.F32: torch.float32, Q.F16: torch.float16, Q.BF16: torch.bfloat16}[ggml_type]
        return bool(torch.isfinite(raw.contiguous().view(dtype)).all())
    fields = _FLOAT_FIELDS.get(ggml_type, ())
    if not fields:
        return True
    blocks = _blocks(raw, ggml_type)
    # An fp16 is infinite or NaN when its 5 exponent bits are all set: bits 2-6 of its high
    # (second, little-endian) byte. One byte a scale is read, in place.
    return not any(
        bool(((blocks[..., at + 1] & _F16_EXPONENT) == _F16_EXPONENT).any()) for at in fields
    )


# ----------------------------------------------------------------------- kernel format


def to_int4(codes: AffineCodes, layout: KernelLayout | None = None) -> Int4Groups:
    """AffineCodes -> the int4 kernel's groups (with the input layout they expect).

    `layout`: an interleaved layout to hold 4-bit codes in too, so that they share one
    product with wider codes (see `shared_layout`); the high planes then carry only the
    zero's shift."""
    if layout is not None and layout.interleave and codes.bits <= 4:
        return _interleaved(_regrouped(codes, layout.interleave))
    if codes.bits <= 4 and codes.group == KERNEL_GROUP:
        # w = s*c + o = s*(c - 8) + (o + 8s)
        return Int4Groups(codes.codes, codes.scale, codes.offset + INT4_OFFSET * codes.scale)
    return _interleaved(codes)


def shared_layout(ggml_types: Iterable[GGMLQuantizationType]) -> KernelLayout | None:
    """One kernel layout that holds all these quantized types: their own where they share
    it, else the one interleaved layout among them, in which 4-bit codes fit too (at twice
    their slots). None where two different interleaved layouts are needed."""
    layouts = {layout_for(t) for t in ggml_types}
    if len(layouts) == 1:
        return next(iter(layouts))
    wide = layouts - {PLAIN}
    if len(wide) != 1 or len(layouts) != 2:
        return None
    layout = next(iter(wide))
    return layout if KERNEL_GROUP % layout.interleave == 0 else None


def _regrouped(codes: AffineCodes, group: int) -> AffineCodes:
    """The same codes with a scale and offset per `group` columns (a divisor of theirs)."""
    if codes.group == group:
        return codes
    repeat = codes.group // group
    if repeat * group != codes.group:
        raise ValueError(f"groups of {codes.group} do not split into groups of {group}")
    return AffineCodes(
        codes.codes,
        codes.scale.repeat_interleave(repeat, dim=1),
        codes.offset.repeat_interleave(repeat, dim=1),
        codes.bits,
        group,
    )


def _interleaved(codes: AffineCodes) -> Int4Groups:
    """Each source group of g columns -> one kernel group of 2g slots: g hi codes (fed 16x),
    then g lo codes (fed x), sharing the group's scale s and a zero z.

    With hi' = hi + h (h per group): 16*(hi' - 8) + (lo - 8) = c + 16h - 136, and the zero
    term reaches all 2g slots, whose inputs sum to 17 * sum(x). So
    s*c + o = s*(16*(hi' - 8) + (lo - 8)) + 17*z with z = (o + (136 - 16h)*s) / 17;
    h is chosen to bring that nearest zero while hi' stays within 0..15.
    """
    rows, cols = codes.codes.shape
    group = codes.group
    hi = (codes.codes >> 4).view(rows, -1, group)
    lo = (codes.codes & 0x0F).view(rows, -1, group)
    hi_max = (1 << max(codes.bits - 4, 0)) - 1
    ratio = torch.where(codes.scale != 0, codes.offset / codes.scale, torch.zeros_like(codes.scale))
    shift = torch.round((ratio + 136) / 16).clamp(0, 15 - hi_max)
    constant = codes.offset + (136 - 16 * shift) * codes.scale
    hi = hi + shift.to(torch.uint8)[..., None]
    slots = torch.cat([hi, lo], dim=-1).reshape(rows, -1)
    layout = KernelLayout(group=2 * group, interleave=group)
    return Int4Groups(slots, codes.scale, constant / 17, layout)


def expand_input(x: torch.Tensor, layout: KernelLayout) -> torch.Tensor:
    """The kernel's input: x [tokens, cols], or per interleaved group [16 * x_g, x_g]."""
    if not layout.interleave:
        return x
    # Built from x alone: a host-side constant would be a host-to-device copy in every step,
    # which a CUDA graph cannot capture.
    grouped = x.view(x.shape[0], -1, 1, layout.interleave)
    return torch.cat([grouped * 16.0, grouped], dim=2).reshape(x.shape[0], -1)


def effective_weight(groups: Int4Groups) -> torch.Tensor:
    """Reference: the [rows, cols] weights the kernel computes with its input layout."""
    kernel_weights = groups.dequantize()
    width = groups.layout.interleave
    if not width:
        return kernel_weights
    rows = kernel_weights.shape[0]
    pairs = kernel_weights.view(rows, -1, 2, width)
    return (16 * pairs[:, :, 0] + pairs[:, :, 1]).reshape(rows, -1)
