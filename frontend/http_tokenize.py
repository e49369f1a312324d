"""POST /tokenize and POST /detokenize, in vLLM's request and answer shapes: a prompt or chat messages (rendered by
the chat template, as /v1/chat/completions renders them) to token ids, and token ids back to text.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec
from aiohttp import web

from .http_errors import ApiError, json_response
from .http_params import ServedModel, decode_body

if TYPE_CHECKING:
    from .http_chat import ChatCompletions
    from .server import FrontendServer


class TokenizeRequest(msgspec.Struct, kw_only=True):
    """vLLM's TokenizeCompletionRequest (prompt) or TokenizeChatRequest (messages): exactly one of the two."""

    model: str | None = None
    prompt: str | None = None
    messages: list | None = None
    add_special_tokens: bool | None = None  # default: true for a prompt, false for messages (a template writes BOS)
    return_token_strs: bool = False
    # messages only
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[dict] | None = None
    documents: list[dict] | None = None
    chat_template_kwargs: dict | None = None
    chat_template: str | None = None  # a template per request: refused, as vLLM refuses it by default


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    """vLLM's DetokenizeRequest."""

    tokens: list[int]
    model: str | None = None


class Tokenization:
    """The /tokenize and /detokenize handlers over one FrontendServer (chat rendering by the chat route's)."""

    def __init__(self, server: FrontendServer, model: ServedModel, chat: ChatCompletions) -> None:
        self.server = server
        self.model = model
        self.chat = chat

    async def tokenize(self, request: web.Request) -> web.Response:
        """POST /tokenize: {count, max_model_len, tokens, token_strs}."""
        body = await decode_body(request, TokenizeRequest)
        self.model.check(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise ApiError(400, "give prompt or messages (one of them)", param="prompt", code="invalid_value")
        if body.chat_template is not None:
            raise ApiError(400, "chat_template per request is not supported; the server's template is used",
                           param="chat_template", code="unsupported_value")
        if body.prompt is not None:
            text, add_special = body.prompt, body.add_special_tokens is not False
        else:
            text, add_special = self.chat.render(body), bool(body.add_special_tokens)
        tokenizer = self.server.tokenizer
        ids = await tokenizer.encode_async(text, add_special_tokens=add_special)
        strs = [tokenizer.backend.id_to_token(i) for i in ids] if body.return_token_strs else None
        return json_response({"count": len(ids), "max_model_len": self.server.max_model_len, "tokens": ids,
                              "token_strs": strs})

    async def detokenize(self, request: web.Request) -> web.Response:
        """POST /detokenize: {prompt}, the ids' text (special tokens spelled out, as vLLM's)."""
        body = await decode_body(request, DetokenizeRequest)
        self.model.check(body.model)
        vocab = self.server.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise ApiError(400, f"tokens {bad[:8]} are not in the vocabulary [0, {vocab})", param="tokens",
                           code="invalid_value")
        return json_response({"prompt": self.server.tokenizer.decode(body.tokens, skip_special_tokens=False)})
