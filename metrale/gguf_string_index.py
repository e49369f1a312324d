"""Where a GGUF file's long string arrays (a vocabulary's tokens and merges) lay their items, remembered between
processes so that opening the file need not walk their length prefixes again.

Reaching the fields after an array means reading each of its strings' length in turn (each string's place
depends on the one before): the one part of opening a file that grows with its vocabulary, and each served
process opens it. The lengths found are kept under the cache directory (METRALE_CACHE_DIR, default
~/.cache/metrale, in `gguf-strings/`), named by the file's identity (path, size, mtime, inode) and the array's
place. They are checked against the file before use, every length against the prefix it claims to be (one
vectorised gather), so what is used is exactly what the walk would have found, even for a file changed in
place under the same identity; anything that fails the check is walked again and written anew.
"""

from __future__ import annotations

import hashlib
import os
import pathlib
import tempfile

import numpy as np

MIN_ITEMS = 1024  # shorter arrays walk in well under a millisecond: not worth a file
MAX_ENTRIES = 64  # the oldest beyond these are removed when one is written (files replaced, test files)


def cache_dir() -> pathlib.Path:
    """The directory the lengths are kept in."""
    return pathlib.Path(os.environ.get("METRALE_CACHE_DIR", pathlib.Path.home() / ".cache" / "metrale")) / "gguf-strings"


def _entry(path: str, at: int, count: int) -> pathlib.Path | None:
    """The cache file for the array of count strings whose first length prefix is at byte `at` of path; None when
    the file cannot be stat'ed."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    identity = f"{os.path.realpath(path)}\0{st.st_size}\0{st.st_mtime_ns}\0{st.st_ino}\0{st.st_dev}"
    return cache_dir() / f"{hashlib.sha256(identity.encode()).hexdigest()[:32]}-{at}-{count}.npy"


def recall(plain: np.ndarray, path: str, at: int, count: int) -> np.ndarray | None:
    """The lengths (int64 [count]) of the count strings at byte `at` of the file (plain: its bytes), as remembered
    and checked against the file; None when none are remembered or they do not match it."""
    entry = _entry(path, at, count) if count >= MIN_ITEMS else None
    if entry is None:
        return None
    try:
        lengths = np.load(entry, allow_pickle=False)
    except (OSError, ValueError, EOFError):
        return None
    if lengths.dtype != np.int64 or lengths.shape != (count,) or (lengths < 0).any():
        return None
    prefixes = at + np.concatenate(([0], np.cumsum(lengths[:-1] + 8)))  # where each string's length lies
    if int(prefixes[-1]) + 8 + int(lengths[-1]) > len(plain):
        return None
    stated = plain[prefixes[:, None] + np.arange(8)].view("<u8").reshape(-1)
    return lengths if np.array_equal(stated, lengths) else None


def remember(path: str, at: int, count: int, lengths: np.ndarray) -> None:
    """Keep the lengths found by walking the array (best effort: an unwritable cache is left alone)."""
    entry = _entry(path, at, count) if count >= MIN_ITEMS else None
    if entry is None:
        return
    tmp = None
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=entry.parent, suffix=".tmp", delete=False) as f:
            tmp = f.name
            np.save(f, np.ascontiguousarray(lengths, dtype=np.int64), allow_pickle=False)
        os.replace(tmp, entry)  # atomic: a process reading meanwhile sees the old file or the new one
        _prune(entry.parent)
    except OSError:
        if tmp is not None:
            pathlib.Path(tmp).unlink(missing_ok=True)


def _prune(directory: pathlib.Path) -> None:
    """Remove the oldest entries beyond MAX_ENTRIES (another process may be removing them too)."""
    entries = sorted(directory.glob("*.npy"), key=lambda p: p.stat().st_mtime_ns if p.exists() else 0)
    for old in entries[:-MAX_ENTRIES]:
        old.unlink(missing_ok=True)
