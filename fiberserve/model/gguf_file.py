"""A GGUF file's metadata and tensors, read straight from its memory map.

``gguf.GGUFReader`` builds a numpy view for every item of every metadata array (a vocabulary's tokens, its
merges, their types: hundreds of thousands), which costs most of a small model's start-up. Here scalars, strings
and numeric arrays are decoded as they are met, and a string array is only walked past: it is decoded when read
(:class:`StringArray`). Tensors are views of the one mapping, shaped as ``gguf`` shapes them, so its
``gguf.quants.dequantize`` takes them.
"""

from __future__ import annotations

import mmap
import os
import struct
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

GGUF_MAGIC = b"GGUF"

#: GGUF metadata value types with a fixed size, as struct formats and numpy dtypes (little-endian).
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_DEFAULT_ALIGNMENT = 32


class StringArray:
    """A metadata array of strings, decoded on demand: its length is known without reading it."""

    def __init__(self, data: np.ndarray, offset: int, count: int) -> None:
        self._data, self._offset, self._count = data, offset, count

    def __len__(self) -> int:
        return self._count

    def items(self) -> list[str]:
        out, offset, data = [], self._offset, self._data
        for _ in range(self._count):
            length = int.from_bytes(data[offset : offset + 8].tobytes(), "little")
            out.append(data[offset + 8 : offset + 8 + length].tobytes().decode("utf-8"))
            offset += 8 + length
        return out


@dataclass
class GgufTensor:
    name: str
    tensor_type: Any  #: a ``gguf.GGMLQuantizationType``
    shape: tuple[int, ...]  #: GGUF's order: the fastest-moving dimension first
    data: np.ndarray  #: a view of the file: float arrays as their dtype, block formats as bytes [rows, row bytes]


class GgufFile:
    """``fields``: every metadata key's value (numbers, strings, lists, or a :class:`StringArray`); ``tensors``:
    every tensor, in the file's order. Raises ValueError for a file that is not GGUF or is cut short, and
    :class:`.UnsupportedModelError` for a tensor type the installed ``gguf`` package does not know."""

    def __init__(self, path: str | Path) -> None:
        self._path = path
        self._rows_fd: int | None = None  #: opened by the first :meth:`read_rows`
        with open(path, "rb") as file:
            size = file.seek(0, 2)
            self._map = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) if size else None
        self.data = np.frombuffer(self._map, dtype=np.uint8) if self._map else np.zeros(0, dtype=np.uint8)
        self._buffer = self.data.data
        if self.data[:4].tobytes() != GGUF_MAGIC:
            raise ValueError(f"not a GGUF file (it starts with {self.data[:4].tobytes()!r})")
        self._offset = len(GGUF_MAGIC)
        version, tensor_count, field_count = self._unpack("<IQQ")
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} is not supported (2 and 3 are)")
        self.fields: dict[str, Any] = {}
        for _ in range(field_count):
            key = self._string()
            (kind,) = self._unpack("<I")
            self.fields[key] = self._value(kind)
        infos = [self._tensor_info() for _ in range(tensor_count)]
        alignment = int(self.fields.get("general.alignment", _DEFAULT_ALIGNMENT))
        start = -(-self._offset // alignment) * alignment
        self.tensors = [self._tensor(start, *info) for info in infos]

    def release(self, tensor: GgufTensor) -> None:
        """Drop ``tensor``'s pages from this process's memory once read (the file stays mapped; a later read
        fetches them again from the page cache)."""
        if self._map is None or not hasattr(mmap, "MADV_DONTNEED"):
            return
        first = self._offset_of(tensor)
        start = first // mmap.PAGESIZE * mmap.PAGESIZE
        self._map.madvise(mmap.MADV_DONTNEED, start, first + tensor.data.nbytes - start)

    def read_rows(self, tensor: GgufTensor, index: np.ndarray) -> np.ndarray:
        """Rows ``index`` of a 2-D tensor, [len(index), row], read from the file rather than through the mapping: a
        lookup of a few rows (an embedding's) then maps none of the file into this process, where a mapped read
        maps the whole run of pages the kernel reads around it."""
        out = np.empty((len(index), *tensor.data.shape[1:]), dtype=tensor.data.dtype)
        row_bytes, first = tensor.data.strides[0], self._offset_of(tensor)
        if self._rows_fd is None:  # open while this file is, closed with it
            self._rows_fd = os.open(self._path, os.O_RDONLY)
            weakref.finalize(self, os.close, self._rows_fd)
        for i, row in enumerate(index.tolist()):  # positioned reads: lookups on several threads need no lock
            os.preadv(self._rows_fd, [memoryview(out[i]).cast("B")], first + row * row_bytes)
        return out

    def _offset_of(self, tensor: GgufTensor) -> int:
        return tensor.data.__array_interface__["data"][0] - self.data.__array_interface__["data"][0]

    def _unpack(self, fmt: str) -> tuple:
        try:
            values = struct.unpack_from(fmt, self._buffer, self._offset)
        except struct.error:
            raise self._truncated() from None
        self._offset += struct.calcsize(fmt)
        return values

    def _truncated(self) -> ValueError:
        return ValueError(f"truncated: its metadata runs past the end of the file ({len(self.data)} bytes)")

    def _string(self) -> str:
        (length,) = self._unpack("<Q")
        end = self._offset + length
        if end > len(self.data):
            raise self._truncated()
        text = bytes(self._buffer[self._offset : end]).decode("utf-8")
        self._offset = end
        return text

    def _value(self, kind: int) -> Any:
        if kind in _SCALARS:
            return self._unpack(_SCALARS[kind])[0]
        if kind == _STRING:
            return self._string()
        if kind != _ARRAY:
            raise ValueError(f"unknown GGUF metadata value type {kind}")
        item_kind, count = self._unpack("<IQ")
        if item_kind == _STRING:
            first = self._offset
            for _ in range(count):  # walked past, not decoded
                (length,) = self._unpack("<Q")
                self._offset += length
            return StringArray(self.data, first, count)
        if item_kind in _SCALARS:
            dtype = np.dtype(_SCALARS[item_kind].replace("?", "b1"))
            end = self._offset + count * dtype.itemsize
            if end > len(self.data):
                raise self._truncated()
            values = self.data[self._offset : end].view(dtype).tolist()
            self._offset = end
            return values
        return [self._value(item_kind) for _ in range(count)]

    def _tensor_info(self) -> tuple[str, tuple[int, ...], int, int]:
        name = self._string()
        (dims,) = self._unpack("<I")
        shape = self._unpack(f"<{dims}Q")
        kind, offset = self._unpack("<IQ")
        return name, shape, kind, offset

    def _tensor(self, start: int, name: str, shape: tuple[int, ...], kind: int, offset: int) -> GgufTensor:
        import gguf

        from fiberserve.model.config import UnsupportedModelError  # config imports this module

        try:
            tensor_type = gguf.GGMLQuantizationType(kind)
        except ValueError:
            raise UnsupportedModelError(
                f"tensor {name!r} has GGML type {kind}, which the installed gguf package does not know"
            ) from None
        block, size = gguf.GGML_QUANT_SIZES[tensor_type]
        count = int(np.prod(shape, dtype=np.int64))
        first, end = start + offset, start + offset + count * size // block
        if end > len(self.data):
            raise ValueError(f"truncated: its tensors end at byte {end}, the file has {len(self.data)} bytes")
        dims = tuple(reversed(shape))
        dtype = {
            gguf.GGMLQuantizationType.F32: np.float32,
            gguf.GGMLQuantizationType.F16: np.float16,
            gguf.GGMLQuantizationType.F64: np.float64,
            gguf.GGMLQuantizationType.I8: np.int8,
            gguf.GGMLQuantizationType.I16: np.int16,
            gguf.GGMLQuantizationType.I32: np.int32,
            gguf.GGMLQuantizationType.I64: np.int64,
        }.get(tensor_type)
        raw = self.data[first:end]
        if dtype is not None:
            data = raw.view(dtype).reshape(dims)
        else:
            data = raw.reshape(gguf.quants.quant_shape_to_byte_shape(dims, tensor_type))
        return GgufTensor(name, tensor_type, shape, data)
