"""Tiny random Llama-family models in Hugging Face layout, with a locally trained tokenizer.

Tests, demos and benchmarks need a model folder that looks exactly like a real checkpoint
(config.json, model.safetensors, generation_config.json, tokenizer.json, tokenizer_config.json)
without downloading anything. The weights are random — the text such a model writes is noise — but
deterministic from a seed, and scaled so the logits are peaked (the top-1 token wins by a clear
margin), which makes greedy parity against other implementations meaningful rather than a coin
toss decided by float rounding.

Written with torch + safetensors + tokenizers only; transformers is a test-only dependency.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import shutil
import sys
import sysconfig
import tempfile
from typing import Any

import torch
from safetensors.torch import save_file

ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
    "mistral": ("MistralForCausalLM", "mistral"),
}

# Special tokens, in id order (they are the first ids of the vocabulary).
PAD, BOS, EOS = "<pad>", "<s>", "</s>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
THINK, THINK_END = "<think>", "</think>"
TOOL_CALL, TOOL_CALL_END = "<tool_call>", "</tool_call>"
SPECIAL_TOKENS = [PAD, BOS, EOS, IM_START, IM_END, THINK, THINK_END, TOOL_CALL, TOOL_CALL_END]

TOKENIZER_VOCAB_SIZE = 2048

# A ChatML-style template. It opens with the bos token (as Llama 3's does), so a chat prompt is
# tokenized with add_special_tokens=False; plain text gets bos from the tokenizer's post-processor.
CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Standard-library sources the tokenizer is trained on: present in every CPython, read locally.
_CORPUS_FILES = (
    "os.py",
    "textwrap.py",
    "string.py",
    "functools.py",
    "json/__init__.py",
    "json/decoder.py",
    "json/encoder.py",
    "collections/__init__.py",
    "dataclasses.py",
    "contextlib.py",
)

PRESETS: dict[str, dict[str, Any]] = {
    "test": dict(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=None,  # the tokenizer's size
        max_position_embeddings=512,
    ),
    "default": dict(
        hidden_size=256,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        intermediate_size=512,
        vocab_size=None,
        max_position_embeddings=2048,
    ),
    "bench-tiny": dict(
        hidden_size=512,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        intermediate_size=1408,
        vocab_size=32000,
        max_position_embeddings=4096,
    ),
    "bench-small": dict(
        hidden_size=1024,
        num_hidden_layers=16,
        num_attention_heads=16,
        num_key_value_heads=8,
        intermediate_size=2816,
        vocab_size=32000,
        max_position_embeddings=4096,
    ),
}

_ROPE_THETA = {"llama": 10000.0, "qwen2": 1000000.0, "qwen3": 1000000.0, "mistral": 10000.0}

# Bump when the output of make_tiny_model changes, so cached default models are rebuilt.
FORMAT_VERSION = 1

_LOGIT_STD = 8.0  # std of a logit over the vocabulary: peaked enough for greedy parity


def make_tiny_model(
    out_dir: str | os.PathLike,
    arch: str = "llama",
    *,
    preset: str = "test",
    seed: int = 0,
    dtype: str = "float32",
    tie_word_embeddings: bool = False,
    rope_scaling: dict | None = None,
    **overrides: Any,
) -> pathlib.Path:
    """Write a random model of `arch` in Hugging Face layout into out_dir and return its path."""
    if arch not in ARCHITECTURES:
        raise ValueError(f"unknown arch {arch!r}; expected one of {sorted(ARCHITECTURES)}")
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; expected one of {sorted(PRESETS)}")
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer()
    config = _model_config(arch, preset, dtype, tie_word_embeddings, rope_scaling, tokenizer, overrides)
    tensors = _random_weights(config, arch, seed, tokenizer.get_vocab_size())
    torch_dtype = _TORCH_DTYPES[dtype]
    tensors = {name: t.to(torch_dtype).contiguous() for name, t in tensors.items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    _write_json(out / "config.json", config)
    write_tokenizer(out, tokenizer, model_max_length=config["max_position_embeddings"])
    return out


def write_tokenizer(out_dir: str | os.PathLike, tokenizer=None, *, model_max_length: int) -> Any:
    """Write the tiny tokenizer's files (tokenizer.json, tokenizer_config.json, generation_config.json) into
    out_dir, training it unless given; returns it. Model folders made elsewhere (tests save transformers'
    own random models) get the same tokenizer and stop ids this way."""
    out = pathlib.Path(out_dir)
    tokenizer = tokenizer or train_tokenizer()
    _write_json(out / "generation_config.json", _generation_config(tokenizer))
    tokenizer.save(str(out / "tokenizer.json"))
    _write_json(out / "tokenizer_config.json", _tokenizer_config(model_max_length))
    return tokenizer


def default_model_dir() -> pathlib.Path:
    """Build the "default" preset once into the cache dir (atomically) and return its folder."""
    return cached_model_dir(f"tiny-llama-default-v{FORMAT_VERSION}-py{sys.version_info[0]}{sys.version_info[1]}", "default")


def cached_model_dir(name: str, preset: str, dtype: str = "float32") -> pathlib.Path:
    """The preset's random Llama in $METRALE_CACHE_DIR (default ~/.cache/metrale)/name, built once: into a
    temp folder renamed into place, so concurrent builders never see half a model."""
    cache = pathlib.Path(os.environ.get("METRALE_CACHE_DIR") or pathlib.Path.home() / ".cache" / "metrale")
    final = cache / name
    if (final / "config.json").exists():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=final.parent))
    try:
        make_tiny_model(tmp, "llama", preset=preset, seed=0, dtype=dtype)
        tmp.chmod(0o755)  # mkdtemp makes it private; the cached model is for every user of the cache
        try:
            os.rename(tmp, final)  # atomic; fails if another process got there first
        except OSError:
            if not (final / "config.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def train_tokenizer():
    """Train the byte-level BPE tokenizer deterministically on local stdlib sources."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB_SIZE,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus_lines(), trainer=trainer)
    bos_id = tokenizer.token_to_id(BOS)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    return tokenizer


def _corpus_lines():
    """Yield the training corpus: fixed stdlib files, in a fixed order."""
    stdlib = pathlib.Path(sysconfig.get_paths()["stdlib"])
    for rel in _CORPUS_FILES:
        path = stdlib / rel
        if path.exists():
            yield from path.read_text(encoding="utf-8").splitlines(keepends=True)
    # A little non-ASCII text so multi-byte merges exist (byte-level covers the rest anyway).
    yield "naïve café — déjà vu; Größe; 東京; привет; 🙂\n"


def _model_config(arch, preset, dtype, tie, rope_scaling, tokenizer, overrides) -> dict[str, Any]:
    """The config.json dict for arch and preset, with overrides applied."""
    fields = dict(PRESETS[preset])
    unknown_head_dim = "head_dim" not in overrides
    fields.update(overrides)
    if fields.get("vocab_size") is None:
        fields["vocab_size"] = tokenizer.get_vocab_size()
    hidden, heads = fields["hidden_size"], fields["num_attention_heads"]
    if unknown_head_dim:
        # Qwen3 decouples head_dim from hidden/heads (Qwen3-0.6B: 1024 hidden, 16 heads, head_dim 128).
        fields["head_dim"] = 2 * hidden // heads if arch == "qwen3" else hidden // heads
    architecture, model_type = ARCHITECTURES[arch]
    config: dict[str, Any] = {
        "architectures": [architecture],
        "model_type": model_type,
        "hidden_act": "silu",
        "initializer_range": 0.02,
        "rms_norm_eps": 1e-6,
        "rope_theta": _ROPE_THETA[arch],
        "rope_scaling": rope_scaling,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": tie,
        "torch_dtype": dtype,
        "use_cache": True,
        "bos_token_id": tokenizer.token_to_id(BOS),
        "eos_token_id": tokenizer.token_to_id(EOS),
        "pad_token_id": tokenizer.token_to_id(PAD),
    }
    if arch == "llama":
        config["mlp_bias"] = False
        config["pretraining_tp"] = 1
    if arch in ("qwen2", "qwen3"):
        config.update(use_sliding_window=False, sliding_window=None, max_window_layers=fields["num_hidden_layers"])
    if arch == "mistral":
        config["sliding_window"] = None
    config.update(fields)
    return config


def _random_weights(config: dict[str, Any], arch: str, seed: int, tokenizer_vocab: int) -> dict[str, torch.Tensor]:
    """Random float32 weights under HF names, deterministic from seed, with peaked logits."""
    gen = torch.Generator().manual_seed(seed)
    hidden = config["hidden_size"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config["head_dim"]
    inter = config["intermediate_size"]
    vocab = config["vocab_size"]

    def normal(*shape: int, std: float) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * std

    def norm_weight(n: int) -> torch.Tensor:
        # Near 1 but not 1, so a norm applied with the wrong weight shows up in parity.
        return 1.0 + normal(n, std=0.1)

    # Each sub-block's output is O(1), comparable to the residual, so attention (and so the KV
    # cache) really shapes the logits rather than the model being a bigram table.
    lin = 1.0 / math.sqrt(hidden)
    lm_std = _LOGIT_STD / math.sqrt(hidden)
    w: dict[str, torch.Tensor] = {}
    embed = normal(vocab, hidden, std=lm_std if config["tie_word_embeddings"] else 1.0)
    # Ids past the tokenizer (bench presets pad the vocabulary to 32000) get zero rows: their logit
    # is 0, far below the top tokens, so generated ids always decode.
    embed[tokenizer_vocab:] = 0
    w["model.embed_tokens.weight"] = embed
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = norm_weight(hidden)
        w[p + "self_attn.q_proj.weight"] = normal(heads * head_dim, hidden, std=2 * lin)
        w[p + "self_attn.k_proj.weight"] = normal(kv_heads * head_dim, hidden, std=2 * lin)
        w[p + "self_attn.v_proj.weight"] = normal(kv_heads * head_dim, hidden, std=lin)
        w[p + "self_attn.o_proj.weight"] = normal(hidden, heads * head_dim, std=1.0 / math.sqrt(heads * head_dim))
        if arch == "qwen2" or config.get("attention_bias"):
            w[p + "self_attn.q_proj.bias"] = normal(heads * head_dim, std=0.1)
            w[p + "self_attn.k_proj.bias"] = normal(kv_heads * head_dim, std=0.1)
            w[p + "self_attn.v_proj.bias"] = normal(kv_heads * head_dim, std=0.1)
        if arch != "qwen2" and config.get("attention_bias"):
            w[p + "self_attn.o_proj.bias"] = normal(hidden, std=0.1)
        if arch == "qwen3":
            w[p + "self_attn.q_norm.weight"] = norm_weight(head_dim)
            w[p + "self_attn.k_norm.weight"] = norm_weight(head_dim)
        w[p + "post_attention_layernorm.weight"] = norm_weight(hidden)
        w[p + "mlp.gate_proj.weight"] = normal(inter, hidden, std=lin)
        w[p + "mlp.up_proj.weight"] = normal(inter, hidden, std=lin)
        w[p + "mlp.down_proj.weight"] = normal(hidden, inter, std=1.0 / math.sqrt(inter))
        if config.get("mlp_bias"):
            w[p + "mlp.gate_proj.bias"] = normal(inter, std=0.1)
            w[p + "mlp.up_proj.bias"] = normal(inter, std=0.1)
            w[p + "mlp.down_proj.bias"] = normal(hidden, std=0.1)
    w["model.norm.weight"] = norm_weight(hidden)
    if not config["tie_word_embeddings"]:
        lm_head = normal(vocab, hidden, std=lm_std)
        lm_head[tokenizer_vocab:] = 0
        w["lm_head.weight"] = lm_head
    return w


def _generation_config(tokenizer) -> dict[str, Any]:
    """generation_config.json: both end-of-text and end-of-turn stop generation."""
    return {
        "bos_token_id": tokenizer.token_to_id(BOS),
        "eos_token_id": [tokenizer.token_to_id(EOS), tokenizer.token_to_id(IM_END)],
        "pad_token_id": tokenizer.token_to_id(PAD),
        "do_sample": False,
    }


def _tokenizer_config(model_max_length: int) -> dict[str, Any]:
    """tokenizer_config.json: the special tokens and the chat template."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "unk_token": None,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "additional_special_tokens": [IM_START, IM_END, THINK, THINK_END, TOOL_CALL, TOOL_CALL_END],
        "chat_template": CHAT_TEMPLATE,
    }


def _write_json(path: pathlib.Path, obj: dict[str, Any]) -> None:
    """Write obj as indented JSON."""
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
