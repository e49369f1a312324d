"""A GGUF file's metadata as the facts of a Hugging Face folder: a config.json dict and the tokenizer's parts.

A GGUF (llama.cpp's format) carries everything a model folder does in one file: hyperparameters under
`{arch}.*` keys, the tokenizer under `tokenizer.ggml.*`, the chat template, and the tensors. The file is read
with the `gguf` package (llama.cpp's own reader); the keys are mapped to config.json's names as transformers'
GGUF integration maps them, and each family's own fields are stated as its folder's config.json states them
(what llama.cpp assumes for a family rather than stores: Gemma's sliding pattern and query scale, Qwen3-MoE's
renormalised routing; what it stores as tensors: Llama 3's rope (gguf_rope.py), Phi-3's longrope factors), so
`metrale.model_facts` derives the same facts from either. No torch here (the reader needs only numpy): the
frontend and the engine core import this through model_facts.
"""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np

from metrale.gguf_reader import GgufError, read
from metrale.gguf_types import FILE_TYPES, TensorType
from metrale.gguf_rope import rope_scaling_from_factors

__all__ = ["GgufError", "field", "gguf_file", "hf_config", "open_gguf", "eos_token_ids", "indices_of", "split_pairs"]

SUFFIX = ".gguf"

# What metrale serves from a GGUF: the family (`general.architecture`, or the Llama variant the file is) ->
# (config.json model_type, architectures[0]). llama.cpp writes Mistral and Mixtral as `llama`.
_SERVED = {
    "llama": ("llama", "LlamaForCausalLM"),
    "mistral": ("mistral", "MistralForCausalLM"),
    "mixtral": ("mixtral", "MixtralForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
    "qwen3moe": ("qwen3_moe", "Qwen3MoeForCausalLM"),
    "gemma2": ("gemma2", "Gemma2ForCausalLM"),
    "gemma3": ("gemma3_text", "Gemma3ForCausalLM"),
    "phi3": ("phi3", "Phi3ForCausalLM"),
    "olmo2": ("olmo2", "Olmo2ForCausalLM"),
}

# `{arch}.<key>` -> config.json key (transformers' GGUF_CONFIG_MAPPING for these families).
_CONFIG_KEYS = {
    "context_length": "max_position_embeddings",
    "block_count": "num_hidden_layers",
    "feed_forward_length": "intermediate_size",
    "embedding_length": "hidden_size",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "attention.key_length": "head_dim",
    "attention.sliding_window": "sliding_window",
    "rope.freq_base": "rope_theta",
    "vocab_size": "vocab_size",
}

# llama.cpp's `general.file_type` values whose tensors are all float32; any other file is served in bfloat16
# by default (the fast dtype on a CPU; a dequantized 4- or 8-bit weight is exact in bfloat16 only up to its
# scale's rounding, far below the quantization's own error).
_ALL_F32 = 0


def gguf_file(path: str | Path) -> Path | None:
    """The GGUF file a --model path names: the file itself, or the one *.gguf of a folder without config.json.

    None for anything else (a Hugging Face folder); GgufError for a folder holding several GGUF files.
    """
    root = Path(path)
    if root.is_file():
        return root if root.suffix.lower() == SUFFIX else None
    if not root.is_dir() or (root / "config.json").exists():
        return None
    found = sorted(p for p in root.iterdir() if p.suffix.lower() == SUFFIX and p.is_file())
    if len(found) > 1:
        names = ", ".join(p.name for p in found)
        raise GgufError(f"{root} holds {len(found)} GGUF files ({names}); name one with --model")
    return found[0] if found else None


def open_gguf(path: str | Path):
    """The file's reader (one per process and file: its tensors stay memory-mapped); GgufError if unreadable."""
    return _open(str(Path(path).resolve()))


@functools.lru_cache(maxsize=4)
def _open(path: str):
    """open_gguf for a resolved path."""
    try:
        return read(path)
    except GgufError:
        raise
    except (ValueError, IndexError, KeyError, OSError, UnicodeDecodeError) as e:
        raise GgufError(f"{path}: not a readable GGUF file ({e})") from None


def field(reader, key: str, default=None):
    """A metadata value as Python (str, int, float, bool or a list of them), or default when absent."""
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def split_pairs(reader, key: str) -> list[tuple[str, ...]]:
    """A string array's items split at their first space ("left right" -> (left, right): a vocabulary's merges),
    [] when the file lacks the key: in one split where every item has exactly one space."""
    f = reader.fields.get(key)
    if f is None:
        return []
    split = getattr(getattr(f, "parts", None), "pairs", None)  # (gguf_reader's lazy arrays have it)
    pairs = split() if split is not None else None
    return pairs if pairs is not None else [tuple(m.split(" ", 1)) for m in f.contents()]


def hf_config(reader, *, path: str) -> dict:
    """The config.json dict this GGUF describes (transformers' key mapping, and each family's fields as its Hugging
    Face folder states them); GgufError for a family metrale does not serve."""
    arch = str(field(reader, "general.architecture"))
    family = _family(reader, arch)
    if family not in _SERVED:
        served = ", ".join(dict.fromkeys(k for k in _SERVED if k not in ("mistral", "mixtral")))
        # (no path: model_facts names the --model path in front)
        raise GgufError(f"GGUF architecture {arch!r} is not served (served from GGUF: {served}; Mistral and Mixtral as llama)")
    model_type, architecture = _SERVED[family]
    tensor_names = {t.name for t in reader.tensors}
    config: dict = {"architectures": [architecture], "model_type": model_type, "hidden_act": "silu"}
    for key, hf_key in _CONFIG_KEYS.items():
        value = field(reader, f"{arch}.{key}")
        if value is not None:
            config[hf_key] = value
    if "head_dim" not in config and family in ("llama", "mistral", "mixtral"):
        dim = field(reader, f"{arch}.rope.dimension_count")  # llama.cpp's rotary width = head_dim for these
        if dim is not None:
            config["head_dim"] = dim
    for needed in ("num_hidden_layers", "hidden_size", "num_attention_heads"):
        if needed not in config:
            raise GgufError(f"{path}: metadata lacks {arch}.{_gguf_key(needed)}")
    config.setdefault("num_key_value_heads", config["num_attention_heads"])
    if "vocab_size" not in config:
        tokens = reader.fields.get("tokenizer.ggml.tokens")
        if tokens is None:
            raise GgufError(f"{path}: metadata states no vocab_size and no tokenizer.ggml.tokens")
        config["vocab_size"] = len(tokens.data)
    rope_scaling = _rope_scaling(reader, arch)
    if rope_scaling:
        config["rope_scaling"] = rope_scaling
    config["tie_word_embeddings"] = "output.weight" not in tensor_names
    config["attention_bias"] = "blk.0.attn_q.bias" in tensor_names and family != "qwen2"
    _FAMILY_FIELDS.get(family, _no_fields)(reader, arch, config, tensor_names)
    for key in ("bos_token_id", "eos_token_id", "padding_token_id"):
        value = field(reader, f"tokenizer.ggml.{key}")
        if value is not None:
            config["pad_token_id" if key == "padding_token_id" else key] = value
    file_type = field(reader, "general.file_type")
    config["torch_dtype"] = "float32" if file_type == _ALL_F32 or _all_f32(reader) else "bfloat16"
    config["gguf"] = {"file_type": _file_type_name(file_type), "architecture": arch}
    return config


def _family(reader, arch: str) -> str:
    """The family a file of GGUF architecture arch holds: llama.cpp writes Mistral and Mixtral as `llama`
    (transformers tells Mistral apart by name; a Llama with experts is a Mixtral)."""
    if arch != "llama":
        return arch
    if int(field(reader, "llama.expert_count", 0) or 0) > 0:
        return "mixtral"
    name = str(field(reader, "general.name", "") or "")
    return "mistral" if "mistral" in name.lower() else "llama"


def _no_fields(reader, arch: str, config: dict, tensor_names: set[str]) -> None:
    """Families whose config the shared keys state whole."""


def _llama_fields(reader, arch: str, config: dict, tensor_names: set[str]) -> None:
    """Llama 3.1's rope: llama.cpp's converter writes it as the rope_freqs tensor (see gguf_rope.py)."""
    if "rope_freqs.weight" in tensor_names and "rope_scaling" not in config:
        head_dim = int(config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"])
        dim = int(field(reader, f"{arch}.rope.dimension_count", head_dim))
        original = field(reader, f"{arch}.rope.scaling.original_context_length")
        scaling = rope_scaling_from_factors(
            _tensor(reader, "rope_freqs.weight"), float(config.get("rope_theta", 10_000.0)), dim, original
        )
        if scaling:
            config["rope_scaling"] = scaling


def _mixtral_fields(reader, arch: str, config: dict, tensor_names: set[str]) -> None:
    """Mixtral's experts."""
    config["num_local_experts"] = int(field(reader, f"{arch}.expert_count"))
    config["num_experts_per_tok"] = int(field(reader, f"{arch}.expert_used_count", 2))
    _llama_fields(reader, arch, config, tensor_names)


def _qwen3moe_fields(reader, arch: str, config: dict, tensor_names: set[str]) -> None:
    """Qwen3-MoE's experts; llama.cpp always renormalises the top-k weights (transformers' GGUF default
    norm_topk_prob=True) and a layer without a router is dense (mlp_only_layers)."""
    config["num_experts"] = int(field(reader, f"{arch}.expert_count"))
    config["num_experts_per_tok"] = int(field(reader, f"{arch}.expert_used_count"))
    config["moe_intermediate_size"] = int(field(reader, f"{arch}.expert_feed_forward_length"))
    config["norm_topk_prob"] = True
    config["decoder_sparse_step"] = 1
    layers = int(config["num_hidden_layers"])
    config["mlp_only_layers"] = [i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" not in tensor_names]


def _gemma_fields(reader, arch: str, config: dict, tensor_names: set[str]) -> None:
    """Gemma 2 and 3: GELU-tanh, the query scale llama.cpp uses (head_dim, or hidden / heads for the 27B models),
    soft-capping, and which layers slide (llama.cpp: every other layer for Gemma 2, five in six for Gemma 3, unless
    the file lists them)."""
    config.pop("hidden_act")
    config["hidden_activation"] = "gelu_pytorch_tanh"
    layers, hidden, heads = int(config["num_hidden_layers"]), int(config["hidden_size"]), int(config["num_attention_heads"])
    head_dim = int(config.setdefault("head_dim", hidden // heads))
    big = (arch, layers) in (("gemma2", 46), ("gemma3", 62))
    config["query_pre_attn_scalar"] = hidden // heads if big else head_dim
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        value = field(reader, f"{arch}.{key}")
        config[key] = float(value) if value else None
    if not config.get("sliding_window"):
        config["sliding_window"] = None
        return
    pattern = field(reader, f"{arch}.attention.sliding_window_pattern")  # a list of bools, or a period
    if not isinstance(pattern, list) or len(pattern) != layers:
        every = int(pattern) if isinstance(pattern, int) and pattern > 0 else 2 if arch == "gemma2" else 6
        pattern = [i % every < every - 1 for i in range(layers)]
    config["layer_types"] = ["sliding_attention" if p else "full_attention" for p in pattern]
    if arch == "gemma3":
        config["rope_local_base_freq"] = float(field(reader, f"{arch}.rope.freq_base_swa", 10_000.0))


def _phi3_fields(reader, arch: str, config: dict, tensor_names: set[str]) -> None:
    """Phi-3: a partial rotary (rope.dimension_count), the original context, no window when 0, and longrope's
    factors stored as the rope_factors_long / rope_factors_short tensors."""
    head_dim = int(config.pop("head_dim", 0) or config["hidden_size"] // config["num_attention_heads"])
    rotary = field(reader, f"{arch}.rope.dimension_count")
    if rotary and int(rotary) != head_dim:
        config["partial_rotary_factor"] = int(rotary) / head_dim
    original = field(reader, f"{arch}.rope.scaling.original_context_length")
    if original:
        config["original_max_position_embeddings"] = int(original)
    if not config.get("sliding_window"):
        config["sliding_window"] = None
    if "rope_factors_long.weight" in tensor_names:
        config["rope_scaling"] = {
            "rope_type": "longrope",
            "long_factor": _decimals(_tensor(reader, "rope_factors_long.weight")),
            "short_factor": _decimals(_tensor(reader, "rope_factors_short.weight")),
        }


_FAMILY_FIELDS = {
    "llama": _llama_fields,
    "mistral": _llama_fields,
    "mixtral": _mixtral_fields,
    "qwen3moe": _qwen3moe_fields,
    "gemma2": _gemma_fields,
    "gemma3": _gemma_fields,
    "phi3": _phi3_fields,
}


def _decimals(values: np.ndarray) -> list[float]:
    """float32 values as the shortest decimals that round to them, as config.json writes them (a setting's value
    is then the same Python float from either; both round it to the same float32)."""
    return [float(str(v)) for v in values.astype(np.float32)]


def _tensor(reader, name: str) -> np.ndarray:
    """A small float32 tensor of the file (rope factors); GgufError if absent or not float32."""
    tensor = next((t for t in reader.tensors if t.name == name), None)
    if tensor is None or tensor.tensor_type.name != "F32":
        raise GgufError(f"tensor {name}: {'absent' if tensor is None else 'not F32'} (rope factors)")
    return np.asarray(tensor.data, dtype=np.float32).reshape(-1)


# Token texts llama.cpp ends a generation at wherever its vocabulary has them (its special_eog_ids), beside the ids the
# file names: a Gemma file without an eot key still stops at <end_of_turn>, as under llama.cpp.
_EOG_TEXTS = frozenset((
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<end_of_turn>", "<|endoftext|>", "<|eom_id|>",
    "<EOT>", "_<EOT>", "<|end_of_text|>", "<end_of_utterance>",
))


def eos_token_ids(reader) -> list[int]:
    """The ids that end a generation: eos, the end-of-turn / end-of-message ids the file names, then the tokens
    llama.cpp treats as end of generation by their text."""
    ids = [field(reader, f"tokenizer.ggml.{k}") for k in ("eos_token_id", "eot_token_id", "eom_token_id")]
    named = [int(i) for i in ids if isinstance(i, int)]
    try:
        tokens = field(reader, "tokenizer.ggml.tokens") or []
    except UnicodeDecodeError:  # a token that is not UTF-8 (the tokenizer refuses the file; the ids still stand)
        tokens = [bytes(reader.fields["tokenizer.ggml.tokens"].parts[i]).decode("utf-8", errors="replace")
                  for i in reader.fields["tokenizer.ggml.tokens"].data]
    return list(dict.fromkeys(named + indices_of(tokens, _EOG_TEXTS)))


def indices_of(tokens: list[str], texts: frozenset[str] | set[str]) -> list[int]:
    """The ids of the tokens whose text is one of texts, in order (each text found by list.index: a vocabulary
    holds few of them, so this reads the list in C rather than looping over it in Python)."""
    found = []
    for text in texts.intersection(tokens):
        at = -1
        try:
            while True:
                at = tokens.index(text, at + 1)
                found.append(at)
        except ValueError:
            pass
    return sorted(found)


def _rope_scaling(reader, arch: str) -> dict:
    """config.json's rope_scaling from `{arch}.rope.scaling.*` ({} when the rope is not scaled)."""
    kind = field(reader, f"{arch}.rope.scaling.type")
    factor = field(reader, f"{arch}.rope.scaling.factor")
    if kind in (None, "none") or not factor or float(factor) == 1.0:
        return {}
    out: dict = {"rope_type": str(kind), "factor": float(factor)}
    original = field(reader, f"{arch}.rope.scaling.original_context_length")
    if original:
        out["original_max_position_embeddings"] = int(original)
    return out


def _all_f32(reader) -> bool:
    """True when every matrix in the file is float32 (files that state no file_type)."""
    return all(t.tensor_type == TensorType.F32 for t in reader.tensors if len(t.shape) > 1)


def _file_type_name(value) -> str:
    """llama.cpp's name of a general.file_type value (MOSTLY_Q4_1, ...), or "unknown"."""
    try:
        return FILE_TYPES.get(int(value), "unknown")
    except (TypeError, ValueError):
        return "unknown"


def _gguf_key(hf_key: str) -> str:
    """The GGUF key (after the architecture) that maps to a config.json key, for messages."""
    return next(k for k, v in _CONFIG_KEYS.items() if v == hf_key)
