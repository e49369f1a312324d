"""Every --dtype with every weight source on every CPU path this box can force: each cell answers.

Flags were tested one at a time, and `--dtype float16` with a GGUF failed every request (the quantized kernels
answered float32 rows, and the next kernel refused the mix). Here each cell — a dtype (auto, float32, bfloat16,
float16, vLLM's `half`) × a weight source (HF folder fp32 and bf16; GGUF F16, BF16, Q8_0, Q4_0, Q4_1, Q4_K,
Q5_K, Q6_K and a Q4_K_M-style mix; `--quantization int8/int4`) × a CPU path (each native kernel class the CPU
runs, and torch's ops) — runs one short greedy request. It must end with tokens, every log-probability finite,
and its first token's top log-probabilities close to the same source served in float32 on the same path, within
the dtype's rounding. The other families (Gemma, Phi-3, OLMo 2, the MoE and recurrent ones) run float16 with
each quantization on the process's own path. A sample of cells runs through `metrale serve`.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from conftest import _kernel_classes, use_kernel_class
from gguf_models import random_k_quant_encoder

from metrale import LLM, SamplingParams
from metrale.model_facts import resolve_model

PROMPT = "def fibonacci(n):"
DTYPES = ("auto", "float32", "bfloat16", "float16", "half")
# GGUF tensor types a file is written in (K-quants as random blocks of small scale, see gguf_models.py).
GGUF_TYPES = ("f16", "bf16", "q8_0", "q4_0", "q4_1", "q4_k", "q5_k", "q6_k", "q4_k_m")
SOURCES = ("hf-fp32", "hf-bf16", *(f"gguf-{t}" for t in GGUF_TYPES), "int8", "int4")
PATHS = (*_kernel_classes(), "torch")
# How far a first-token probability may move from the float32 run of the same weights (in probability, where a
# token's weight in the answer lies, not in log space, where an unlikely token's rounding looks large): bfloat16
# keeps 8 bits of mantissa and float16 11, through a couple of layers and logits of magnitude ~30 (tiny models'
# logits are peaked on purpose), and the quantized products' int8 activations turn a rounding of x into a whole
# code step; float32 differs only in the order of its sums. Garbage (an overflow, a wrong layout, a dtype mix-up)
# moves the mass elsewhere and loses the first choice.
TOLERANCE = {"float32": 1e-3, "bfloat16": 0.1, "float16": 0.1}
TOP = 5
# The K-quants' block scale: random codes times a smaller scale keep every activation inside float16's range, as
# a trained model's do (random blocks at gguf_models' default scale overflow float16 in the first layer).
K_SCALE = 2e-4
# Shapes whose rows are whole 256-value K-quant super-blocks.
SHAPE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, head_dim=64)


def _q4_k_m(name: str, values: np.ndarray):
    """llama.cpp's Q4_K_M mix: Q6_K for attn_v and ffn_down, Q4_K for the rest (a fused qkv of two types)."""
    kind = "q6_k" if (".attn_v." in name or ".ffn_down." in name) else "q4_k"
    return random_k_quant_encoder(kind, scale=K_SCALE)(name, values)


@pytest.fixture(scope="module")
def sources(tiny_model_dir, tmp_path_factory):
    """source name -> (model path, LLM keyword arguments)."""
    from metrale.gpu_worker.gguf_export import write_gguf

    fp32 = tiny_model_dir("llama", **SHAPE)
    out = {"hf-fp32": (fp32, {}), "hf-bf16": (tiny_model_dir("llama", dtype="bfloat16", **SHAPE), {})}
    root = tmp_path_factory.mktemp("dtype-matrix")
    for kind in GGUF_TYPES:
        path = root / f"tiny.{kind}.gguf"
        if kind == "q4_k_m":
            write_gguf(fp32, path, "f32", encode=_q4_k_m)
        elif kind in ("q4_k", "q5_k", "q6_k"):
            write_gguf(fp32, path, "f32", encode=random_k_quant_encoder(kind, scale=K_SCALE))
        else:
            write_gguf(fp32, path, kind)
        out[f"gguf-{kind}"] = (path, {})
    out["int8"] = (fp32, {"quantization": "int8"})
    out["int4"] = (fp32, {"quantization": "int4"})
    return out


@pytest.fixture
def cpu_path(request, monkeypatch):
    """Force one CPU path for the test: a native kernel class, or torch's ops."""
    path = request.param
    if path == "torch":
        monkeypatch.setenv("METRALE_CPU_KERNELS", "torch")
    else:
        use_kernel_class(path, monkeypatch)
    return path


def _first_token(path, dtype: str, **kw) -> tuple[list[int], dict[int, float]]:
    """One greedy request: (its token ids, the first token's top log-probabilities)."""
    llm = LLM(str(path), dtype=dtype, **kw)
    try:
        out = llm.generate([PROMPT], SamplingParams(max_tokens=3, temperature=0, logprobs=TOP))[0].outputs[0]
    finally:
        llm.close()
    assert out.finish_reason == "length" and len(out.token_ids) == 3, out
    for step in out.logprobs:
        assert all(math.isfinite(lp) for lp in (step.logprob, *step.top_logprobs)), step
    first = out.logprobs[0]
    return out.token_ids, dict(zip(first.top_ids, first.top_logprobs))


def _assert_close(reference: dict[int, float], top: dict[int, float], tolerance: float) -> None:
    """The float32 run's first choice is among this run's top, and every token both list has its probability
    within tolerance of the float32 run's."""
    assert max(reference, key=reference.get) in top, (reference, top)
    for tok in set(reference) & set(top):
        assert abs(math.exp(top[tok]) - math.exp(reference[tok])) <= tolerance, (tok, reference, top)


_references: dict[tuple[str, str], dict[int, float]] = {}


@pytest.mark.parametrize("cpu_path", PATHS, indirect=True)
@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_every_dtype_with_every_source_answers_close_to_float32(sources, cpu_path, source, dtype):
    path, kw = sources[source]
    key = (cpu_path, source)
    if key not in _references:
        _references[key] = _first_token(path, "float32", **kw)[1]
    reference = _references[key]
    _, top = _first_token(path, dtype, **kw)
    served = {"auto": resolve_model(path).config["torch_dtype"], "half": "float16"}.get(dtype, dtype)
    _assert_close(reference, top, TOLERANCE[served])


FAMILIES = ("gemma2", "gemma3", "phi3", "olmo2", "qwen3_moe", "mixtral", "bamba")


@pytest.mark.parametrize("quantization", [None, "int8", "int4"])
@pytest.mark.parametrize("kind", FAMILIES)
def test_every_family_answers_in_float16_with_each_quantization(hf_model_dir, kind, quantization):
    kw = {"quantization": quantization} if quantization else {}
    path = hf_model_dir(kind)
    reference = _first_token(path, "float32", **kw)[1]
    _, top = _first_token(path, "float16", **kw)
    _assert_close(reference, top, TOLERANCE["float16"])


SERVED_CELLS = [
    pytest.param("smollm2", ("--dtype", "half"), id="smollm2-q4_1-half"),
    pytest.param("gguf-q8_0", ("--dtype", "float16", "--quantization", "int4"), id="q8_0-float16-int4"),
]


@pytest.mark.slow
@pytest.mark.parametrize("source,flags", SERVED_CELLS)
def test_metrale_serve_answers_in_float16(sources, source, flags):
    """The crash a user met: `metrale serve --model FILE.gguf --dtype half` answered every request with a 500."""
    import openai
    from gguf_models import smollm2_path
    from serve_fixture import free_port, running_server

    path = smollm2_path() if source == "smollm2" else sources[source][0]
    port = free_port()
    with running_server(path, "--http-port", str(port), *flags):
        with openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=120) as api:
            if source == "smollm2":
                reply = api.chat.completions.create(
                    model=path.name, temperature=0, max_tokens=16,
                    messages=[{"role": "system", "content": "Answer in one short sentence."},
                              {"role": "user", "content": "What is the capital of France?"}])
                assert "Paris" in reply.choices[0].message.content
            else:
                reply = api.completions.create(model=path.name, prompt=PROMPT, temperature=0, max_tokens=4)
                assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == 4
