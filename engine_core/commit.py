"""Committing a step's tokens to its sequences: append, advance row state, check stops."""

from __future__ import annotations

from itertools import repeat

import numpy as np

from metrale.ipc.errors import ErrorCode
from metrale.ipc.messages import TokenLogprob
from metrale.ipc.plan import POOL_LAST, POOL_SUM, StepResult
from metrale.ipc.pooling import finish_embedding

from .grammar import advance as advance_grammar
from .pipeline import update_row_state
from .sequence import Sequence
from .step_io import StepIo


def commit_tokens(io: StepIo, seqs: list[Sequence], tokens: np.ndarray, result: StepResult | None,
                  skip: list[bool] | None) -> int:
    """Append each sampling row's token to its sequence, skipping discarded rows; returns how many rows it ended
    (a stop, a length, a grammar's end).

    A finished row is skipped only through its discard flag (set by validation or an abort): the lane's
    correctness rests on that flag, and a test without validation must be able to see the difference.
    """
    token_list = tokens.tolist()
    toks = io.toks
    logprobs = result is not None and result.logprobs is not None
    pool = io.pool
    caching, bs = pool.enable_prefix_caching, pool.block_size
    num_ended = 0
    for r, (seq, tok, gone) in enumerate(zip(seqs, token_list, skip or repeat(False))):
        # Its settled blocks (below num_computed, all committed before this token) are keyed for the prefix cache.
        if caching and seq.num_computed >= (seq.kv.hashed_blocks + 1) * bs:  # a block filled since the last commit
            pool.cache_full_blocks(seq)
        if tok < 0 or gone:
            continue
        req = seq.req
        if req.beam is not None:  # a beam row's step gives its search alternatives; the search picks the tokens
            req.beam.take(seq, result, r)
            continue
        out = seq.out
        out.tokens.append(tok)
        seq.post()
        if logprobs and req.params.num_logprobs is not None:  # the top-N, or logprob_token_ids' in their order
            out.pending_logprobs.append(_token_logprob(result, r, tok, req.params.num_logprobs))
        if not req.plain:  # a plain row has no row state and no grammar
            update_row_state(seq, tok, toks)
            if seq.row_state.grammar is not None:  # structured outputs: the matcher follows the committed tokens
                ended = advance_grammar(seq, tok)
                if ended == "stop":
                    seq.finish("stop")
                elif ended is not None:
                    seq.finish("error", ended, ErrorCode.INTERNAL)
        if tok in req.stop_ids or len(out.tokens) >= req.stop_at:  # else no stop can apply
            _check_stop(io, seq, tok)
            num_ended += out.finish_reason is not None
        elif not req.plain:
            num_ended += out.finish_reason is not None
    return num_ended


def _check_stop(io: StepIo, seq: Sequence, tok: int) -> None:
    """Finish seq if tok ends it: EOS, a stop id, max_tokens, or the model's context."""
    p = seq.req.params
    num_tokens = len(seq.out.tokens)
    num_output = num_tokens - seq.req.num_prompt
    if num_output >= p.min_tokens and ((not p.ignore_eos and tok in io.eos_ids) or tok in p.stop_token_ids):
        seq.finish("stop")
    elif num_output >= p.max_tokens or num_tokens >= io.max_model_len:
        seq.finish("length")


def _token_logprob(result: StepResult, r: int, tok: int, n: int) -> TokenLogprob:
    """The logprob record of row r's sampled token, with its top-n alternatives."""
    if n and result.top_ids is not None and result.top_logprobs is not None:
        return TokenLogprob(tok, float(result.logprobs[r]), result.top_ids[r, :n].tolist(), result.top_logprobs[r, :n].tolist())
    return TokenLogprob(tok, float(result.logprobs[r]))


def commit_prompt_logprobs(seqs: list[Sequence], starts: list[int], counts: np.ndarray, result: StepResult,
                           skip: list[bool]) -> None:
    """Append each row's prompt logprobs from a settled step (StepResult.prompt_*: counts[r] positions per row
    from starts[r], row after row): position p gives prompt token p + 1's entry; entries a sequence already has
    (a recompute after preemption) are skipped."""
    if result.prompt_logprobs is None:
        return
    lps = result.prompt_logprobs.tolist()
    ids = result.prompt_top_ids.tolist() if result.prompt_top_ids is not None else None
    tops = result.prompt_top_logprobs.tolist() if result.prompt_top_logprobs is not None else None
    at = 0
    for r in np.flatnonzero(counts).tolist():
        seq, start, count = seqs[r], starts[r], int(counts[r])
        if not skip[r]:
            n = seq.params.prompt_logprobs
            entries = seq.out.prompt_entries
            for j in range(max(0, len(entries) - 1 - start), count):
                i = at + j
                token = seq.tokens[start + j + 1]
                if n and ids is not None:
                    entries.append(TokenLogprob(token, lps[i], ids[i][:n], tops[i][:n]))
                else:
                    entries.append(TokenLogprob(token, lps[i]))
        at += count


def commit_pooled(seqs: list[Sequence], starts: list[int], kinds: np.ndarray, result: StepResult,
                  skip: list[bool]) -> None:
    """Take each pooled row's vector from a settled step (StepResult.pooled, one per row with kinds[r], in row
    order) and finish the embeddings requests whose whole prompt is now computed. A chunk at position 0 starts a
    request's vector again (a recompute after preemption starts there too); a later chunk adds to a sum, replaces
    a last token's and leaves a first token's."""
    pooled = result.pooled
    for q, r in enumerate(np.flatnonzero(kinds).tolist()):
        seq = seqs[r]
        if skip[r] or seq.finished:
            continue
        if pooled is None or q >= len(pooled):
            seq.finish("error", "the device returned no pooled vector for an embeddings request", ErrorCode.INTERNAL)
            continue
        kind, start, out = kinds[r], starts[r], seq.out
        if start == 0 or kind == POOL_LAST:
            out.pool_total = pooled[q].astype(np.float64)
        elif kind == POOL_SUM:
            out.pool_total += pooled[q]
        if seq.num_computed >= seq.num_tokens:
            out.embedding = finish_embedding(out.pool_total, seq.req.pool_kind, seq.num_tokens, seq.req.pooling)
            seq.finish("stop")
