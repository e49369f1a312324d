"""What a model is built with: the model facts, the dtype and device, and the choices the worker made for this device.

Every model class takes one `ModelContext` (vLLM's VllmConfig, smaller): the facts resolved once by
metrale/model_facts.py (max_model_len, windows, vocab ...; a model never derives them again), the loaded
native CPU kernels, the device's attention backend, the parallel group, and the linear method for each
layer (dense unless a quantized checkpoint says otherwise).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from metrale.gpu_worker.layers.attention_backends import TORCH, TorchAttention
from metrale.gpu_worker.layers.linear_method import LinearMethod, dense_method
from metrale.gpu_worker.layers.parallel import SINGLE, ParallelGroup
from metrale.model_facts import ModelFacts, decoder_config


@dataclass(frozen=True, slots=True)
class ModelContext:
    """The facts and the device-level choices a model's layers are built from."""

    facts: ModelFacts
    dtype: torch.dtype
    device: torch.device
    native: bool = False  # the native CPU kernels are loaded: fused norm, rotary and activation paths
    attention: TorchAttention = TORCH  # the device's attention backend (a layer may fall back to torch)
    group: ParallelGroup = SINGLE
    quant: Callable[[str], LinearMethod] = dense_method  # the linear method for a layer's checkpoint prefix

    @property
    def config(self) -> dict:
        """The decoder's config.json fields (a multimodal wrapper's text_config merged in)."""
        return decoder_config(self.facts.config)

    def linear_method(self, prefix: str) -> LinearMethod:
        """The method for the linear layer whose checkpoint name is prefix (e.g. "model.layers.0.mlp.down_proj")."""
        return self.quant(prefix)
