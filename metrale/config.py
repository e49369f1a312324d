"""The knobs, one struct for each audience: EngineArgs (model + engine, shared by LLM and serve) and ServeConfig.

Their fields, types and defaults are metrale/settings.py's table (scope "engine" and "serve"): a setting is added
there, and only there. They are msgspec Structs so the supervisor hands them to its child processes as JSON,
never pickle.
"""

from __future__ import annotations

import msgspec

from metrale import settings
from metrale.settings import QUANTIZATIONS  # noqa: F401 - its old home (tests and scripts import it here)


class _EngineArgs(msgspec.Struct, kw_only=True):
    """EngineArgs' methods (its fields are the table's)."""

    def validate(self) -> None:
        """Raise ValueError naming the first knob that cannot work: outside its choices or range in the table, or
        a count below 1."""
        for s in settings.of_scope("engine"):
            value = getattr(self, s.name)
            if value is None and s.default is None:
                continue
            if s.choices is not None and value not in s.choices:
                raise ValueError(f"{s.name} must be one of {', '.join(s.choices)} (got {value!r})")
            if (s.min is not None and value < s.min) or (s.max is not None and value > s.max):
                bound = f">= {s.min}" if s.max is None else f"in [{s.min}, {s.max}]"
                raise ValueError(f"{s.name} must be {bound} (got {value})")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "max_waiting", "decode_burst",
                     "num_kv_blocks"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1 (got {getattr(self, name)})")
        if self.swap_space_gb < 0:
            raise ValueError(f"swap_space_gb must be >= 0 (got {self.swap_space_gb})")
        self._validate_lora()

    def _validate_lora(self) -> None:
        """ValueError naming the first --lora-modules entry that cannot be served (read without torch)."""
        from metrale.lora_adapters import LoraError, read_adapter

        if self.lora_modules and not self.enable_lora:
            raise ValueError("lora_modules needs enable_lora (--enable-lora)")
        if len(self.lora_modules) > self.max_loras:
            raise ValueError(f"{len(self.lora_modules)} lora_modules, but max_loras is {self.max_loras} (--max-loras)")
        names = [name for name, _ in lora_pairs(self.lora_modules)]
        if len(set(names)) != len(names):
            raise ValueError(f"lora_modules names an adapter twice: {names}")
        for name, path in lora_pairs(self.lora_modules):
            try:
                spec = read_adapter(path)
            except LoraError as e:
                raise ValueError(f"lora_modules {name}: {e}") from None
            if spec.rank > self.max_lora_rank:
                raise ValueError(f"lora_modules {name}: rank {spec.rank} is above max_lora_rank {self.max_lora_rank} "
                                 "(--max-lora-rank)")

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
            "enable_lora": self.enable_lora,
            "lora_modules": list(self.lora_modules),
            "max_loras": self.max_loras,
            "max_lora_rank": self.max_lora_rank,
            "max_logprobs": self.max_logprobs,
        }


def lora_pairs(modules: list[str]) -> list[tuple[str, str]]:
    """--lora-modules entries as (name, path); ValueError for one that is not NAME=PATH (or vLLM's JSON form)."""
    pairs = []
    for entry in modules:
        if entry.lstrip().startswith("{"):
            try:
                item = msgspec.json.decode(entry)
                pairs.append((str(item["name"]), str(item["path"])))
                continue
            except (msgspec.DecodeError, KeyError, TypeError):
                raise ValueError(f"lora_modules {entry!r}: JSON needs \"name\" and \"path\"") from None
        name, sep, path = entry.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"lora_modules {entry!r}: expected NAME=PATH")
        pairs.append((name, path))
    return pairs


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
