"""Build the model a checkpoint's facts name (models/registry.py) and fill it from its safetensors. Never touches a hub."""

from __future__ import annotations

import json
import pathlib
from collections.abc import Iterator

import torch
from safetensors import safe_open
from tqdm import tqdm

from metrale.gpu_worker.layers.attention_backends import TORCH, TorchAttention
from metrale.gpu_worker.models.context import ModelContext
from metrale.gpu_worker.models.registry import model_class
from metrale.model_facts import ModelFacts

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


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
    facts: ModelFacts,
    *,
    dtype: str | torch.dtype = "auto",
    device: str | torch.device = "cpu",
    native: bool = False,
    attention: TorchAttention = TORCH,
    show_progress: bool = True,
):
    """The model for facts (its architecture's class from the registry), loaded and ready to run.

    native: the native CPU kernels are loaded; attention: the device's attention backend. ModelError for an
    architecture no model here implements (before anything is read); ValueError for a checkpoint that does
    not fit the model.
    """
    cls = model_class(facts.architecture)
    ctx = ModelContext(
        facts=facts, dtype=resolve_dtype(dtype, facts.config), device=torch.device(device), native=native, attention=attention
    )
    model = cls(ctx)
    model.load_weights(_tensors(weight_files(facts.path), show_progress))
    return model


def _tensors(files: list[pathlib.Path], show_progress: bool) -> Iterator[tuple[str, torch.Tensor]]:
    """Every (name, tensor) of the files, one at a time."""
    handles = [safe_open(str(f), framework="pt", device="cpu") for f in files]
    total = sum(len(h.keys()) for h in handles)
    with tqdm(total=total, desc="loading weights", unit="tensor", disable=not show_progress, leave=False) as bar:
        for handle in handles:
            for name in handle.keys():
                yield name, handle.get_tensor(name)
                bar.update(1)
