"""GGUF files: model facts, tokenizer, chat template and weights read from the file, against transformers.

Tiny random models are written as GGUF in each tensor type (metrale.gpu_worker.gguf_export, what llama.cpp's
converter does for these families) and read back by metrale and by transformers' GGUF loader; the real
SmolLM2-135M-Instruct Q4_1 file (fetched by README's test command) is checked the same way.
"""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch
from gguf_models import K_QUANTS, smollm2_path

from metrale import LLM, SamplingParams
from metrale.frontend.chat import ChatTemplate
from metrale.frontend.tokenizer import Tokenizer
from metrale.gguf_metadata import GgufError, hf_config, open_gguf
from metrale.gpu_worker.gguf_weights import gguf_tensors
from metrale.gpu_worker.loader import load_model
from metrale.model_facts import ModelError, resolve_model

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # transformers' GGUF loader needs it

TEXTS = [
    "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n",
    "The year 2024 has 365 days; π ≈ 3.14159.",
    "naïve café — déjà vu; Größe; 東京; привет; 🙂",
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
    "I'm sure they'll say we've   got\t\ttabs\n\n\nand   spaces   ",
    " leading space",
    "",
]
FACT_FIELDS = ("architecture", "model_type", "vocab_size", "max_model_len", "eos_token_ids", "layer_windows", "state_kind")
CONFIG_FIELDS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                 "intermediate_size", "tie_word_embeddings", "rope_theta", "bos_token_id")


def _hf_tokenizer(path):
    return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@pytest.fixture(scope="module")
def smollm2_tokenizers():
    """(ours, transformers') tokenizers of the SmolLM2 GGUF, loaded once for this module."""
    path = smollm2_path()
    return Tokenizer.from_dir(path), _hf_tokenizer(path)


def _hf_model(path):
    return transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()


# ---- model facts -------------------------------------------------------------------------------


@pytest.mark.parametrize("arch,kw", [("llama", {}), ("qwen3", {}), ("llama", {"tie_word_embeddings": True})])
def test_gguf_resolves_to_the_facts_of_the_folder_it_was_written_from(tiny_model_dir, tiny_gguf, arch, kw):
    folder, gguf = resolve_model(tiny_model_dir(arch, **kw)), resolve_model(tiny_gguf(arch, "q8_0", **kw))
    for name in FACT_FIELDS:
        assert getattr(gguf, name) == getattr(folder, name), name
    for key in CONFIG_FIELDS:
        assert gguf.config[key] == folder.config[key], key
    assert gguf.config["rms_norm_eps"] == pytest.approx(folder.config["rms_norm_eps"])
    assert gguf.config["torch_dtype"] == "bfloat16"  # a quantized file is served in bf16 unless told otherwise
    assert resolve_model(tiny_gguf(arch, "f32", **kw)).config["torch_dtype"] == "float32"


def test_a_folder_holding_one_gguf_resolves_to_it_and_two_are_refused(tiny_gguf, tmp_path):
    one = tmp_path / "one"
    one.mkdir()
    shutil.copy(tiny_gguf("llama", "q8_0"), one / "model.gguf")
    assert resolve_model(one).architecture == "LlamaForCausalLM"
    assert Tokenizer.from_dir(one).encode("hello") == Tokenizer.from_dir(one / "model.gguf").encode("hello")
    two = tmp_path / "two"
    two.mkdir()
    for name in ("model.gguf", "other.gguf"):
        shutil.copy(tiny_gguf("llama", "q8_0"), two / name)
    with pytest.raises(ModelError, match=r"2 GGUF files \(model.gguf, other.gguf\)"):
        resolve_model(two)


def test_smollm2_facts():
    facts = resolve_model(smollm2_path())
    # eos <|im_end|> (2), and <|endoftext|> (0), which llama.cpp ends a generation at by its text
    assert (facts.architecture, facts.vocab_size, facts.max_model_len, facts.eos_token_ids) == (
        "LlamaForCausalLM", 49152, 8192, (2, 0))
    assert facts.config["tie_word_embeddings"] and facts.config["num_hidden_layers"] == 30
    assert facts.config["hidden_size"] == 576 and facts.config["gguf"]["file_type"] == "MOSTLY_Q4_1"


# ---- tokenizer and chat template ------------------------------------------------------------------


def test_gguf_tokenizer_equals_the_folders_tokenizer(tiny_model_dir, tiny_gguf):
    folder, gguf = Tokenizer.from_dir(tiny_model_dir("llama")), Tokenizer.from_dir(tiny_gguf("llama", "f32"))
    for text in TEXTS:
        assert gguf.encode(text) == folder.encode(text), text
        assert gguf.encode(text, add_special_tokens=False) == folder.encode(text, add_special_tokens=False)
    assert (gguf.bos_token_id, gguf.eos_token_ids, gguf.pad_token_id) == (folder.bos_token_id, folder.eos_token_ids, folder.pad_token_id)
    assert gguf.special_token_ids == folder.special_token_ids and gguf.vocab_size == folder.vocab_size
    assert gguf.chat_template == folder.chat_template


@pytest.mark.parametrize("which", ["tiny", "smollm2"])
def test_gguf_tokenizer_encodes_and_decodes_as_transformers(tiny_gguf, which, request):
    if which == "tiny":
        path = tiny_gguf("llama", "q8_0")
        ours, theirs = Tokenizer.from_dir(path), _hf_tokenizer(path)
    else:
        path = smollm2_path()
        ours, theirs = request.getfixturevalue("smollm2_tokenizers")
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == theirs.encode(text), text
        assert ours.decode(ids, skip_special_tokens=False) == theirs.decode(ids, skip_special_tokens=False)
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True)
    assert ours.vocab_size == resolve_model(path).vocab_size  # (transformers' GPT-2 class adds <|endoftext|> to a vocabulary lacking it)


def test_smollm2_chat_template_renders_as_transformers(smollm2_tokenizers):
    tokenizer, theirs = smollm2_tokenizers
    template = ChatTemplate.load(smollm2_path(), tokenizer)
    for messages in (
        [{"role": "user", "content": "What is the capital of France?"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
         {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "2+2?"}],
    ):
        want = theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert template.render(messages) == want


# ---- weights ------------------------------------------------------------------------------------


@pytest.mark.parametrize("outtype", ["f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1", *K_QUANTS])
def test_gguf_tensors_are_transformers_dequantized_weights(tiny_gguf, outtype):
    # K-quant blocks need rows of 256: the "default" preset (hidden 256, intermediate 512).
    path = tiny_gguf("llama", outtype, **({"preset": "default"} if outtype in K_QUANTS else {}))
    config = hf_config(open_gguf(path), path=str(path))
    ours = dict(gguf_tensors(path, config))
    theirs = _hf_model(path).state_dict()
    theirs.pop("lm_head.weight")  # written untied: ours has it too, checked below
    assert set(theirs) <= set(ours)
    for name, tensor in theirs.items():
        # float tensors come as stored (F16 / BF16 views of the file), the rest as float32: equal as values
        torch.testing.assert_close(ours[name].float(), tensor.float(), rtol=0, atol=0, msg=name)


@pytest.mark.parametrize(
    "arch,outtype,kw",
    [("llama", "q8_0", {}), ("llama", "q4_1", {"tie_word_embeddings": True}), ("qwen2", "q4_0", {}),
     ("qwen3", "bf16", {"head_dim": 128}), ("mistral", "q5_0", {})],  # transformers reads no head_dim for qwen3
)
def test_gguf_greedy_tokens_equal_transformers(tiny_gguf, arch, outtype, kw):
    path = tiny_gguf(arch, outtype, **kw)
    prompts = [[1, 17, 305, 88, 1020, 45], [1, 9, 9, 700], list(range(1, 30))]
    # The dequantized weights multiplied dense, as transformers does (the quantized kernels quantize the
    # activations too: test_gguf_quant_types.py checks them against the same product).
    llm = LLM(str(path), dtype="float32", quantization="none", show_progress=False)
    ours = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    model = _hf_model(path)
    for prompt, out in zip(prompts, ours):
        want = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=None)
        assert out.token_ids == want[0, len(prompt):].tolist()


def test_smollm2_greedy_tokens_equal_transformers_and_answer():
    path = smollm2_path()
    llm = LLM(str(path), dtype="float32", quantization="none", show_progress=False)  # the dequantized weights
    prompt = ChatTemplate.load(path, llm.tokenizer).render([{"role": "user", "content": "What is the capital of France?"}])
    ids = llm.tokenizer.encode(prompt, add_special_tokens=False)
    out = llm.generate([ids], SamplingParams(max_tokens=12, temperature=0))[0]
    want = _hf_model(path).generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)[0, len(ids):].tolist()
    assert out.token_ids == want[: len(out.token_ids)] and (len(out.token_ids) == 12 or out.finish_reason == "stop")
    assert "Paris" in out.text


# ---- damaged files --------------------------------------------------------------------------------


def test_a_truncated_gguf_is_one_error_naming_the_tensor(tiny_gguf, tmp_path):
    src = tiny_gguf("llama", "q8_0")
    data = src.read_bytes()
    last = max(open_gguf(src).tensors, key=lambda t: t.data_offset)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) - 100])
    with pytest.raises(ModelError, match=rf"tensor {last.name}: .*truncated file"):
        resolve_model(cut)


def test_an_unknown_tensor_type_is_an_error_naming_the_tensor(tiny_gguf, tmp_path):
    bad = tmp_path / "bad.gguf"
    shutil.copy(tiny_gguf("llama", "q8_0"), bad)
    from gguf import GGUFReader

    reader = GGUFReader(str(bad), "r+")
    victim = reader.tensors[3]
    victim.field.parts[4][0] = 250  # the tensor info's ggml type
    reader.data.flush()
    del reader
    with pytest.raises(GgufError, match=rf"tensor {victim.name}: unknown ggml type 250"):
        open_gguf(bad)


def test_a_non_finite_weight_is_an_error_naming_the_tensor(tiny_gguf, tmp_path):
    bad = tmp_path / "nan.gguf"
    shutil.copy(tiny_gguf("llama", "q8_0"), bad)
    from gguf import GGMLQuantizationType, GGUFReader

    reader = GGUFReader(str(bad), "r+")
    victim = next(t for t in reader.tensors if t.tensor_type == GGMLQuantizationType.Q8_0)
    victim.data[0, 0:2] = np.array([np.nan], dtype=np.float16).view(np.uint8)  # the first block's scale
    reader.data.flush()
    del reader
    with pytest.raises(GgufError, match=rf"tensor {victim.name}: holds values that are not finite"):
        load_model(resolve_model(bad), dtype="float32", show_progress=False)


def test_end_of_generation_tokens_are_found_by_their_text_as_llama_cpp_finds_them(tmp_path):
    """A file that names only its eos still stops at <end_of_turn> (Gemma files without an eot key)."""
    import gguf

    from metrale.gguf_metadata import eos_token_ids

    path = tmp_path / "vocab.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("llama")
    writer.add_token_list(["<pad>", "<eos>", "<bos>", "hello", "<end_of_turn>", "<start_of_turn>"])
    writer.add_eos_token_id(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert eos_token_ids(open_gguf(path)) == [1, 4]
