"""metrale: an LLM serving engine. The public names are imported lazily so `import metrale` stays cheap."""

from metrale import cpu_isa

cpu_isa.apply_to_environment()  # before torch starts: a forced kernel class caps torch's and oneDNN's kernels too

from metrale.ipc.pooling import PoolingParams  # noqa: E402
from metrale.ipc.sampling import SamplingParams  # noqa: E402

__all__ = ["LLM", "RequestOutput", "CompletionOutput", "SamplingParams", "PoolingParams", "EmbeddingRequestOutput", "LoRARequest", "BeamSearchParams", "BeamSearchOutput",
           "BeamSearchSequence", "Client", "AsyncClient"]


def __getattr__(name: str):
    if name == "LoRARequest":
        from metrale import llm_lora

        return llm_lora.LoRARequest
    if name == "EmbeddingRequestOutput":
        from metrale import llm_embed

        return llm_embed.EmbeddingRequestOutput
    if name in ("LLM", "RequestOutput", "CompletionOutput"):
        from metrale import llm

        return getattr(llm, name)
    if name in ("BeamSearchParams", "BeamSearchOutput", "BeamSearchSequence"):
        from metrale import beam_search

        return getattr(beam_search, name)
    if name in ("Client", "AsyncClient"):
        from metrale.frontend import client

        return getattr(client, name)
    raise AttributeError(f"module 'metrale' has no attribute {name!r}")
