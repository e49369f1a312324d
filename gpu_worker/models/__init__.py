"""Model implementations, looked up by the `architectures` name in config.json."""

from __future__ import annotations

from metrale.gpu_worker.models.llama import ARCHITECTURES as _LLAMA_FAMILY
from metrale.gpu_worker.models.llama import LlamaConfig, LlamaForCausalLM

SUPPORTED_ARCHITECTURES: tuple[str, ...] = _LLAMA_FAMILY


def architecture_of(config: dict) -> str:
    """The checkpoint's architecture name (the first of config.json's `architectures`)."""
    archs = config.get("architectures") or []
    return archs[0] if archs else f"<none; model_type={config.get('model_type')!r}>"


def check_supported(config: dict) -> str:
    """The architecture name, or ValueError naming it when no model here implements it."""
    arch = architecture_of(config)
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"unsupported architecture {arch!r} (supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
    return arch


__all__ = ["SUPPORTED_ARCHITECTURES", "LlamaConfig", "LlamaForCausalLM", "architecture_of", "check_supported"]
