"""The GGML block kernel (native/ggml_dot.cpp) against its float64 reference, for every type
it reads: row by row, stacked, biased and gated, on every path this CPU has."""

from __future__ import annotations

import pytest
import torch
from gguf.constants import GGML_QUANT_SIZES
from gguf.constants import GGMLQuantizationType as Q

from miniapp.engine.ops.quant import _FLOAT_FIELDS, dequantize_rows
from miniapp.native import ggml, int4, reference
from miniapp.native.ggml import ISA_AVX2, ISA_AVX512, PackedGgml

TYPES = [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K]
POISON = float("nan")
# The kernel's fp32 sums of exact integer block products, against float64: a few ulps of
# the output's scale. A wrong code, scale or offset is off by far more.
TOLERANCE = 2e-6


@pytest.fixture(scope="module")
def library():
    return int4.load()


def paths(library) -> list[int]:
    return [isa for isa in (ISA_AVX2, ISA_AVX512) if ggml.cpu_has(library, isa)]


def random_blocks(qtype: Q, rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    """Random codes with finite, moderate fp16 scales (uint8 [rows, row_bytes])."""
    generator = torch.Generator().manual_seed(seed)
    per_block, size = GGML_QUANT_SIZES[qtype]
    blocks = torch.randint(
        0, 256, (rows, cols // per_block, size), generator=generator, dtype=torch.uint8
    )
    for at in _FLOAT_FIELDS[qtype]:
        scale = torch.rand(rows, cols // per_block, generator=generator) * 0.02 + 0.001
        blocks[..., at : at + 2] = scale.half().view(torch.uint8).view(rows, -1, 2)
    return blocks.reshape(rows, -1).contiguous()


def expected(parts: list[tuple[torch.Tensor, Q]], x: torch.Tensor, cols: int) -> torch.Tensor:
    weights = [
        (dequantize_rows(raw, qtype, cols), GGML_QUANT_SIZES[qtype][0] == 256)
        for raw, qtype in parts
    ]
    return reference.ggml_matmul(weights, x)


def assert_close(y: torch.Tensor, want: torch.Tensor) -> None:
    assert not torch.isnan(y).any()
    error = (y.double() - want).abs().max() / want.abs().max()
    assert error <= TOLERANCE, error


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("m", [1, 3, 9, 20])
def test_each_type_matches_its_float64_reference(library, qtype, m):
    cols = 512
    raw = random_blocks(qtype, 37, cols)
    x = torch.randn(m, cols)
    want = expected([(raw, qtype)], x, cols)
    for isa in paths(library):
        out = torch.full((m, 37), POISON)
        PackedGgml(library, [(raw, qtype)], cols, isa=isa).forward(x, out=out)
        assert_close(out, want)


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q5_0, Q.Q8_0], ids=lambda q: q.name)
def test_an_odd_number_of_blocks(library, qtype):
    """The AVX-512 path takes two 32-weight blocks a step; a row of 3 ends on a lone one."""
    raw = random_blocks(qtype, 20, 96)
    x = torch.randn(3, 96)
    want = expected([(raw, qtype)], x, 96)
    for isa in paths(library):
        assert_close(PackedGgml(library, [(raw, qtype)], 96, isa=isa)(x), want)


@pytest.mark.parametrize("qtype", [Q.Q5_0, Q.Q4_K, Q.Q6_K], ids=lambda q: q.name)
def test_a_row_is_the_same_bits_alone_and_in_a_batch_on_every_path(library, qtype):
    """Verification and batching need each row exactly as its own decode step gives it. The
    paths apply offsets in different orders (one process runs one path): they agree to
    rounding."""
    cols = 768
    raw = random_blocks(qtype, 50, cols, seed=1)
    x = torch.randn(13, cols)
    results = []
    for isa in paths(library):
        weight = PackedGgml(library, [(raw, qtype)], cols, isa=isa)
        together = weight(x)
        alone = torch.cat([weight(x[r : r + 1]) for r in range(13)])
        assert torch.equal(together, alone)
        results.append(together)
    for other in results[1:]:
        assert_close(other, results[0].double())


def test_bf16_input_is_read_as_its_values(library):
    cols = 256
    raw = random_blocks(Q.Q4_K, 16, cols)
    weight = PackedGgml(library, [(raw, Q.Q4_K)], cols)
    x = torch.randn(2, cols).bfloat16()
    assert torch.equal(weight(x), weight(x.float()))


def test_stacked_parts_of_mixed_types_with_a_bias(library):
    """Q|K|V of a Q4_K_M file: Q and K in Q4_K, V in Q6_K, one bias over all rows."""
    cols = 256
    parts = [
        (random_blocks(t, r, cols, seed=r), t)
        for t, r in ((Q.Q4_K, 32), (Q.Q4_K, 16), (Q.Q6_K, 16))
    ]
    bias = torch.randn(64)
    x = torch.randn(5, cols)
    y = PackedGgml(library, parts, cols, bias=bias)(x)
    assert_close(y, expected(parts, x, cols) + bias.double())


def test_a_gated_weight_gives_silu_of_the_gate_times_up(library):
    cols = 256
    gate, up = random_blocks(Q.Q4_K, 24, cols, seed=2), random_blocks(Q.Q4_K, 24, cols, seed=3)
    bias = torch.randn(48)
    x = torch.randn(4, cols)
    y = PackedGgml(library, [(gate, Q.Q4_K), (up, Q.Q4_K)], cols, bias=bias, gated=True)(x)
    both = expected([(gate, Q.Q4_K), (up, Q.Q4_K)], x, cols) + bias.double()
    want = torch.nn.functional.silu(both[:, :24]) * both[:, 24:]
    assert y.shape == (4, 24)
    assert_close(y, want)


def test_the_weight_is_read_in_place(library):
    """No copy: the kernel reads the tensor it was given (a file's memory map, in use)."""
    cols = 256
    raw = random_blocks(Q.Q8_0, 16, cols)
    weight = PackedGgml(library, [(raw, Q.Q8_0)], cols)
    x = torch.randn(1, cols)
    before = weight(x)
    raw.view(16, -1, 34)[:, :, 2:] = 0  # every code of every block (bytes 0-1: the scale)
    assert weight(x).abs().max() <= 1e-5 * before.abs().max()  # zero, up to rounding


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda lib: PackedGgml(lib, [(random_blocks(Q.Q4_K, 4, 256), Q.Q4_K)], 512), "match"),
        (lambda lib: PackedGgml(lib, [(random_blocks(Q.Q4_K, 4, 256), Q.Q4_K)], 128), "read"),
        (
            lambda lib: PackedGgml(lib, [(torch.zeros(4, 64, dtype=torch.uint8), Q.Q2_K)], 256),
            "read",
        ),
        (
            lambda lib: PackedGgml(
                lib, [(random_blocks(Q.Q8_0, 4, 64), Q.Q8_0)], 64, bias=torch.zeros(5)
            ),
            "bias",
        ),
        (
            lambda lib: PackedGgml(lib, [(random_blocks(Q.Q8_0, 4, 64), Q.Q8_0)], 64, gated=True),
            "gated",
        ),
    ],
)
def test_weights_the_kernel_cannot_read_are_refused_by_name(library, make, message):
    with pytest.raises(ValueError, match=message):
        make(library)


def test_x_of_the_wrong_width_is_refused(library):
    weight = PackedGgml(library, [(random_blocks(Q.Q8_0, 4, 64), Q.Q8_0)], 64)
    with pytest.raises(ValueError, match="columns"):
        weight(torch.randn(1, 32))


# ------------------------------------------------------------------ interleaved groups

INTERLEAVED_TYPES = [Q.Q4_K, Q.Q6_K, Q.Q5_0, Q.Q8_0]


@pytest.mark.parametrize("qtype", INTERLEAVED_TYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("m", [1, 3, 6, 20])
def test_rows_interleaved_eight_at_a_time_match_the_reference(library, qtype, m):
    cols = 512
    raw = random_blocks(qtype, 48, cols, seed=4)
    x = torch.randn(m, cols)
    want = expected([(raw, qtype)], x, cols)
    for isa in paths(library):
        weight = PackedGgml(library, [(raw, qtype)], cols, isa=isa, interleave=True)
        assert weight.interleaved and weight.nbytes == raw.numel()
        out = torch.full((m, 48), POISON)
        weight.forward(x, out=out)
        assert_close(out, want)


@pytest.mark.parametrize("qtype", INTERLEAVED_TYPES, ids=lambda q: q.name)
def test_an_interleaved_row_is_the_same_bits_alone_and_in_a_batch(library, qtype):
    """Large enough for both threads, split on a group boundary."""
    cols = 2048
    raw = random_blocks(qtype, 104, cols, seed=5)
    x = torch.randn(11, cols)
    for isa in paths(library):
        weight = PackedGgml(library, [(raw, qtype)], cols, isa=isa, interleave=True)
        together = weight(x)
        assert torch.equal(together, torch.cat([weight(x[r : r + 1]) for r in range(11)]))
        assert_close(together, expected([(raw, qtype)], x, cols))


def test_interleaved_and_plain_parts_stack_with_a_bias(library):
    """Q|K|V with V of 12 rows: Q and K interleave, V (not whole groups) stays as it is."""
    cols = 256
    parts = [
        (random_blocks(t, r, cols, seed=r), t)
        for t, r in ((Q.Q4_K, 32), (Q.Q8_0, 16), (Q.Q6_K, 12))
    ]
    bias = torch.randn(60)
    x = torch.randn(7, cols)
    weight = PackedGgml(library, parts, cols, bias=bias, interleave=True)
    assert weight.shape.types == (112, 108, 14)
    assert_close(weight(x), expected(parts, x, cols) + bias.double())


def test_an_interleaved_gated_weight(library):
    cols = 256
    gate, up = random_blocks(Q.Q6_K, 24, cols, seed=6), random_blocks(Q.Q6_K, 24, cols, seed=7)
    bias = torch.randn(48)
    x = torch.randn(5, cols)
    parts = [(gate, Q.Q6_K), (up, Q.Q6_K)]
    y = PackedGgml(library, parts, cols, bias=bias, gated=True, interleave=True)(x)
    both = expected(parts, x, cols) + bias.double()
    assert_close(y, torch.nn.functional.silu(both[:, :24]) * both[:, 24:])


def test_interleaving_copies_a_slice_at_a_time_and_releases_each(library, monkeypatch):
    monkeypatch.setattr(ggml, "_SLICE_BYTES", 4096)
    cols = 256
    raw = random_blocks(Q.Q4_K, 64, cols, seed=8)
    released = []
    weight = PackedGgml(library, [(raw, Q.Q4_K)], cols, interleave=True, release=released.append)
    # 4096 bytes hold 3 groups of 8 rows of 144 bytes: slices of 24, 24 and 16 rows.
    assert [len(s) for s in released] == [24, 24, 16]
    assert sum(s.data_ptr() - raw.data_ptr() == 0 for s in released) == 1
    x = torch.randn(2, cols)
    assert_close(weight(x), expected([(raw, Q.Q4_K)], x, cols))


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q6_K], ids=lambda q: q.name)
def test_a_row_gathered_back_from_its_group_is_the_file_row(library, qtype):
    """A tied embedding reads the output head's interleaved copy."""
    cols = 512
    raw = random_blocks(qtype, 32, cols, seed=9)
    weight = PackedGgml(library, [(raw, qtype)], cols, interleave=True)
    order = ggml.group_byte_order(library, qtype)
    copy = weight.parts[0][0].view(4, -1, 8 * order.shape[1])
    for row in (0, 5, 8, 31):
        blocks = copy[row // 8][:, order[row % 8]]
        assert torch.equal(blocks.reshape(-1), raw[row])


def test_types_whose_interleaving_re_encodes_bytes_have_no_byte_order(library):
    assert ggml.group_byte_order(library, Q.Q4_K) is None
    assert ggml.group_byte_order(library, Q.Q5_0) is None
    assert ggml.group_byte_order(library, Q.Q4_1) is None


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("interleave", [False, True], ids=["rows", "interleaved"])
def test_the_largest_codes_against_the_largest_inputs_stay_exact(library, qtype, interleave):
    """Every code (and K-type scale) at its largest, every x code at 127 or -127: the 16-bit
    partial sums the AVX2 paths keep must not wrap."""
    cols = 512
    raw = random_blocks(qtype, 16, cols, seed=10)
    per_block, size = GGML_QUANT_SIZES[qtype]
    blocks = raw.view(16, -1, size)
    scales = set()
    for at in _FLOAT_FIELDS[qtype]:
        scales.update((at, at + 1))
    largest = 0x80 if qtype == Q.Q8_0 else 0xFF  # Q8_0: -128, the widest signed code
    for byte in range(size):
        if byte not in scales:
            blocks[:, :, byte] = largest
    x = torch.cat([torch.ones(1, cols), -torch.ones(1, cols), torch.randn(1, cols)])
    want = expected([(raw, qtype)], x, cols)
    for isa in paths(library):
        weight = PackedGgml(library, [(raw, qtype)], cols, isa=isa, interleave=interleave)
        assert_close(weight(x), want)
