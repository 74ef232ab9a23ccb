"""Reading GGUF files: validation, metadata and memory-mapped tensor data.

The `gguf` package parses the header; tensor bytes are read through our own read-only memory
map, so that pages can be handed back to the OS (`release`) as soon as a tensor has been
repacked. Every structural problem becomes a `ModelFileError` naming the file and the reason.
"""

from __future__ import annotations

import mmap
import struct
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGUFReader, GGUFValueType
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from .errors import ModelFileError

GGUF_MAGIC = b"GGUF"
LARGE_ARRAY_ITEMS = 4096


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a GGUF file. `shape` is in torch order (rows first)."""

    name: str
    ggml_type: GGMLQuantizationType
    shape: tuple[int, ...]
    offset: int  # absolute byte offset of the data in the file
    nbytes: int

    @property
    def n_elements(self) -> int:
        return int(np.prod(self.shape))

    @property
    def rows(self) -> int:
        return int(np.prod(self.shape[:-1]))  # 1 for vectors


class GGUFFile:
    """A validated, memory-mapped GGUF file."""

    def __init__(self, path: Path | str):
        self.path = Path(path)
        _check_header(self.path)
        try:
            reader = GGUFReader(self.path, "r")
        except Exception as exc:  # the reader raises many types on corrupt input
            raise ModelFileError(self.path, f"corrupt or truncated GGUF ({_short(exc)})") from exc
        # Large arrays (the tokenizer's vocabulary and merges) stay unread: llama.cpp owns
        # tokenization, and converting 50k strings to Python costs a noticeable start-up delay.
        self.metadata: dict[str, Any] = {
            name: _field_value(field)
            for name, field in reader.fields.items()
            if len(field.data) <= LARGE_ARRAY_ITEMS
        }
        file_size = self.path.stat().st_size
        self.tensors: dict[str, TensorInfo] = {}
        for tensor in reader.tensors:
            info = _tensor_info(self.path, tensor, file_size)
            self.tensors[info.name] = info
        del reader
        with self.path.open("rb") as handle:
            self._map = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)

    @property
    def architecture(self) -> str:
        arch = self.metadata.get("general.architecture")
        if not isinstance(arch, str):
            raise ModelFileError(self.path, "GGUF has no general.architecture")
        return arch

    def arch_value(self, key: str, default: Any = None) -> Any:
        """Metadata `<architecture>.<key>`, e.g. `block_count`."""
        return self.metadata.get(f"{self.architecture}.{key}", default)

    def tensor(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise ModelFileError(self.path, f"missing tensor {name}") from None

    def raw(self, info: TensorInfo) -> torch.Tensor:
        """uint8 [rows, row_bytes] sharing the memory map (read-only: never write to it)."""
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # torch warns on read-only buffers
            flat = torch.frombuffer(
                self._map, dtype=torch.uint8, count=info.nbytes, offset=info.offset
            )
        return flat.view(info.rows, -1)

    def release(self) -> None:
        """Drop every mapped page from this process's memory; pages are re-read if touched.

        The whole map, not one tensor's range: the kernel maps file pages in large batches
        around each fault, so a tensor's neighbours become resident too.
        """
        self._map.madvise(mmap.MADV_DONTNEED)


def _check_header(path: Path) -> None:
    if not path.exists():
        raise ModelFileError(path, "file not found")
    if path.is_dir():
        raise ModelFileError(path, "is a directory, not a GGUF file")
    try:
        with path.open("rb") as handle:
            magic = handle.read(4)
    except OSError as exc:
        raise ModelFileError(path, f"cannot read ({exc.strerror})") from exc
    if magic != GGUF_MAGIC:
        raise ModelFileError(path, "not a GGUF file (bad magic bytes)")


def _tensor_info(path: Path, tensor: Any, file_size: int) -> TensorInfo:
    try:
        ggml_type = GGMLQuantizationType(int(tensor.tensor_type))
    except ValueError:
        raise ModelFileError(
            path, f"tensor {tensor.name} has unknown type id {int(tensor.tensor_type)}"
        ) from None
    # GGUF stores dims innermost-first; torch wants rows first.
    shape = tuple(int(d) for d in reversed([int(x) for x in tensor.shape]))
    block_size, type_size = GGML_QUANT_SIZES[ggml_type]
    nbytes = int(np.prod(shape)) // block_size * type_size
    offset = int(tensor.data_offset)
    if offset + nbytes > file_size:
        raise ModelFileError(path, f"truncated GGUF (tensor {tensor.name} runs past end of file)")
    return TensorInfo(tensor.name, ggml_type, shape, offset, nbytes)


def _field_value(field: Any) -> Any:
    types = field.types
    if not types:
        return None
    if types[0] == GGUFValueType.ARRAY:
        if len(types) > 1 and types[1] == GGUFValueType.STRING:
            return [bytes(field.parts[i]).decode("utf-8", "replace") for i in field.data]
        return [field.parts[i].tolist()[0] for i in field.data]
    if types[0] == GGUFValueType.STRING:
        return bytes(field.parts[field.data[0]]).decode("utf-8", "replace")
    return field.parts[field.data[0]].tolist()[0]


def _short(exc: Exception) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:160] if text else type(exc).__name__


# ------------------------------------------------------------------ one value, fast

# Sizes of GGUF's fixed-size value types (type id -> bytes); 8 is a string, 9 an array.
_SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_SCALAR_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
                   10: "<Q", 11: "<q", 12: "<d"}  # fmt: skip
_STRING, _ARRAY = 8, 9
_MAX_STRING = 64 << 20  # longer than any key or chat template: a corrupt length


def read_scalar(path: Path | str, key: str) -> Any:
    """One scalar metadata value (a number, bool or string) without parsing the whole file:
    GGUFFile reads every key, and a 262k-word vocabulary takes seconds. Scans the key-value
    section in order and stops at `key`; None if absent, ModelFileError if the file is bad."""
    path = Path(path)
    _check_header(path)
    try:
        with path.open("rb") as handle:
            return _scan_for(handle, key)
    except (OSError, struct.error, UnicodeDecodeError, ValueError) as exc:
        raise ModelFileError(path, f"corrupt or truncated GGUF ({_short(exc)})") from exc


def _scan_for(handle, key: str) -> Any:
    handle.seek(4)
    version, _tensors, count = struct.unpack("<IQQ", handle.read(20))
    if version < 2:
        raise ValueError(f"GGUF version {version} is too old")
    for _ in range(count):
        name = _read_string(handle)
        kind = struct.unpack("<I", handle.read(4))[0]
        if name == key and kind != _ARRAY:
            return _read_scalar(handle, kind)
        _skip_value(handle, kind)
    return None


def _read_string(handle) -> str:
    (length,) = struct.unpack("<Q", handle.read(8))
    if length > _MAX_STRING:  # a corrupt length must not become a huge allocation
        raise ValueError(f"a string of {length} bytes")
    return handle.read(length).decode("utf-8")


def _read_scalar(handle, kind: int) -> Any:
    if kind == _STRING:
        return _read_string(handle)
    return struct.unpack(_SCALAR_FORMATS[kind], handle.read(_SCALAR_SIZES[kind]))[0]


def _skip_value(handle, kind: int) -> None:
    if kind == _STRING:
        (length,) = struct.unpack("<Q", handle.read(8))
        handle.seek(length, 1)
    elif kind == _ARRAY:
        element, items = struct.unpack("<IQ", handle.read(12))
        if element in _SCALAR_SIZES:
            handle.seek(_SCALAR_SIZES[element] * items, 1)
        else:
            for _ in range(items):
                _skip_value(handle, element)
    else:
        handle.seek(_SCALAR_SIZES[kind], 1)
