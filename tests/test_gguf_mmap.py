"""A GGUF file loaded by mmap: tensors a kernel takes as stored used in place, the rest repacked once (issue 37).

The mapped load (the embedding read from the file's blocks, float tensors as views of the map, the repacking in
C, the map's pages released) must run the same tokens as the copying load it replaced, keep the file mapped
read-only, and hold no more than the file's tensor bytes plus the repacked copies.
"""

from __future__ import annotations

import mmap

import gguf
import numpy as np
import pytest
import torch
from gguf_models import K_QUANTS

from metrale import LLM, SamplingParams
from metrale.gguf_metadata import open_gguf
from metrale.gpu_worker import gguf_weights, loader
from metrale.gpu_worker.gguf_weights import mapped
from metrale.gpu_worker.layers import gguf_quant_types as qt
from metrale.gpu_worker.layers import cpu_kernels, gguf_repack
from metrale.gpu_worker.layers.gguf_embedding import GgufEmbedding, rows_to_floats
from metrale.gpu_worker.weight_memory import weight_bytes

PROMPTS = [[1, 17, 305, 88, 1020, 45], list(range(1, 40))]
GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
FAULT_AROUND = 64 << 10
TYPES = ["f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1", *K_QUANTS]


def _file(tiny_gguf, outtype: str, **kw):
    return tiny_gguf("llama", outtype, tie_word_embeddings=True, **({"preset": "default"} if outtype in K_QUANTS else {}), **kw)


def _copying_load(monkeypatch) -> None:
    """The load before the map was used in place: the embedding dequantized into a float table, every tensor
    copied into its parameter, the panels packed by torch, the map's pages kept."""
    monkeypatch.setattr(loader, "_embeds_in_place", lambda *a: False)
    monkeypatch.setattr(loader, "_in_place", lambda model, weights, gguf, group: weights)
    monkeypatch.setattr(gguf_repack, "available", lambda: False)
    monkeypatch.setattr(loader, "release_pages", lambda path: 0)


@pytest.mark.parametrize("outtype", TYPES)
def test_the_mapped_load_runs_the_copying_loads_tokens(tiny_gguf, monkeypatch, outtype):
    path = _file(tiny_gguf, outtype)
    llm = LLM(str(path), dtype="float32", show_progress=False)
    ours = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
    quantized = outtype not in ("f32", "f16", "bf16")
    assert isinstance(llm.runner.model.model.embed_tokens, GgufEmbedding) == quantized
    del llm
    with monkeypatch.context() as m:
        _copying_load(m)
        ref = LLM(str(path), dtype="float32", show_progress=False)
        assert not isinstance(ref.runner.model.model.embed_tokens, GgufEmbedding)
        assert ours == [o.token_ids for o in ref.generate(PROMPTS, GREEDY)]


def test_bfloat16_model_of_a_q8_0_file_runs_the_copying_loads_tokens(tiny_gguf, monkeypatch):
    # The embedding's rows dequantized in float32 then rounded, as the float table was.
    path = _file(tiny_gguf, "q8_0")
    ours = [o.token_ids for o in LLM(str(path), dtype="bfloat16", show_progress=False).generate(PROMPTS, GREEDY)]
    _copying_load(monkeypatch)
    assert ours == [o.token_ids for o in LLM(str(path), dtype="bfloat16", show_progress=False).generate(PROMPTS, GREEDY)]


@pytest.mark.parametrize("outtype", ["q8_0", "q4_1", "q5_0", *K_QUANTS])
def test_embedding_rows_are_the_dequantized_tables_rows(tiny_gguf, outtype):
    path = _file(tiny_gguf, outtype)
    tensor = next(t for t in open_gguf(path).tensors if t.name == "token_embd.weight")
    raw = np.asarray(tensor.data)
    table = gguf.quants.dequantize(raw, tensor.tensor_type)
    ids = torch.tensor([0, 5, 5, len(raw) - 1, 17])
    got = rows_to_floats(torch.from_numpy(raw.copy())[ids], tensor.tensor_type.name)
    assert torch.equal(got, torch.from_numpy(table[ids.numpy()]))


def test_the_file_stays_mapped_read_only_and_in_place_weights_are_views_of_it(tiny_gguf):
    # f32: the embedding table and the norms are the file's pages; the linear layers are repacked (not views).
    path = _file(tiny_gguf, "f32")
    data = open_gguf(path).data
    assert data._mmap is not None and not data.flags.writeable
    with pytest.raises(TypeError):
        data._mmap.write(b"x")  # an ACCESS_READ map
    model = LLM(str(path), dtype="float32", show_progress=False).runner.model
    assert mapped(model.model.embed_tokens.weight, path)
    assert mapped(model.model.norm.weight, path)
    assert mapped(model.model.layers[0].input_layernorm.weight, path)
    # q8_0: the embedding is the file's blocks; the layers' panels are the process's own.
    path = _file(tiny_gguf, "q8_0")
    model = LLM(str(path), dtype="float32", show_progress=False).runner.model
    embed = model.model.embed_tokens
    assert isinstance(embed, GgufEmbedding) and mapped(embed.weight, path)
    assert embed.weight.dtype == torch.uint8 and embed.qtype == "Q8_0"
    qkv = model.model.layers[0].self_attn.qkv_proj
    held = qkv.gguf_runs[0].product.args if qkv.gguf_runs is not None else [qkv.dequantized]  # no kernels: dense
    assert held and not any(mapped(t, path) for t in held)


def test_a_float_parameter_of_another_dtype_is_a_copy(tiny_gguf):
    # bfloat16 from an f32 file: every value converted, nothing aliases the map.
    path = _file(tiny_gguf, "f32")
    model = LLM(str(path), dtype="bfloat16", show_progress=False).runner.model
    assert not mapped(model.model.embed_tokens.weight, path)
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16


@pytest.mark.parametrize("outtype", ["f32", "q8_0", "q4_0", "q4_1", "q5_0"])
def test_resident_weight_bytes_stay_within_the_files_tensor_bytes(tiny_gguf, outtype):
    if outtype != "f32" and not cpu_kernels.available():
        pytest.skip("without the native kernels a quantized layer runs its dequantized weight dense")
    path = _file(tiny_gguf, outtype)
    llm = LLM(str(path), dtype="float32", show_progress=False)
    loaded = weight_bytes(llm.runner.model, path)
    assert loaded.mapped <= mmap.PAGESIZE * 4  # the pages read at load are released
    assert loaded.resident <= 1.1 * loaded.file_tensors, loaded
    llm.generate(PROMPTS, GREEDY)
    used = weight_bytes(llm.runner.model, path)
    assert used.own == loaded.own  # running allocates no weights
    # What faults back in is the in-place tensors' pages (the kernel maps up to 64 KiB around each fault).
    in_place = [t for t in llm.runner.model.parameters() if mapped(t, path)]
    assert used.mapped <= sum(t.nbytes for t in in_place) + len(in_place) * FAULT_AROUND, used


def test_the_copying_load_holds_more(tiny_gguf, monkeypatch):
    # The bound above can fail: the float table of a Q8_0 embedding is beside its head's panels.
    path = _file(tiny_gguf, "q8_0")
    _copying_load(monkeypatch)
    llm = LLM(str(path), dtype="float32", show_progress=False)
    loaded = weight_bytes(llm.runner.model, path)
    assert loaded.resident > 1.1 * loaded.file_tensors


def test_release_pages_drops_the_maps_resident_pages(tiny_gguf):
    path = _file(tiny_gguf, "q4_0")
    data = open_gguf(path).data
    assert int(np.asarray(data).sum(dtype=np.uint64)) > 0  # every page read
    from metrale.gpu_worker.weight_memory import _mapped_rss

    assert _mapped_rss(path) > 0
    assert gguf_weights.release_pages(path) > 0
    assert _mapped_rss(path) == 0


# ---- the C repacking against the torch path it replaces --------------------------------------------------------


def _random_blocks_raw(name: str, rows: int, cols: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    t = qt.TYPES[name]
    raw = rng.integers(0, 256, size=(rows, cols // t.block, t.nbytes), dtype=np.uint8)
    for at in t.halves:  # finite scales
        raw[:, :, at : at + 2] = rng.uniform(-0.1, 0.1, size=(rows, cols // t.block)).astype(np.float16).view(np.uint8).reshape(rows, -1, 2)
    return raw.reshape(rows, -1)


def _random_blocks(name: str, rows: int, cols: int, seed: int) -> qt.Blocks:
    return qt.decode(name, _random_blocks_raw(name, rows, cols, seed))


def _packers():
    return {
        "int8": qt.pack_int8_parts, "int4": qt.int4_pack, "int5": qt.pack_int5,
        "kq8": lambda parts: qt.pack_kq8(qt.merged([b for _, b in parts])),
    }


@pytest.mark.skipif(not gguf_repack.available(), reason="no C compiler")
@pytest.mark.parametrize("kernel,types", [
    ("int8", ["Q8_0"]), ("int8", ["Q8_0", "IQ4_NL"]), ("int4", ["Q4_1"]), ("int4", ["Q4_0", "Q4_K"]),
    ("int4", ["Q4_K", "Q4_1", "Q4_0"]), ("int5", ["Q5_0"]), ("int5", ["Q5_1", "Q5_0"]), ("kq8", ["Q6_K"]),
    ("kq8", ["Q4_K", "Q6_K", "Q5_K"]), ("kq8", ["IQ4_XS", "Q3_K", "Q2_K"]),
])
@pytest.mark.parametrize("rows", [16, 37, 1100])
def test_c_repacking_gives_the_torch_paths_bytes(monkeypatch, kernel, types, rows):
    parts = [(t, _random_blocks(t, rows + 5 * i, 512, seed=i)) for i, t in enumerate(types)]
    packed = _packers()[kernel](parts)
    monkeypatch.setattr(gguf_repack, "available", lambda: False)
    reference = _packers()[kernel](parts)
    assert len(packed) == len(reference)
    for got, want in zip(packed, reference):
        assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want)


@pytest.mark.skipif(not gguf_repack.available(), reason="no C compiler")
@pytest.mark.parametrize("kernel,types", [
    ("int8", ["Q8_0"]), ("int4", ["Q4_1"]), ("int4", ["Q4_0"]), ("int4", ["Q4_K"]), ("int4", ["Q4_K", "Q4_1", "Q4_0"]),
    ("int5", ["Q5_0"]), ("int5", ["Q5_1", "Q5_0"]), ("kq8", ["Q6_K"]), ("kq8", ["Q5_K"]), ("kq8", ["Q5_K", "Q6_K"]),
])
@pytest.mark.parametrize("rows", [16, 37, 300])
def test_stored_blocks_go_straight_to_the_decoded_paths_bytes(kernel, types, rows):
    # Rows read where they lie (here: every other row of a larger array, one row unfilled: zero blocks).
    raws, parts, held = [], [], []
    for i, t in enumerate(types):
        spaced = _random_blocks_raw(t, 2 * (rows + 5 * i), 512, seed=i)
        held.append(spaced)  # the addresses point into it
        raw = spaced[::2].copy()
        raw[3] = 0
        addresses = spaced.ctypes.data + np.arange(0, len(spaced), 2, dtype=np.int64) * spaced.strides[0]
        spaced[::2] = raw
        addresses[3] = 0
        raws.append((t, raw))
        parts.append((t, addresses))
    got = gguf_repack.from_stored(kernel, parts, 512)
    want = _packers()[kernel]([(t, qt.decode(t, raw)) for t, raw in raws])
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape and torch.equal(g, w)


def test_types_the_c_decoder_lacks_are_left_to_the_common_form():
    addresses = np.zeros(16, dtype=np.int64)
    assert gguf_repack.from_stored("kq8", [("Q6_K", addresses), ("Q3_K", addresses)], 256) is None
    assert gguf_repack.from_stored("int8", [("IQ4_NL", addresses)], 256) is None


# ---- metadata ---------------------------------------------------------------------------------------------


def test_metadata_parsed_in_one_pass_equals_gguf_readers(tiny_gguf):
    path = tiny_gguf("llama", "q8_0")
    ours, theirs = open_gguf(path), gguf.GGUFReader(str(path))
    assert list(ours.fields) == list(theirs.fields)
    for key, want in theirs.fields.items():
        got = ours.fields[key]
        assert got.types == want.types and list(got.data) == want.data, key
        assert [p.tobytes() for p in got.parts] == [p.tobytes() for p in want.parts], key
        assert [p.dtype for p in got.parts] == [p.dtype for p in want.parts], key
        assert got.contents() == want.contents(), key
        if want.types[:1] == [gguf.GGUFValueType.ARRAY] and want.data:
            assert got.contents(0) == want.contents(0) and got.contents(-1) == want.contents(-1), key
            assert got.contents(slice(1, 3)) == want.contents(slice(1, 3)), key
    assert any(f.types[:1] == [gguf.GGUFValueType.ARRAY] for f in theirs.fields.values())


# ---- q/k rows read in llama.cpp's order ---------------------------------------------------------------------


@pytest.mark.parametrize("outtype", ["q8_0", "q4_0"])
def test_q_and_k_blocks_are_read_in_the_models_row_order(tiny_gguf, monkeypatch, outtype):
    # llama.cpp permutes a llama's q/k rows; the blocks stay where the file has them and the layer reads them in the
    # model's order (gguf_linear.GGUF_ROWS). The dense load undoes the permutation on a copy of the floats instead.
    from metrale.model_facts import resolve_model

    path = tiny_gguf("llama", outtype)
    quantized = loader.load_model(resolve_model(path), dtype="float32", show_progress=False)
    monkeypatch.setattr(loader, "gguf_layer_kinds", lambda gguf, layer_of: {})  # every layer dense
    dense = loader.load_model(resolve_model(path), dtype="float32", show_progress=False)
    x = torch.randn(5, quantized.model.layers[0].self_attn.qkv_proj.in_features, generator=torch.Generator().manual_seed(0))
    for i in (0, len(dense.model.layers) - 1):
        got, want = quantized.model.layers[i].self_attn.qkv_proj(x), dense.model.layers[i].self_attn.qkv_proj(x)
        assert (got - want).norm() < 0.05 * want.norm(), i
