"""The tiny-model maker: HF layout per architecture, determinism, tokenizer, peaked logits, cache, CLI."""

from __future__ import annotations

import importlib.util
import json
import pathlib
import threading

import numpy as np
import pytest
from safetensors import safe_open

from metrale.gpu_worker import tiny_model
from metrale.gpu_worker.tiny_model import SPECIAL_TOKENS, default_model_dir, make_tiny_model

FILES = {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json", "tokenizer_config.json"}
ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    "arch, architecture, model_type",
    [
        ("llama", "LlamaForCausalLM", "llama"),
        ("qwen2", "Qwen2ForCausalLM", "qwen2"),
        ("qwen3", "Qwen3ForCausalLM", "qwen3"),
        ("mistral", "MistralForCausalLM", "mistral"),
    ],
)
def test_each_arch_writes_a_hugging_face_folder(arch, architecture, model_type, tiny_model_dir):
    path = tiny_model_dir(arch)
    assert FILES <= {p.name for p in path.iterdir()}
    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == [architecture] and config["model_type"] == model_type
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "lm_head.weight" in names and "model.layers.1.mlp.down_proj.weight" in names
    assert ("model.layers.0.self_attn.q_proj.bias" in names) == (arch == "qwen2")
    assert ("model.layers.0.self_attn.q_norm.weight" in names) == (arch == "qwen3")
    if arch == "qwen3":
        assert config["head_dim"] != config["hidden_size"] // config["num_attention_heads"]


def test_same_seed_same_bytes_other_seed_other_weights(tmp_path):
    a = make_tiny_model(tmp_path / "a", "llama", seed=3, num_hidden_layers=1)
    b = make_tiny_model(tmp_path / "b", "llama", seed=3, num_hidden_layers=1)
    c = make_tiny_model(tmp_path / "c", "llama", seed=4, num_hidden_layers=1)
    for name in FILES:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()
    assert (a / "tokenizer.json").read_bytes() == (c / "tokenizer.json").read_bytes()


def test_overrides_replace_preset_fields_and_tied_models_omit_lm_head(tmp_path):
    path = make_tiny_model(
        tmp_path / "m", "mistral", tie_word_embeddings=True, num_hidden_layers=1, intermediate_size=96
    )
    config = json.loads((path / "config.json").read_text())
    assert (config["num_hidden_layers"], config["intermediate_size"], config["hidden_size"]) == (1, 96, 64)
    assert config["tie_word_embeddings"] is True
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        assert "lm_head.weight" not in set(f.keys())


def test_presets_have_the_documented_shapes():
    keys = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "intermediate_size")
    small = tiny_model.PRESETS["bench-small"]
    assert tuple(small[k] for k in keys) == (1024, 16, 16, 8, 2816) and small["vocab_size"] == 32000
    tiny = tiny_model.PRESETS["bench-tiny"]
    assert (tiny["hidden_size"], tiny["num_hidden_layers"], tiny["intermediate_size"]) == (512, 8, 1408)


def test_tokenizer_round_trips_utf8_and_adds_bos(tiny_model_dir):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tiny_model_dir("llama") / "tokenizer.json"))
    assert 2000 <= tok.get_vocab_size() <= 4000
    for i, special in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(special) == i
    texts = ["def f(x):\n    return x + 1\n", "naïve 東京 🙂 \x00\t", "<think>plan</think><tool_call>{}</tool_call>"]
    for text in texts:
        enc = tok.encode(text)
        assert enc.ids[0] == tok.token_to_id("<s>")
        assert tok.decode(enc.ids, skip_special_tokens=False) == "<s>" + text
    enc = tok.encode("<think>", add_special_tokens=False)
    assert enc.ids == [tok.token_to_id("<think>")]


def test_chat_template_renders_roles_and_generation_prompt(tiny_model_dir):
    transformers = pytest.importorskip("transformers")
    tok = transformers.AutoTokenizer.from_pretrained(tiny_model_dir("llama"))
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == "<s><|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert not tok.apply_chat_template(messages, tokenize=False).endswith("assistant\n")
    assert tok.eos_token == "</s>" and tok.bos_token == "<s>"


def test_logits_are_peaked(tiny_model_dir, plans):
    from metrale.gpu_worker.model_runner import ModelRunner

    runner = ModelRunner(tiny_model_dir("llama"), device="cpu", num_kv_blocks=8, show_progress=False)
    prompt = np.random.default_rng(0).integers(16, 2048, size=40).tolist()
    rows = [plans.Row(prompt[:n], 0, [1, 2, 3]) for n in range(8, 41, 4)]
    gaps = []
    for row in rows:
        runner.execute(plans.make_plan([row]))
        top = np.sort(runner.read_logits()[0])[-2:]
        gaps.append(top[1] - top[0])
    assert np.median(gaps) > 0.5, gaps


def test_default_model_dir_builds_once_even_when_raced(tmp_path, monkeypatch):
    monkeypatch.setenv("METRALE_CACHE_DIR", str(tmp_path))
    results, errors = [], []

    def build():
        try:
            results.append(default_model_dir())
        except Exception as exc:  # surfaced by the assert below
            errors.append(exc)

    threads = [threading.Thread(target=build) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors and len(results) == 2 and results[0] == results[1]
    path = results[0]
    assert path.parent == tmp_path and FILES <= {p.name for p in path.iterdir()}
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temp dir left behind
    assert default_model_dir() == path
    config = json.loads((path / "config.json").read_text())
    assert (config["hidden_size"], config["num_hidden_layers"]) == (256, 4)


def test_cli_writes_a_model(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("make_tiny_model_cli", ROOT / "scripts" / "make_tiny_model.py")
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)
    assert cli.main(["--arch", "qwen2", "--out", str(tmp_path / "q"), "--dtype", "bfloat16", "--seed", "5"]) == 0
    config = json.loads((tmp_path / "q" / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForCausalLM"] and config["torch_dtype"] == "bfloat16"
    assert str(tmp_path / "q") in capsys.readouterr().out
