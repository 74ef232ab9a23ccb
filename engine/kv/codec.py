"""The KV cache's codecs: fp32 keys and values into a KVType's storage (kv_types.py says the
layout) and back. The torch functions are the reference and the path off the CPU (a GPU, a
graph-captured step); on the CPU the native library does the same, bit for bit."""

from __future__ import annotations

import functools

import numpy as np
import torch

from .types import BLOCK, F32, KVType

F16_MAX = 65504.0


def storage_dtype(kind: KVType) -> torch.dtype:
    return getattr(torch, kind.storage)


def encode(
    kind: KVType, x: torch.Tensor, rotated: bool | None = None, matrix: torch.Tensor | None = None
) -> torch.Tensor:
    """fp32 [..., head_dim] -> storage [..., width], in torch (any device). `rotated` stores
    x times the Hadamard matrix (default: as the cache does, for the quantized types), by
    `rotate`'s butterflies or, given `matrix` (`rotation_matrix`), by one product."""
    if kind is F32:
        return x.float()
    if not kind.blocked:
        return x.to(storage_dtype(kind))
    rotated = kind.blocked if rotated is None else rotated
    x = _rotated(x.float(), matrix) if rotated else x.float()
    return _encode_q8(x) if kind.name == "q8" else _encode_q4(x)


def decode(
    kind: KVType,
    stored: torch.Tensor,
    head_dim: int,
    rotated: bool | None = None,
    matrix: torch.Tensor | None = None,
) -> torch.Tensor:
    """storage [..., width] -> fp32 [..., head_dim], in torch (any device)."""
    if not kind.blocked:
        return stored.float()
    rotated = kind.blocked if rotated is None else rotated
    values = _decode_q8(stored, head_dim) if kind.name == "q8" else _decode_q4(stored, head_dim)
    return _rotated(values, matrix) if rotated else values


@functools.cache
def rotation_matrix(head_dim: int, device: torch.device) -> torch.Tensor:
    """fp32 [head_dim, head_dim]: `rotate` as a matrix, x @ it. On a GPU one product does
    what the butterflies take 3 kernels a level for (18 for heads of 64), in every layer's
    encode and decode of every step; the result differs from them only in rounding. One a
    head size and device, shared by every cache (read only)."""
    return rotate(torch.eye(head_dim)).to(device)


def _rotated(x: torch.Tensor, matrix: torch.Tensor | None) -> torch.Tensor:
    return rotate(x) if matrix is None else x @ matrix


def rotate(x: torch.Tensor) -> torch.Tensor:
    """x [..., d] times the normalised Hadamard matrix (block-diagonal, blocks of the largest
    power of two dividing d), which is its own inverse. The quantized types are stored rotated
    (kv_types.py says why); these butterflies, in this order, give the native codec's bits."""
    d = x.shape[-1]
    size = d & -d
    lead = x.shape[:-1]
    y = x.reshape(*lead, d // size, size)
    span = 1
    while span < size:
        pairs = y.reshape(*lead, d // size, size // (2 * span), 2, span)
        a, b = pairs[..., 0, :], pairs[..., 1, :]
        y = torch.stack([a + b, a - b], dim=-2).reshape(*lead, d // size, size)
        span *= 2
    return y.reshape(x.shape) * _ROTATION_SCALES[size]


# 1/sqrt(size) for each block size (a power of two), in float32 arithmetic as the native codec
# computes it, kept as Python numbers: a tensor made in `rotate` would be copied from the host
# in every decode step, which a CUDA graph cannot capture.
_ROTATION_SCALES = {1 << i: float(np.float32(1.0) / np.sqrt(np.float32(1 << i))) for i in range(16)}


def _blocks(x: torch.Tensor) -> torch.Tensor:
    return x.float().reshape(*x.shape[:-1], x.shape[-1] // BLOCK, BLOCK)


def _f16_bytes(values: torch.Tensor) -> torch.Tensor:
    """fp32 [..., n] -> f16 [..., n] seen as bytes [..., 2n]."""
    return values.clamp(-F16_MAX, F16_MAX).half().view(torch.uint8)


def _encode_q8(x: torch.Tensor) -> torch.Tensor:
    blocks = _blocks(x)
    scale_bytes = _f16_bytes(blocks.abs().amax(-1) / 127.0)
    scale = scale_bytes.view(torch.float16).float()[..., None]
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = torch.where(scale > 0, torch.round(blocks / safe), torch.zeros_like(blocks))
    codes = codes.clamp(-127, 127).to(torch.int8).view(torch.uint8).flatten(-2)
    return torch.cat([codes, scale_bytes], dim=-1)


def _decode_q8(stored: torch.Tensor, head_dim: int) -> torch.Tensor:
    # Views, not copies: the codes and scales are reinterpreted where they lie (a copy of
    # each would be a pass over the whole cache in every layer of a graph-captured step).
    codes = stored[..., :head_dim].view(torch.int8).float()
    scale = stored[..., head_dim:].view(torch.float16).float()
    blocks = codes.reshape(*codes.shape[:-1], -1, BLOCK) * scale[..., None]
    return blocks.flatten(-2)


def _encode_q4(x: torch.Tensor) -> torch.Tensor:
    blocks = _blocks(x)
    low, high = blocks.amin(-1), blocks.amax(-1)
    min_bytes = _f16_bytes(low)
    low = min_bytes.view(torch.float16).float()[..., None]
    scale_bytes = _f16_bytes((high[..., None] - low)[..., 0] / 15.0)
    scale = scale_bytes.view(torch.float16).float()[..., None]
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = torch.where(scale > 0, torch.round((blocks - low) / safe), torch.zeros_like(blocks))
    codes = codes.clamp(0, 15).to(torch.uint8)
    packed = codes[..., : BLOCK // 2] | (codes[..., BLOCK // 2 :] << 4)
    return torch.cat([packed.flatten(-2), scale_bytes, min_bytes], dim=-1)


def _decode_q4(stored: torch.Tensor, head_dim: int) -> torch.Tensor:
    n_blocks = head_dim // BLOCK
    packed = stored[..., : head_dim // 2].reshape(*stored.shape[:-1], n_blocks, BLOCK // 2)
    codes = torch.cat([packed & 15, packed >> 4], dim=-1).float()
    tail = stored[..., head_dim // 2 :].view(torch.float16).float()
    scale, low = tail[..., :n_blocks, None], tail[..., n_blocks:, None]
    return (codes * scale + low).flatten(-2)


TILE_ROWS = 32  # tokens a q4 tile (kv_types.py)


def encode_tiles(x: torch.Tensor) -> torch.Tensor:
    """fp32 [..., tiles * TILE_ROWS, head_dim] -> q4 tiles [..., tiles * TILE_ROWS, width]
    (native/kv_codec.h, "q4 tiles"): per tile and channel a 4-bit code per token, an f16
    scale and an f16 minimum over the tile's tokens, the side table spread over its rows."""
    *lead, tokens, d = x.shape
    tiles = x.float().reshape(*lead, tokens // TILE_ROWS, TILE_ROWS, d)
    low_bytes = _f16_bytes(tiles.amin(-2))  # [..., tiles, 2d]
    low = low_bytes.view(torch.float16).float()[..., None, :]
    scale_bytes = _f16_bytes((tiles.amax(-2, keepdim=True) - low)[..., 0, :] / 15.0)
    scale = scale_bytes.view(torch.float16).float()[..., None, :]
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = torch.where(scale > 0, torch.round((tiles - low) / safe), torch.zeros_like(tiles))
    blocks = codes.clamp(0, 15).to(torch.uint8).reshape(*codes.shape[:-1], d // BLOCK, BLOCK)
    packed = (blocks[..., : BLOCK // 2] | (blocks[..., BLOCK // 2 :] << 4)).flatten(-2)
    side = torch.cat([scale_bytes, low_bytes], dim=-1)  # [..., tiles, 4d]: row r holds r's share
    side = side.reshape(*side.shape[:-1], TILE_ROWS, d // 8)
    return torch.cat([packed, side], dim=-1).reshape(*lead, tokens, d // 2 + d // 8)


def tile_tables(stored: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """q4 tiles [..., tiles * TILE_ROWS, width] -> (codes [..., tokens, head_dim] as uint8,
    per tile (scale, minimum) fp32 [..., tiles, 2, head_dim])."""
    *lead, tokens, _ = stored.shape
    d = head_dim
    packed = stored[..., : d // 2].reshape(*lead, tokens, d // BLOCK, BLOCK // 2)
    codes = torch.cat([packed & 15, packed >> 4], dim=-1).reshape(*lead, tokens, d)
    side = stored[..., d // 2 :].reshape(*lead, tokens // TILE_ROWS, TILE_ROWS * d // 8)
    tables = side.contiguous().view(torch.float16).float().reshape(*lead, -1, 2, d)
    return codes, tables


def decode_tiles(stored: torch.Tensor, head_dim: int) -> torch.Tensor:
    """q4 tiles [..., tiles * TILE_ROWS, width] -> fp32 [..., tiles * TILE_ROWS, head_dim]."""
    codes, tables = tile_tables(stored, head_dim)
    per_token = tables.repeat_interleave(TILE_ROWS, dim=-3)  # [..., tokens, 2, d]
    return codes.float() * per_token[..., 0, :] + per_token[..., 1, :]


class KVCodec:
    """One cache's way into and out of its storage: the native codec for quantized rows on
    the CPU (the same bits, without a dozen small torch ops per layer and step), torch
    elsewhere. f32 passes through untouched. Quantized rows are stored rotated, and the
    attention kernel rotates queries and outputs to match."""

    ROTATED = 8  # added to the kind's code for the native codec: rows stored rotated
    TILES = 5  # the native attention's type number for keys stored as q4 tiles

    def __init__(self, kind: KVType, head_dim: int, device: torch.device, keys: bool = False):
        kind.check(head_dim)
        self.kind, self.head_dim, self.device = kind, head_dim, device
        # q4 keys are stored in tiles (kv_types.py): the cache writes them through its
        # KeyTiles, and this codec passes them through as fp32.
        self.tiled = keys and kind.tiled_keys
        self.rotated = kind.blocked and not self.tiled
        self.width = kind.width(head_dim)
        self.dtype = storage_dtype(kind)
        self._native_code = kind.code + (self.ROTATED if self.rotated else 0)
        self.native = None
        # The rotation as a matrix: the torch path's product off the CPU. The Triton kernels
        # take it as the sign that rows are stored rotated (they turn rows in butterflies).
        self.rotation = rotation_matrix(head_dim, device) if self.rotated else None
        self.matrix = None  # the rotation as one product in this codec's torch path: off the CPU
        if kind.blocked and device.type == "cpu":
            from ..platform.kernels import cpu_kv_codec  # lazily: it loads the native library

            self.native = cpu_kv_codec()
        else:
            self.matrix = self.rotation

    @property
    def kernel_code(self) -> int:
        """The native attention's type number for rows stored this way."""
        return self.TILES if self.tiled else self.kind.code

    def empty(self, heads: int, tokens: int) -> torch.Tensor:
        """Zeroed storage [1, heads, tokens, width]."""
        return torch.zeros((1, heads, tokens, self.width), dtype=self.dtype, device=self.device)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """fp32 [1, heads, tokens, head_dim] -> storage [1, heads, tokens, width] (tiled keys:
        fp32 as they are, for the cache's KeyTiles)."""
        if self.kind is F32 or self.tiled:
            return x
        if self.native is not None and x.device.type == "cpu":
            return self.native.encode(self._native_code, x.float(), self.width, self.dtype)
        return encode(self.kind, x, self.rotated, self._matrix())

    def decode(self, stored: torch.Tensor) -> torch.Tensor:
        """storage [1, heads, tokens, width] -> fp32 [1, heads, tokens, head_dim] (not for
        tiled keys: their cache's KeyTiles decodes them)."""
        if self.tiled:
            raise ValueError("tiled keys are decoded by their cache")
        if self.kind is F32:
            return stored
        if self.native is not None and stored.device.type == "cpu":
            return self.native.decode(self._native_code, stored, self.head_dim)
        return decode(self.kind, stored, self.head_dim, self.rotated, self._matrix())

    def _matrix(self) -> torch.Tensor | None:
        """The rotation as one product, except under torch.compile, where the butterflies
        fuse into the kernels around them and the product would be a kernel of its own."""
        return None if torch.compiler.is_compiling() else self.matrix
