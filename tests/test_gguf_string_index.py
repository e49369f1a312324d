"""The lengths of a GGUF's long string arrays remembered between processes (metrale/gguf_string_index.py): used
only where every one matches the file, so a file rewritten in place under the same identity still reads as it
now is; a missing, damaged or unwritable cache only means walking the arrays again."""

from __future__ import annotations

import os

import gguf
import pytest

from metrale import gguf_arrays, gguf_reader, gguf_string_index

N = gguf_string_index.MIN_ITEMS + 7


def _write(path, tokens: list[str]) -> None:
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_array("tokenizer.ggml.tokens", tokens)
    writer.add_uint32("after", 11)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("METRALE_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache" / "gguf-strings"


def _tokens(path) -> list[str]:
    reader = gguf_reader.read(str(path))
    assert reader.fields["after"].contents() == 11
    return reader.fields["tokenizer.ggml.tokens"].contents()


def test_a_second_open_reads_the_remembered_lengths_without_walking(tmp_path, cache, monkeypatch):
    path = tmp_path / "v.gguf"
    tokens = [f"t{i}" * (i % 5 + 1) for i in range(N)]
    _write(path, tokens)
    assert _tokens(path) == tokens
    assert len(list(cache.iterdir())) == 1

    def no_walk(*a):
        raise AssertionError("walked the prefixes again")

    monkeypatch.setattr(gguf_arrays, "walk", no_walk)
    assert _tokens(path) == tokens


def test_a_file_rewritten_under_the_same_identity_reads_as_it_now_is(tmp_path, cache):
    path = tmp_path / "v.gguf"
    old = ["ab", "c"] * (N // 2) + ["d"]
    new = ["a", "bc"] * (N // 2) + ["d"]  # the same count and bytes, other lengths
    _write(path, old)
    assert _tokens(path) == old
    stat = os.stat(path)
    rewritten = tmp_path / "w.gguf"
    _write(rewritten, new)
    with open(path, "r+b") as f:  # in place: the same inode and size
        f.write(rewritten.read_bytes())
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    now = os.stat(path)
    assert (now.st_ino, now.st_size, now.st_mtime_ns) == (stat.st_ino, stat.st_size, stat.st_mtime_ns)
    assert _tokens(path) == new


def test_a_damaged_or_unwritable_cache_only_means_walking_again(tmp_path, cache, monkeypatch):
    path = tmp_path / "v.gguf"
    tokens = [str(i) for i in range(N)]
    _write(path, tokens)
    assert _tokens(path) == tokens
    (entry,) = cache.iterdir()
    entry.write_bytes(b"not an array")
    assert _tokens(path) == tokens
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    monkeypatch.setenv("METRALE_CACHE_DIR", str(blocked))  # its gguf-strings/ cannot be made
    assert _tokens(path) == tokens


def test_the_cache_keeps_only_the_newest_entries(tmp_path, cache, monkeypatch):
    monkeypatch.setattr(gguf_string_index, "MAX_ENTRIES", 2)
    for i in range(4):
        path = tmp_path / f"v{i}.gguf"
        _write(path, [str(j + i) for j in range(N)])
        _tokens(path)
    assert len(list(cache.glob("*.npy"))) == 2
