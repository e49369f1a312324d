"""A GGUF file's fields and tensors as gguf's GGUFReader lists them, read without importing `gguf`: checked tensor
infos, plain slices of the map, and flat arrays read lazily (gguf_arrays.py).

`read(path)` parses a little-endian file of version 2 or 3 itself (`GgufFile`: the same fields, parts, types and
tensors as gguf's reader, its types numbered as gguf_types.py names them); a big-endian file, or one with an
array of arrays, goes to gguf's own reader (`reader_class`), made fast the same way. gguf's import costs a
served process more than this file's header does, and each of its processes reads it. No torch here (the
frontend and the engine core read metadata too).
"""

from __future__ import annotations

import functools
import math
import sys
from typing import Any, NamedTuple

import numpy as np

from metrale.gguf_arrays import SCALARS, ArrayParts, array_field
from metrale.gguf_types import BLOCK_SIZES, TensorType, ValueType


class GgufError(ValueError):
    """The GGUF file cannot be read or served; the message says what (and which tensor, where one is at fault)."""


@functools.cache
def _field_class():
    """gguf's ReaderField whose contents, for an array read here, come from its items in bulk."""
    from gguf.gguf_reader import ReaderField

    class ArrayField(ReaderField):
        __slots__ = ()

        def contents(self, index_or_slice: int | slice = slice(None)):
            """As gguf's: the item (an int index) or a list of them (a slice)."""
            if isinstance(self.parts, ArrayParts):
                return self.parts.items()[index_or_slice]
            return super().contents(index_or_slice)

    return ArrayField


@functools.cache
def reader_class():
    """gguf's GGUFReader, checking each tensor's type and extent first (so a bad one is named), slicing a plain
    ndarray view of its memory map (numpy's memmap subclass costs a Python call per slice), and reading flat
    arrays lazily (see the module docstring)."""
    from gguf import GGUFReader

    class CheckedReader(GGUFReader):
        _plain: np.ndarray | None = None

        def plain(self) -> np.ndarray:
            """The file's bytes as a plain ndarray view of the map."""
            if self._plain is None:
                self._plain = self.data.view(np.ndarray)
            return self._plain

        def _get(self, offset, dtype, count=1, override_order=None):
            count, dt = int(count), np.dtype(dtype)
            arr = self.plain()[offset : offset + dt.itemsize * count].view(dtype=dt)[:count]
            return arr.view(arr.dtype.newbyteorder(self.byte_order if override_order is None else override_order))

        def _build_fields(self, offs, count):
            # GGUFReader._build_fields, with flat arrays read by _array_field (its list concatenation of the
            # parts would make every item).
            field_class = _field_class()
            for _ in range(count):
                orig_offs = offs
                kv_klen, kv_kdata = self._get_str(offs)
                offs += int(kv_klen.nbytes + kv_kdata.nbytes)
                raw_kv_type = self._get(offs, np.uint32)
                offs += int(raw_kv_type.nbytes)
                head = [kv_klen, kv_kdata, raw_kv_type]
                name = str(bytes(kv_kdata), encoding="utf-8")
                lazy = None
                if int(raw_kv_type[0]) == ValueType.ARRAY and self.byte_order == "I":
                    lazy = array_field(self, offs, head)
                if lazy is not None:
                    parts, data, types, size = lazy
                    self._push_field(field_class(orig_offs, name, parts, data, types), skip_sum=True)
                else:
                    size, field_parts, idxs, types = self._get_field_parts(offs, raw_kv_type[0])
                    self._push_field(field_class(orig_offs, name, head + field_parts, [i + len(head) for i in idxs], types),
                                     skip_sum=True)
                offs += size
            return offs

        def _build_tensors(self, start_offs, fields):
            _check_tensor_infos(self, start_offs, fields)
            super()._build_tensors(start_offs, fields)

    return CheckedReader


def _check_tensor_infos(reader, start_offs: int, fields: list) -> None:
    """Raise GgufError naming the first tensor whose type is unknown or whose bytes lie past the file's end."""
    size = len(reader.data)
    for field in fields:
        _len, name_data, _n_dims, dims, raw_dtype, offset = field.parts
        name = bytes(name_data).decode("utf-8", errors="replace")
        try:
            qtype = TensorType(int(raw_dtype[0]))
        except ValueError:
            raise GgufError(f"tensor {name}: unknown ggml type {int(raw_dtype[0])} (corrupt file?)") from None
        block, type_size = BLOCK_SIZES[qtype]
        n = math.prod(dims.tolist())
        if n % block:
            raise GgufError(f"tensor {name}: {n} elements is not a whole number of {qtype.name} blocks")
        end = start_offs + int(offset[0]) + n // block * type_size
        if end > size:
            raise GgufError(
                f"tensor {name}: its data ends at byte {end} but the file has {size} bytes (truncated file)"
            )


# ---- the reader without gguf ----------------------------------------------------------------------------------

_MAGIC = 0x46554747  # "GGUF" read little-endian
_VERSIONS = (2, 3)
_ALIGNMENT = 32  # GGUF_DEFAULT_ALIGNMENT
# Tensor types whose data gguf's reader gives as their own dtype; every other type as uint8 rows of blocks.
_ITEM_TYPES = {TensorType.F32: np.float32, TensorType.F16: np.float16, TensorType.F64: np.float64,
               TensorType.I8: np.int8, TensorType.I16: np.int16, TensorType.I32: np.int32, TensorType.I64: np.int64}


_DTYPES = {t: np.dtype(t) for t in (np.uint8, np.uint32, np.uint64, *SCALARS.values())}  # (np.dtype() per view is slow)


class _NotHere(Exception):
    """The file needs gguf's own reader (big-endian, an array of arrays)."""


class Field(NamedTuple):
    """A metadata field as gguf's ReaderField: its parts (numpy views of the file), which of them hold the value
    (`data`), and its value types."""

    offset: int
    name: str
    parts: Any = []
    data: list[int] = [-1]
    types: list[ValueType] = []

    def contents(self, index_or_slice: int | slice = slice(None)) -> Any:
        """As gguf's: the value as Python; of an array, the item (an int index) or a list of them (a slice)."""
        if isinstance(self.parts, ArrayParts):
            return self.parts.items()[index_or_slice]
        if not self.types:
            return None
        if self.types[0] == ValueType.STRING:
            return str(self.parts[-1].tobytes(), encoding="utf-8")
        return self.parts[-1].tolist()[0]


class Tensor(NamedTuple):
    """A tensor's info and data (a view of the map) as gguf's ReaderTensor."""

    name: str
    tensor_type: TensorType
    shape: np.ndarray
    n_elements: int
    n_bytes: int
    data_offset: int
    data: np.ndarray
    field: Field


def read(path: str):
    """The reader of the GGUF file at path: GgufFile, or gguf's (reader_class) for a file GgufFile leaves to it.
    ValueError / IndexError / KeyError / OSError / UnicodeDecodeError for a file that is not a readable GGUF."""
    try:
        return GgufFile(path)
    except _NotHere:
        return reader_class()(path)


class GgufFile:
    """A little-endian GGUF file of version 2 or 3, memory-mapped read-only: `fields` (name -> Field, in the
    file's order, after gguf's GGUF.version / tensor_count / kv_count), `tensors` (Tensor, in the file's order),
    `data` (the map), `alignment`, `data_offset`, `byte_order` ("I": the host's), as gguf's reader has them."""

    byte_order = "I"

    def __init__(self, path: str):
        if sys.byteorder != "little":
            raise _NotHere
        self.data = np.memmap(path, mode="r")
        self._plain = self.data.view(np.ndarray)
        if self._view(0, np.uint32)[0] != _MAGIC:
            raise ValueError("GGUF magic invalid")
        version = self._view(4, np.uint32)
        if version[0] & 0xFFFF == 0:
            raise _NotHere  # big-endian
        if version[0] not in _VERSIONS:
            raise ValueError(f"GGUF version {int(version[0])} is not one this reader handles")
        counts = self._view(8, np.uint64, 2)
        self.fields: dict[str, Field] = {}
        self.tensors: list[Tensor] = []
        self._push(Field(4, "GGUF.version", [version], [0], [ValueType.UINT32]))
        self._push(Field(8, "GGUF.tensor_count", [counts[:1]], [0], [ValueType.UINT64]))
        self._push(Field(16, "GGUF.kv_count", [counts[1:]], [0], [ValueType.UINT64]))
        offs = self._read_fields(24, int(counts[1]))
        offs, infos = self._read_tensor_infos(offs, int(counts[0]))
        self.alignment = _ALIGNMENT
        align = self.fields.get("general.alignment")
        if align is not None:
            if align.types != [ValueType.UINT32]:
                raise ValueError("Bad type for general.alignment field")
            self.alignment = int(align.parts[-1][0])
            if self.alignment == 0 or self.alignment & (self.alignment - 1):
                raise ValueError("Invalid alignment: must be a non-zero power of two")
        self.data_offset = offs + -offs % self.alignment
        _check_tensor_infos(self, self.data_offset, infos)
        self._read_tensors(self.data_offset, infos)

    def plain(self) -> np.ndarray:
        """The file's bytes as a plain ndarray view of the map."""
        return self._plain

    def _view(self, offset: int, dtype, count: int = 1) -> np.ndarray:
        """count values of dtype at offset (a view of the map); ValueError past the file's end."""
        dt = _DTYPES.get(dtype) or np.dtype(dtype)
        end = offset + dt.itemsize * count
        if end > len(self._plain):
            raise ValueError(f"the file ends inside a value at byte {offset}")
        return self._plain[offset:end].view(dt)

    def _string(self, offset: int) -> tuple[np.ndarray, np.ndarray]:
        """A string's (length, bytes) parts at offset."""
        length = self._view(offset, np.uint64)
        return length, self._view(offset + 8, np.uint8, int(length[0]))

    def _push(self, field: Field) -> None:
        if field.name in self.fields:
            raise KeyError(f"Duplicate {field.name} already in list at offset {field.offset}")
        self.fields[field.name] = field

    def _read_fields(self, offs: int, count: int) -> int:
        """The count metadata fields from offs; the offset after them."""
        for _ in range(count):
            start = offs
            klen, key = self._string(offs)
            offs += 8 + len(key)
            vtype = self._view(offs, np.uint32)
            offs += 4
            head = [klen, key, vtype]
            name = str(key.tobytes(), encoding="utf-8")
            kind = int(vtype[0])
            if kind == ValueType.ARRAY:
                lazy = array_field(self, offs, head)
                if lazy is None:
                    raise _NotHere  # an array of arrays
                parts, data, types, size = lazy
                self._push(Field(start, name, parts, data, types))
                offs += size
            elif kind == ValueType.STRING:
                slen, text = self._string(offs)
                self._push(Field(start, name, [*head, slen, text], [4], [ValueType.STRING]))
                offs += 8 + len(text)
            elif kind in SCALARS:
                value = self._view(offs, SCALARS[kind])
                self._push(Field(start, name, [*head, value], [3], [ValueType(kind)]))
                offs += value.nbytes
            else:
                raise ValueError(f"Unknown/unhandled field type {kind}")
        return offs

    def _read_tensor_infos(self, offs: int, count: int) -> tuple[int, list[Field]]:
        """The count tensor infos from offs (as gguf's fields of them); the offset after them."""
        infos = []
        for _ in range(count):
            start = offs
            nlen, name = self._string(offs)
            offs += 8 + len(name)
            n_dims = self._view(offs, np.uint32)
            dims = self._view(offs + 4, np.uint64, int(n_dims[0]))
            offs += 4 + dims.nbytes
            raw_type = self._view(offs, np.uint32)
            offset = self._view(offs + 4, np.uint64)
            offs += 12
            parts = [nlen, name, n_dims, dims, raw_type, offset]
            infos.append(Field(start, str(name.tobytes(), encoding="utf-8"), parts, [1, 3, 4, 5]))
        return offs, infos

    def _read_tensors(self, start: int, infos: list[Field]) -> None:
        """Each tensor's data as gguf's reader shapes it: its own dtype for float and integer types, else uint8
        rows of blocks (the last dimension in bytes); the dimensions reversed (rows first)."""
        names = set()
        for info in infos:
            _nlen, _name, _n_dims, dims, raw_type, offset = info.parts
            if info.name in names:
                raise ValueError(f"Found duplicated tensor with name {info.name}")
            names.add(info.name)
            ttype = TensorType(int(raw_type[0]))
            shape = tuple(reversed(dims.tolist()))
            n = math.prod(dims.tolist())
            block, type_size = BLOCK_SIZES[ttype]
            n_bytes = n * type_size // block
            at = start + int(offset[0])
            item = _ITEM_TYPES.get(ttype)
            if item is None:
                shape = (*shape[:-1], shape[-1] // block * type_size)
                item = np.uint8
            data = self._plain[at : at + n_bytes].view(item).reshape(shape)
            self.tensors.append(Tensor(info.name, ttype, dims, n, n_bytes, at, data, info))
