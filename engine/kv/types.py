"""How the KV cache stores keys and values: `--kv-type f32|f16|bf16|q8|q4`, or one type for
keys and another for values, `--kv-type K/V` (e.g. `q8/q4`).

A cache holds one storage row per (kv head, token): `width(head_dim)` elements of
`storage_dtype`. The float types store the values themselves. The quantized ones store bytes,
in blocks of 32 values along the head dimension, laid out for the native attention kernel
(`native/kv_codec.h`, "KV storage"), which reads them directly:

* q8: the head_dim codes (int8, code = round(x / scale)), then one f16 scale per block,
  scale = max |x| / 127 (llama.cpp's q8_0 maths; 8.5 bits a value);
* q4: head_dim / 2 bytes of codes, then one f16 scale and after all scales one f16 minimum
  per block, x = code * scale + min with code in 0..15 (llama.cpp's q4_1 maths; 5 bits a
  value). Byte i of a block holds value i in its low nibble and value i + 16 in its high.

Quantized rows are stored times a normalised Hadamard matrix, as llama.cpp rotates its
quantized caches: keys have a few large channels, and the rotation spreads them over the
row, so a block's scale no longer follows one outlier (q4's perplexity cost fell from +8% to
+5% on SmolLM2, from +12% to +9% on Gemma 3). Queries are rotated alike and outputs back,
so attention is unchanged.

Keys suffer from quantization far more than values: a few of their channels are large for
every token, so any block along the head dimension spans them (rows of 4-bit keys cost +5%
perplexity on SmolLM2, +9% on Gemma 3). q4 *keys* are therefore stored as KIVI does, per
channel over tiles of 32 tokens: a 4-bit code per value, an f16 scale and minimum per channel
and tile (the same 5 bits a value; layout in native/kv_codec.h, "q4 tiles"). Only
complete tiles are quantized: the newest tile, which queries attend to the most, stays fp32
(engine/kv/key_tiles.py), and so do a ring's sinks. That costs +0.7% (SmolLM2) and +0.9%
(Gemma 3) at ctx 2048 (docs/BENCHMARKS.md). q4 values stay rows as above.

Codes are computed from the f16-rounded scale (and minimum), so decoding is exact fp32
arithmetic: code * scale is exact in fp32, and q4 adds the minimum with one rounding (the
kernel's fused multiply-add gives the same bits). The torch functions here are the
reference and the path off the CPU (a GPU, a graph-captured step); on the CPU the native
library encodes and decodes the same bits (kv_codec.py; this module imports no torch, so
the llama.cpp side and memory estimates can use it).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import MiniappError

BLOCK = 32  # values per quantization block, along the head dimension


@dataclass(frozen=True)
class KVType:
    name: str
    code: int  # the native kernel's type number
    storage: str  # the torch dtype of the storage: float32, float16, bfloat16, uint8
    itemsize: int  # its bytes
    bits: float  # bits a stored value takes, scales included
    blocked: bool = False  # stores blocks of BLOCK values (head_dim must divide)
    tiled_keys: bool = False  # stores keys per channel over tiles of tokens (q4)

    def width(self, head_dim: int) -> int:
        """Storage elements of one (kv head, token) row."""
        if self.name == "q8":
            return head_dim + 2 * (head_dim // BLOCK)
        if self.name == "q4":
            return head_dim // 2 + 4 * (head_dim // BLOCK)
        return head_dim

    def row_bytes(self, head_dim: int) -> int:
        return self.width(head_dim) * self.itemsize

    def check(self, head_dim: int) -> None:
        """A one-line error when this type cannot store rows of head_dim values."""
        if self.blocked and head_dim % BLOCK:
            raise MiniappError(
                f"--kv-type {self.name} stores blocks of {BLOCK} values; this model's "
                f"heads have {head_dim} (use f16 or bf16)"
            )

    # One type stores keys and values alike (see KVPair).
    @property
    def key(self) -> KVType:
        return self

    @property
    def value(self) -> KVType:
        return self


@dataclass(frozen=True)
class KVPair:
    """Keys stored as one type and values as another (`--kv-type q8/q4`): what a cache
    setting is, besides a single KVType, which stands for the pair (t, t)."""

    key: KVType
    value: KVType

    @property
    def name(self) -> str:
        return f"{self.key.name}/{self.value.name}"

    @property
    def bits(self) -> float:
        return (self.key.bits + self.value.bits) / 2

    @property
    def blocked(self) -> bool:
        return self.key.blocked or self.value.blocked

    def check(self, head_dim: int) -> None:
        self.key.check(head_dim)
        self.value.check(head_dim)


KVSetting = KVType | KVPair


F32 = KVType("f32", 0, "float32", 4, 32.0)
F16 = KVType("f16", 1, "float16", 2, 16.0)
BF16 = KVType("bf16", 2, "bfloat16", 2, 16.0)
Q8 = KVType("q8", 3, "uint8", 1, 8.5, blocked=True)
Q4 = KVType("q4", 4, "uint8", 1, 5.0, blocked=True, tiled_keys=True)
KV_TYPES = {t.name: t for t in (F32, F16, BF16, Q8, Q4)}
KV_TYPE_NAMES = tuple(KV_TYPES)
# The settings reports list: every type for both, and the pair that keeps keys in 8 bits.
KV_SETTING_NAMES = (*KV_TYPE_NAMES, "q8/q4")
# The default: the smallest type within the accuracy targets on our models, and faster than
# f32 at long contexts (docs/BENCHMARKS.md, "KV cache types").
DEFAULT_KV_TYPE = "q8"
# llama.cpp's names for the same maths (its KV cache default is f16).
LLAMA_CPP_NAMES = {"f32": "f32", "f16": "f16", "bf16": "bf16", "q8": "q8_0", "q4": "q4_1"}


def default_kv_type(head_dim: int) -> KVType:
    """The default for heads of head_dim values: DEFAULT_KV_TYPE, or f16 where its blocks do
    not fit (a head size that is not a multiple of 32)."""
    kind = KV_TYPES[DEFAULT_KV_TYPE]
    return kind if not (kind.blocked and head_dim % BLOCK) else F16


def storable_kv_types(head_dim: int) -> list[KVType]:
    """Every type that can store heads of head_dim values."""
    return [k for k in KV_TYPES.values() if not (k.blocked and head_dim % BLOCK)]


def kv_type(name: str | KVSetting) -> KVSetting:
    """The setting called `name`: one type (`q8`) or a key type and a value type (`q8/q4`;
    `q8/q8` is `q8`); a one-line error naming the choices otherwise."""
    if isinstance(name, KVType | KVPair):
        return name
    parts = [KV_TYPES.get(part.strip()) for part in str(name).strip().lower().split("/")]
    if not 1 <= len(parts) <= 2 or None in parts:
        raise MiniappError(
            f"--kv-type {name!r}: choose from {', '.join(KV_TYPE_NAMES)}, "
            "or KEYS/VALUES such as q8/q4"
        )
    key, value = parts[0], parts[-1]
    return key if key == value else KVPair(key, value)


def bytes_per_token(kind: KVSetting, n_layers: int, n_kv_heads: int, head_dim: int) -> int:
    """Keys and values of one token over every layer."""
    rows = kind.key.row_bytes(head_dim) + kind.value.row_bytes(head_dim)
    return n_layers * n_kv_heads * rows
