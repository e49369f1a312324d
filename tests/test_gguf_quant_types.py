"""GGUF tensor types kept quantized (layers/gguf_quant_types.py's table, layers/gguf_linear.py's method).

Per type: the table's decoding is gguf's own dequantization bit for bit, and the layer's product on every
instruction-set class this CPU has (the kernel_isa fixture) is x, quantized per block as the kernels do, times
gguf's dequantized weight, to float32's rounding of the sums, for float32, bfloat16 and float16 rows (the
answer in x's dtype). A stacked layer whose parts differ in type keeps each in its own; a tiny model written as
a K-quant mix (Q4_K_M's shape: Q4_K q/k, Q6_K v and down, Q5_0 up, Q8_0 head) serves the same greedy tokens as
its dequantized weights multiplied dense with the same activation codes.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from metrale import LLM, SamplingParams
from metrale.gpu_worker.layers import gguf_linear
from metrale.gpu_worker.layers import gguf_quant_types as qt
from metrale.gpu_worker.layers.gguf_linear import GgufLinearMethod, tagged
from metrale.gpu_worker.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from metrale.gpu_worker.layers.parallel import ParallelGroup
from metrale.gpu_worker.layers.quantization import _wide, quantize_activations

CPU = torch.device("cpu")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def random_blocks(name: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Rows of random `name` blocks (uint8 [rows, cols / block * nbytes]) with small positive fp16 scales."""
    t = qt.TYPES[name]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows, cols // t.block, t.nbytes), dtype=np.uint8)
    for at in t.halves:  # the fp16 scales
        scale = (rng.random((rows, cols // t.block)) * 2e-3 + 1e-4).astype(np.float16)
        raw[:, :, at : at + 2] = scale.view(np.uint8).reshape(rows, -1, 2)
    return raw.reshape(rows, -1)


def gguf_dequantized(name: str, raw: np.ndarray) -> torch.Tensor:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    return torch.from_numpy(np.array(dequantize(raw, GGMLQuantizationType[name]), dtype=np.float32))


def _reference(x: torch.Tensor, weight: torch.Tensor, wide: bool = False) -> torch.Tensor:
    """float64 x @ weight.T with x quantized per block (the kernels' integers, exactly); wide (the amx class's many
    bf16 rows through a kernel that takes them): x unquantized times the weight rounded to bf16, as those kernels do."""
    if wide and _wide(x):
        return x.double() @ weight.to(torch.bfloat16).double().T
    codes, scales = quantize_activations(x)
    xq = (codes.double().view(*scales.shape, 32) * scales.double()[..., None]).flatten(1)[:, : x.shape[1]]
    return xq @ weight.double().T


def _check(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    assert got.dtype == dtype and got.shape == want.shape
    tol = {torch.float32: 1e-5, torch.bfloat16: 2**-8, torch.float16: 2**-10}[dtype]  # float32 sums; one rounding
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol * float(want.abs().max()))


def _layer(name: str, raw: np.ndarray, cols: int, **method) -> ColumnParallelLinear:
    layer = ColumnParallelLinear(cols, raw.shape[0], dtype=torch.float32, device=CPU, quant_method=GgufLinearMethod(**method))
    layer.weight.weight_loader(layer.weight, tagged(raw, name))
    layer.process_weights_after_loading()
    return layer


@pytest.mark.parametrize("name", sorted(qt.TYPES))
def test_the_table_decodes_as_gguf_dequantizes(name):
    raw = random_blocks(name, 5, 512)
    assert torch.equal(qt.dequantize(qt.decode(name, raw)), gguf_dequantized(name, raw))
    assert qt.finite(name, raw)
    raw.reshape(-1, qt.TYPES[name].nbytes)[3, qt.TYPES[name].halves[-1] + 1] = 0x7C  # an fp16 inf or NaN
    assert not qt.finite(name, raw)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", sorted(qt.TYPES))
def test_each_type_multiplies_as_dequantize_then_matmul(kernel_isa, name, dtype):
    cols = 512
    raw = random_blocks(name, 37, cols)  # a ragged last panel
    layer = _layer(name, raw, cols)
    assert layer.gguf_runs is not None  # the kernel, not the dense fallback
    weight = gguf_dequantized(name, raw)
    wide = layer.wide and layer.gguf_runs[0].product.takes_wide  # the int8 and 4-bit kernels have the wide product
    for rows in (1, 3, 33):
        x = torch.randn(rows, cols).to(dtype)
        _check(layer(x), _reference(x, weight, wide), dtype)


def test_the_reference_method_is_the_dense_product():
    raw = random_blocks("Q6_K", 20, 256)
    x = torch.randn(4, 256)
    got = _layer("Q6_K", raw, 256, reference=True)(x)
    _check(got, _reference(x, gguf_dequantized("Q6_K", raw)), torch.float32)


@pytest.mark.parametrize("v_type", ["Q6_K", "Q4_K", "Q8_0"])
def test_a_stacked_layer_keeps_each_parts_type(kernel_isa, v_type):
    cols = 256
    parts = {"q": ("Q4_K", 64), "k": ("Q5_K", 32), "v": (v_type, 32)}
    layer = QKVParallelLinear(cols, 32, 2, 1, dtype=torch.float32, device=CPU, quant_method=GgufLinearMethod())
    raws = {}
    for seed, (shard, (name, rows)) in enumerate(parts.items()):
        raws[shard] = random_blocks(name, rows, cols, seed)
        layer.weight.weight_loader(layer.weight, tagged(raws[shard], name), shard)
    layer.process_weights_after_loading()
    assert layer.gguf_types == [name for name, _ in parts.values()]  # no part dequantized or re-typed
    assert len(layer.gguf_runs) == len({qt.TYPES[name].kernel for name, _ in parts.values()}) + (v_type == "Q4_K")
    weight = torch.cat([gguf_dequantized(name, raws[s]) for s, (name, _) in parts.items()])
    for dtype in DTYPES:
        x = torch.randn(3, cols).to(dtype)
        _check(layer(x), _reference(x, weight), dtype)


@pytest.mark.parametrize("rows", [16, 17, 32, 40, 70])
def test_many_bf16_rows_take_the_wide_product_in_every_run(kernel_isa, rows):
    # A Q4_K_M file's stacked qkv (Q5_0 q and k, Q8_0 v) beside a Q6_K and a Q4_K part: on the amx class every run
    # (int5, int8, kq8, int4) multiplies many bf16 rows by its weight dequantized to bf16 (AMX tiles), ragged row
    # tiles and a ragged last panel included; elsewhere each runs its int8 product.
    cols = 512
    parts = {"q": ("Q5_0", 48), "k": ("Q5_0", 16), "v": ("Q8_0", 16)}
    layer = QKVParallelLinear(cols, 16, 3, 1, dtype=torch.bfloat16, device=CPU, quant_method=GgufLinearMethod())
    raws = {s: random_blocks(name, n, cols, seed) for seed, (s, (name, n)) in enumerate(parts.items())}
    for shard, (name, _) in parts.items():
        layer.weight.weight_loader(layer.weight, tagged(raws[shard], name), shard)
    layer.process_weights_after_loading()
    tail = {name: random_blocks(name, 21, cols, 7) for name in ("Q6_K", "Q4_K", "Q5_1")}
    assert layer.wide == (kernel_isa == "amx")
    weight = torch.cat([gguf_dequantized(name, raws[s]) for s, (name, _) in parts.items()])
    x = torch.randn(rows, cols).bfloat16()
    _check(layer(x), _reference(x, weight, layer.wide), torch.bfloat16)
    for name, raw in tail.items():
        single = _layer(name, raw, cols)
        assert single.wide == (kernel_isa == "amx") and single.gguf_single is not None
        _check(single(x), _reference(x, gguf_dequantized(name, raw), single.wide), torch.bfloat16)


@pytest.mark.parametrize("name", ["Q4_1", "Q5_0", "Q6_K", "Q8_0"])
def test_a_row_parallel_ranks_columns_of_the_blocks_multiply_as_its_share(kernel_isa, name):
    # Its loader cuts the stored rows by columns (whole blocks): those go through it into a copy, the rest of a
    # layer's rows are read in place.
    cols, rows = 512, 48
    raw = random_blocks(name, rows, cols, seed=3)
    weight = gguf_dequantized(name, raw)
    for rank in range(2):
        layer = RowParallelLinear(cols, rows, dtype=torch.float32, device=CPU, quant_method=GgufLinearMethod(),
                                  group=ParallelGroup(rank=rank, size=2))
        layer.weight.weight_loader(layer.weight, tagged(raw, name))
        layer.process_weights_after_loading()
        x = torch.randn(3, cols // 2)
        _check(layer.quant_method.apply(layer, x), _reference(x, weight[:, rank * cols // 2 : (rank + 1) * cols // 2]), torch.float32)


def test_rows_loaded_twice_are_refused():
    raw = random_blocks("Q8_0", 16, 64)
    layer = ColumnParallelLinear(64, 16, dtype=torch.float32, device=CPU, quant_method=GgufLinearMethod())
    layer.weight.weight_loader(layer.weight, tagged(raw, "Q8_0"))
    layer.weight.weight_loader(layer.weight, tagged(raw, "Q8_0"))
    with pytest.raises(ValueError, match="loaded twice"):
        layer.process_weights_after_loading()


def test_a_type_without_a_row_is_refused_by_the_method():
    layer = ColumnParallelLinear(64, 16, dtype=torch.float32, device=CPU, quant_method=GgufLinearMethod())
    with pytest.raises(ValueError, match="known type"):
        layer.weight.weight_loader(layer.weight, torch.zeros(16, 64))


# A Q4_K_M-like mix: each tensor of the tiny model written in its own type (random blocks, small scales).
_MIX = {
    "attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q6_K", "attn_output": "Q5_K", "ffn_gate": "Q4_K",
    "ffn_up": "Q5_0", "ffn_down": "Q6_K", "token_embd": "Q6_K", "output": "Q8_0",
}


def _mix_encoder():
    import gguf

    seeds = iter(range(1000))

    def encode(name: str, values: np.ndarray):
        qtype = _MIX.get(name.split(".")[-2])
        if qtype is None or values.ndim != 2:
            return None
        return random_blocks(qtype, values.shape[0], values.shape[1], next(seeds)), gguf.GGMLQuantizationType[qtype]

    return encode


@pytest.mark.parametrize("tied", [False, True])
def test_a_k_quant_mix_serves_its_dequantized_models_tokens(tiny_model_dir, tmp_path, monkeypatch, tied):
    from metrale.gpu_worker.gguf_export import write_gguf

    src = tiny_model_dir("llama", preset="default", tie_word_embeddings=tied)
    path = write_gguf(src, tmp_path / "mix.gguf", "f32", encode=_mix_encoder())
    prompts = [[1, 17, 305, 88, 1020, 45], list(range(1, 40))]
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    llm = LLM(str(path), dtype="float32", show_progress=False)
    model = llm.runner.model
    assert model.model.layers[0].self_attn.qkv_proj.gguf_types == ["Q4_K", "Q6_K"]  # runs of rows by type
    assert model.model.layers[0].mlp.gate_up_proj.gguf_types == ["Q4_K", "Q5_0"]
    assert model.lm_head.gguf_types == ["Q6_K" if tied else "Q8_0"]
    ours = [o.token_ids for o in llm.generate(prompts, greedy)]
    del llm
    monkeypatch.setattr(gguf_linear, "_kernel", lambda name, device: None)  # every layer dense, same codes
    ref = LLM(str(path), dtype="float32", show_progress=False)
    assert ref.runner.model.model.layers[0].self_attn.qkv_proj.gguf_runs is None
    assert ours == [o.token_ids for o in ref.generate(prompts, greedy)]
