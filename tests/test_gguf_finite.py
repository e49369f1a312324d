"""A GGUF tensor whose blocks hold a scale that is not finite (inf, NaN) is an error naming it, wherever the check
is made: the C packing checks a GGUF-typed layer's blocks in its own pass (gguf_repack.NonFiniteScales), the layer
itself where it packs or dequantizes without C, the weight stream (gguf_weights.py) everything else."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch
from gguf_models import K_QUANTS

from metrale.gguf_metadata import GgufError, open_gguf
from metrale.gpu_worker.layers import gguf_quant_types as qt
from metrale.gpu_worker.layers import gguf_repack
from metrale.gpu_worker.loader import load_model
from metrale.model_facts import resolve_model

BAD = {"inf": np.float16(np.inf), "nan": np.float16(np.nan)}


def _spoiled(src, tmp_path, tensor: str, half: int, value: str):
    """A copy of the file with one block's scale (the half at byte `half` of the tensor's 3rd row's first block)
    made inf or NaN; the tensor's name."""
    bad = tmp_path / "bad.gguf"
    shutil.copy(src, bad)
    t = next(t for t in open_gguf(src).tensors if t.name == tensor)
    at = t.data_offset + 2 * t.data.shape[1] + half
    with open(bad, "r+b") as f:
        f.seek(at)
        f.write(BAD[value].tobytes())
    return bad


@pytest.mark.parametrize("outtype", ["q8_0", "q4_0", "q4_1", "q5_0", "q5_1", *K_QUANTS])
@pytest.mark.parametrize("c_packing", [True, False])
def test_a_non_finite_scale_in_a_layer_is_an_error_naming_its_tensor(tiny_gguf, tmp_path, monkeypatch, outtype, c_packing):
    src = tiny_gguf("llama", outtype, **({"preset": "default"} if outtype in K_QUANTS else {}))
    victim = next(t for t in open_gguf(src).tensors if t.name.endswith("ffn_down.weight") and t.tensor_type.name in qt.TYPES)
    if not c_packing:
        monkeypatch.setattr(gguf_repack, "available", lambda: False)
    for half in qt.TYPES[victim.tensor_type.name].halves:
        for value in BAD:
            bad = _spoiled(src, tmp_path, victim.name, half, value)
            with pytest.raises(GgufError, match=rf"tensor {victim.name}: holds values that are not finite"):
                load_model(resolve_model(bad), dtype="float32", show_progress=False)


@pytest.mark.skipif(not gguf_repack.available(), reason="no C compiler")
@pytest.mark.parametrize("kernel,name", [("int8", "Q8_0"), ("int4", "Q4_0"), ("int4", "Q4_1"), ("int4", "Q4_K"),
                                         ("int5", "Q5_0"), ("int5", "Q5_1"), ("kq8", "Q5_K"), ("kq8", "Q6_K")])
def test_the_c_packing_refuses_a_non_finite_scale(kernel, name):
    t = qt.TYPES[name]
    rows, cols = 37, 512
    raw = np.zeros((rows, cols // t.block * t.nbytes), dtype=np.uint8)
    addresses = raw.ctypes.data + np.arange(rows, dtype=np.int64) * raw.strides[0]
    assert gguf_repack.from_stored(kernel, [(name, addresses)], cols) is not None
    for row in (0, 20, rows - 1):
        for half in t.halves:
            spoiled = raw.copy()
            spoiled[row, t.nbytes + half : t.nbytes + half + 2] = np.frombuffer(BAD["nan"].tobytes(), np.uint8)
            at = spoiled.ctypes.data + np.arange(rows, dtype=np.int64) * spoiled.strides[0]
            with pytest.raises(gguf_repack.NonFiniteScales):
                gguf_repack.from_stored(kernel, [(name, at)], cols)
    assert torch.equal(gguf_repack.from_stored(kernel, [(name, addresses)], cols)[0],
                       gguf_repack.from_stored(kernel, [(name, addresses)], cols)[0])
