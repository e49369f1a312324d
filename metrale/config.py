"""The knobs, one struct for each audience: EngineArgs (model + engine, shared by LLM and serve) and ServeConfig.

Their fields, types and defaults are metrale/settings.py's table (scope "engine" and "serve"): a setting is added
there, and only there. They are msgspec Structs so the supervisor hands them to its child processes as JSON,
never pickle.
"""

from __future__ import annotations

import msgspec

from metrale import settings
from metrale.settings import QUANTIZATIONS  # noqa: F401 - its old home


class _EngineArgs(msgspec.Struct, kw_only=True):
    """EngineArgs' methods (its fields are the table's)."""

    def validate(self) -> None:
        """Raise ValueError naming the first knob that cannot work."""
        if self.dtype not in settings.DTYPES:
            raise ValueError(f"dtype must be auto, float32, bfloat16 or float16 (got {self.dtype!r})")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "max_waiting", "decode_burst"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1 (got {getattr(self, name)})")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)} (got {self.quantization!r})")
        if self.preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"preemption_mode must be recompute or swap (got {self.preemption_mode!r})")
        if self.swap_space_gb < 0:
            raise ValueError(f"swap_space_gb must be >= 0 (got {self.swap_space_gb})")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1 (got {self.num_kv_blocks})")
        for name in ("tensor_parallel_size", "data_parallel_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1 (got {getattr(self, name)})")
        if self.all_reduce not in settings.ALL_REDUCE_CHOICES:
            raise ValueError(f"all_reduce must be auto, shm or gloo (got {self.all_reduce!r})")
        if self.speculative not in (None, "ngram"):
            raise ValueError(f"speculative must be ngram or None (got {self.speculative!r})")
        if self.speculative_disable_by_batch_size is not None and self.speculative_disable_by_batch_size < 2:
            raise ValueError("speculative_disable_by_batch_size must be at least 2 (got "
                             f"{self.speculative_disable_by_batch_size})")
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError(f"num_speculative_tokens must be in [1, 16] (got {self.num_speculative_tokens})")


    def runner_kwargs(self, model_dir: str) -> dict:
        """The model runner's keyword arguments (in-process for LLM, as JSON for a worker process)."""
        return {
            "model_dir": model_dir,
            "dtype": self.dtype,
            "quantization": self.quantization,
            "device": self.device,
            "num_kv_blocks": self.num_kv_blocks,
            "kv_cache_memory": self.kv_cache_memory,
            "block_size": self.block_size,
            "max_num_seqs": self.max_num_seqs,
            "show_progress": self.show_progress,
            "swap_space": int(self.swap_space_gb * 2**30) if self.preemption_mode == "swap" else 0,
            "max_model_len": self.max_model_len,
            "decode_graphs": False if self.enforce_eager else None,
        }


EngineArgs = msgspec.defstruct(
    "EngineArgs", settings.struct_fields("engine"), bases=(_EngineArgs,), kw_only=True, module=__name__,
    namespace={"__doc__": "What model to load and how the engine core schedules it: settings.py's \"engine\" "
                          "settings, the same names in LLM(...) and `metrale serve`."},
)

ServeConfig = msgspec.defstruct(
    "ServeConfig",
    [("engine", EngineArgs, msgspec.field(default_factory=EngineArgs)),
     ("run_dir", str, ""),  # where the ipc:// sockets live (a fresh temp dir per serve): the supervisor's, no setting
     *settings.struct_fields("serve")],
    kw_only=True, module=__name__,
    namespace={"__doc__": "`metrale serve`: the engine plus where and how the three processes talk (settings.py's "
                          "\"serve\" settings)."},
)
