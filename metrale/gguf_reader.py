"""gguf's GGUFReader, made fast on the parts a served model reads: checked tensor infos, plain slices, and arrays
(a vocabulary's hundred thousand strings, its scores and types) whose items are made only when asked for.

gguf's reader lists a field's items as parts, two numpy views per string and one per scalar, each made by a
chain of Python calls: over a vocabulary that is most of a file's open time, and most of those views are never
read. Here a flat array in the host's byte order is read in one pass over its length prefixes (`_ArrayParts`:
the same parts, types and data indices as gguf's, each part made on access), and its contents come in bulk
(`ArrayField.contents`: the strings decoded once, the scalars as one list), so opening a file costs the scan
and the tokenizer pays for the strings it reads, once. No torch here (the frontend and the engine core read
metadata too).
"""

from __future__ import annotations

import functools
import struct
from collections.abc import Iterator, Sequence

import numpy as np


class GgufError(ValueError):
    """The GGUF file cannot be read or served; the message says what (and which tensor, where one is at fault)."""


_ARRAY, _STRING = 9, 8  # GGUFValueType.ARRAY / STRING
_SCALARS = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
            7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
_HEAD = 5  # a field's parts before its items: key length, key, value type, item type, item count
_LENGTH = struct.Struct("<Q")


class _ArrayParts(Sequence):
    """The parts of a flat array field as gguf's reader lists them (the five head parts, then one part per scalar
    or two per string: its length and its bytes), each item part made when it is asked for."""

    def __init__(self, head: list, plain: np.ndarray, values: np.ndarray | None, starts: np.ndarray | None,
                 lengths: np.ndarray | None):
        self.head = head
        self.plain = plain
        self.values = values  # scalars: the array's values (a view of the map)
        self.starts, self.lengths = starts, lengths  # strings: where each one's bytes start, and their lengths
        self._items: list | None = None

    def __len__(self) -> int:
        return _HEAD + (len(self.values) if self.values is not None else 2 * len(self.starts))

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        n = len(self)
        i = i + n if i < 0 else i
        if not 0 <= i < n:
            raise IndexError("part index out of range")
        if i < _HEAD:
            return self.head[i]
        k = i - _HEAD
        if self.values is not None:
            return self.values[k : k + 1]
        start = self.starts[k // 2]
        if k % 2 == 0:
            return self.plain[start - 8 : start].view(np.uint64)
        return self.plain[start : start + self.lengths[k // 2]]

    def __iter__(self) -> Iterator:
        return (self[i] for i in range(len(self)))

    def items(self) -> list:
        """Every item as Python (str, int, float or bool), made once."""
        if self._items is None:
            if self.values is not None:
                self._items = self.values.tolist()
            else:
                self._items = _strings(self.plain, self.starts, self.lengths)
        return self._items

    def pairs(self) -> list[tuple[str, str]] | None:
        """A string array's items split at their one space ("left right" -> (left, right): a vocabulary's merges),
        all in one split; None where an item has no space or more than one, or the array is not of strings."""
        if self.starts is None:
            return None
        joined = _joined(self.plain, self.starts, self.lengths)
        # Each item's NUL mark, then its one space: nothing else may be either (a NUL or a second space in an item).
        found = joined[np.flatnonzero((joined == 0) | (joined == 32))]
        if len(found) != 2 * len(self.starts) or found[0::2].any() or (found[1::2] != 32).any():
            return None
        try:
            flat = joined.tobytes().decode("utf-8").replace("\x00", " ").split(" ")
        except UnicodeDecodeError:
            return None
        return list(zip(flat[1::2], flat[2::2]))


def _joined(plain: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """The bytes of the strings at starts (each after its 8-byte length prefix), each after a NUL (uint8, a copy)."""
    if len(starts) == 0:
        return np.zeros(0, dtype=np.uint8)
    lo, hi = int(starts[0]) - 1, int(starts[-1] + lengths[-1])
    region = plain[lo:hi].copy()
    marks = starts - (lo + 1)  # the last byte of each string's length prefix, in region
    region[marks] = 0
    keep = np.ones(len(region), dtype=bool)
    keep[(marks[1:, None] - np.arange(7, 0, -1)).ravel()] = False  # the rest of each prefix but the first
    return region[keep]


def _strings(plain: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> list[str]:
    """The strings at starts (each after its 8-byte length) decoded from UTF-8 in one call: _joined's bytes
    decoded, then split at the NULs (one string at a time where a string holds a NUL itself).
    UnicodeDecodeError as str(bytes, "utf-8") raises it for a string that is not UTF-8."""
    try:
        text = _joined(plain, starts, lengths).tobytes().decode("utf-8")
    except UnicodeDecodeError:
        text = None
    if text is None or text.count("\x00") != len(starts):
        buf = memoryview(plain)
        return [str(buf[s : s + n], "utf-8") for s, n in zip(starts.tolist(), lengths.tolist())]
    items = text.split("\x00")
    del items[0]
    return items


@functools.cache
def _field_class():
    """gguf's ReaderField whose contents, for an array read here, come from its items in bulk."""
    from gguf.gguf_reader import ReaderField

    class ArrayField(ReaderField):
        __slots__ = ()

        def contents(self, index_or_slice: int | slice = slice(None)):
            """As gguf's: the item (an int index) or a list of them (a slice)."""
            if isinstance(self.parts, _ArrayParts):
                return self.parts.items()[index_or_slice]
            return super().contents(index_or_slice)

    return ArrayField


def _array_field(reader, offs: int, head: list):
    """(field parts, data indices, types, size in bytes) of the flat array at offs in the host's byte order, its
    items left unmade; None for anything else (nested arrays: gguf's reader reads those)."""
    from gguf import GGUFValueType

    plain = reader.plain()
    itype = plain[offs : offs + 4].view(np.uint32)
    alen = plain[offs + 4 : offs + 12].view(np.uint64)
    if len(alen) != 1:
        raise ValueError("an array's header runs past the end of the file")
    count, kind, at = int(alen[0]), int(itype[0]), offs + 12
    parts = [*head, itype, alen]
    if kind in _SCALARS:
        values = plain[at : at + count * np.dtype(_SCALARS[kind]).itemsize].view(_SCALARS[kind])
        if len(values) != count:
            raise ValueError(f"array of {count} runs past the end of the file")
        data = list(range(_HEAD, _HEAD + count))
        return _ArrayParts(parts, plain, values, None, None), data, [GGUFValueType.ARRAY, GGUFValueType(kind)], 12 + values.nbytes
    if kind != _STRING:
        return None
    starts, unpack, buf = [0] * count, _LENGTH.unpack_from, memoryview(plain)
    try:
        for i in range(count):  # the one pass over the length prefixes (each string's place depends on the last)
            at += 8 + unpack(buf, at)[0]
            starts[i] = at
    except struct.error:
        raise ValueError("a string runs past the end of the file") from None
    if at > len(plain):
        raise ValueError("a string runs past the end of the file")
    # (starts holds each string's end so far: its start is the end before it plus the next length prefix)
    ends = np.array(starts, dtype=np.int64)
    starts = np.empty_like(ends)
    if count:
        starts[0] = offs + 20
        starts[1:] = ends[:-1] + 8
    lengths = ends - starts
    data = list(range(_HEAD + 1, _HEAD + 2 * count, 2))
    return _ArrayParts(parts, plain, None, starts, lengths), data, [GGUFValueType.ARRAY, GGUFValueType.STRING], at - offs


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
                if int(raw_kv_type[0]) == _ARRAY and self.byte_order == "I":
                    lazy = _array_field(self, offs, head)
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
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    size = len(reader.data)
    for field in fields:
        _len, name_data, _n_dims, dims, raw_dtype, offset = field.parts
        name = bytes(name_data).decode("utf-8", errors="replace")
        try:
            qtype = GGMLQuantizationType(int(raw_dtype[0]))
        except ValueError:
            raise GgufError(f"tensor {name}: unknown ggml type {int(raw_dtype[0])} (corrupt file?)") from None
        block, type_size = GGML_QUANT_SIZES[qtype]
        n = int(np.prod(dims.astype(np.int64)))
        if n % block:
            raise GgufError(f"tensor {name}: {n} elements is not a whole number of {qtype.name} blocks")
        end = start_offs + int(offset[0]) + n // block * type_size
        if end > size:
            raise GgufError(
                f"tensor {name}: its data ends at byte {end} but the file has {size} bytes (truncated file)"
            )
