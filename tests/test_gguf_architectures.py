"""Every architecture metrale serves from a folder also from a GGUF file.

Each family's tiny random folder (tiny_model.py, or transformers' own checkpoint: tests/hf_models.py) is written
as a float32 GGUF the way llama.cpp's converter writes it (gguf_export: Llama's permuted q/k and Llama 3's
rope_freqs tensor, stacked experts, Gemma's 1 + w norms, Phi-3's fused projections and longrope factor tensors)
and read back: the same model facts and rotary, the same tokenizer, chat template and special tokens, and greedy
float32 tokens and logits equal to the folder's own run (itself checked against transformers in
test_model_parity.py). An architecture metrale does not serve is one line.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch
from test_model_parity import run_greedy

from metrale import LLM
from metrale.frontend.chat import ChatTemplate
from metrale.frontend.tokenizer import Tokenizer
from metrale.gguf_metadata import open_gguf
from metrale.gguf_rope import llama3_factors, rope_scaling_from_factors
from metrale.gpu_worker.gguf_export import write_gguf
from metrale.gpu_worker.layers.rope_scaling import RopeConfig, inv_freq
from metrale.gpu_worker.model_runner import ModelRunner
from metrale.model_facts import ModelError, resolve_model

pytest.importorskip("transformers")

_LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
_LONGROPE = {
    "rope_parameters": {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.1, 3.8],
        "long_factor": [1.0, 1.5, 2.5, 4.0, 6.0, 9.0, 13.0, 18.0],
    },
    "original_max_position_embeddings": 32,
}
# case -> (folder maker: "tiny" (tiny_model.py) or "hf" (transformers' own), its kind, config overrides)
CASES = {
    # Llama 3.1's rope: five blended dimensions fix the settings; one blended dimension (Llama 3's 1 and 4 assumed)
    "llama3-rope": ("tiny", "llama", {"head_dim": 32, "rope_scaling": {**_LLAMA3, "original_max_position_embeddings": 128}}),
    "llama3-rope-one-blended": ("tiny", "llama", {"rope_scaling": {**_LLAMA3, "original_max_position_embeddings": 16}}),
    "mistral": ("tiny", "mistral", {}),
    "qwen2": ("tiny", "qwen2", {}),
    "qwen3": ("tiny", "qwen3", {}),
    "mixtral": ("hf", "mixtral", {}),
    "qwen3_moe": ("hf", "qwen3_moe", {}),
    "qwen3_moe-dense-layer": ("hf", "qwen3_moe", {"mlp_only_layers": [1]}),
    "gemma2": ("hf", "gemma2", {}),
    "gemma3": ("hf", "gemma3", {}),
    "phi3": ("hf", "phi3", {}),
    "phi3-longrope": ("hf", "phi3", _LONGROPE),
    "phi3-partial-rotary": ("hf", "phi3", {"partial_rotary_factor": 0.5}),
    "olmo2": ("hf", "olmo2", {}),
}
FACT_FIELDS = ("architecture", "model_type", "vocab_size", "max_model_len", "max_position_embeddings", "eos_token_ids",
               "rope_type", "layer_windows", "state_kind")
# Prompts past the sliding windows (8) and longrope's original length (32): from the start, as
# test_model_parity does (the runner and transformers part ways on a row crossing it mid-generation).
PROMPT_LENS = {"phi3-longrope": (3, 5, 33)}


@pytest.fixture(scope="module")
def folder_and_gguf(tiny_model_dir, hf_model_dir, tmp_path_factory):
    """case -> (its folder, that folder written as a float32 GGUF), built once per module."""
    built: dict[str, tuple] = {}

    def make(case: str):
        if case not in built:
            maker, kind, kw = CASES[case]
            folder = (tiny_model_dir if maker == "tiny" else hf_model_dir)(kind, **kw)
            built[case] = folder, write_gguf(folder, tmp_path_factory.mktemp(f"gguf-{case}") / f"{case}.gguf")
        return built[case]

    return make


def _head_dim(config: dict) -> int:
    return int(config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"])


@pytest.mark.parametrize("case", list(CASES))
def test_gguf_states_the_facts_and_rotary_of_its_folder(folder_and_gguf, case):
    folder, gguf = (resolve_model(p) for p in folder_and_gguf(case))
    for name in FACT_FIELDS:
        assert getattr(gguf, name) == getattr(folder, name), name
    for layer_type in ("full_attention", "sliding_attention"):
        head_dim = _head_dim(folder.config)
        assert RopeConfig.from_hf(gguf.config, head_dim, layer_type) == RopeConfig.from_hf(folder.config, head_dim, layer_type)


@pytest.mark.parametrize("case", list(CASES))
def test_gguf_greedy_tokens_and_logits_equal_its_folders(folder_and_gguf, case, plans):
    folder, gguf = folder_and_gguf(case)
    runs = []
    for path in (folder, gguf):
        runner = ModelRunner(path, dtype="float32", num_kv_blocks=256, show_progress=False)
        rng = np.random.default_rng(5)
        prompts = [rng.integers(16, runner.info.vocab_size, size=n).tolist() for n in PROMPT_LENS.get(case, (3, 12, 20))]
        runs.append(run_greedy(runner, prompts, 10, plans))
    for i, (ours, theirs) in enumerate(zip(*runs)):
        assert theirs.out == ours.out, f"{case}: prompt {i} diverges"
        worst = max(float(np.abs(a - b).max()) for a, b in zip(ours.logits, theirs.logits))
        assert worst < 1e-5, f"{case}: prompt {i} logits differ by {worst}"


@pytest.mark.parametrize("case", ["llama3-rope", "mistral", "qwen2", "qwen3", "mixtral", "qwen3_moe", "gemma2", "gemma3", "phi3", "olmo2"])
def test_gguf_tokenizer_chat_template_and_special_tokens_are_the_folders(folder_and_gguf, case):
    folder, gguf = folder_and_gguf(case)
    ours, theirs = Tokenizer.from_dir(gguf), Tokenizer.from_dir(folder)
    # (no whitespace right after a special token: llama.cpp strips it after Phi-3's, by the model's name)
    text = "<|im_start|>user\nWhat is 2+2?<|im_end|>"
    assert ours.encode(text) == theirs.encode(text)
    assert (ours.bos_token_id, ours.eos_token_ids, ours.pad_token_id) == (theirs.bos_token_id, theirs.eos_token_ids, theirs.pad_token_id)
    messages = [{"role": "user", "content": "Hi"}]
    assert ChatTemplate.load(gguf, ours).render(messages) == ChatTemplate.load(folder, theirs).render(messages)


@pytest.mark.parametrize("case", ["phi3", "gemma3", "mixtral"])
def test_a_q8_0_file_keeps_each_familys_layers_quantized_near_its_dequantized_run(folder_and_gguf, case, tmp_path):
    """Phi-3's fused qkv and gate_up, Gemma's projections and Mixtral's attention stay int8 as stored (Mixtral's
    48-wide expert rows, no whole number of Q8_0 blocks, stored F16 as llama.cpp's converter does); the first
    greedy token and its log-probability are those of the dequantized weights, up to the int8 products' error."""
    from metrale import SamplingParams
    from metrale.gpu_worker.gguf_weights import gguf_layer_kinds
    from metrale.gpu_worker.loader import _layer_of
    from metrale.gpu_worker.models.registry import model_class

    folder, _ = folder_and_gguf(case)
    path = write_gguf(folder, tmp_path / f"{case}.q8_0.gguf", "q8_0")
    facts = resolve_model(path)
    kinds = gguf_layer_kinds(path, _layer_of(model_class(facts.architecture)))
    fused = "model.layers.0.self_attn.qkv_proj"
    assert kinds[fused] == "int8" and (case != "phi3" or kinds["model.layers.0.mlp.gate_up_proj"] == "int8")
    prompts = [[1, 17, 305, 88, 1020, 45], [1, 9, 9, 700, 33, 12, 14, 55]]
    params = SamplingParams(max_tokens=1, temperature=0, logprobs=1)
    kept = LLM(str(path), dtype="float32", show_progress=False).generate(prompts, params)
    dense = LLM(str(path), dtype="float32", quantization="none", show_progress=False).generate(prompts, params)
    for a, b in zip(kept, dense):
        assert a.token_ids == b.token_ids
        assert a.logprobs[0].logprob == pytest.approx(b.logprobs[0].logprob, abs=0.15)


def test_gemma_norms_are_stored_plus_one_and_experts_stacked(folder_and_gguf):
    """What llama.cpp's converter writes (and llama.cpp reads): Gemma's norm weights as 1 + w, experts as one
    [n_expert, rows, cols] tensor per projection and layer."""
    from safetensors.torch import load_file

    folder, gguf = folder_and_gguf("gemma3")
    stored = {t.name: np.asarray(t.data) for t in open_gguf(gguf).tensors}
    w = load_file(str(folder / "model.safetensors"))["model.layers.0.pre_feedforward_layernorm.weight"].numpy()
    np.testing.assert_array_equal(stored["blk.0.ffn_norm.weight"], w + np.float32(1))
    assert "output.weight" not in stored  # tied
    folder, gguf = folder_and_gguf("mixtral")
    stored = {t.name: np.asarray(t.data) for t in open_gguf(gguf).tensors}
    assert stored["blk.1.ffn_gate_exps.weight"].shape == (4, 48, 64)
    assert stored["blk.1.ffn_down_exps.weight"].shape == (4, 64, 48)
    assert stored["blk.1.ffn_gate_inp.weight"].shape == (4, 64)


def test_a_mixtral_file_with_one_tensor_per_expert_loads_as_the_stacked_one(folder_and_gguf, tmp_path):
    """Mixtral files written before llama.cpp stacked experts (blk.N.ffn_gate.E.weight), which llama.cpp still reads."""
    from metrale.gpu_worker.gguf_weights import gguf_tensors

    folder, stacked = folder_and_gguf("mixtral")
    legacy = write_gguf(folder, tmp_path / "legacy.gguf", one_tensor_per_expert=True)
    assert "blk.0.ffn_up.3.weight" in {t.name for t in open_gguf(legacy).tensors}
    config = resolve_model(stacked).config
    ours, theirs = dict(gguf_tensors(legacy, resolve_model(legacy).config)), dict(gguf_tensors(stacked, config))
    assert ours.keys() == theirs.keys() and "model.layers.1.mlp.experts.3.down_proj.weight" in ours
    for name, tensor in theirs.items():
        torch.testing.assert_close(ours[name], tensor, rtol=0, atol=0, msg=name)


def test_gemma3_without_a_pattern_key_slides_five_layers_in_six(hf_model_dir, tmp_path):
    """llama.cpp's fixed Gemma 3 pattern when the file states none (its converter writes none)."""
    layer_types = ["sliding_attention"] * 5 + ["full_attention"] + ["sliding_attention"] * 2
    folder = hf_model_dir("gemma3", num_hidden_layers=8, layer_types=layer_types)
    gguf = write_gguf(folder, tmp_path / "g.gguf")
    assert "gemma3.attention.sliding_window_pattern" not in open_gguf(gguf).fields
    assert resolve_model(gguf).layer_windows == resolve_model(folder).layer_windows == (8,) * 5 + (None,) + (8,) * 2


def test_rope_freqs_that_no_llama3_settings_give_are_divided_as_llama_cpp_does():
    theta, dim = 10000.0, 16
    odd = np.array([1.0, 1.0, 1.7, 2.9, 3.0, 3.5, 6.0, 8.0], dtype=np.float32)
    scaling = rope_scaling_from_factors(odd, theta, dim)
    assert scaling["rope_type"] == "default" and scaling["freq_factors"] == pytest.approx(odd.tolist())
    cfg = {"rope_theta": theta, "rope_scaling": scaling, "max_position_embeddings": 64}
    plain = {"rope_theta": theta, "max_position_embeddings": 64}
    ours = inv_freq(RopeConfig.from_hf(cfg, dim), torch.device("cpu"))
    torch.testing.assert_close(ours, inv_freq(RopeConfig.from_hf(plain, dim), torch.device("cpu")) / torch.from_numpy(odd))
    # and factors that llama3 settings do give are those settings
    params = {**_LLAMA3, "original_max_position_embeddings": 8192}
    assert rope_scaling_from_factors(llama3_factors(params, 500000.0, 128).astype(np.float32), 500000.0, 128) == params


def _bert_gguf(path):
    import gguf

    writer = gguf.GGUFWriter(str(path), "bert")
    writer.add_block_count(1)
    writer.add_embedding_length(8)
    writer.add_head_count(2)
    writer.add_tokenizer_model("gpt2")  # a tokenizer metrale reads: the architecture is what it refuses
    writer.add_token_list(["a", "b", "ab", "<s>"])
    writer.add_token_types([1, 1, 1, 3])
    writer.add_token_merges(["a b"])
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_an_unserved_architecture_is_one_line_naming_it(tmp_path):
    path = _bert_gguf(tmp_path / "bert.gguf")
    with pytest.raises(ModelError) as err:
        resolve_model(path)
    message = str(err.value)
    assert "\n" not in message and "GGUF architecture 'bert' is not served (served from GGUF: llama," in message
    with pytest.raises(ModelError, match="GGUF architecture 'bert' is not served"):
        LLM(str(path), show_progress=False)
    result = subprocess.run([sys.executable, "-m", "metrale.cli", "serve", "--model", str(path)], capture_output=True,
                            text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert lines[-1].startswith("metrale serve: error: ") and "GGUF architecture 'bert' is not served" in lines[-1]
