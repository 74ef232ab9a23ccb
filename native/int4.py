"""The small-batch int4 GEMM of `int4_gemm.cpp`, from Python: loading the library (building
it on first use if the installed one is missing or stale), packing weights into its layout,
and calling it.

A weight is 4-bit codes [rows, k] with a scale and zero per group of `group` columns,
w = (code - 8) * scale + zero; the kernel computes y = x @ w.T in fp32 from x in fp32 or
bf16 (rounded to bf16 first, as torch's int4 kernel takes it). See `reference.py` for the
same in plain torch.
"""

from __future__ import annotations

import ctypes
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

from . import build

ABI_VERSION = 11  # must match kAbiVersion in int4_gemm.cpp
BLOCK_ROWS = 16  # output rows per packed block
GATE_ROWS = BLOCK_ROWS // 2  # gated blocks: 8 gate rows, then the 8 matching up rows
CHUNK_COLS = 8  # input columns per 64-byte chunk of a block
NIBBLES = 4  # codes per 16-bit word: columns 2j + h of a chunk, j = 0..3
SCALE_DTYPE = torch.bfloat16
ZERO_CODE = 8  # padding rows: code 8 with zero scale and zero decode to 0

ISA_AVX512_VNNI, ISA_AVX512, ISA_AVX2 = 3, 2, 1
ISA_NAMES = {ISA_AVX512_VNNI: "avx512vnni", ISA_AVX512: "avx512", ISA_AVX2: "avx2"}
_X_TYPES = {torch.float32: 0, torch.bfloat16: 1}
EPILOGUE_STORE, EPILOGUE_SILU_MUL = 0, 1

ENV_SWITCH = "MINIAPP_NATIVE"  # "0" or "off": torch's op; "avx2" / "avx512": force a path
CACHE_ENV = "MINIAPP_CACHE_DIR"


class NativeUnavailable(Exception):
    """Why the native library cannot be used here (one line)."""


class Library:
    """The loaded shared library and the path it runs on this CPU."""

    def __init__(self, path: Path, isa: int | None = None):
        self.path = path
        cdll = ctypes.CDLL(str(path))
        self.cdll = cdll  # other kernels of the library bind their own functions
        if cdll.miniapp_native_abi() != ABI_VERSION:
            raise NativeUnavailable(f"{path.name} has another ABI version")
        cdll.miniapp_native_source_hash.restype = ctypes.c_char_p
        self.source_hash = cdll.miniapp_native_source_hash().decode()
        self._cpu_has = cdll.miniapp_int4_cpu_has
        self.gemm = cdll.miniapp_int4_gemm
        i64, ptr, i32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
        self.gemm.argtypes = [ptr, ptr, i64, i32, i64, ptr, i32]
        self.gemm.restype = i32
        # The same with terms added before the epilogue (LoRA updates).
        self.gemm_pre = cdll.miniapp_int4_gemm_pre
        self.gemm_pre.argtypes = [ptr, ptr, i64, i32, i64, ptr, ptr, i64, i32]
        self.gemm_pre.restype = i32
        self.isa = isa if isa is not None else self.best_isa()

    def cpu_has(self, isa: int) -> bool:
        return bool(self._cpu_has(isa))

    def best_isa(self) -> int:
        # BF16 first: its activations keep 8 bits of mantissa each, where the integer paths
        # quantize x to int8 per 16 columns; on a Zen 4 that agreed less with llama.cpp
        # (mean KL 7-11% higher on four texts) and quoted less faithfully, although the
        # VNNI path ran 10-15% faster at 1-64 rows. Without BF16, VNNI gives the AVX2 path's
        # bits, 1.7x faster.
        for isa in (ISA_AVX512, ISA_AVX512_VNNI, ISA_AVX2):
            if self.cpu_has(isa):
                return isa
        raise NativeUnavailable("the CPU lacks AVX2/FMA (and AVX-512 VNNI or BF16)")

    @property
    def isa_name(self) -> str:
        return ISA_NAMES[self.isa]


def installed_path() -> Path | None:
    """The library `setup.py` built next to this file, if any."""
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    path = Path(__file__).with_name(build.LIBRARY_STEM + suffix)
    return path if path.exists() else None


def cache_path() -> Path:
    """Where a library built on first use goes: the user cache folder, keyed by source."""
    import platformdirs

    root = os.environ.get(CACHE_ENV) or platformdirs.user_cache_dir("miniapp")
    return Path(root) / "native" / f"int4_gemm-{build.source_hash()}.so"


def load(isa: str | None = None) -> Library:
    """The library for this machine: the installed one if it matches the source next to it,
    else one built (once) into the user cache. `isa` forces "avx2" or "avx512".
    Raises NativeUnavailable with the reason."""
    forced = {name: code for code, name in ISA_NAMES.items()}.get(isa or "")
    expected = build.source_hash() if build.SOURCE.exists() else None
    library = None
    installed = installed_path()
    if installed is not None:
        try:
            library = Library(installed, forced)
        except NativeUnavailable:  # another ABI: built from an older source
            library = None
        if library is not None and expected is not None and library.source_hash != expected:
            library = None  # built from an older source (an editable checkout)
    if library is None:
        if expected is None:
            raise NativeUnavailable("no installed library and no source to build it from")
        path = cache_path()
        if not path.exists():
            try:
                build.build(path)
            except build.BuildError as exc:
                raise NativeUnavailable(str(exc)) from exc
        library = Library(path, forced)
    if forced is not None and not library.cpu_has(forced):
        raise NativeUnavailable(f"the CPU lacks {isa}")
    return library


# ----------------------------------------------------------------------------- packing


def padded_rows(rows: int) -> int:
    return -(-rows // BLOCK_ROWS) * BLOCK_ROWS


def pack(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """Codes uint8 [rows, k] (0..15) with scale and zero [rows, k / group] -> the kernel's
    layout, uint8 [blocks * groups * (8 * group + 64)]. Rows are padded to whole blocks of 16
    with weights that decode to zero. See int4_gemm.cpp for the layout."""
    rows, k = codes.shape
    n_groups = scale.shape[1]
    group = k // n_groups
    if group * n_groups != k or group % CHUNK_COLS:
        raise ValueError(f"{k} columns do not split into groups of a multiple of {CHUNK_COLS}")
    pad = padded_rows(rows) - rows
    if pad:
        codes = torch.nn.functional.pad(codes, (0, 0, 0, pad), value=ZERO_CODE)
        scale = torch.nn.functional.pad(scale, (0, 0, 0, pad))
        zero = torch.nn.functional.pad(zero, (0, 0, 0, pad))
    blocks = (rows + pad) // BLOCK_ROWS
    # column 8c + 2j + h of row r -> nibble j of 16-bit word 2r + h of chunk c
    grouped = codes.to(torch.uint8).view(
        blocks, BLOCK_ROWS, n_groups, group // CHUNK_COLS, NIBBLES, 2
    )
    nibbles = grouped.permute(0, 2, 3, 1, 5, 4)  # block, group, chunk, row, h, j
    low_byte = nibbles[..., 0] | (nibbles[..., 1] << 4)  # little-endian words
    high_byte = nibbles[..., 2] | (nibbles[..., 3] << 4)
    chunk_bytes = torch.stack([low_byte, high_byte], dim=-1).reshape(blocks, n_groups, -1)
    return torch.cat(
        [chunk_bytes, _per_group_bf16(scale, blocks), _per_group_bf16(zero, blocks)], dim=-1
    ).reshape(-1)


Q4_0, Q4_1 = 2, 3  # GGML type ids `pack_q4_rows` reads
Q4_BLOCK_BYTES = {Q4_0: 18, Q4_1: 20}


def pack_q4_rows(
    library: Library,
    parts: list[torch.Tensor],
    ggml_type: int,
    k: int,
    order: torch.Tensor | None = None,
) -> torch.Tensor:
    """Q4_0 or Q4_1 rows as the GGUF file stores them (uint8 [rows, row_bytes] each, stacked
    in order) -> the kernel's layout, in one native pass: the bytes `pack` gives for the
    same weights (scale d, zero m + 8d or 0, rows padded to blocks of 16). `order`: the
    stacked rows in the order to pack them (gate_up_order for a gated weight)."""
    if ggml_type not in Q4_BLOCK_BYTES or k % 32:
        raise ValueError(f"native Q4 packing takes Q4_0/Q4_1 rows of a multiple of 32, not {k}")
    row_bytes = k // 32 * Q4_BLOCK_BYTES[ggml_type]
    addresses = []
    for raw in parts:
        if raw.shape[1] != row_bytes or raw.stride(0) != row_bytes or raw.stride(1) != 1:
            raise ValueError("Q4 rows do not match their width")
        addresses.append(raw.data_ptr() + row_bytes * torch.arange(raw.shape[0], dtype=torch.int64))
    stacked = torch.cat(addresses)
    if order is not None:
        stacked = stacked[order]
    rows = stacked.shape[0]
    padded = torch.zeros(padded_rows(rows), dtype=torch.int64)  # 0: a padding row
    padded[:rows] = stacked
    groups = k // 32
    out = torch.empty(
        padded.shape[0] // BLOCK_ROWS * groups * (BLOCK_ROWS * 16 + 64), dtype=torch.uint8
    )
    function = library.cdll.miniapp_int4_pack_q4
    function.restype = ctypes.c_int
    function.argtypes = [
        ctypes.c_void_p,
        ctypes.c_int64,
        ctypes.c_int64,
        ctypes.c_int,
        ctypes.c_void_p,
        ctypes.c_int,
    ]
    status = function(
        padded.data_ptr(), padded.shape[0], k, ggml_type, out.data_ptr(), torch.get_num_threads()
    )
    if status:
        raise ValueError(f"native Q4 packing refused type {ggml_type} rows of {k}")
    return out


def _per_group_bf16(values: torch.Tensor, blocks: int) -> torch.Tensor:
    """[rows, groups] -> uint8 [blocks, groups, 32]: each group's 16 row values as bf16."""
    per_block = values.to(SCALE_DTYPE).view(blocks, BLOCK_ROWS, -1).transpose(1, 2)
    return per_block.contiguous().view(torch.uint8)


def gate_up_order(rows: int) -> torch.Tensor:
    """Row order that puts, in every block of 16, 8 gate rows and then the 8 up rows of the
    same outputs (gate rows are 0..rows/2-1, up rows the rest)."""
    half = rows // 2
    if rows % 2 or half % GATE_ROWS:
        raise ValueError(f"gated weights need 2 x a multiple of {GATE_ROWS} rows, not {rows}")
    gate = torch.arange(half).view(-1, GATE_ROWS)
    return torch.cat([gate, gate + half], dim=1).reshape(-1)


# ----------------------------------------------------------------------------- calling


@dataclass(frozen=True)
class PackedShape:
    rows: int  # rows of the weight (outputs; 2 x outputs for a gated weight)
    k: int  # input columns
    group: int  # columns per scale and zero
    gated: bool = False  # rows hold gate|up; y = silu(gate) * up

    @property
    def blocks(self) -> int:
        return padded_rows(self.rows) // BLOCK_ROWS

    @property
    def outputs(self) -> int:
        return self.rows // 2 if self.gated else self.rows


class _Weight(ctypes.Structure):
    """Int4Weight in int4_gemm.cpp."""

    _fields_ = [
        ("packed", ctypes.c_void_p),
        ("n_blocks", ctypes.c_int64),
        ("k", ctypes.c_int64),
        ("group", ctypes.c_int64),
        ("n", ctypes.c_int64),
        ("epilogue", ctypes.c_int32),
        ("isa", ctypes.c_int32),
        ("ggml", ctypes.c_void_p),  # a GgmlWeight (native/ggml.py), or None
    ]


class BoundGemm:
    """A weight bound for one of the library's GEMMs (`_gemm`, called with the weight's
    structure at `_address`); `forward(x)` gives fp32 [M, outputs] for x [M, k]."""

    _kernel = "native int4 kernel"  # named when it refuses a call
    shape: object
    _gemm: object
    _address: int
    _k: int
    _outputs: int

    def forward(
        self, x: torch.Tensor, out: torch.Tensor | None = None, pre: torch.Tensor | None = None
    ) -> torch.Tensor:
        """`out`: an fp32 [M, outputs] contiguous tensor to write into (tests poison it).
        `pre`: fp32 [M, outputs] (gated: [M, 2 x outputs], gate terms then up terms),
        contiguous, added to W x before the epilogue (LoRA updates)."""
        m, k = x.shape
        if k != self._k:
            raise ValueError(f"x has {k} columns, the weight {self._k}")
        x_type = _X_TYPES.get(x.dtype)
        if x_type is None or x.stride(-1) != 1:
            x, x_type = x.float().contiguous(), 0
        if out is None:
            y = torch.empty((m, self._outputs), dtype=torch.float32)
        elif out.shape == (m, self._outputs) and out.dtype == torch.float32 and out.is_contiguous():
            y = out
        else:
            raise ValueError(f"out must be fp32 [{m}, {self._outputs}] and contiguous")
        if pre is not None:
            return self._forward_pre(x, x_type, y, pre)
        status = self._gemm(
            self._address,
            x.data_ptr(),
            x.stride(0),
            x_type,
            m,
            y.data_ptr(),
            torch.get_num_threads(),
        )
        if status:
            raise ValueError(f"the {self._kernel} refused x {tuple(x.shape)} for {self.shape}")
        return y

    __call__ = forward

    def _forward_pre(self, x, x_type: int, y: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
        width = 2 * self._outputs if self.shape.gated else self._outputs
        m = x.shape[0]
        if pre.shape != (m, width) or pre.dtype != torch.float32 or not pre.is_contiguous():
            raise ValueError(f"pre must be fp32 [{m}, {width}] and contiguous")
        status = self.library.gemm_pre(
            self._address,
            x.data_ptr(),
            x.stride(0),
            x_type,
            m,
            y.data_ptr(),
            pre.data_ptr(),
            width,
            torch.get_num_threads(),
        )
        if status:
            raise ValueError(f"the {self._kernel} refused x {tuple(x.shape)} for {self.shape}")
        return y


class PackedInt4(BoundGemm):
    """A weight in the kernel's layout; `forward(x)` gives fp32 [M, outputs] for x [M, k]."""

    def __init__(self, library: Library, data: torch.Tensor, shape: PackedShape, isa=None):
        self.library, self.data, self.shape = library, data, shape
        self.isa = library.isa if isa is None else isa
        epilogue = EPILOGUE_SILU_MUL if shape.gated else EPILOGUE_STORE
        self._weight = _Weight(
            data.data_ptr(), shape.blocks, shape.k, shape.group, shape.outputs, epilogue, self.isa
        )
        # What a call needs besides x, bound once: ctypes converts each argument on every
        # call (~0.1 us each), so the weight goes as one address.
        self._gemm = library.gemm
        self._address = ctypes.addressof(self._weight)
        self._k, self._outputs = shape.k, shape.outputs

    def with_isa(self, isa: int) -> PackedInt4:
        """The same weight run on another path (tests compare paths on one machine)."""
        return PackedInt4(self.library, self.data, self.shape, isa)
