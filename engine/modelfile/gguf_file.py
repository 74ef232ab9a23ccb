"""Reading GGUF files: validation, metadata and memory-mapped tensor data.

The `gguf` package parses the header; tensor bytes are read through our own read-only memory
map, so that pages can be handed back to the OS (`release`) as soon as a tensor has been
repacked. Every structural problem becomes a `ModelFileError` naming the file and the reason.
"""

from __future__ import annotations

import math
import mmap
import struct
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from ..errors import ModelFileError

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
        return math.prod(self.shape)

    @property
    def rows(self) -> int:
        return math.prod(self.shape[:-1])  # 1 for vectors


class GGUFFile:
    """A validated, memory-mapped GGUF file."""

    def __init__(self, path: Path | str):
        self.path = Path(path)
        _check_header(self.path)
        with self.path.open("rb") as handle:
            self._map = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
        try:
            layout = _read_layout(self._map)
        except (struct.error, ValueError, UnicodeDecodeError) as exc:
            self._map.close()
            raise ModelFileError(self.path, _layout_problem(exc)) from exc
        self.metadata, self.tensors, self.arrays = layout
        problem = _misplaced_tensor(self.tensors.values(), file_end=len(self._map))
        if problem:
            self._map.close()
            raise ModelFileError(self.path, problem)

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

    def array_strings(self, key: str) -> Iterator[bytes]:
        """The raw bytes of each string of an array (large ones included), in order."""
        info = self.arrays[key]
        if info.element != _STRING:
            raise ValueError(f"{key} is not an array of strings")
        buffer = self._map
        for start, end in _string_ends(buffer, info.start, info.length):
            yield buffer[start:end]

    def array_numbers(self, key: str) -> np.ndarray:
        """An array of fixed-size numbers (large ones included), as numpy values."""
        info = self.arrays[key]
        if info.element not in _SCALAR_FORMATS:
            raise ValueError(f"{key} is not an array of numbers")
        dtype = np.dtype(_SCALAR_FORMATS[info.element])
        return np.frombuffer(self._map, dtype, count=info.length, offset=info.start)

    def release_view(self, view: torch.Tensor) -> None:
        """Drop the mapped pages under one tensor from `raw` (a range of rows, say), rounded
        out to whole pages: a large tensor read once at load need not stay resident while
        the rest of it is read. Pages are re-read from the file if touched again."""
        base = torch.frombuffer(self._map, dtype=torch.uint8, count=1).data_ptr()
        start = view.data_ptr() - base
        end = start + view.numel() * view.element_size()
        start -= start % mmap.PAGESIZE
        end = min(len(self._map), -(-end // mmap.PAGESIZE) * mmap.PAGESIZE)
        if 0 <= start < end:
            self._map.madvise(mmap.MADV_DONTNEED, start, end - start)

    def close(self) -> None:
        """Unmap the file now, unless tensors from `raw` still point into it (the map then
        goes when the last of them does)."""
        try:
            self._map.close()
        except BufferError:
            pass

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


def _layout_problem(exc: Exception) -> str:
    if isinstance(exc, UnsupportedVersion):
        return str(exc)
    return f"corrupt or truncated GGUF ({_short(exc)})"


def _short(exc: Exception) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:160] if text else type(exc).__name__


# ------------------------------------------------------------------ the file's layout
#
# Our own reader of GGUF's header, key-value and tensor-info sections: `gguf`'s GGUFReader
# builds a numpy view for every string of a tokenizer's vocabulary, which took 5.7 s for
# SmolLM2's 49k tokens and 25.6 s for Gemma 3's 262k on a 2-core EPYC, at every load.
# Large arrays are skipped here (walked, never decoded), so a load reads in milliseconds.
# The tests check this reader against GGUFReader on every tiny architecture.

# GGUF value types: id -> struct format of the fixed-size ones; 8 is a string, 9 an array.
_SCALAR_FORMATS = {
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}
_SCALAR_SIZES = {kind: struct.calcsize(fmt) for kind, fmt in _SCALAR_FORMATS.items()}
_STRING, _ARRAY = 8, 9
_MAX_STRING = 64 << 20  # longer than any key or chat template: a corrupt length
_MAX_DIMS = 4  # GGML_MAX_DIMS
_DEFAULT_ALIGNMENT = 32


_U64 = struct.Struct("<Q")


def _string_ends(buffer, offset: int, count: int) -> Iterator[tuple[int, int]]:
    """(start, end) of each of `count` length-prefixed strings from `offset`, in one tight
    loop: a vocabulary holds up to 10^5-10^6 of them, and a cursor call per string made
    reading Gemma 3's 262,144 tokens take half a second."""
    read, size = _U64.unpack_from, len(buffer)
    for _ in range(count):
        if offset + 8 > size:
            raise ValueError(f"it ends at byte {size}, inside a string at byte {offset}")
        start = offset + 8
        offset = start + read(buffer, offset)[0]
        if offset > size:
            raise ValueError("a value runs past the end of the file")
        yield start, offset


def _skip_strings(buffer, offset: int, count: int) -> int:
    """The end of `count` length-prefixed strings from `offset`: _string_ends's walk with
    nothing kept (a read past the end raises struct.error, a corrupt file)."""
    read = _U64.unpack_from
    for _ in range(count):
        offset += 8 + read(buffer, offset)[0]
    if offset > len(buffer):
        raise ValueError("a value runs past the end of the file")
    return offset


class _Cursor:
    """Reads GGUF's little-endian values from a buffer, front to back; running past the
    end raises struct.error or ValueError, which callers report as a corrupt file."""

    def __init__(self, buffer, offset: int = 0):
        self.buffer, self.offset = buffer, offset

    def unpack(self, fmt: str) -> tuple:
        if self.offset + struct.calcsize(fmt) > len(self.buffer):
            raise ValueError(
                f"it ends at byte {len(self.buffer)}, inside a value at byte {self.offset}"
            )
        values = struct.unpack_from(fmt, self.buffer, self.offset)
        self.offset += struct.calcsize(fmt)
        return values

    def skip(self, count: int) -> None:
        if self.offset + count > len(self.buffer):
            raise ValueError("a value runs past the end of the file")
        self.offset += count

    def string(self, errors: str = "strict") -> str:
        (length,) = self.unpack("<Q")
        if length > _MAX_STRING:  # a corrupt length must not become a huge allocation
            raise ValueError(f"a string of {length} bytes")
        start = self.offset
        self.skip(length)
        return bytes(self.buffer[start : self.offset]).decode("utf-8", errors)

    def value(self, kind: int) -> Any:
        """One scalar or string; a string value is decoded leniently, as text to show."""
        if kind == _STRING:
            return self.string("replace")
        if kind not in _SCALAR_FORMATS:
            raise ValueError(f"unknown value type {kind}")
        return self.unpack(_SCALAR_FORMATS[kind])[0]

    def array_header(self) -> tuple[int, int]:
        """An array's element type and length, refused if the rest of the file could not
        hold that many elements (a corrupt length must not become a long loop)."""
        element, items = self.unpack("<IQ")
        smallest = _SCALAR_SIZES.get(element, 8)  # a string or array starts with 8 bytes
        if items * smallest > len(self.buffer) - self.offset:
            raise ValueError(f"an array of {items} items runs past the end of the file")
        return element, items

    def skip_value(self, kind: int) -> None:
        if kind == _STRING:
            (length,) = self.unpack("<Q")
            self.skip(length)
        elif kind == _ARRAY:
            element, items = self.array_header()
            if element in _SCALAR_SIZES:
                self.skip(_SCALAR_SIZES[element] * items)
            elif element == _STRING:
                self.offset = _skip_strings(self.buffer, self.offset, items)
            else:
                for _ in range(items):
                    self.skip_value(element)
        elif kind in _SCALAR_SIZES:
            self.skip(_SCALAR_SIZES[kind])
        else:
            raise ValueError(f"unknown value type {kind}")

    def entry(self) -> tuple[str, Any]:
        """The next key and its value: a list for an array of at most LARGE_ARRAY_ITEMS
        scalars or strings, _SKIPPED for a larger or nested one (walked over, not read)."""
        key = self.string()
        (kind,) = self.unpack("<I")
        if kind != _ARRAY:
            return key, self.value(kind)
        element, items = self.array_header()
        if items > LARGE_ARRAY_ITEMS or element == _ARRAY:
            self.offset -= 12
            self.skip_value(_ARRAY)
            return key, _SKIPPED
        return key, [self.value(element) for _ in range(items)]


_SKIPPED = object()


class UnsupportedVersion(ValueError):
    """A GGUF version this reader does not take: said as it is, not as a corrupt file."""


def _open_sections(buffer) -> tuple[_Cursor, int, int]:
    """A cursor at the first key, the number of tensors and the number of keys."""
    cursor = _Cursor(buffer, len(GGUF_MAGIC))
    (version,) = cursor.unpack("<I")
    if version & 0xFFFF == 0:
        raise ValueError("a big-endian GGUF, which this reader does not take")
    if not 2 <= version <= 3:
        raise UnsupportedVersion(f"GGUF version {version} is not supported (2 and 3 are)")
    n_tensors, n_keys = cursor.unpack("<QQ")
    return cursor, n_tensors, n_keys


@dataclass(frozen=True)
class ArrayInfo:
    """An array value's element type (GGUF's type id) and length, kept for every array,
    the skipped large ones included, so their types can be checked without reading them."""

    element: int
    length: int
    start: int  # byte offset of the first element


# The fewest bytes a key-value entry (key length, type, a one-byte value) and a tensor entry
# (name length, dims count, one dim, type, offset) can take: counts claiming more entries
# than the file could hold are refused before any loop runs over them.
_MIN_ENTRY_BYTES = 8 + 4 + 1
_MIN_TENSOR_ENTRY_BYTES = 8 + 4 + 8 + 4 + 8


def _read_layout(buffer) -> tuple[dict[str, Any], dict[str, TensorInfo], dict[str, ArrayInfo]]:
    cursor, n_tensors, n_keys = _open_sections(buffer)
    left = len(buffer) - cursor.offset
    if n_keys * _MIN_ENTRY_BYTES + n_tensors * _MIN_TENSOR_ENTRY_BYTES > left:
        raise ValueError(f"it claims {n_keys} keys and {n_tensors} tensors, more than it holds")
    metadata: dict[str, Any] = {}
    arrays: dict[str, ArrayInfo] = {}
    for _ in range(n_keys):
        start = cursor.offset
        key, value = cursor.entry()
        if key in metadata or key in arrays:
            raise ValueError(f"key {key} appears twice")
        if value is not _SKIPPED:
            metadata[key] = value
        arrays_at = _array_at(buffer, start)
        if arrays_at is not None:
            arrays[key] = arrays_at
    placed = [_tensor_entry(cursor) for _ in range(n_tensors)]
    alignment = metadata.get("general.alignment", _DEFAULT_ALIGNMENT)
    if type(alignment) is not int or alignment <= 0 or alignment & (alignment - 1):
        raise ValueError(f"general.alignment is {alignment!r}, not a power of two")
    data_start = -(-cursor.offset // alignment) * alignment
    tensors = {}
    for name, ggml_type, shape, relative in placed:
        if name in tensors:
            raise ValueError(f"tensor {name} appears twice")
        if relative % alignment:
            raise ValueError(f"tensor {name} is not aligned to {alignment} bytes")
        block_size, type_size = GGML_QUANT_SIZES[ggml_type]
        if shape[-1] % block_size:
            raise ValueError(
                f"tensor {name} has rows of {shape[-1]} values, not whole {ggml_type.name} "
                f"blocks of {block_size}"
            )
        nbytes = math.prod(shape) // block_size * type_size
        tensors[name] = TensorInfo(name, ggml_type, shape, data_start + relative, nbytes)
    return metadata, tensors, arrays


def _array_at(buffer, start: int) -> ArrayInfo | None:
    """The element type and length of the array entry at `start`, None for a scalar."""
    cursor = _Cursor(buffer, start)
    (key_length,) = cursor.unpack("<Q")
    cursor.skip(key_length)
    (kind,) = cursor.unpack("<I")
    if kind != _ARRAY:
        return None
    element, items = cursor.unpack("<IQ")
    return ArrayInfo(element, items, cursor.offset)


def _misplaced_tensor(tensors, file_end: int) -> str | None:
    """Why a tensor's bytes are not inside the file or overlap another's, or None."""
    previous = None
    for info in sorted(tensors, key=lambda info: info.offset):
        if info.offset + info.nbytes > file_end:
            return (
                f"truncated GGUF (tensor {info.name} claims {_size(info.nbytes)} from byte "
                f"{info.offset}, past the end of the file at {file_end})"
            )
        if previous is not None and previous.offset + previous.nbytes > info.offset:
            return f"corrupt GGUF (tensors {previous.name} and {info.name} overlap)"
        previous = info
    return None


def _size(nbytes: int) -> str:
    for unit, scale in (("TB", 1 << 40), ("GB", 1 << 30), ("MB", 1 << 20), ("KB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} bytes"


def _tensor_entry(cursor: _Cursor) -> tuple[str, GGMLQuantizationType, tuple[int, ...], int]:
    name = cursor.string()
    (n_dims,) = cursor.unpack("<I")
    if not 1 <= n_dims <= _MAX_DIMS:
        raise ValueError(f"tensor {name} has {n_dims} dimensions")
    dims = cursor.unpack(f"<{n_dims}Q")
    if 0 in dims:
        raise ValueError(f"tensor {name} has an empty dimension")
    type_id, relative = cursor.unpack("<IQ")
    try:
        ggml_type = GGMLQuantizationType(type_id)
    except ValueError:
        raise ValueError(f"tensor {name} has unknown type id {type_id}") from None
    # GGUF stores dims innermost-first; torch wants rows first.
    return name, ggml_type, tuple(reversed(dims)), relative


def read_scalar(path: Path | str, key: str) -> Any:
    """One scalar metadata value (a number, bool or string), reading the key-value section
    only up to `key`, as the server's model list does for every file in the folder; None if
    absent or an array, ModelFileError if the file is bad."""
    path = Path(path)
    _check_header(path)
    try:
        with (
            path.open("rb") as handle,
            mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as buffer,
        ):
            cursor, _, n_keys = _open_sections(buffer)
            for _ in range(n_keys):
                name, value = cursor.entry()
                if name == key:
                    return None if isinstance(value, list) or value is _SKIPPED else value
    except (OSError, struct.error, ValueError, UnicodeDecodeError) as exc:
        raise ModelFileError(path, _layout_problem(exc)) from exc
    return None
