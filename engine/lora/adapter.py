"""A LoRA adapter read from a GGUF file as llama.cpp's converter writes it, checked against
the base model it is meant for.

An adapter file says `general.type = adapter` and `adapter.type = lora`, names the base's
architecture, and holds for each weight W it changes two small tensors: `<W>.lora_a`
[rank, inputs] and `<W>.lora_b` [outputs, rank]. Applied unmerged, a row x of that weight's
input gives W x + s B (A x), with s = scale * alpha / rank (the user's scale alone when the
file's `adapter.lora.alpha` is 0). The base stays as it is, quantized and shared; only A
and B are read here, copied out of the file into plain tensors.

Everything that can be wrong with such a file for this base is found here, before any of it
is used, and said in one line naming the file: not an adapter at all (a model, merged or
not), another architecture, a tensor the base lacks, shapes that do not fit the base's
weight, A and B of different ranks, a type we do not read."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from gguf.constants import GGMLQuantizationType

from ..errors import ModelFileError
from ..modelfile.gguf_file import GGUFFile, TensorInfo
from ..ops.quant import dequantize_rows

LORA_A, LORA_B = ".lora_a", ".lora_b"
# The float types an adapter's tensors are read from, and what they are kept as: f64 (which
# llama.cpp does not read) becomes f32, the others stay as stored.
_FLOAT_TYPES = {
    GGMLQuantizationType.F32: (torch.float32, torch.float32),
    GGMLQuantizationType.F16: (torch.float16, torch.float16),
    GGMLQuantizationType.BF16: (torch.bfloat16, torch.bfloat16),
    GGMLQuantizationType.F64: (torch.float64, torch.float32),
}


class AdapterError(ModelFileError):
    """An adapter file that is not a LoRA adapter, or not one for this base model."""


@dataclass(frozen=True)
class LoraPair:
    """The low-rank update of one base weight [outputs, inputs]: a [rank, inputs] and b
    [outputs, rank]."""

    a: torch.Tensor
    b: torch.Tensor

    @property
    def rank(self) -> int:
        return self.a.shape[0]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.a, self.b))


@dataclass(frozen=True)
class LoraAdapter:
    path: Path
    architecture: str
    alpha: float
    pairs: dict[str, LoraPair]  # keyed by the base weight's name, e.g. blk.0.attn_q.weight
    # Some tensors were F64 in the file (kept as f32 here): llama.cpp crashes on such files
    # (llama-cpp-python 0.3.36 and llama-server alike), so they never go to it.
    from_f64: bool = False

    @property
    def rank(self) -> int:
        """The largest rank of its pairs (they usually share one)."""
        return max(pair.rank for pair in self.pairs.values())

    @property
    def nbytes(self) -> int:
        return sum(pair.nbytes for pair in self.pairs.values())

    def scaling(self, pair: LoraPair, scale: float = 1.0) -> float:
        """s in W x + s B (A x): scale * alpha / rank, or the scale alone without an alpha."""
        return scale * self.alpha / pair.rank if self.alpha else scale


def read_adapter(path: Path | str, base: GGUFFile) -> LoraAdapter:
    """The adapter at `path`, checked against `base`. Raises AdapterError (one line)."""
    path = Path(path)
    if not path.is_file():
        raise AdapterError(path, "no such adapter file")
    adapter = GGUFFile(path)  # ModelFileError (one line) for what is not a readable GGUF
    try:
        _check_header(adapter, base)
        pairs = _read_pairs(adapter, base)
        alpha = _alpha(adapter)
        from_f64 = any(
            info.ggml_type == GGMLQuantizationType.F64 for info in adapter.tensors.values()
        )
    finally:
        adapter.close()
    return LoraAdapter(path, base.architecture, alpha, pairs, from_f64)


def _check_header(adapter: GGUFFile, base: GGUFFile) -> None:
    path, metadata = adapter.path, adapter.metadata
    kind = metadata.get("general.type")
    if kind != "adapter":
        what = f"general.type is {kind!r}" if kind else "it has no general.type"
        raise AdapterError(path, f"not a LoRA adapter ({what}: a model file, merged or not?)")
    if metadata.get("adapter.type") != "lora":
        raise AdapterError(path, f"adapter.type is {metadata.get('adapter.type')!r}, not 'lora'")
    arch = metadata.get("general.architecture")
    if arch != base.architecture:
        raise AdapterError(
            path,
            f"an adapter for {arch!r}, but the model ({base.path.name}) is {base.architecture!r}",
        )


def _alpha(adapter: GGUFFile) -> float:
    alpha = adapter.metadata.get("adapter.lora.alpha", 0.0)
    if not isinstance(alpha, int | float) or isinstance(alpha, bool) or alpha < 0:
        raise AdapterError(adapter.path, f"adapter.lora.alpha is {alpha!r}, not a number >= 0")
    return float(alpha)


def _read_pairs(adapter: GGUFFile, base: GGUFFile) -> dict[str, LoraPair]:
    path, tensors = adapter.path, adapter.tensors
    targets = sorted({name[: -len(LORA_A)] for name in tensors if name.endswith(LORA_A)})
    targets += sorted(
        {name[: -len(LORA_B)] for name in tensors if name.endswith(LORA_B)} - set(targets)
    )
    stray = [name for name in tensors if not name.endswith((LORA_A, LORA_B))]
    if stray:
        raise AdapterError(path, f"tensor {stray[0]} is not a LoRA tensor (.lora_a or .lora_b)")
    if not targets:
        raise AdapterError(path, "the adapter holds no LoRA tensors")
    pairs = {}
    for target in targets:
        a_info, b_info = tensors.get(target + LORA_A), tensors.get(target + LORA_B)
        if a_info is None or b_info is None:
            missing = target + (LORA_A if a_info is None else LORA_B)
            raise AdapterError(path, f"{missing} is missing (each weight needs both halves)")
        weight = base.tensors.get(target)
        if target.startswith("token_embd"):
            raise AdapterError(path, f"{target}: adapters on the token embedding are not read")
        if weight is None or len(weight.shape) != 2:
            raise AdapterError(path, f"{target}: the model has no such weight to adapt")
        pairs[target] = _pair(path, target, a_info, b_info, weight, adapter)
    return pairs


def _pair(path, target, a_info: TensorInfo, b_info: TensorInfo, weight: TensorInfo, adapter):
    outputs, inputs = weight.shape
    if len(a_info.shape) != 2 or len(b_info.shape) != 2:
        raise AdapterError(path, f"{target}: lora_a and lora_b must be matrices")
    rank = a_info.shape[0]
    if b_info.shape[1] != rank:
        raise AdapterError(path, f"{target}: lora_a has rank {rank}, lora_b rank {b_info.shape[1]}")
    if not 0 < rank <= min(outputs, inputs):
        raise AdapterError(path, f"{target}: rank {rank} for a {outputs}x{inputs} weight")
    if a_info.shape[1] != inputs or b_info.shape[0] != outputs:
        raise AdapterError(
            path,
            f"{target}: lora_a {list(a_info.shape)} and lora_b {list(b_info.shape)} do not fit "
            f"the model's {outputs}x{inputs} weight (another base model?)",
        )
    return LoraPair(_read(adapter, a_info), _read(adapter, b_info))


def _read(adapter: GGUFFile, info: TensorInfo) -> torch.Tensor:
    if info.ggml_type == GGMLQuantizationType.Q8_0:  # the converter's --outtype q8_0
        values = dequantize_rows(adapter.raw(info), info.ggml_type, info.shape[1])
        if not torch.isfinite(values).all():
            raise AdapterError(adapter.path, f"{info.name} holds values that are not finite")
        # Kept as f16: each value d q rounded to 11 bits (an 8-bit code times an f16 scale
        # may need 18), a change under 0.025%, well below llama.cpp's own 8-bit rounding of
        # the activations it multiplies them with.
        return values.to(torch.float16)
    types = _FLOAT_TYPES.get(info.ggml_type)
    if types is None:
        raise AdapterError(
            adapter.path,
            f"{info.name} is {info.ggml_type.name}; adapters are read as F32, F16, BF16 or Q8_0",
        )
    stored, kept = types
    values = adapter.raw(info).view(stored).reshape(info.shape)
    if not torch.isfinite(values).all():
        raise AdapterError(adapter.path, f"{info.name} holds values that are not finite")
    return values.to(kept, copy=True)
