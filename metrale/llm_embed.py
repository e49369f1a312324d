"""LLM.embed: embeddings offline, as vLLM's LLM.embed returns them (`outputs[i].outputs.embedding`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from metrale.ipc.pooling import PoolingParams
from metrale.ipc.sampling import SamplingParams
from metrale.model_facts import resolve_model

if TYPE_CHECKING:
    from metrale.llm import LLM


@dataclass
class EmbeddingOutput:
    """One prompt's embedding."""

    embedding: list[float] = field(default_factory=list)

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class EmbeddingRequestOutput:
    """What LLM.embed returns per prompt (vLLM's shape)."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    prompt: str | None = None
    finished: bool = True


def embed(llm: LLM, texts: list[str | None], token_lists: list[list[int]],
          pooling_params: PoolingParams | list[PoolingParams] | None) -> list[EmbeddingRequestOutput]:
    """Every prompt's embedding, batched by the engine like any requests; ValueError naming what the model or a
    request's params cannot give (nothing runs then)."""
    facts = resolve_model(llm.model_dir)
    if facts.pooling.unsupported:
        raise ValueError(f"{facts.name} cannot give embeddings: metrale does not run {facts.pooling.unsupported}")
    plist = pooling_params if isinstance(pooling_params, list) else [pooling_params or PoolingParams()] * len(texts)
    if len(plist) != len(texts):
        raise ValueError(f"{len(plist)} pooling params for {len(texts)} prompts")
    info = llm.engine.info
    for p in plist:
        p.validate(info.hidden_size, info.matryoshka)
    results = [EmbeddingRequestOutput(f"embed-{llm.next_id()}", ids, EmbeddingOutput(), prompt=text)
               for text, ids in zip(texts, token_lists)]
    added = []
    try:
        for result, p in zip(results, plist):
            llm.engine.add_request(result.request_id, result.prompt_token_ids, SamplingParams(), stream=False, pooling=p)
            added.append(result.request_id)
    except Exception:
        llm.abandon(added)
        raise
    by_id = {r.request_id: r for r in results}
    open_ids = set(by_id)
    while open_ids:
        for delta in llm.engine.step():
            if delta.request_id not in open_ids or delta.finish_reason is None:
                continue
            open_ids.discard(delta.request_id)
            if delta.finish_reason != "stop" or delta.embedding is None:
                llm.abandon(open_ids)
                raise RuntimeError(f"embedding request {delta.request_id} failed: {delta.error or delta.finish_reason}")
            by_id[delta.request_id].outputs.embedding = delta.embedding
    llm.run_until_idle()
    return results
