"""Model implementations, one file per architecture family, looked up by config.json's `architectures` name
(models/registry.py); the blocks they share are in models/decoder.py, the layers in gpu_worker/layers/."""

from __future__ import annotations

from metrale.gpu_worker.models.registry import SUPPORTED_ARCHITECTURES, model_class

__all__ = ["SUPPORTED_ARCHITECTURES", "model_class"]
