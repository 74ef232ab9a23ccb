"""Our native small-batch int4 GEMM (native/int4_gemm.cpp) against the pure-torch reference
(native/reference.py), on every path this CPU runs (AVX-512 BF16, AVX2), at several batch
sizes M and weight shapes, including row counts that are not a multiple of the 16-row block
and column counts that are not a multiple of the 64 columns of a chunk pair. Outputs are
poisoned with NaN first, so an element the kernel forgets to write fails the test.

Tolerance: `reference.error_bound`, k * 2^-23 * sum |w x| per output: twice the textbook
bound on an fp32 accumulation of k products, computed in float64 from the same x (bf16 on
the AVX-512 path, int8 per run of columns on the AVX2 path), scales and zeros the kernel
uses. A wrong code, scale, zero or row moves an output by a whole |w x| term, orders of
magnitude above it. The gated (silu(gate) * up) outputs add the error that propagates
through SiLU, plus 2^-20 relative for the kernel's exp.
"""

from __future__ import annotations

import pytest
import torch
from gguf.constants import GGMLQuantizationType
from test_native_ggml import random_blocks

from miniapp.engine.ops.quant import decode, to_int4
from miniapp.native import build, int4, reference

M_VALUES = (1, 2, 3, 4, 5, 7, 8, 9, 13, 16, 17)
# (rows, k, group): partial row blocks (1, 17, 40, 259), k of an odd number of 32-column
# groups (96, 160, 576 + 32), groups of 64 as the interleaved Q5/Q6/Q8 layouts use.
SHAPES = (
    (1, 32, 32),
    (17, 96, 32),
    (40, 160, 32),
    (259, 608, 32),
    (576, 576, 32),
    (48, 128, 64),
    (33, 192, 64),
)
GATED_SHAPES = ((16, 32), (48, 96), (3072, 576))  # (gate + up rows, k); groups of 32
SILU_SLOPE_MAX = 1.1  # |d silu / dx| <= 1.0998
EXP_RELATIVE_ERROR = 2.0**-20


@pytest.fixture(scope="module")
def library() -> int4.Library:
    try:
        return int4.load()
    except int4.NativeUnavailable as exc:
        # Fail, not skip: the set-up has a compiler, so CI must test the kernel it ships.
        pytest.fail(f"native library unavailable here: {exc}")


def _isas() -> list[int]:
    try:
        lib = int4.load()
    except int4.NativeUnavailable:
        return []
    return [isa for isa in int4.ISA_NAMES if lib.cpu_has(isa)]


ISAS = pytest.mark.parametrize("isa", _isas(), ids=lambda isa: int4.ISA_NAMES[isa])
ACTIVATIONS = {
    int4.ISA_AVX512_VNNI: reference.INT8,
    int4.ISA_AVX512: reference.BF16,
    int4.ISA_AVX2: reference.INT8,
}


def random_weight(rows: int, k: int, group: int, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (rows, k), generator=generator, dtype=torch.uint8)
    scale = torch.rand(rows, k // group, generator=generator) / 16 + 0.001
    zero = torch.randn(rows, k // group, generator=generator) / 16
    return codes, scale, zero


def packed(library, codes, scale, zero, isa, gated=False) -> int4.PackedInt4:
    rows, k = codes.shape
    group = k // scale.shape[1]
    if gated:
        order = int4.gate_up_order(rows)
        codes, scale, zero = codes[order], scale[order], zero[order]
    shape = int4.PackedShape(rows, k, group, gated)
    return int4.PackedInt4(library, int4.pack(codes, scale, zero), shape, isa)


def poisoned(m: int, n: int) -> torch.Tensor:
    return torch.full((m, n), float("nan"))


@ISAS
@pytest.mark.parametrize("rows,k,group", SHAPES)
def test_matches_reference(library, isa, rows, k, group):
    codes, scale, zero = random_weight(rows, k, group, seed=rows + k)
    weight = packed(library, codes, scale, zero, isa)
    activations = ACTIVATIONS[isa]
    for m in M_VALUES:
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
        y = weight.forward(x, out=poisoned(m, rows))
        assert torch.isfinite(y).all(), f"unwritten outputs at M={m}"
        expected = reference.int4_matmul(x, codes, scale, zero, activations)
        error = (y.double() - expected).abs()
        bound = reference.error_bound(x, codes, scale, zero, activations)
        assert (error <= bound).all(), f"M={m}: worst error/bound {(error / bound).max():.3g}"


@ISAS
@pytest.mark.parametrize("gated", [False, True], ids=["plain", "gated"])
def test_rows_are_bit_identical_to_single_row_calls(library, isa, gated):
    """Speculative verification relies on it: each row of an M-row call equals the same row
    computed alone (M = 1), bit for bit, whatever M, tile split or thread count."""
    rows, k = (96, 576) if gated else (200, 576)
    weight = packed(library, *random_weight(rows, k, 32), isa, gated=gated)
    x = torch.randn(17, k, generator=torch.Generator().manual_seed(7))
    singles = torch.cat([weight.forward(x[i : i + 1]) for i in range(17)])
    for m in M_VALUES:
        assert torch.equal(weight.forward(x[:m]), singles[:m]), f"M={m}"
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(weight.forward(x), singles)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("gated", [False, True], ids=["plain", "gated"])
@pytest.mark.parametrize("group", [32, 64, 16, 8])
def test_the_vnni_path_gives_the_avx2_paths_bits(library, gated, group):
    """Two paths, one answer: the AVX-512 VNNI path sums the same exact integer products as
    the AVX2 path and rounds them in the same steps, so a machine with either computes the
    same logits (and the AVX2 path is the VNNI path's reference)."""
    rows, k = (96, 576) if gated else (200, 576)
    weight = packed(library, *random_weight(rows, k, group), int4.ISA_AVX2, gated=gated)
    x = torch.randn(23, k, generator=torch.Generator().manual_seed(3))
    x[5, 40] = float("nan")
    vnni = weight.with_isa(int4.ISA_AVX512_VNNI)
    if not library.cpu_has(int4.ISA_AVX512_VNNI):  # then refused, and AVX2 is the path
        with pytest.raises(ValueError, match="refused"):
            vnni.forward(x)
        return
    for m in (1, 2, 8, 12, 13, 23):
        ours, avx2 = vnni.forward(x[:m]), weight.forward(x[:m])
        torch.testing.assert_close(ours, avx2, rtol=0, atol=0, equal_nan=True, msg=f"M={m}")


@ISAS
@pytest.mark.parametrize("rows,k", GATED_SHAPES)
def test_gated_matches_reference(library, isa, rows, k):
    codes, scale, zero = random_weight(rows, k, 32, seed=rows)
    weight = packed(library, codes, scale, zero, isa, gated=True)
    activations = ACTIVATIONS[isa]
    for m in (1, 4, 9, 17):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
        y = weight.forward(x, out=poisoned(m, rows // 2))
        assert torch.isfinite(y).all(), f"unwritten outputs at M={m}"
        linear = reference.int4_matmul(x, codes, scale, zero, activations)
        bound = reference.error_bound(x, codes, scale, zero, activations)
        gate, up = linear.chunk(2, dim=1)
        gate_bound, up_bound = bound.chunk(2, dim=1)
        expected = reference.gated_int4_matmul(x, codes, scale, zero, activations)
        allowed = (
            SILU_SLOPE_MAX * up.abs() * gate_bound
            + torch.nn.functional.silu(gate).abs() * up_bound
            + EXP_RELATIVE_ERROR * expected.abs()
        )
        assert ((y.double() - expected).abs() <= allowed).all(), f"M={m}"


@ISAS
def test_input_dtypes_and_strides_give_the_same_result(library, isa):
    """bf16 input gives what its fp32 values give; a row stride other than k (a slice of a
    wider tensor) is read in place; on the AVX-512 path, which rounds x to bf16 first, fp32
    input gives what its bf16 rounding gives."""
    weight = packed(library, *random_weight(64, 96, 32), isa)
    wide = torch.randn(5, 200)
    x = wide[:, 40:136]
    expected = weight.forward(x.contiguous())
    assert torch.equal(weight.forward(x), expected)
    assert torch.equal(weight.forward(x.double()), expected)
    rounded = x.bfloat16()
    assert torch.equal(weight.forward(rounded), weight.forward(rounded.float()))
    if ACTIVATIONS[isa] == reference.BF16:
        assert torch.equal(weight.forward(rounded), expected)


@ISAS
def test_nan_input_gives_nan_rows(library, isa):
    weight = packed(library, *random_weight(32, 64, 32), isa)
    x = torch.randn(3, 64)
    x[1, 5] = float("nan")
    y = weight.forward(x)
    assert torch.isnan(y[1]).all() and torch.isfinite(y[[0, 2]]).all()


def test_bad_calls_are_refused(library):
    weight = packed(library, *random_weight(16, 64, 32), library.isa)
    with pytest.raises(ValueError, match="columns"):
        weight.forward(torch.randn(2, 32))
    with pytest.raises(ValueError, match="out must be"):
        weight.forward(torch.randn(2, 64), out=torch.empty(2, 17))
    with pytest.raises(ValueError, match="gated weights"):
        int4.gate_up_order(24)


def test_zero_rows(library):
    weight = packed(library, *random_weight(16, 64, 32), library.isa)
    assert weight.forward(torch.empty(0, 64)).shape == (0, 16)


def test_pack_pads_rows_with_zero_weights():
    codes, scale, zero = random_weight(17, 64, 32)
    data = int4.pack(codes, scale, zero)
    blocks, groups = 2, 2
    assert data.numel() == blocks * groups * (8 * 32 + 2 * 2 * int4.BLOCK_ROWS)


# ------------------------------------------------------------------ loading and fallback


def test_cpu_without_the_instructions_is_refused(library, monkeypatch):
    monkeypatch.setattr(int4.Library, "cpu_has", lambda self, isa: False)
    with pytest.raises(int4.NativeUnavailable, match="lacks AVX2"):
        library.best_isa()


def test_no_compiler_means_torch_op(monkeypatch, tmp_path):
    from miniapp.engine.platform import kernels

    monkeypatch.setenv(int4.CACHE_ENV, str(tmp_path))  # nothing built there yet
    monkeypatch.setattr(int4, "installed_path", lambda: None)
    monkeypatch.setattr(build, "find_compiler", lambda: None)
    with pytest.raises(int4.NativeUnavailable, match="no C\\+\\+ compiler"):
        int4.load()
    kernels._load.cache_clear()
    try:
        choice = kernels.cpu_int4_kernel()
        assert not choice.native
        assert choice.describe() == (
            "torch _weight_int4pack_mm_for_cpu (native kernel: no C++ compiler (set CXX or "
            "install g++))"
        )
    finally:
        kernels._load.cache_clear()


def test_compile_error_is_one_line(tmp_path, monkeypatch):
    broken = tmp_path / "broken.cpp"
    broken.write_text("this is not C++\n")
    with pytest.raises(build.BuildError, match="^compile failed: .*error"):
        build.build(tmp_path / "out.so", broken)
    assert not list(tmp_path.glob("*.partial")), "a failed build leaves no partial file"


def test_stale_installed_library_is_rebuilt(library, monkeypatch, tmp_path):
    """An installed library built from another source (an edited checkout) is not used."""
    monkeypatch.setenv(int4.CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(int4, "installed_path", lambda: library.path)
    monkeypatch.setattr(build, "source_hash", lambda source=build.SOURCE: "0123456789abcdef")
    built = []
    monkeypatch.setattr(build, "build", lambda output, source=None: built.append(output))
    with pytest.raises(OSError):  # the stub built nothing: loading the new path fails
        int4.load()
    assert built == [tmp_path / "native" / "int4_gemm-0123456789abcdef.so"]


def test_installed_library_of_another_abi_is_rebuilt(library, monkeypatch, tmp_path):
    """A library from before an ABI change (an old editable build) is rebuilt, not refused."""
    monkeypatch.setenv(int4.CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(int4, "installed_path", lambda: library.path)
    monkeypatch.setattr(int4, "ABI_VERSION", int4.ABI_VERSION + 1)
    built = []
    monkeypatch.setattr(build, "build", lambda output, source=None: built.append(output))
    with pytest.raises(OSError):  # the stub built nothing: loading the new path fails
        int4.load()
    assert built == [int4.cache_path()]


def test_switch_off_gives_torch_op_and_same_results(library, monkeypatch):
    """MINIAPP_NATIVE=0 packs for torch's kernel; both agree within the int4 tests' bound."""
    from gguf.constants import GGMLQuantizationType as Q
    from tiny_gguf import quantize_k

    from miniapp.engine.ops.layers import linear_from_raw
    from miniapp.engine.platform.kernels import cpu_int4_kernel

    generator = torch.Generator().manual_seed(3)
    values = torch.randn(40, 256, generator=generator).numpy()
    raw = torch.from_numpy(quantize_k(values, Q.Q4_K))
    x = torch.randn(3, 256, generator=generator)
    native = linear_from_raw([(raw, Q.Q4_K)], 256)
    monkeypatch.setenv(int4.ENV_SWITCH, "0")
    off = "(native kernel: switched off by MINIAPP_NATIVE=0)"
    assert cpu_int4_kernel().describe().endswith(off)
    fallback = linear_from_raw([(raw, Q.Q4_K)], 256)
    assert native.native is not None and fallback.native is None
    expected = fallback(x).float()
    assert (native(x) - expected).abs().max() <= 0.02 * expected.abs().max()


def test_forced_path_is_used(library, monkeypatch):
    from miniapp.engine.platform.kernels import cpu_int4_kernel

    for isa in _isas():
        monkeypatch.setenv(int4.ENV_SWITCH, int4.ISA_NAMES[isa])
        choice = cpu_int4_kernel()
        assert choice.native and choice.library.isa == isa
        assert choice.describe().startswith(f"native {int4.ISA_NAMES[isa]} (")


@pytest.mark.parametrize("switch", ["", "0"], ids=["native", "off"])
def test_doctor_says_which_kernel(miniapp_exe, switch, library):
    import os
    import subprocess

    env = {**os.environ, int4.ENV_SWITCH: switch}
    out = subprocess.run(
        [miniapp_exe, "doctor"], capture_output=True, text=True, env=env, timeout=300
    ).stdout
    line = next(x for x in out.splitlines() if x.startswith("int4 matmul on the CPU: "))
    if switch:
        assert "torch _weight_int4pack_mm_for_cpu (native kernel: switched off" in line
    else:
        assert line.startswith(f"int4 matmul on the CPU: native {library.isa_name} (")


def test_unwritable_cache_is_a_build_error(tmp_path):
    blocked = tmp_path / "file"
    blocked.write_text("")
    with pytest.raises(build.BuildError, match="cannot write the library"):
        build.build(blocked / "native" / "lib.so")


@pytest.mark.parametrize("ggml_type", [2, 3], ids=["Q4_0", "Q4_1"])
@pytest.mark.parametrize("rows", [16, 37])
def test_q4_rows_pack_natively_into_the_same_bytes_as_torch(library, ggml_type, rows):
    """Loading packs a file's Q4_0/Q4_1 rows in one native pass; it must give exactly the
    layout the torch packing gives (which the kernel's other tests check)."""
    qtype = GGMLQuantizationType(ggml_type)
    raw = random_blocks(qtype, rows, 256)
    groups = to_int4(decode(raw, qtype))
    assert torch.equal(
        int4.pack_q4_rows(library, [raw], ggml_type, 256),
        int4.pack(groups.codes, groups.scale, groups.zero),
    )
    gate, up = random_blocks(qtype, 24, 256, seed=1), random_blocks(qtype, 24, 256, seed=2)
    both = to_int4(decode(torch.cat([gate, up]), qtype))
    order = int4.gate_up_order(48)
    assert torch.equal(
        int4.pack_q4_rows(library, [gate, up], ggml_type, 256, order),
        int4.pack(both.codes[order], both.scale[order], both.zero[order]),
    )
