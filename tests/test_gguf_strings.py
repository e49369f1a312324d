"""A GGUF's string arrays read in bulk (metrale/gguf_arrays.py): the vocabulary decoded in one call and the merges
split in one, giving what gguf's reader gives item by item, and falling back to it for items the bulk path
cannot take (a NUL inside an item, a merge without exactly one space, bytes that are not UTF-8)."""

from __future__ import annotations

import gguf
import pytest

from metrale.gguf_metadata import field, open_gguf, split_pairs

TOKENS = ["a", "", "héllo", "日本語", "Ġthe", "<|im_end|>", "x" * 300, "\n", "\t\t", "é"]
MERGES = ["a b", "Ġ t", "h é", "日 本", "Ġt he", "é é"]


def _write(tmp_path, arrays: dict[str, list], name: str = "strings.gguf"):
    """A tensorless GGUF file holding these string arrays (and one scalar between them)."""
    path = tmp_path / name
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, items in arrays.items():
        writer.add_array(key, items)
        writer.add_uint32(key + ".after", 7)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _theirs(path, key: str) -> list[str]:
    return gguf.GGUFReader(str(path)).fields[key].contents()


@pytest.mark.parametrize("tokens", [TOKENS, ["only"], ["a\x00b", "c", "\x00"], ["", ""]])
def test_strings_read_in_bulk_are_gguf_readers(tmp_path, tokens):
    path = _write(tmp_path, {"tokenizer.ggml.tokens": tokens})
    reader = open_gguf(path)
    assert field(reader, "tokenizer.ggml.tokens") == _theirs(path, "tokenizer.ggml.tokens") == tokens
    assert field(reader, "tokenizer.ggml.tokens.after") == 7  # the scan ends where the array does


@pytest.mark.parametrize("merges", [MERGES, ["a b c", "d"], ["ab", "c d e"], ["a b", "c  d"], [" a", "b "], ["a\x00b c"]])
def test_merges_split_in_bulk_are_split_at_their_first_space(tmp_path, merges):
    path = _write(tmp_path, {"tokenizer.ggml.merges": merges})
    want = [tuple(m.split(" ", 1)) for m in _theirs(path, "tokenizer.ggml.merges")]
    assert split_pairs(open_gguf(path), "tokenizer.ggml.merges") == want
    assert split_pairs(open_gguf(path), "tokenizer.ggml.absent") == []


@pytest.mark.parametrize("key", ["tokenizer.ggml.tokens", "tokenizer.ggml.merges"])
def test_a_string_that_is_not_utf8_is_refused(tmp_path, key):
    path = _write(tmp_path, {key: ["a b", "b \u00e8"]})
    data = path.read_bytes()
    at = data.index("\u00e8".encode())
    path.write_bytes(data[:at] + b"\xff\xfe" + data[at + 2 :])  # the same length, not UTF-8
    with pytest.raises(UnicodeDecodeError):
        field(open_gguf(path), key)
    with pytest.raises(UnicodeDecodeError):
        split_pairs(open_gguf(path), key)


def test_the_bulk_path_sees_each_string_after_one_nul(tmp_path):
    # (the bulk decode falls back to one string at a time when its bytes are wrong, so check them directly)
    from metrale.gguf_arrays import joined

    path = _write(tmp_path, {"tokenizer.ggml.tokens": TOKENS})
    parts = open_gguf(path).fields["tokenizer.ggml.tokens"].parts
    assert joined(parts.plain, parts.starts, parts.lengths).tobytes() == b"".join(b"\0" + t.encode() for t in TOKENS)
