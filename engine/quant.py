"""GGML block formats as torch tensors.

Two jobs:
* pure-torch dequantizers for raw GGML rows (the reference every kernel is tested against, and
  the path for embedding look-ups, which only touch a few rows);
* conversion of 4-bit and 8-bit blocks into `Int4Groups`: 4-bit codes with one fp32 scale and
  zero per group of 32, which is exactly what torch's int4-packed matmul computes
  (w = (q - 8) * scale + zero).

Block layouts (all little-endian, groups of 32 along a row):
* Q4_0: fp16 d, 16 bytes of nibbles;            w = d * (q - 8)
* Q4_1: fp16 d, fp16 m, 16 bytes of nibbles;    w = d * q + m
* Q8_0: fp16 d, 32 int8;                        w = d * q
In a 16-byte nibble run, element j < 16 is the low nibble of byte j, element j + 16 the high one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

GROUP_SIZE = 32
INT4_OFFSET = 8  # torch's int4 ops subtract 8 from every code

Q = GGMLQuantizationType
INT4_TYPES = frozenset({Q.Q4_0, Q.Q4_1})
# Q8_0 is held as two 4-bit planes (see `q8_0_to_int4_pair`), so it stays 8 bits a weight.
LINEAR_TYPES = frozenset({Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.F32, Q.F16, Q.BF16})
FLOAT_TYPES = frozenset({Q.F32, Q.F16, Q.BF16})


@dataclass
class Int4Groups:
    """A weight matrix [rows, cols] as 4-bit codes with a scale and zero per group of 32."""

    codes: torch.Tensor  # uint8 [rows, cols], values 0..15
    scale: torch.Tensor  # float32 [rows, cols // 32]
    zero: torch.Tensor  # float32 [rows, cols // 32]

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)  # type: ignore[return-value]

    def dequantize(self) -> torch.Tensor:
        """Reference: the fp32 weights these groups encode."""
        rows, cols = self.codes.shape
        grouped = self.codes.view(rows, cols // GROUP_SIZE, GROUP_SIZE).float()
        weights = (grouped - INT4_OFFSET) * self.scale[..., None] + self.zero[..., None]
        return weights.view(rows, cols)

    def slice_rows(self, start: int, end: int) -> Int4Groups:
        return Int4Groups(self.codes[start:end], self.scale[start:end], self.zero[start:end])

    def pad_rows(self, n: int, code: int) -> Int4Groups:
        """Append n rows of `code` with zero scale and zero: they decode to 0."""
        return Int4Groups(
            torch.nn.functional.pad(self.codes, (0, 0, 0, n), value=code),
            torch.nn.functional.pad(self.scale, (0, 0, 0, n)),
            torch.nn.functional.pad(self.zero, (0, 0, 0, n)),
        )

    @staticmethod
    def concat_rows(parts: list[Int4Groups]) -> Int4Groups:
        if len(parts) == 1:
            return parts[0]
        """Stack several weights that share an input, e.g. Q, K and V, into one matrix."""
        return Int4Groups(
            torch.cat([p.codes for p in parts]),
            torch.cat([p.scale for p in parts]),
            torch.cat([p.zero for p in parts]),
        )


def row_bytes(ggml_type: GGMLQuantizationType, n_cols: int) -> int:
    block, size = GGML_QUANT_SIZES[ggml_type]
    return n_cols // block * size


def _blocks(raw: torch.Tensor, ggml_type: GGMLQuantizationType) -> torch.Tensor:
    """View raw rows uint8 [rows, row_bytes] as [rows, n_blocks, block_bytes]."""
    block_bytes = GGML_QUANT_SIZES[ggml_type][1]
    return raw.reshape(raw.shape[0], -1, block_bytes)


def _fp16_at(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    return blocks[..., offset : offset + 2].contiguous().view(torch.float16).squeeze(-1).float()


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., 16] -> uint8 [..., 32]: low nibbles first, then high nibbles."""
    return torch.cat([packed & 0x0F, packed >> 4], dim=-1)


def int4_groups_from_raw(raw: torch.Tensor, ggml_type: GGMLQuantizationType) -> Int4Groups:
    """Q4_0 / Q4_1 rows -> Int4Groups, exactly (fp16 block scales fit fp32)."""
    blocks = _blocks(raw, ggml_type)
    rows = raw.shape[0]
    d = _fp16_at(blocks, 0)
    if ggml_type == Q.Q4_0:
        codes = _nibbles(blocks[..., 2:18])
        zero = torch.zeros_like(d)
    elif ggml_type == Q.Q4_1:
        codes = _nibbles(blocks[..., 4:20])
        # d*q + m == d*(q - 8) + (m + 8d)
        zero = _fp16_at(blocks, 2) + INT4_OFFSET * d
    else:
        raise ValueError(f"not a 4-bit type: {ggml_type.name}")
    return Int4Groups(codes.reshape(rows, -1), d, zero)


def q8_0_to_int4_pair(raw: torch.Tensor) -> Int4Groups:
    """Q8_0 rows [rows, cols] -> Int4Groups [rows, 2*cols], exactly.

    With u = q + 128 split into hi = u >> 4 and lo = u & 15, d*q = 16d*(hi - 8) + d*(lo - 8) + 8d.
    The hi plane fills the first `cols` columns and the lo plane the rest, so multiplying by
    [x, x] gives W @ x with one int4 kernel call and no precision lost.
    """
    blocks = _blocks(raw, Q.Q8_0)
    rows = raw.shape[0]
    d = _fp16_at(blocks, 0)
    unsigned = (blocks[..., 2:34].view(torch.int8).to(torch.int16) + 128).to(torch.uint8)
    hi, lo = unsigned >> 4, unsigned & 0x0F
    codes = torch.cat([hi.reshape(rows, -1), lo.reshape(rows, -1)], dim=1)
    scale = torch.cat([16 * d, d], dim=1)
    zero = torch.cat([torch.zeros_like(d), INT4_OFFSET * d], dim=1)
    return Int4Groups(codes, scale, zero)


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
    if ggml_type in INT4_TYPES:
        return int4_groups_from_raw(raw, ggml_type).dequantize()
    if ggml_type == Q.Q8_0:
        blocks = _blocks(raw, Q.Q8_0)
        d = _fp16_at(blocks, 0)
        values = blocks[..., 2:34].contiguous().view(torch.int8).float()
        return (values * d[..., None]).reshape(rows, n_cols)
    raise ValueError(f"no dequantizer for {ggml_type.name}")
