"""A PEFT LoRA adapter folder's facts, read without torch: what `--lora-modules` names, checked at start-up.

A folder is `adapter_config.json` + `adapter_model.safetensors` (what `PeftModel.save_pretrained` writes).
`read_adapter` reads the config and the safetensors header only (the tensors' names and shapes, no data), so
the frontend and the engine core can validate every adapter before a worker exists, and refuses, naming the
field or the tensor, whatever the worker's slots (layers/lora.py) could not serve exactly: LoRA variants that
change the forward (DoRA, aLoRA, ...), biases, `modules_to_save`, per-module ranks, and targets outside the
decoder's attention and MLP projections (embeddings, the LM head, experts, Mamba layers).
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import struct
from dataclasses import dataclass

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."  # what PeftModel puts before the base model's module names

# The projections an adapter may target, in the order a decoder layer runs them.
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Phi-3's checkpoints (and so its adapters) hold q/k/v as one `qkv_proj` and gate/up as one `gate_up_proj`.
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
SUPPORTED_TARGETS = PROJECTIONS + tuple(FUSED)
_EMBEDDINGS = ("embed_tokens", "lm_head", "wte", "embed_out", "word_embeddings")

# Config fields that, when set, make the adapter something other than x @ A.T @ B.T * scaling on a projection.
_REFUSED_FIELDS = (
    "use_dora", "lora_bias", "use_qalora", "alora_invocation_tokens", "monteclora_config", "use_bdlora",
    "arrow_config", "kasa_config", "layer_replication", "target_parameters", "trainable_token_indices",
    "modules_to_save", "rank_pattern", "alpha_pattern",
)


class LoraError(ValueError):
    """An adapter that cannot be served as asked: the message names the folder and the field or tensor."""


@dataclass(frozen=True, slots=True)
class AdapterSpec:
    """What the worker needs to know of an adapter before reading its tensors."""

    path: str
    rank: int  # PEFT's r
    lora_alpha: float
    scaling: float  # lora_alpha / rank, or lora_alpha / sqrt(rank) with use_rslora; folded into B on load
    target_modules: tuple[str, ...]  # the projections its tensors adapt, in PROJECTIONS' order (fused ones split)
    base_model_name_or_path: str | None

    @property
    def weights_file(self) -> pathlib.Path:
        """The adapter's safetensors file."""
        return pathlib.Path(self.path) / WEIGHTS_FILE


def read_adapter(path: str | os.PathLike) -> AdapterSpec:
    """The spec of the PEFT LoRA folder at path; LoraError naming what makes it unservable."""
    root = pathlib.Path(path)
    config_file, weights_file = root / CONFIG_FILE, root / WEIGHTS_FILE
    for needed in (config_file, weights_file):
        if not needed.is_file():
            raise LoraError(f"LoRA adapter {root}: missing {needed.name}")
    try:
        cfg = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise LoraError(f"LoRA adapter {root}: cannot read {CONFIG_FILE}: {e}") from None
    where = f"LoRA adapter {root}"
    if str(cfg.get("peft_type", "LORA")).upper() != "LORA":
        raise LoraError(f"{where}: peft_type {cfg.get('peft_type')!r} is not LORA")
    for name in _REFUSED_FIELDS:
        if cfg.get(name):
            raise LoraError(f"{where}: {name}={cfg[name]!r} is not supported")
    if cfg.get("bias", "none") != "none":
        raise LoraError(f"{where}: bias={cfg['bias']!r} is not supported (only 'none')")
    rank, alpha = cfg.get("r"), cfg.get("lora_alpha")
    if not isinstance(rank, int) or rank < 1 or not isinstance(alpha, (int, float)):
        raise LoraError(f"{where}: r={rank!r} and lora_alpha={alpha!r} must be a positive integer and a number")
    _check_config_targets(where, cfg.get("target_modules"))
    targets = _tensor_targets(where, read_header(weights_file), rank)
    scaling = alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank
    return AdapterSpec(
        path=str(root), rank=rank, lora_alpha=float(alpha), scaling=float(scaling), target_modules=targets,
        base_model_name_or_path=cfg.get("base_model_name_or_path"),
    )


def module_of(tensor_name: str) -> tuple[str, str]:
    """(the base model's module name, "A" or "B") of a PEFT tensor name; LoraError for any other tensor."""
    name = tensor_name.removeprefix(PEFT_PREFIX)
    for suffix, which in ((".lora_A.weight", "A"), (".lora_B.weight", "B")):
        if name.endswith(suffix):
            return name[: -len(suffix)], which
    raise LoraError(f"tensor {tensor_name!r} is not a LoRA A or B weight (a variant or extra module is not supported)")


def read_header(weights_file: pathlib.Path) -> dict[str, list[int]]:
    """Each tensor's shape, from a safetensors file's header (its data is not read)."""
    try:
        with open(weights_file, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            if size > os.path.getsize(weights_file) - 8:
                raise ValueError(f"a header of {size} bytes")
            header = json.loads(f.read(size))
    except (OSError, ValueError, struct.error) as e:
        raise LoraError(f"{weights_file}: not a safetensors file ({e})") from None
    return {name: list(info["shape"]) for name, info in header.items() if name != "__metadata__"}


def _check_config_targets(where: str, targets) -> None:
    """A listed target must be a supported projection (a regex string is checked through the tensors' names)."""
    if not isinstance(targets, list):
        return
    for target in targets:
        leaf = str(target).rsplit(".", 1)[-1]
        if leaf in _EMBEDDINGS:
            raise LoraError(f"{where}: target {target!r} is an embedding or the LM head, which is not supported")
        if leaf not in SUPPORTED_TARGETS:
            raise LoraError(f"{where}: target {target!r} is not supported (supported: {', '.join(SUPPORTED_TARGETS)})")


def _tensor_targets(where: str, shapes: dict[str, list[int]], rank: int) -> tuple[str, ...]:
    """The projections the tensors adapt; LoraError for a tensor outside them, a missing half, or another rank."""
    halves: dict[str, dict[str, list[int]]] = {}
    for name, shape in shapes.items():
        if "lora_embedding" in name:
            raise LoraError(f"{where}: tensor {name!r} adapts an embedding, which is not supported")
        try:
            module, which = module_of(name)
        except LoraError as e:
            raise LoraError(f"{where}: {e}") from None
        leaf = module.rsplit(".", 1)[-1]
        if leaf in _EMBEDDINGS:
            raise LoraError(f"{where}: tensor {name!r} adapts an embedding or the LM head, which is not supported")
        if ".experts." in module or ".mamba." in module or leaf not in SUPPORTED_TARGETS:
            raise LoraError(f"{where}: tensor {name!r} adapts {module!r}, which is not supported "
                            "(only the decoder's attention and MLP projections; no experts, Mamba layers)")
        if len(shape) != 2 or shape[0 if which == "A" else 1] != rank:
            raise LoraError(f"{where}: tensor {name!r} has shape {shape}, not rank {rank} (per-module ranks are not supported)")
        halves.setdefault(module, {})[which] = shape
    if not halves:
        raise LoraError(f"{where}: {WEIGHTS_FILE} holds no LoRA tensors")
    for module, pair in halves.items():
        if len(pair) != 2:
            raise LoraError(f"{where}: {module!r} has lora_{next(iter(pair))} but not its other half")
    leaves = {m.rsplit(".", 1)[-1] for m in halves}
    leaves |= {part for fused, parts in FUSED.items() if fused in leaves for part in parts}
    return tuple(t for t in PROJECTIONS if t in leaves)
