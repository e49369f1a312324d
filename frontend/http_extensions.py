"""vLLM's request extensions on both endpoints: honoured (return_token_ids, return_tokens_as_token_ids,
truncate_prompt_tokens with truncation_side, prompt_logprobs in whole answers, use_beam_search with its length_penalty,
early_stopping and include_stop_str_in_output: the search is http_beam.py's; allowed_token_ids, logprob_token_ids and
bad_words, which the engine serves: http_params.py passes them on), or refused with a 400 that names them
(prompt_logprobs with stream, the beam search fields without use_beam_search, allowed_token_ids, logprob_token_ids and
bad_words with use_beam_search) — never silently ignored, since a client that sends one relies on it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from metrale.ipc.messages import TokenLogprob

from .http_errors import ApiError
from .http_params import SamplingFields

if TYPE_CHECKING:
    from .server import FrontendServer

_SYNC_ENCODE_CHARS = 8192  # longer prompts are tokenized off the event loop (as live_requests.py does)


def refuse_unserved(body: SamplingFields) -> None:
    """400 naming the first vLLM extension this server does not implement, or a beam search field without
    use_beam_search."""
    if not body.use_beam_search:
        for name, unused in (("length_penalty", (None, 1.0)), ("early_stopping", (None, False)),
                             ("include_stop_str_in_output", (None, False))):
            if getattr(body, name) not in unused:
                raise ApiError(400, f"{name} applies only with use_beam_search", param=name, code="unsupported_value")
    if body.use_beam_search:  # a search ranks its beams' raw alternatives: no mask, no pinned ids
        for name in ("allowed_token_ids", "logprob_token_ids", "bad_words"):
            if getattr(body, name):
                raise ApiError(400, f"`{name}` is not supported with beam search.", param=name,
                               code="unsupported_value")
    if body.prompt_logprobs is not None:
        if body.stream:  # vLLM's words (it takes 0 and then sends none; here nothing asked for is dropped)
            raise ApiError(400, "`prompt_logprobs` are not available when `stream=True`.", param="prompt_logprobs",
                           code="unsupported_value")
        if body.prompt_logprobs < -1:
            raise ApiError(400, "`prompt_logprobs` must be a positive value or -1.", param="prompt_logprobs",
                           code="invalid_value")


def needs_prompt_ids(body: SamplingFields, force_usage: bool = False) -> bool:
    """Whether the handler tokenizes the prompt itself: to return its ids, truncate it, or count it per chunk (asked
    for, or forced by --enable-force-include-usage)."""
    continuous = body.stream and (force_usage or (body.stream_options is not None
                                                  and body.stream_options.continuous_usage_stats))
    return bool(body.return_token_ids) or body.truncate_prompt_tokens is not None or continuous


async def prompt_ids(server: FrontendServer, body: SamplingFields, text: str | None, ids: list[int] | None,
                     add_special_tokens: bool) -> list[int]:
    """The prompt's token ids, tokenized as the engine path would, then truncate_prompt_tokens applied (vLLM's: keep
    the last k, or with truncation_side "right" the first k; -1 is max_model_len); 400 when k is out of range."""
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
    return list(ids[:k]) if body.truncation_side == "right" else list(ids[-k:])


def check_pinned(body: SamplingFields, logprobs: int | None, vocab_size: int, max_logprobs: int) -> None:
    """400 naming logprob_token_ids (vLLM's: each token's alternatives are these ids, wherever they rank; the engine
    reports their logprobs) when logprobs are not asked for, or it is not 1 to max_logprobs distinct ids of the
    vocabulary (the ticket ring carries at most max_logprobs alternatives per row)."""
    ids = body.logprob_token_ids
    if ids is None:
        return
    def refuse(why: str) -> ApiError:
        return ApiError(400, f"logprob_token_ids {why}", param="logprob_token_ids", code="invalid_value")
    if logprobs is None:
        raise refuse("needs logprobs: true")
    if not ids or len(ids) > max(max_logprobs, 0) or len(set(ids)) != len(ids):
        raise refuse(f"must be 1 to {max_logprobs} distinct token ids (this server's --max-logprobs; got {len(ids)})")
    bad = [i for i in ids if not (isinstance(i, int) and 0 <= i < vocab_size)]
    if bad:
        raise refuse(f"has ids out of vocabulary (size {vocab_size}): {bad[:8]}")


def pin(items: list[TokenLogprob], ids: list[int] | None) -> list[TokenLogprob]:
    """items with their alternatives as vLLM lists them for logprob_token_ids: the token itself first, then the
    asked ids the engine reported (in their order, the token not twice); items unchanged when ids is None."""
    if ids is None:
        return items
    out = []
    for t in items:
        pairs = [(i, lp) for i, lp in zip(t.top_ids, t.top_logprobs) if i != t.token_id]
        out.append(TokenLogprob(t.token_id, t.logprob, [t.token_id] + [i for i, _ in pairs],
                                [t.logprob] + [lp for _, lp in pairs]))
    return out


def token_label(texts, as_ids: bool):
    """How logprobs name a token: its text, or "token_id:N" (return_tokens_as_token_ids)."""
    return (lambda token_id: f"token_id:{token_id}") if as_ids else texts


def prompt_logprob_dicts(entries: list[TokenLogprob | None], top: int, texts) -> list[dict | None]:
    """vLLM's prompt_logprobs: per prompt token None (the first, which has nothing before it) or a map from token ids
    (as strings) to {"logprob", "rank", "decoded_token"}: the prompt token first, then its position's top `top`
    alternatives, ranked from 1. The prompt token's rank is known only when it is among them (else null: the engine
    reports no rank beyond the top N). A logprob of -inf is -9999.0, as vLLM clamps it. texts: TokenTexts."""
    out: list[dict | None] = []
    for t in entries:
        if t is None:
            out.append(None)
            continue
        ids, logprobs = t.top_ids[:top], t.top_logprobs[:top]
        rank = 1 + sum(lp > t.logprob for lp in logprobs) if t.token_id in ids else None
        entry = {str(t.token_id): _logprob_entry(t.logprob, rank, texts(t.token_id))}
        for r, (token_id, lp) in enumerate(zip(ids, logprobs), 1):
            entry.setdefault(str(token_id), _logprob_entry(lp, r, texts(token_id)))
        out.append(entry)
    return out


def _logprob_entry(logprob: float, rank: int | None, decoded: str) -> dict:
    """One token's entry in prompt_logprobs (vLLM's Logprob)."""
    return {"logprob": max(logprob, -9999.0), "rank": rank, "decoded_token": decoded}
