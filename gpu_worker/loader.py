"""Load a Hugging Face model folder (config.json + *.safetensors) or a GGUF file into our model. Never touches a hub."""

from __future__ import annotations

import json
import pathlib

import torch
from safetensors import safe_open
from tqdm import tqdm

from metrale import gguf_metadata
from metrale.gpu_worker.models import LlamaConfig, LlamaForCausalLM, check_supported

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_config(model_dir: str | pathlib.Path) -> dict:
    """config.json as a dict; ValueError if its architecture is not one we implement."""
    path = pathlib.Path(model_dir) / "config.json"
    if not path.exists():
        raise FileNotFoundError(f"no config.json in {model_dir}")
    config = json.loads(path.read_text(encoding="utf-8"))
    check_supported(config)
    return config


def resolve_dtype(dtype: str | torch.dtype, config: dict) -> torch.dtype:
    """The torch dtype for "auto" (the config's dtype) or a dtype name."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        dtype = config.get("torch_dtype") or config.get("dtype") or "float32"
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported (supported: auto, {', '.join(DTYPES)})")
    return DTYPES[dtype]


def weight_files(model_dir: str | pathlib.Path) -> list[pathlib.Path]:
    """The checkpoint's safetensors files: those the index names, else every *.safetensors."""
    root = pathlib.Path(model_dir)
    index = root / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        files = [root / name for name in sorted(set(weight_map.values()))]
    else:
        files = sorted(root.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_dir}")
    return files


def load_model(
    model_dir: str | pathlib.Path,
    *,
    dtype: str | torch.dtype = "auto",
    device: str | torch.device = "cpu",
    show_progress: bool = True,
) -> tuple[LlamaForCausalLM, dict]:
    """Build the model for model_dir's config and fill it from its safetensors (or its GGUF file, when model_dir
    names one: metrale.gguf_metadata.gguf_file); returns (model, config)."""
    gguf = gguf_metadata.gguf_file(model_dir)
    if gguf is not None:
        from metrale.gpu_worker.gguf_weights import gguf_tensors

        config = gguf_metadata.hf_config(gguf_metadata.open_gguf(gguf), path=str(gguf))
        check_supported(config)
    else:
        config = load_config(model_dir)
    torch_dtype = resolve_dtype(dtype, config)
    device = torch.device(device)
    model = LlamaForCausalLM(LlamaConfig.from_hf(config), dtype=torch_dtype, device=device)
    if gguf is not None:
        loaded = {model.load_weight(name, tensor) for name, tensor in gguf_tensors(gguf, config)}
    else:
        loaded = _load_tensors(model, weight_files(model_dir), show_progress)
    if model.config.tie_word_embeddings or "lm_head.weight" not in loaded:
        model.tie_embeddings()
        loaded.add("lm_head.weight")
    missing = model.expected_weights() - loaded
    if missing:
        raise ValueError(f"{model_dir}: checkpoint lacks {len(missing)} weights, e.g. {sorted(missing)[:3]}")
    model.eval()
    return model, config


def _load_tensors(model: LlamaForCausalLM, files: list[pathlib.Path], show_progress: bool) -> set[str]:
    """Copy every tensor of the files into the model (cast to its dtype); return the names loaded."""
    loaded: set[str] = set()
    handles = [safe_open(str(f), framework="pt", device="cpu") for f in files]
    total = sum(len(h.keys()) for h in handles)
    with tqdm(total=total, desc="loading weights", unit="tensor", disable=not show_progress, leave=False) as bar:
        for handle in handles:
            for name in handle.keys():
                loaded.add(model.load_weight(name, handle.get_tensor(name)))
                bar.update(1)
    return loaded
