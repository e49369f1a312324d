"""The model facts every process plans with, resolved once from the model's own files.

`resolve_model(path)` reads config.json (and generation_config.json) of a Hugging Face folder, or the metadata of a
GGUF file (`metrale.gguf_metadata` maps it to the same config dict), and derives what
the supervisor, the frontend, the engine core and the worker all need to agree on: the architecture, the
vocabulary, the longest sequence (rope scaling included), the end-of-sequence ids, the per-layer sliding
windows and the kind of per-sequence state. Nobody else reads config.json for these: they ask this module
(or receive its `ModelFacts`). No torch here: the engine core and the frontend import it.
"""

from __future__ import annotations

import functools
import json
import logging
from pathlib import Path

import msgspec

from metrale import gguf_metadata
from metrale.pooling_config import PoolingConfig, read_pooling

# What a launched-ahead step leaves behind: paged KV only ("attention": an over-run position is simply never
# read, the seed's Rewind), or recurrent state that a step overwrites ("recurrent": the seed's RepickOnly).
STATE_ATTENTION = "attention"
STATE_RECURRENT = "recurrent"

# Rope types whose max_position_embeddings is the base length that `factor` stretches (vLLM's rule); llama3 and
# longrope checkpoints already state the extended length.
_STRETCHING_ROPE = ("linear", "dynamic", "yarn")

DEMO_MODEL_NOTE = "serving the built-in tiny demo model: random weights, so its text is random"

log = logging.getLogger(__name__)


class ModelError(ValueError):
    """The model path cannot be served; the message names the path and what is wrong (one line)."""


class ModelFacts(msgspec.Struct, frozen=True, kw_only=True):
    """What every process knows about the model being served."""

    path: str  # the model folder (or GGUF file) as given, resolved
    name: str  # for logs and the HTTP API's model id
    architecture: str
    model_type: str
    vocab_size: int
    max_model_len: int  # longest prompt + output, after any user cap
    max_position_embeddings: int  # the checkpoint's base context (rope tables are built for max_model_len)
    eos_token_ids: tuple[int, ...]
    rope_type: str
    layer_windows: tuple[int | None, ...]  # per layer: sliding window in tokens, or None
    state_kind: str = STATE_ATTENTION
    config: dict = {}  # the checkpoint's config.json (a GGUF's mapped to it), for the worker that builds the model
    hidden_size: int = 0  # the width of a hidden state (an embedding's, before any `dimensions` cut)
    pooling: PoolingConfig = PoolingConfig()  # how an embedding is pooled (its sentence-transformers files)


def resolve_model_dir(model: str | None) -> str:
    """The folder to load: the given one, or the built-in demo model (made once, then cached)."""
    if model is not None:
        return model
    from metrale.gpu_worker.tiny_model import default_model_dir

    log.warning(DEMO_MODEL_NOTE)
    return str(default_model_dir())


def resolve_model(path: str | Path, max_model_len: int | None = None) -> ModelFacts:
    """The facts of the model at path; ModelError (one line naming the path) when it cannot be read.

    max_model_len caps the derived length (the user's --max-model-len); larger than the model allows is an
    error, as in vLLM.
    """
    facts = _resolve(str(Path(path).expanduser().resolve()))
    if max_model_len is None:
        return facts
    if max_model_len < 2:
        raise ModelError(f"max_model_len must be >= 2 (got {max_model_len})")
    if max_model_len > facts.max_model_len:
        raise ModelError(
            f"max_model_len {max_model_len} is longer than {facts.name} allows ({facts.max_model_len}, from its config.json)"
        )
    return msgspec.structs.replace(facts, max_model_len=max_model_len)


@functools.lru_cache(maxsize=8)
def _resolve(path: str) -> ModelFacts:
    root = Path(path)
    if not root.exists():
        raise ModelError(f"--model {path}: no such file or directory")
    try:
        gguf = gguf_metadata.gguf_file(root)
        if gguf is not None:
            reader = gguf_metadata.open_gguf(gguf)
            config = gguf_metadata.hf_config(reader, path=str(gguf))
            generation = {"eos_token_id": gguf_metadata.eos_token_ids(reader)}
            return facts_from_config(config, generation, path=path, name=root.name)
    except gguf_metadata.GgufError as e:
        raise ModelError(f"--model {path}: {e}") from None
    if not root.is_dir():
        raise ModelError(
            f"--model {path}: not a model folder (expected a Hugging Face folder with config.json, or a .gguf file)"
        )
    config = _read_json(root / "config.json", required=True)
    generation = _read_json(root / "generation_config.json", required=False)
    facts = facts_from_config(config, generation, path=path, name=root.name)
    return msgspec.structs.replace(facts, pooling=read_pooling(root, config))


def facts_from_config(config: dict, generation: dict, *, path: str, name: str) -> ModelFacts:
    """The facts a config.json dict (and a generation_config dict) state."""
    cfg = decoder_config(config)
    try:
        num_layers = int(cfg["num_hidden_layers"])
        vocab_size = int(cfg["vocab_size"])
    except (KeyError, TypeError, ValueError) as e:
        raise ModelError(f"{path}: config.json lacks a valid {e}") from None
    max_pos = int(cfg.get("max_position_embeddings") or 2048)
    rope = rope_parameters(cfg)
    rope_type = rope["rope_type"]
    return ModelFacts(
        path=path,
        name=name,
        architecture=architecture_of(config),
        model_type=str(cfg.get("model_type", "")),
        vocab_size=vocab_size,
        max_model_len=derived_max_model_len(cfg, rope, rope_type, max_pos),
        max_position_embeddings=max_pos,
        eos_token_ids=_eos_ids(generation, cfg),
        rope_type=rope_type,
        layer_windows=layer_windows(cfg, num_layers),
        state_kind=STATE_RECURRENT if _has_recurrent_layers(cfg) else STATE_ATTENTION,
        config=config,
        hidden_size=int(cfg.get("hidden_size") or 0),
        pooling=PoolingConfig(matryoshka=bool(cfg.get("is_matryoshka") or cfg.get("matryoshka_dimensions"))),
    )


def architecture_of(config: dict) -> str:
    """The checkpoint's architecture name (the first of config.json's `architectures`)."""
    archs = config.get("architectures") or []
    return str(archs[0]) if archs else f"<none; model_type={config.get('model_type')!r}>"


def decoder_config(config: dict) -> dict:
    """The decoder's fields of a config.json dict: multimodal wrappers keep them in text_config."""
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else None
    return {**config, **text} if text else config


def rope_parameters(cfg: dict, layer_type: str | None = None) -> dict:
    """The rope settings of a (decoder) config, standardised as transformers does: either form it writes
    (`rope_parameters`, or the older `rope_scaling` + `rope_theta`), nested per layer type or not, with
    rope_type, rope_theta, partial_rotary_factor and (for the types that need it)
    original_max_position_embeddings filled in.

    layer_type ("full_attention", "sliding_attention") picks a per-layer-type rotary (Gemma 3's global and
    local ones); None is the full-attention one.
    """
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    params = params if isinstance(params, dict) else {}
    model_type = cfg.get("model_type", "")
    nested = {k: v for k, v in params.items() if isinstance(v, dict)}
    theta = cfg.get("rope_theta")
    if nested and "rope_type" not in params and "type" not in params:
        # transformers 5 nests per layer type: {"full_attention": {...}, "sliding_attention": {...}}
        params = dict(nested.get(layer_type or "full_attention") or nested.get("full_attention") or next(iter(nested.values())))
    elif model_type in ("gemma3", "gemma3_text"):
        # transformers 4's form: rope_theta and rope_scaling for the global layers, rope_local_base_freq local.
        if layer_type == "sliding_attention":
            params, theta = {}, cfg.get("rope_local_base_freq", 10_000.0)
        elif theta is None:
            theta = 1_000_000.0
        params = dict(params)
    else:
        params = dict(params)
    rope_type = str(params.get("rope_type") or params.get("type") or "default")
    if model_type == "phi3" and rope_type in ("su", "yarn"):
        rope_type = "longrope"  # Phi-3's config names its longrope so
    params["rope_type"] = rope_type
    if params.get("rope_theta") is None:
        params["rope_theta"] = 10_000.0 if theta is None else theta
    if cfg.get("partial_rotary_factor") is not None:
        params.setdefault("partial_rotary_factor", cfg["partial_rotary_factor"])
    if rope_type in ("llama3", "yarn", "longrope"):
        # transformers prefers a top-level original_max_position_embeddings (Phi-3 keeps it there).
        if cfg.get("original_max_position_embeddings") is not None:
            params["original_max_position_embeddings"] = cfg["original_max_position_embeddings"]
        params.setdefault("original_max_position_embeddings", cfg.get("max_position_embeddings") or 2048)
    return params


def derived_max_model_len(cfg: dict, rope: dict, rope_type: str, max_pos: int) -> int:
    """The longest sequence the model serves: max_position_embeddings, stretched by the rope factor for the
    types that stretch a base length (yarn from its original length), as vLLM derives it."""
    factor = float(rope.get("factor", 1.0) or 1.0)
    if rope_type not in _STRETCHING_ROPE or factor <= 1.0 or cfg.get("model_type") in ("gemma3", "gemma3_text"):
        return max_pos  # Gemma 3 states its long context already and scales only its global layers' rope
    if rope_type == "yarn":
        return int(int(rope.get("original_max_position_embeddings") or max_pos) * factor)
    return int(max_pos * factor)


def layer_windows(cfg: dict, num_layers: int) -> tuple[int | None, ...]:
    """Each layer's sliding window, following transformers' rules per family."""
    window = cfg.get("sliding_window")
    model_type = cfg.get("model_type", "")
    if model_type in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe") and not cfg.get("use_sliding_window", False):
        window = None
    if window is None:
        return (None,) * num_layers
    window = int(window)
    layer_types = cfg.get("layer_types")
    if layer_types:
        return tuple(window if t == "sliding_attention" else None for t in layer_types)
    if model_type in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe"):
        first = int(cfg.get("max_window_layers", num_layers))  # Qwen: layers from max_window_layers on slide
        return tuple(window if i >= first else None for i in range(num_layers))
    if model_type == "gemma2":  # even layers slide
        return tuple(window if i % 2 == 0 else None for i in range(num_layers))
    if model_type in ("gemma3", "gemma3_text"):
        every = int(cfg.get("sliding_window_pattern", 6))
        return tuple(window if (i + 1) % every else None for i in range(num_layers))
    return (window,) * num_layers


def _has_recurrent_layers(cfg: dict) -> bool:
    """True for models with per-sequence recurrent state (Mamba, hybrid attention/SSM)."""
    if cfg.get("model_type") in ("mamba", "mamba2"):
        return True
    if cfg.get("model_type") == "bamba":  # Mamba 2 layers except those in attn_layer_indices
        return len(set(cfg.get("attn_layer_indices") or ())) < int(cfg.get("num_hidden_layers") or 0)
    layer_types = cfg.get("layers_block_type") or cfg.get("layer_types") or []
    return any(t in ("mamba", "mamba2", "linear_attention") for t in layer_types)


def _eos_ids(generation: dict, cfg: dict) -> tuple[int, ...]:
    """End-of-sequence ids: generation_config.json's eos_token_id (int or list), else config.json's (what
    transformers' generate stops on)."""
    eos = generation.get("eos_token_id")
    if eos is None:
        eos = cfg.get("eos_token_id")
    if eos is None:
        return ()
    values = eos if isinstance(eos, list) else [eos]
    return tuple(dict.fromkeys(int(e) for e in values if isinstance(e, int) and not isinstance(e, bool)))


def _read_json(path: Path, *, required: bool) -> dict:
    if not path.is_file():
        if required:
            raise ModelError(f"--model {path.parent}: no config.json (expected a Hugging Face model folder or a .gguf file)")
        return {}
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelError(f"{path}: unreadable ({e})") from None
    if not isinstance(value, dict):
        raise ModelError(f"{path}: not a JSON object")
    return value


# generation_config.json keys that become request defaults (vLLM's list, less max_new_tokens).
SAMPLING_DEFAULT_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                         "frequency_penalty")
GENERATION_CONFIG_SOURCES = "auto (the model's generation_config.json), vllm (none), or a folder holding one"


def generation_defaults(model_path: str | Path, source: str = "auto") -> dict[str, float | int]:
    """The sampling defaults a request gets for what it leaves out (`--generation-config`, as vLLM's): "auto"
    takes the model's generation_config.json, "vllm" none (SamplingParams' own defaults), a folder its file's.
    ModelError for a folder without one or an unreadable file."""
    if source == "vllm":
        return {}
    if source == "auto":
        root = Path(model_path).expanduser()
        if not root.is_dir():  # a GGUF file carries no generation config
            return {}
        generation = _read_json(root / "generation_config.json", required=False)
    else:
        folder = Path(source).expanduser()
        if not (folder / "generation_config.json").is_file():
            raise ModelError(f"--generation-config {source}: no generation_config.json there (use {GENERATION_CONFIG_SOURCES})")
        generation = _read_json(folder / "generation_config.json", required=False)
    defaults = {}
    for key in SAMPLING_DEFAULT_KEYS:
        value = generation.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            defaults[key] = int(value) if key == "top_k" else float(value)
    return defaults
