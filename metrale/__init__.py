"""metrale: an LLM serving engine. The public names are imported lazily so `import metrale` stays cheap."""

from metrale.ipc.sampling import SamplingParams

__all__ = ["LLM", "RequestOutput", "CompletionOutput", "SamplingParams", "Client", "AsyncClient"]


def __getattr__(name: str):
    if name in ("LLM", "RequestOutput", "CompletionOutput"):
        from metrale import llm

        return getattr(llm, name)
    if name in ("Client", "AsyncClient"):
        from metrale.frontend import client

        return getattr(client, name)
    raise AttributeError(f"module 'metrale' has no attribute {name!r}")
