"""LoRA adapters offline: vLLM's LoRARequest, and LLM's adapters by name (loaded at the first request naming one)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from metrale.llm import LLM


@dataclass(frozen=True)
class LoRARequest:
    """vLLM's LoRARequest: an adapter by name and PEFT folder (lora_int_id is taken for vLLM's sake; the name is the
    key). An adapter LLM(lora_modules=...) loaded may be named with no path."""

    lora_name: str
    lora_int_id: int = 0
    lora_path: str = ""


def adapter_names(llm: LLM, lora_request, count: int) -> list[str | None]:
    """Each prompt's adapter name (None: the base model), loading a LoRARequest's adapter into the next LoRA slot the
    engine core assigns the first time its name comes; ValueError naming what cannot be served (nothing runs)."""
    requests = list(lora_request) if isinstance(lora_request, (list, tuple)) else [lora_request] * count
    if len(requests) != count:
        raise ValueError(f"{len(requests)} lora_request for {count} prompts")
    names = []
    for req in requests:
        if req is None:
            names.append(None)
            continue
        if not llm.args.enable_lora:
            raise ValueError("lora_request needs LLM(..., enable_lora=True)")
        if req.lora_name not in llm.engine.lora_slots:
            _load(llm, req)
        names.append(req.lora_name)
    return names


def _load(llm: LLM, req: LoRARequest) -> None:
    """Load a new adapter into a free slot the engine core picks (the device loads it, every rank its shard)."""
    from metrale.ipc.errors import Refused

    if not req.lora_path:
        raise ValueError(f"the LoRA adapter {req.lora_name!r} is not loaded and its lora_path is not given")
    try:
        llm.engine.load_lora(req.lora_name, req.lora_path)
    except Refused as e:
        raise ValueError(f"lora_request {req.lora_name!r}: {e.message}") from None
