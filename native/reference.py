"""Plain-torch references for the native kernels: what each computes, for the tests.

Computed in float64 from x as the kernel's path takes it (rounded to bf16 on the AVX-512
path, quantized to int8 per run of 16 columns on the AVX2 path) and from scales and zeros
rounded to bf16 (their storage), so the only difference left is the kernel's own fp32
arithmetic.
"""

from __future__ import annotations

import torch

CODE_OFFSET = 8
INT8_MAX = 127.0
BF16, INT8 = "bf16", "int8"  # how a path takes x


def int4_weight(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """w = (code - 8) * scale + zero per group, float64 [rows, k]."""
    group = codes.shape[1] // scale.shape[1]
    scale = scale.to(torch.bfloat16).double().repeat_interleave(group, dim=1)
    zero = zero.to(torch.bfloat16).double().repeat_interleave(group, dim=1)
    return (codes.double() - CODE_OFFSET) * scale + zero


def kernel_input(x: torch.Tensor, group: int, activations: str = BF16) -> torch.Tensor:
    """x as the kernel multiplies it, float64: bf16-rounded, or q * dx with q = round(x / dx)
    an int8 and dx = max |x| / 127 per run of columns (fp32 steps, as the kernel)."""
    if activations == BF16:
        return x.to(torch.bfloat16).double()
    runs = x.float().reshape(x.shape[0], -1, run_columns(group))
    step = runs.abs().amax(dim=-1, keepdim=True) / INT8_MAX
    q = torch.where(step > 0, torch.round(runs / step), torch.zeros_like(runs))
    return (q.double() * step.double()).reshape(x.shape)


def run_columns(group: int) -> int:
    """Columns sharing one int8 step: 16, or 8 in a group of a multiple of 8 only."""
    return 16 if group % 16 == 0 else 8


def int4_matmul(
    x: torch.Tensor,
    codes: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor,
    activations: str = BF16,
) -> torch.Tensor:
    """y = x @ w.T, float64 [M, rows]."""
    group = codes.shape[1] // scale.shape[1]
    return kernel_input(x, group, activations) @ int4_weight(codes, scale, zero).T


def gated_int4_matmul(
    x: torch.Tensor,
    codes: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor,
    activations: str = BF16,
) -> torch.Tensor:
    """silu(x @ gate.T) * (x @ up.T) for w = gate rows then up rows, float64 [M, rows / 2]."""
    y = int4_matmul(x, codes, scale, zero, activations)
    gate, up = y.chunk(2, dim=1)
    return torch.nn.functional.silu(gate) * up


def error_bound(
    x: torch.Tensor,
    codes: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor,
    activations: str = BF16,
) -> torch.Tensor:
    """A bound on an fp32 accumulation's error for each output: k * 2^-23 * sum |w x|
    (twice the textbook recursive-summation bound k * u, u = 2^-24). A wrong code, scale or
    row moves an output by about one |w x| term, far above this."""
    group = codes.shape[1] // scale.shape[1]
    magnitude = kernel_input(x, group, activations).abs() @ int4_weight(codes, scale, zero).abs().T
    return codes.shape[1] * 2.0**-23 * magnitude


QUERY_BLOCK = 32  # values per block of a query quantized for q8 and q4 keys


def quantized_query(rotated: torch.Tensor) -> torch.Tensor:
    """What the attention kernel dots with q8 and q4 keys in place of a (rotated) fp32 query
    [..., d]: blocks of 32 as int8 codes, step = max |x| / 127 in fp32, rounded half to
    even; returned dequantized, in float64."""
    blocks = rotated.float().reshape(*rotated.shape[:-1], -1, QUERY_BLOCK)
    step = blocks.abs().amax(-1, keepdim=True) / 127.0
    codes = torch.where(step > 0, (blocks / step).round(), torch.zeros_like(blocks))
    return (codes.clamp(-127, 127).double() * step.double()).reshape(rotated.shape)


def tiled_key_scores(query: torch.Tensor, codes: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Scores (before the softmax scale) of one q4 tile's keys against a query head, as the
    kernel computes them, in float64: the query times the tile's channel scales (fp32),
    quantized as a query over q8 keys is, dotted with the codes, plus the query dotted with
    the minimums. query [d], codes [n, d], table [2, d] (scales, minimums)."""
    scaled = quantized_query(query.float() * table[0].float())
    return codes.double() @ scaled + query.double() @ table[1].double()


def attend_rows(
    queries: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    scale: float,
    lengths: list[int] | None = None,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """What `miniapp_attend_rows` computes, in float64: queries [rows, heads, head_dim] over
    keys and values [kv_heads, tokens, head_dim]; row r sees its first lengths[r] keys, or
    those mask[r] marks. A row that sees nothing gives zeros."""
    rows, n_heads, _ = queries.shape
    group = n_heads // keys.shape[0]
    out = torch.zeros(queries.shape, dtype=torch.float64)
    for row in range(rows):
        visible = mask[row] if mask is not None else torch.arange(keys.shape[1]) < lengths[row]
        if not visible.any():
            continue
        for head in range(n_heads):
            k = keys[head // group][visible].double()
            v = values[head // group][visible].double()
            weights = torch.softmax(k @ queries[row, head].double() * scale, dim=0)
            out[row, head] = weights @ v
    return out


def attend_sequences(
    queries: torch.Tensor,
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
    scale: float,
    masks: list[torch.Tensor | None],
) -> torch.Tensor:
    """What `miniapp_attend_sequences` computes: row r of queries over keys[r] and values[r]
    ([kv_heads, tokens_r, head_dim]), seeing what masks[r] marks (all keys for None)."""
    rows = []
    for row, (k, v, mask) in enumerate(zip(keys, values, masks, strict=True)):
        visible = (
            mask.reshape(1, -1) if mask is not None else torch.ones(1, k.shape[1], dtype=torch.bool)
        )
        rows.append(attend_rows(queries[row : row + 1], k, v, scale, mask=visible))
    return torch.cat(rows)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """What `miniapp_add_rms_norm` computes after its add, in float64: x / sqrt(mean(x^2) +
    eps) * weight over the last dimension."""
    x = x.double()
    normed = x / torch.sqrt(x.square().mean(-1, keepdim=True) + eps)
    return normed if weight is None else normed * weight.double()


def rope(
    x: torch.Tensor,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    rotary_dim: int,
    interleaved: bool,
) -> torch.Tensor:
    """What `miniapp_rope` computes, from first principles in float64: x [rows, heads,
    head_dim] with each pair of dimensions (2i, 2i + 1) if `interleaved`, else (i, i +
    rotary_dim / 2), turned by position * inv_freq[i]; dimensions past rotary_dim kept."""
    x = x.double().clone()
    angles = positions.double()[:, None] * inv_freq.double()[None, :]  # [rows, rotary_dim / 2]
    cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
    pairs = torch.arange(rotary_dim // 2)
    first, second = (2 * pairs, 2 * pairs + 1) if interleaved else (pairs, pairs + rotary_dim // 2)
    a, b = x[..., first].clone(), x[..., second].clone()
    x[..., first] = a * cos - b * sin
    x[..., second] = a * sin + b * cos
    return x


# ----------------------------------------------------------------- GGML blocks (ggml_dot.cpp)

SMALL_BLOCK, SUPER_BLOCK = 32, 256


def ggml_input(x: torch.Tensor, super_blocks: bool) -> torch.Tensor:
    """x as the GGML kernel multiplies it, float64: q * d with q = round(x * (1 / d)) an int8
    and d = max |x| / 127 (fp32) per block of 32 columns, or of 256 for the K types. The
    kernel multiplies by the fp32 reciprocal, as here: dividing instead rounds a value next
    to a half the other way now and then."""
    block = SUPER_BLOCK if super_blocks else SMALL_BLOCK
    blocks = x.float().reshape(x.shape[0], -1, block)
    step = blocks.abs().amax(dim=-1, keepdim=True) / INT8_MAX
    inverse = torch.where(step > 0, 1.0 / step, torch.zeros_like(step))
    q = torch.round(blocks * inverse)
    return (q.double() * step.double()).reshape(x.shape)


def ggml_matmul(weights: list[tuple[torch.Tensor, bool]], x: torch.Tensor) -> torch.Tensor:
    """x @ W.T in float64 for W stacked from parts (dequantized weights [rows, k], whether the
    part's type has super-blocks), each part multiplying x as the kernel quantizes it for
    that type."""
    return torch.cat([ggml_input(x, super_blocks) @ w.double().T for w, super_blocks in weights], 1)
