"""Weight-only quantization: int8 in blocks of 32 (Q8_0) and 4-bit grouped linear methods, --quantization, and
GGUF layers that stay quantized (their blocks as stored, tests/test_gguf_quant_types.py checks each type).

The kernels quantize each activation row to int8 per block of 32 as llama.cpp does. Parity is against the
dequantized reference (`int8-dequantized` / `int4-dequantized`): the same weight codes and the same activation
codes, multiplied dense in float32, which differs from the kernels only by the order of float32 sums, so greedy
tokens are equal in float32. What quantizing the activations costs against the unquantized product is bounded
on its own (test_activation_quantization_error_is_bounded). The kernels themselves are checked on every
instruction-set class in test_quant_kernels.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf_models import smollm2_path

from metrale import LLM, SamplingParams
from metrale.config import EngineArgs
from metrale.gguf_metadata import open_gguf
from metrale.frontend.chat import ChatTemplate
from metrale.gpu_worker.gguf_weights import gguf_tensors
from metrale.gpu_worker.layers.linear import QKVParallelLinear
from metrale.gpu_worker.layers.linear_method import DenseLinearMethod
from metrale.gpu_worker.layers.quantization import (
    WIDE_ROWS,
    Int4LinearMethod,
    Int8LinearMethod,
    dequantize_int4,
    dequantize_int8,
    linear_methods,
    quantize_activations,
    quantize_int4,
    quantize_int8,
)
from metrale.gpu_worker.loader import load_model
from metrale.model_facts import resolve_model

PROMPTS = [[1, 17, 305, 88, 1020, 45], [1, 9, 9, 700], list(range(1, 30))]
GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)


def _layer(method, w: torch.Tensor, dtype=torch.float32) -> QKVParallelLinear:
    """A q/k/v layer (2 heads, 1 KV head of 32) holding w, loaded split as a checkpoint stores it."""
    layer = QKVParallelLinear(w.shape[1], 32, 2, 1, dtype=dtype, device=torch.device("cpu"), quant_method=method)
    for shard, part in zip("qkv", w.split([64, 32, 32])):
        layer.weight_loader(layer.weight, part, shard)
    layer.process_weights_after_loading()
    return layer


def _quantized_product(x: torch.Tensor, weight: torch.Tensor, wide: bool = False) -> torch.Tensor:
    """float64 x @ weight.T with x quantized per block as the kernels do (the integers' exact product, summed in
    float64); for the rows a wide layer (the amx class) multiplies by its weight in bf16, that product instead."""
    if wide and x.dtype == torch.bfloat16 and x.shape[0] >= WIDE_ROWS:
        return x.double() @ weight.bfloat16().double().T
    codes, scales = quantize_activations(x)
    xq = (codes.double().view(*scales.shape, 32) * scales.double()[..., None]).flatten(1)[:, : x.shape[1]]
    return xq @ weight.double().T


def test_int8_quantizes_per_block_of_32_as_q8_0():
    w = torch.randn(8, 96)
    w[0, :32] = 0  # a block of zeros: scale 0, codes 0
    q, d = quantize_int8(w)
    assert q.dtype == torch.int8 and d.dtype == torch.float16 and d.shape == (8, 3)
    step = d.float().repeat_interleave(32, 1)
    assert bool(((dequantize_int8(q, d) - w).abs() <= step / 2 + 1e-6).all())  # half a step
    assert int(q[0, :32].abs().sum()) == 0 and float(d[0, 0]) == 0
    again = quantize_int8(dequantize_int8(q, d))  # a Q8_0 file's values give back its codes and scales
    assert torch.equal(again[0], q) and torch.equal(again[1], d)


@pytest.mark.parametrize("rows", [1, 5, 40])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_layer_multiplies_its_codes_by_the_quantized_input(dtype, rows):
    w, x = torch.randn(128, 96), torch.randn(rows, 96)
    layer = _layer(Int8LinearMethod(), w, dtype)
    assert layer.qweight.dtype == torch.int8 and layer.weight.numel() == 0  # the float weight is released
    got, want = layer(x.to(dtype)).double(), _quantized_product(x.to(dtype), dequantize_int8(layer.qweight, layer.qscale), layer.wide)
    tol = 1e-5 if dtype == torch.float32 else 2**-8  # float32 sums; bf16's one rounding of the result
    torch.testing.assert_close(got, want, rtol=tol, atol=tol * float(want.abs().max()))


@pytest.mark.parametrize("rows", [1, 5, 40])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int4_layer_multiplies_its_codes_by_the_quantized_input(dtype, rows):
    w, x = torch.randn(128, 96), torch.randn(rows, 96)
    q, s, z = quantize_int4(w)
    dequantized = dequantize_int4(q, s, z)
    assert bool(((dequantized - w).abs() <= s.repeat_interleave(32, 1) * 0.51).all())  # half a step
    layer = _layer(Int4LinearMethod(), w, dtype)
    got, want = layer(x.to(dtype)).double(), _quantized_product(x.to(dtype), dequantized, layer.wide)
    tol = 1e-5 if dtype == torch.float32 else 2**-8
    torch.testing.assert_close(got, want, rtol=tol, atol=tol * float(want.abs().max()))


@pytest.mark.parametrize("rows", [3, 40])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("method", [Int8LinearMethod, Int4LinearMethod])
def test_the_reference_is_the_kernels_product_in_float32(method, dtype, rows):
    w, x = torch.randn(128, 96), torch.randn(rows, 96).to(dtype)
    ours, ref = _layer(method(), w, dtype)(x).float(), _layer(method(reference=True), w, dtype)(x).float()
    tol = 1e-5 if dtype == torch.float32 else 2**-7  # float32 sums; both round the result to bf16 once
    torch.testing.assert_close(ours, ref, rtol=tol, atol=tol * float(ref.abs().max()))


def test_activation_quantization_error_is_bounded():
    # Per block of 32 a code's rounding is at most half a step (block absmax / 254): the product's error is about
    # half a percent of its size, and an outlier coarsens only its own block.
    w, x = torch.randn(256, 512) / 512**0.5, torch.randn(4, 512)

    def error(x: torch.Tensor) -> float:
        codes, scales = quantize_activations(x)
        xq = (codes.float().view(4, 16, 32) * scales[..., None]).flatten(1)
        assert bool(((xq - x).abs() <= scales.repeat_interleave(32, 1) / 2 + 1e-6).all())
        return float((xq @ w.T - x @ w.T).norm() / (x @ w.T).norm())

    assert error(x) < 0.01
    x[:, 7] = 100.0
    assert error(x) < 0.02


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_quantized_greedy_tokens_equal_the_dequantized_reference_in_float32(tiny_model_dir, arch, kind):
    src = str(tiny_model_dir(arch))
    ours = LLM(src, dtype="float32", quantization=kind, show_progress=False).generate(PROMPTS, GREEDY)
    ref = LLM(src, dtype="float32", quantization=f"{kind}-dequantized", show_progress=False).generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in ours] == [r.token_ids for r in ref]


def test_gguf_layers_keep_their_stored_kind(tiny_gguf):
    def methods(path, quantization=None):
        model = load_model(resolve_model(path), dtype="float32", show_progress=False, quantization=quantization)
        layers = [model.model.layers[0].self_attn.qkv_proj, model.model.layers[0].mlp.down_proj, model.lm_head]
        return [type(m.quant_method).__name__ + (":codes" if getattr(m.quant_method, "codes", False) else "") for m in layers]

    assert methods(tiny_gguf("llama", "q8_0")) == ["GgufLinearMethod"] * 3  # the file's blocks, each type's kernel
    assert methods(tiny_gguf("llama", "q4_1")) == ["GgufLinearMethod"] * 3
    assert methods(tiny_gguf("llama", "q5_0")) == ["GgufLinearMethod"] * 3
    assert methods(tiny_gguf("llama", "f16")) == ["DenseLinearMethod"] * 3
    assert methods(tiny_gguf("llama", "q4_1"), "int4") == ["Int4LinearMethod:codes"] * 3  # read off the blocks
    assert methods(tiny_gguf("llama", "q4_1"), "none") == ["DenseLinearMethod"] * 3
    assert methods(tiny_gguf("llama", "q4_1"), "int8") == ["Int8LinearMethod"] * 3
    assert methods(tiny_gguf("llama", "f16"), "int4") == ["Int4LinearMethod"] * 3  # quantized from the floats


@pytest.mark.parametrize("outtype", ["q4_0", "q4_1", "q4_k"])
def test_gguf_4bit_codes_are_the_files_weights_exactly(tiny_gguf, outtype):
    # Codes, scales and offsets read off the blocks reproduce gguf's own dequantization, and in float32 the
    # 4-bit kernel on them runs the same greedy tokens as their reference.
    path = tiny_gguf("llama", outtype, **({"preset": "default"} if outtype == "q4_k" else {}))
    config = resolve_model(path).config
    coded = dict(gguf_tensors(path, config, wants_codes=lambda name: True))
    checked = 0
    for name, values in gguf_tensors(path, config):
        base = name.removesuffix(".weight")
        if base + ".qweight" in coded:
            got = dequantize_int4(coded[base + ".qweight"], coded[base + ".scales"], coded[base + ".zeros"])
            torch.testing.assert_close(got, values, rtol=0, atol=1e-6 * float(values.abs().max()))
            checked += 1
    assert checked > 0
    codes = LLM(str(path), dtype="float32", quantization="int4", show_progress=False)
    method = codes.runner.model.model.layers[0].mlp.gate_up_proj.quant_method
    assert isinstance(method, Int4LinearMethod) and method.codes
    ref = LLM(str(path), dtype="float32", quantization="int4-dequantized", show_progress=False)
    assert [o.token_ids for o in codes.generate(PROMPTS, GREEDY)] == [o.token_ids for o in ref.generate(PROMPTS, GREEDY)]


def test_q8_0_codes_and_scales_are_the_files_own(tiny_gguf):
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    checked = 0
    for tensor in open_gguf(tiny_gguf("llama", "q8_0")).tensors:
        if tensor.tensor_type.name != "Q8_0":
            continue
        raw = np.asarray(tensor.data)
        blocks = raw.reshape(raw.shape[0], -1, 34)  # fp16 scale, then 32 int8 codes
        values = torch.from_numpy(np.array(dequantize(raw, GGMLQuantizationType.Q8_0), dtype=np.float32))
        q, d = quantize_int8(values)
        assert torch.equal(d.view(torch.int16), torch.from_numpy(np.ascontiguousarray(blocks[..., :2]).view(np.int16)[..., 0]))
        assert torch.equal(q, torch.from_numpy(np.ascontiguousarray(blocks[..., 2:]).view(np.int8)).reshape(q.shape))
        checked += 1
    assert checked > 0


def test_q8_0_gguf_runs_int8_like_its_dequantized_reference(tiny_gguf):
    path = str(tiny_gguf("llama", "q8_0"))
    ours = LLM(path, dtype="float32", show_progress=False).generate(PROMPTS, GREEDY)
    ref = LLM(path, dtype="float32", quantization="int8-dequantized", show_progress=False).generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in ours] == [r.token_ids for r in ref]


@pytest.mark.parametrize("source,quantization", [("q8_0", None), ("f32", "int8"), ("f32", "int4")])
def test_a_tied_head_gets_its_own_quantized_table(tiny_gguf, source, quantization):
    path = str(tiny_gguf("llama", source, tie_word_embeddings=True))
    llm = LLM(path, dtype="float32", quantization=quantization, show_progress=False)
    head, embed = llm.runner.model.lm_head, llm.runner.model.model.embed_tokens
    assert not isinstance(head.quant_method, DenseLinearMethod) and not head.shares_weight
    assert embed.weight.numel() > 0  # the lookup keeps the table
    kind = quantization or "int8"
    ref = LLM(path, dtype="float32", quantization=f"{kind}-dequantized", show_progress=False)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == [o.token_ids for o in ref.generate(PROMPTS, GREEDY)]


def test_an_unknown_quantization_is_refused():
    with pytest.raises(ValueError, match="quantization must be one of"):
        EngineArgs(quantization="int3").validate()
    with pytest.raises(ValueError, match="quantization must be one of"):
        linear_methods("fp8")
    assert isinstance(linear_methods(None)("model.layers.0.mlp.down_proj"), DenseLinearMethod)


# SmolLM2 in bf16 (int8 weights re-quantized in blocks of 32 from its Q4_1 file, greedy). Each layer's product is
# within one bf16 rounding of the reference's (test_int8_layer_*), but quantizing the activations makes the network
# discontinuous: a rounding anywhere upstream moves some activation codes across a rounding boundary, so over 30
# layers the kernel and its reference differ about as much as either differs from the dense model (in float32
# too). The bounds are that error of the format's (the logits after the prompt, of magnitude ~25, and the share of
# the answers before their first difference), with room for the paths each class takes; a wrong kernel lands far
# outside them.
SMOLLM2_BF16_MIN_COMMON_PREFIX = 0.4
SMOLLM2_BF16_MAX_LOGIT_ERROR = 2.0
SMOLLM2_QUESTIONS = ["What is the capital of France?", "Name three primary colors.", "What is 2 + 2?",
                     "Who wrote Romeo and Juliet?", "What is the boiling point of water?", "Say hello in Spanish."]


def test_smollm2_int8_bf16_agrees_with_its_dequantized_reference(plans):
    path = smollm2_path()
    runs = {q: LLM(str(path), dtype="bfloat16", quantization=q, show_progress=False) for q in ("int8", "int8-dequantized")}
    template = ChatTemplate.load(path, runs["int8"].tokenizer)
    prompts = [runs["int8"].tokenizer.encode(template.render([{"role": "user", "content": q}]), add_special_tokens=False)
               for q in SMOLLM2_QUESTIONS]
    outs = {q: llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)) for q, llm in runs.items()}
    common = np.mean([_common_prefix(a.token_ids, b.token_ids) / 24 for a, b in zip(outs["int8"], outs["int8-dequantized"])])
    logits = {q: _last_logits(llm, prompts[0], plans) for q, llm in runs.items()}
    error = float((logits["int8"] - logits["int8-dequantized"]).abs().max())
    print(f"common prefix {common:.3f}, max logit error {error:.4f}")
    assert common >= SMOLLM2_BF16_MIN_COMMON_PREFIX
    assert error <= SMOLLM2_BF16_MAX_LOGIT_ERROR


def _common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens two outputs share."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _last_logits(llm: LLM, prompt: list[int], plans) -> torch.Tensor:
    """The float32 logits after the prompt (one prefill step through the runner's forward-only path)."""
    plan = plans.make_plan([plans.Row(prompt, 0, plans.blocks_for(0, len(prompt) + 1))])
    return llm.runner.forward_only(plan)[0].float()
