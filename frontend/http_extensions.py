"""vLLM's request extensions on both endpoints: honoured (return_token_ids, return_tokens_as_token_ids,
truncate_prompt_tokens, use_beam_search with its length_penalty, early_stopping and include_stop_str_in_output: the
search is http_beam.py's), or refused with a 400 that names them (prompt_logprobs, chat echo, the beam search
fields without use_beam_search) — never silently ignored, since a client that sends one relies on it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .http_errors import ApiError
from .http_params import SamplingFields

if TYPE_CHECKING:
    from .server import FrontendServer

_SYNC_ENCODE_CHARS = 8192  # longer prompts are tokenized off the event loop (as live_requests.py does)


def refuse_unserved(body: SamplingFields, echo: bool = False) -> None:
    """400 naming the first vLLM extension this server does not implement, or a beam search field without
    use_beam_search. echo: chat's (echo the last message)."""
    if not body.use_beam_search:
        for name, unused in (("length_penalty", (None, 1.0)), ("early_stopping", (None, False)),
                             ("include_stop_str_in_output", (None, False))):
            if getattr(body, name) not in unused:
                raise ApiError(400, f"{name} applies only with use_beam_search", param=name, code="unsupported_value")
    if body.prompt_logprobs is not None:
        raise ApiError(400, "prompt_logprobs is not supported", param="prompt_logprobs", code="unsupported_value")
    if echo:
        raise ApiError(400, "echo is not supported on chat completions", param="echo", code="unsupported_value")


def needs_prompt_ids(body: SamplingFields) -> bool:
    """Whether the handler tokenizes the prompt itself: to return its ids, truncate it, or count it per chunk."""
    continuous = body.stream_options is not None and body.stream_options.continuous_usage_stats
    return bool(body.return_token_ids) or body.truncate_prompt_tokens is not None or continuous


async def prompt_ids(server: FrontendServer, body: SamplingFields, text: str | None, ids: list[int] | None,
                     add_special_tokens: bool) -> list[int]:
    """The prompt's token ids, tokenized as the engine path would, then truncate_prompt_tokens applied (vLLM's: keep
    the last k; -1 is max_model_len); 400 when k is out of range."""
    if ids is None:
        tok = server.tokenizer
        ids = tok.encode(text, add_special_tokens) if len(text) <= _SYNC_ENCODE_CHARS \
            else await tok.encode_async(text, add_special_tokens)
    k = body.truncate_prompt_tokens
    if k is None:
        return list(ids)
    limit = server.max_model_len
    if k == -1 and limit is not None:
        k = limit
    if k < 1 or (limit is not None and k > limit):
        raise ApiError(400, f"truncate_prompt_tokens must be -1 or in [1, max_model_len ({limit})] (got "
                       f"{body.truncate_prompt_tokens})", param="truncate_prompt_tokens", code="invalid_value")
    return list(ids[-k:])


def token_label(texts, as_ids: bool):
    """How logprobs name a token: its text, or "token_id:N" (return_tokens_as_token_ids)."""
    return (lambda token_id: f"token_id:{token_id}") if as_ids else texts
