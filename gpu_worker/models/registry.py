"""The model registry: config.json's `architectures` name -> the class that implements it.

Each entry names a module of this package and a class in it, imported on first use (vLLM's lazy
registry), so adding an architecture is its file plus one line here.
"""

from __future__ import annotations

import importlib

from metrale.model_facts import ModelError

# architecture name -> (module in metrale.gpu_worker.models, class name)
_MODELS: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("llama", "LlamaForCausalLM"),
    "Qwen3ForCausalLM": ("llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("llama", "LlamaForCausalLM"),
    "Gemma2ForCausalLM": ("gemma", "Gemma2ForCausalLM"),
    "Gemma3ForCausalLM": ("gemma", "Gemma3ForCausalLM"),
    "Phi3ForCausalLM": ("phi3", "Phi3ForCausalLM"),
    "Olmo2ForCausalLM": ("olmo2", "Olmo2ForCausalLM"),
    "Qwen3MoeForCausalLM": ("qwen3_moe", "Qwen3MoeForCausalLM"),
    "MixtralForCausalLM": ("mixtral", "MixtralForCausalLM"),
    "BambaForCausalLM": ("bamba", "BambaForCausalLM"),
}

SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(sorted(_MODELS))


def model_class(architecture: str) -> type:
    """The class for architecture; ModelError (a ValueError) listing the supported ones when none implements it."""
    entry = _MODELS.get(architecture)
    if entry is None:
        raise ModelError(f"unsupported architecture {architecture!r} (supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
    module, name = entry
    return getattr(importlib.import_module(f"metrale.gpu_worker.models.{module}"), name)
