"""POST /v1/embeddings in OpenAI's shape (and vLLM's extensions): each input is its own engine request, pooled as
the model pools (model_facts: its sentence-transformers config), batched by the engine with whatever else runs.
"""

from __future__ import annotations

import base64
import time
import uuid
from typing import TYPE_CHECKING

import msgspec
import numpy as np
from aiohttp import web

from metrale.ipc.messages import Error
from metrale.ipc.pooling import PoolingParams
from metrale.ipc.sampling import PRIORITY_RANGE, SamplingParams

from .http_errors import ApiError, json_response
from .http_params import ServedModel, decode_body
from .http_reply import TokenTexts
from .http_run import Run

if TYPE_CHECKING:
    from .server import FrontendServer

MAX_INPUTS = 2048  # OpenAI's limit on one request's inputs


class EmbeddingRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """OpenAI's embeddings request, with vLLM's extensions; any other field is a 400 naming it."""

    input: str | list  # a text, texts, token ids, or lists of token ids (checked by Embeddings._inputs)
    model: str | None = None
    encoding_format: str = "float"  # "float" | "base64" (float32 little-endian, as OpenAI sends it)
    dimensions: int | None = None
    user: str | None = None
    # vLLM's extensions
    truncate_prompt_tokens: int | None = None  # keep the last n tokens (-1: the model's length)
    add_special_tokens: bool = True
    normalize: bool | None = None
    priority: int = 0


class Embeddings:
    """The /v1/embeddings handler over one FrontendServer."""

    def __init__(self, server: FrontendServer, model: ServedModel) -> None:
        self.server = server
        self.model = model

    async def handle(self, request: web.Request) -> web.Response:
        """Every input's embedding, in input order, with the prompt tokens they took."""
        body = await decode_body(request, EmbeddingRequest)
        self.model.check(body.model)
        pooling = self._pooling(body)
        inputs = await self._inputs(body)
        params = SamplingParams(priority=body.priority)
        adapter = self.model.adapter(body.model)
        run = Run(self.server, TokenTexts(self.server.tokenizer))
        try:
            for i, item in enumerate(inputs):
                if isinstance(item, str):
                    run.start(i, params, prompt=item, add_special_tokens=body.add_special_tokens, pooling=pooling,
                              lora=adapter)
                else:
                    run.start(i, params, token_ids=item, pooling=pooling, lora=adapter)
            vectors: list[list[float] | None] = [None] * len(inputs)
            prompt_tokens = 0
            async for msg in run.messages():
                if isinstance(msg, Error):
                    raise ApiError.from_engine(msg, "input")
                if msg.finish_reason is not None:
                    vectors[int(msg.id)] = msg.embedding
                    prompt_tokens += msg.prompt_tokens or 0
        finally:
            run.close()
        data = [{"index": i, "object": "embedding", "embedding": _encoded(v, body.encoding_format)}
                for i, v in enumerate(vectors)]
        return json_response({
            "id": f"embd-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
            "model": self.model.reply_name(body.model),
            "data": data, "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
        })

    def _pooling(self, body: EmbeddingRequest) -> PoolingParams:
        """The request's PoolingParams; 400 naming the field the model cannot honour."""
        if body.encoding_format not in ("float", "base64"):
            raise ApiError(400, f"encoding_format must be 'float' or 'base64' (got {body.encoding_format!r})",
                           param="encoding_format", code="invalid_value")
        lo, hi = PRIORITY_RANGE
        if not lo <= body.priority <= hi:
            raise ApiError(400, f"priority must be an integer in [{lo}, {hi}]", param="priority", code="invalid_value")
        facts = self.server.facts
        if facts.pooling.unsupported:
            raise ApiError(400, f"the model {self.model.id!r} gives no embeddings: metrale does not run "
                           f"{facts.pooling.unsupported}", param="model", code="unsupported_value")
        pooling = PoolingParams(normalize=body.normalize, dimensions=body.dimensions)
        try:
            pooling.validate(facts.hidden_size, facts.pooling.matryoshka)
        except ValueError as exc:
            raise ApiError(400, str(exc), param="dimensions", code="invalid_value") from None
        return pooling

    async def _inputs(self, body: EmbeddingRequest) -> list[str | list[int]]:
        """The inputs as texts or token lists (token lists when truncate_prompt_tokens asks to cut them); 400 for
        none, too many, an empty one or an id outside the vocabulary."""
        items = body.input
        if isinstance(items, str) or (items and _is_int(items[0])):
            items = [items]
        if not items or len(items) > MAX_INPUTS:
            raise ApiError(400, f"input must hold 1 to {MAX_INPUTS} items (got {len(items)})", param="input",
                           code="invalid_value")
        vocab = self.server.vocab_size
        for item in items:
            if not (isinstance(item, str) or isinstance(item, list) and all(_is_int(t) for t in item)):
                raise ApiError(400, "input must be a string, a list of strings, a list of token ids or a list of "
                               "lists of token ids", param="input", code="invalid_type")
            if not item:
                raise ApiError(400, "input must not hold an empty string or an empty token list", param="input",
                               code="invalid_value")
            if not isinstance(item, str) and not all(0 <= t < vocab for t in item):
                raise ApiError(400, f"input token ids must be in [0, {vocab})", param="input", code="invalid_value")
        keep = body.truncate_prompt_tokens
        if keep is None:
            return list(items)
        limit = self.server.max_model_len or self.server.facts.max_model_len
        if keep == -1:
            keep = limit
        if not 1 <= keep <= limit:
            raise ApiError(400, f"truncate_prompt_tokens must be -1 or in [1, {limit}] (got {keep})",
                           param="truncate_prompt_tokens", code="invalid_value")
        tokenizer = self.server.tokenizer
        out = []
        for item in items:
            ids = await tokenizer.encode_async(item, add_special_tokens=body.add_special_tokens) \
                if isinstance(item, str) else item
            out.append(list(ids[-keep:]))
        return out


def _encoded(vector: list[float] | None, encoding_format: str) -> list[float] | str:
    """The vector as floats, or as OpenAI's base64 of its float32 bytes."""
    if vector is None:
        raise ApiError(500, "the engine returned no embedding", type="server_error", code="internal")
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode()
    return vector


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
