"""Write a Hugging Face folder as a GGUF file (llama.cpp's layout), with the `gguf` package's writer.

For tests and benchmarks: the same random model as a GGUF in each tensor type, read back by metrale, by
transformers and by llama.cpp. It does what llama.cpp's convert_hf_to_gguf.py does for each family metrale serves
(Llama, Mistral and Mixtral as `llama`, Qwen2, Qwen3, Qwen3-MoE, Gemma 2 and 3, Phi-3, OLMo 2): llama.cpp's names
and metadata keys, Llama's q/k rows permuted for llama.cpp's rotary, experts stacked per layer, Gemma's norms stored
as 1 + w, Llama 3's rope as the rope_freqs tensor and Phi-3's longrope as its factor tensors, norms kept in float32,
the tokenizer as a byte-level BPE vocabulary (tokens, merges, token types) with its special ids and chat template.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
from safetensors.torch import load_file

from metrale.gguf_rope import llama3_factors
from metrale.gpu_worker.gguf_names import block_names, top_names
from metrale.model_facts import rope_parameters

# What a tensor is stored as: the file types this writer makes (K-quants have no quantizer in the gguf package).
OUT_TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1")
_FILE_TYPES = {"f32": 0, "f16": 1, "q4_0": 2, "q4_1": 3, "q8_0": 7, "q5_0": 8, "q5_1": 9, "bf16": 32}
_GGUF_ARCH = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "MixtralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3moe",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
    "Phi3ForCausalLM": "phi3",
    "Olmo2ForCausalLM": "olmo2",
}
_CONTROL, _USER_DEFINED, _NORMAL, _UNUSED = 3, 4, 1, 5

# encode(gguf_name, float32 array) -> (data, ggml type) to store a tensor another way, or None for the default.
Encoder = Callable[[str, np.ndarray], "tuple[np.ndarray, object] | None"]


def write_gguf(
    model_dir: str | Path, out: str | Path, outtype: str = "f32", *, encode: Encoder | None = None, one_tensor_per_expert: bool = False
) -> Path:
    """Write model_dir (config.json, *.safetensors, tokenizer.json) as the GGUF file out; returns its path.

    one_tensor_per_expert: experts as Mixtral files written before llama.cpp stacked them (blk.N.ffn_gate.E.weight)."""
    import gguf

    if outtype not in OUT_TYPES:
        raise ValueError(f"outtype {outtype!r}: expected one of {', '.join(OUT_TYPES)}")
    root, out = Path(model_dir), Path(out)
    config = json.loads((root / "config.json").read_text(encoding="utf-8"))
    architecture = config["architectures"][0]
    arch = _GGUF_ARCH[architecture]
    name = root.name
    if architecture == "MistralForCausalLM" and "mistral" not in name.lower():
        name += "-mistral"  # llama.cpp writes Mistral as llama; readers tell it apart by name
    writer = gguf.GGUFWriter(str(out), arch)
    _write_hparams(writer, config, arch, name=name, file_type=_FILE_TYPES[outtype])
    _write_tokenizer(writer, root, config["vocab_size"])
    tensors = {}
    for f in sorted(root.glob("*.safetensors")):
        tensors.update(load_file(str(f)))  # torch's loader: numpy has no bfloat16
    arrays = {hf: values.float().numpy() for hf, values in tensors.items()}
    for gguf_tensor, values in _gguf_tensors(arrays, config, arch, stack_experts=not one_tensor_per_expert):
        custom = encode(gguf_tensor, values) if encode is not None else None
        data, qtype = custom if custom is not None else _encode(values, outtype)
        writer.add_tensor(gguf_tensor, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def requantize_gguf(src: str | Path, out: str | Path, outtype: str) -> Path:
    """Write the GGUF file src again with its matrices stored as outtype (its metadata copied as it is)."""
    import gguf
    from gguf.quants import dequantize

    from metrale.gguf_metadata import open_gguf

    reader = open_gguf(src)
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(str(out), arch)
    for key, f in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue  # the writer writes these itself
        if key == "general.file_type":
            writer.add_file_type(_FILE_TYPES[outtype])
            continue
        vtype = f.types[0]
        writer.add_key_value(key, f.contents(), vtype, sub_type=f.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None)
    for t in reader.tensors:
        values = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        data, qtype = _encode(values, outtype)
        writer.add_tensor(t.name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(out)


# Checkpoint names that differ from transformers' current ones: Mixtral's originals.
_RENAMES = ((".block_sparse_moe.", ".mlp."), (".w1.", ".gate_proj."), (".w3.", ".up_proj."), (".w2.", ".down_proj."))
_EXPERT = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")


def gguf_name(hf_name: str, arch: str = "llama") -> str:
    """llama.cpp's name of a transformers tensor name in a file of GGUF architecture arch (the inverse of
    gguf_names.hf_name)."""
    stem, kind = hf_name.rsplit(".", 1)
    for short, long in top_names().items():
        if stem == long:
            return f"{short}.{kind}"
    parts = stem.split(".", 3)  # model, layers, N, rest
    if parts[:2] == ["model", "layers"] and len(parts) == 4:
        for short, long in block_names(arch).items():
            if parts[3] == long:
                return f"blk.{parts[2]}.{short}.{kind}"
    raise ValueError(f"{hf_name}: no GGUF name for it")


def _gguf_tensors(
    tensors: dict[str, np.ndarray], config: dict, arch: str, *, stack_experts: bool = True
) -> Iterator[tuple[str, np.ndarray]]:
    """(llama.cpp name, float32 array) for every tensor of the folder, transformed as llama.cpp's converter does,
    then the rope factor tensors."""
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    experts: dict[tuple[str, str], dict[int, np.ndarray]] = {}
    for hf, values in tensors.items():
        for old, new in _RENAMES if ".block_sparse_moe." in hf else ():
            hf = hf.replace(old, new)
        if arch.startswith("gemma"):
            if hf == "lm_head.weight":
                continue  # Gemma's head is the embedding (the converter drops a stored copy)
            if hf.endswith("norm.weight"):
                values = values + np.float32(1.0)  # Gemma's norm scales by 1 + w: stored as 1 + w
        m = _EXPERT.fullmatch(hf)
        if m and not stack_experts:
            layer, expert, proj = m.groups()
            yield f"blk.{layer}.ffn_{proj.removesuffix('_proj')}.{expert}.weight", values
            continue
        if m:
            layer, expert, proj = m.groups()
            experts.setdefault((layer, proj), {})[int(expert)] = values
            continue
        name = gguf_name(hf, arch)
        if arch == "llama" and ".attn_q." in name:
            values = permute_rows(values, heads)
        elif arch == "llama" and ".attn_k." in name:
            values = permute_rows(values, kv_heads)
        yield name, values
    for (layer, proj), per_expert in experts.items():
        stacked = np.stack([per_expert[e] for e in range(len(per_expert))])
        yield gguf_name(f"model.layers.{layer}.mlp.experts.{proj}.weight", arch), stacked
    yield from _rope_tensors(config, arch)


def _rope_tensors(config: dict, arch: str) -> Iterator[tuple[str, np.ndarray]]:
    """Llama 3's rope as llama.cpp's per-dimension factors (rope_freqs); Phi-3's longrope factors."""
    rope = rope_parameters(config)
    if arch == "llama" and rope["rope_type"] == "llama3":
        dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
        params = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, **rope}
        yield "rope_freqs.weight", llama3_factors(params, float(rope["rope_theta"]), dim).astype(np.float32)
    if arch == "phi3" and rope["rope_type"] == "longrope":
        yield "rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32)
        yield "rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32)


def permute_rows(rows: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k row order: within each head, rows (i, i + head_dim/2) become (2i, 2i+1)."""
    per_head = rows.shape[0] // heads
    return np.ascontiguousarray(rows.reshape(heads, 2, per_head // 2, *rows.shape[1:]).swapaxes(1, 2)).reshape(rows.shape)


def _encode(values: np.ndarray, outtype: str):
    """(data, ggml type) for a tensor: vectors stay float32 (as llama.cpp keeps norms), matrices take outtype, or
    float16 where their rows are no whole number of its blocks (as llama.cpp's converter falls back)."""
    import gguf

    T = gguf.GGMLQuantizationType
    if values.ndim < 2 or outtype == "f32":
        return values, T.F32
    qtype = T[outtype.upper()]
    if outtype == "f16" or values.shape[-1] % gguf.GGML_QUANT_SIZES[qtype][0]:
        return values.astype(np.float16), T.F16
    return gguf.quants.quantize(values, qtype), qtype


def _write_hparams(writer, config: dict, arch: str, *, name: str, file_type: int) -> None:
    """The `general.*` and `{arch}.*` keys llama.cpp's converter writes for the family."""
    import gguf

    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    rope = rope_parameters(config)
    sliding = rope_parameters(config, "sliding_attention")
    writer.add_name(name)
    writer.add_file_type(file_type)
    writer.add_quantization_version(2)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(hidden)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(config.get("num_key_value_heads") or heads)
    writer.add_layer_norm_rms_eps(config.get("rms_norm_eps", 1e-6))
    writer.add_rope_freq_base(float(rope["rope_theta"]))
    writer.add_rope_dimension_count(int(head_dim * float(rope.get("partial_rotary_factor") or 1.0)))
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_vocab_size(config["vocab_size"])
    if rope["rope_type"] == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(rope["factor"]))
    elif rope["rope_type"] == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(float(rope["factor"]))
        writer.add_rope_scaling_orig_ctx_len(int(rope["original_max_position_embeddings"]))
    experts = config.get("num_local_experts") or config.get("num_experts")
    if experts:
        writer.add_expert_count(int(experts))
        writer.add_expert_used_count(int(config["num_experts_per_tok"]))
    if config.get("moe_intermediate_size"):
        writer.add_expert_feed_forward_length(int(config["moe_intermediate_size"]))
    if arch == "phi3":
        original = int(rope["original_max_position_embeddings"] if "original_max_position_embeddings" in rope
                       else config.get("original_max_position_embeddings") or config["max_position_embeddings"])
        writer.add_rope_scaling_orig_ctx_len(original)
        writer.add_sliding_window(int(config.get("sliding_window") or 0))  # 0: none (Phi-4)
        if rope["rope_type"] == "longrope":
            scale = config["max_position_embeddings"] / original
            writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0)
    if arch.startswith("gemma"):
        _write_gemma_hparams(writer, config, arch, sliding)


def _write_gemma_hparams(writer, config: dict, arch: str, sliding_rope: dict) -> None:
    """Gemma's soft-caps, window and (Gemma 3) local rotary base; the sliding layers as a pattern key where they
    are not llama.cpp's fixed one (every other layer, five in six)."""
    if config.get("attn_logit_softcapping"):
        writer.add_attn_logit_softcapping(float(config["attn_logit_softcapping"]))
    if config.get("final_logit_softcapping"):
        writer.add_final_logit_softcapping(float(config["final_logit_softcapping"]))
    if not config.get("sliding_window"):
        return
    writer.add_sliding_window(int(config["sliding_window"]))
    layers = config["num_hidden_layers"]
    every = 2 if arch == "gemma2" else 6
    fixed = [i % every < every - 1 for i in range(layers)]
    types = config.get("layer_types")
    pattern = [t == "sliding_attention" for t in types] if types else fixed
    if pattern != fixed:
        writer.add_sliding_window_pattern(pattern)
    if arch == "gemma3":
        writer.add_rope_freq_base_swa(float(sliding_rope["rope_theta"]))


def _write_tokenizer(writer, root: Path, vocab_size: int) -> None:
    """tokenizer.json's byte-level BPE as tokenizer.ggml.* keys, with the special ids and the chat template."""
    tok = json.loads((root / "tokenizer.json").read_text(encoding="utf-8"))
    tok_cfg = _read_json(root / "tokenizer_config.json")
    gen_cfg = _read_json(root / "generation_config.json")
    vocab: dict[str, int] = dict(tok["model"]["vocab"])
    added = {a["content"]: a for a in tok.get("added_tokens", [])}
    for content, a in added.items():
        vocab[content] = a["id"]
    # A vocabulary padded past the tokenizer (the bench presets' 32,000 rows) gets placeholder tokens, as
    # llama.cpp's converter writes them: the file's token list must cover every embedding row.
    size = max(max(vocab.values()) + 1, vocab_size)
    tokens = [f"[PAD{i}]" for i in range(size)]
    for t, i in vocab.items():
        tokens[i] = t
    types = [(_CONTROL if added[t]["special"] else _USER_DEFINED) if t in added else _NORMAL for t in tokens]
    types = [_UNUSED if t.startswith("[PAD") and t not in vocab else k for t, k in zip(tokens, types)]
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    for key, add in (("bos_token", writer.add_bos_token_id), ("pad_token", writer.add_pad_token_id)):
        content = tok_cfg.get(key)
        if isinstance(content, str) and content in vocab:
            add(vocab[content])
    eos = gen_cfg.get("eos_token_id")
    eos = list(eos) if isinstance(eos, list) else [eos] if eos is not None else []
    if not eos and isinstance(tok_cfg.get("eos_token"), str) and tok_cfg["eos_token"] in vocab:
        eos = [vocab[tok_cfg["eos_token"]]]
    if eos:
        writer.add_eos_token_id(int(eos[0]))
    if len(eos) > 1:
        writer.add_eot_token_id(int(eos[1]))  # e.g. <|im_end|>: llama.cpp's end of turn
    writer.add_add_bos_token(bool(tok_cfg.get("add_bos_token", False)))
    writer.add_add_eos_token(bool(tok_cfg.get("add_eos_token", False)))
    if isinstance(tok_cfg.get("chat_template"), str):
        writer.add_chat_template(tok_cfg["chat_template"])


def _read_json(path: Path) -> dict:
    """A JSON object file, or {} when absent."""
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
