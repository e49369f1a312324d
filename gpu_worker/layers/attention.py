"""One layer's attention over the paged KV cache: its shape, scale, sliding window and soft-cap, and its backend.

The layer holds no weights (the projections around it are linear layers); it is what a model calls with
the step's rotated q, k and v. Its backend is the device's (layers/attention_backends.py) unless that one
lacks a feature the layer needs, then the torch path.
"""

from __future__ import annotations

import torch

from metrale.gpu_worker.layers.attention_backends import TORCH, TorchAttention
from metrale.gpu_worker.layers.attention_metadata import AttentionMetadata, Window
from metrale.gpu_worker.layers.kv_cache import PagedKVCache


class Attention:
    """softmax(q k^T * scale [soft-capped], causal within the window) v for one layer."""

    __slots__ = ("layer", "num_heads", "num_kv_heads", "head_dim", "scale", "window", "softcap", "backend")

    def __init__(
        self,
        layer: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        scale: float,
        window: Window,
        backend: TorchAttention,
        softcap: float | None = None,
    ):
        """backend: the device's; this layer keeps it only when it supports the layer."""
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale
        self.window = window
        self.softcap = softcap
        self.backend = backend if backend.supports(self) else TORCH

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: PagedKVCache, meta: AttentionMetadata) -> torch.Tensor:
        """q [T, heads, head_dim], k, v [T, kv_heads, head_dim] (rotated) -> [T, heads * head_dim]; writes k, v."""
        return self.backend.forward(self, q, k, v, cache, meta)
