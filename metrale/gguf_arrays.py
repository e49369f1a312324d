"""A GGUF file's flat arrays (a vocabulary's hundred thousand strings, its scores and types) read lazily: the same
parts, types and data indices as gguf's reader lists, each part made on access, the items in bulk.

gguf's reader lists a field's items as parts, two numpy views per string and one per scalar, each made by a
chain of Python calls: over a vocabulary that is most of a file's open time, and most of those views are never
read. Here a flat array in the host's byte order is read in one pass over its length prefixes (`array_field`,
`ArrayParts`), and its contents come in bulk (the strings decoded in one call, the merges split in one, the
scalars as one list), so opening a file costs the pass and the tokenizer pays for the strings it reads, once.
The pass's lengths are remembered between processes (gguf_string_index.py: checked against the file before
use).
"""

from __future__ import annotations

import struct
from collections.abc import Iterator, Sequence

import numpy as np

from metrale import gguf_string_index as string_index
from metrale.gguf_types import ValueType

# A scalar value type -> its numpy dtype (gguf.GGUFReader.gguf_scalar_to_np).
SCALARS = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
            7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
_HEAD = 5  # a field's parts before its items: key length, key, value type, item type, item count
_LENGTH = struct.Struct("<Q")


class ArrayParts(Sequence):
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
                self._items = strings(self.plain, self.starts, self.lengths)
        return self._items

    def pairs(self) -> list[tuple[str, str]] | None:
        """A string array's items split at their one space ("left right" -> (left, right): a vocabulary's merges),
        all in one split; None where an item has no space or more than one, or the array is not of strings."""
        if self.starts is None:
            return None
        items = joined(self.plain, self.starts, self.lengths)
        # Each item's NUL mark, then its one space: nothing else may be either (a NUL or a second space in an item).
        found = items[np.flatnonzero((items == 0) | (items == 32))]
        if len(found) != 2 * len(self.starts) or found[0::2].any() or (found[1::2] != 32).any():
            return None
        try:
            flat = items.tobytes().decode("utf-8").replace("\x00", " ").split(" ")
        except UnicodeDecodeError:
            return None
        return list(zip(flat[1::2], flat[2::2]))


def joined(plain: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
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


def strings(plain: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> list[str]:
    """The strings at starts (each after its 8-byte length) decoded from UTF-8 in one call: joined's bytes
    decoded, then split at the NULs (one string at a time where a string holds a NUL itself).
    UnicodeDecodeError as str(bytes, "utf-8") raises it for a string that is not UTF-8."""
    try:
        text = joined(plain, starts, lengths).tobytes().decode("utf-8")
    except UnicodeDecodeError:
        text = None
    if text is None or text.count("\x00") != len(starts):
        buf = memoryview(plain)
        return [str(buf[s : s + n], "utf-8") for s, n in zip(starts.tolist(), lengths.tolist())]
    items = text.split("\x00")
    del items[0]
    return items


def array_field(reader, offs: int, head: list):
    """(field parts, data indices, types, size in bytes) of the flat array at offs in the host's byte order, its
    items left unmade; None for anything else (nested arrays: gguf's reader reads those)."""
    plain = reader.plain()
    itype = plain[offs : offs + 4].view(np.uint32)
    alen = plain[offs + 4 : offs + 12].view(np.uint64)
    if len(alen) != 1:
        raise ValueError("an array's header runs past the end of the file")
    count, kind, at = int(alen[0]), int(itype[0]), offs + 12
    parts = [*head, itype, alen]
    if kind in SCALARS:
        values = plain[at : at + count * np.dtype(SCALARS[kind]).itemsize].view(SCALARS[kind])
        if len(values) != count:
            raise ValueError(f"array of {count} runs past the end of the file")
        data = range(_HEAD, _HEAD + count)  # (a range, not a list of a vocabulary's worth of ints)
        return ArrayParts(parts, plain, values, None, None), data, [ValueType.ARRAY, ValueType(kind)], 12 + values.nbytes
    if kind != ValueType.STRING:
        return None
    path = getattr(reader.data, "filename", None)
    lengths = string_index.recall(plain, path, at, count) if path else None
    if lengths is None:
        lengths = walk(plain, at, count)
        if path:
            string_index.remember(path, at, count, lengths)
    starts = at + 8 + np.concatenate(([0], np.cumsum(lengths[:-1] + 8))) if count else np.zeros(0, dtype=np.int64)
    end = int(starts[-1] + lengths[-1]) if count else at
    data = range(_HEAD + 1, _HEAD + 2 * count, 2)
    return ArrayParts(parts, plain, None, starts, lengths), data, [ValueType.ARRAY, ValueType.STRING], end - offs


def walk(plain: np.ndarray, at: int, count: int) -> np.ndarray:
    """The lengths (int64 [count]) of the count strings from byte `at`, each after its 8-byte length prefix:
    one pass over the prefixes (each string's place depends on the one before)."""
    lengths, unpack, buf = [0] * count, _LENGTH.unpack_from, memoryview(plain)
    try:
        for i in range(count):
            n = unpack(buf, at)[0]
            lengths[i] = n
            at += 8 + n
    except struct.error:
        raise ValueError("a string runs past the end of the file") from None
    if at > len(plain):
        raise ValueError("a string runs past the end of the file")
    return np.array(lengths, dtype=np.int64)
