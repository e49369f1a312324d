"""Structured outputs on the engine core: each grammar row's xgrammar matcher, advanced by committed tokens, and
the token bitmasks a plan carries.

The frontend compiles a request's grammar (frontend/grammar_compiler.py) against the vocabulary it sends first
(`GrammarVocab`); here a `GrammarBook` keeps that vocabulary and one deserialized CompiledGrammar per key, and
gives each structured sequence a `RowGrammar`: a matcher that accepts exactly the committed output tokens (the
outputs a request is resubmitted with included). The mask of a row's next pick is a function of how many tokens
its matcher has accepted, which is what `RowMask.grammar_at` records: a step launched before its row's last
token was committed carries a bitmask made one token early, and validation sees the difference (the seed's
stale mask). xgrammar runs on numpy here (metrale/xgrammar_core.py): no torch.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from metrale import xgrammar_core as xg
from metrale.ipc.errors import ErrorCode, Refused
from metrale.ipc.messages import GrammarBlob, GrammarVocab
from metrale.ipc.plan import MASK_GRAMMAR

from .sequence import Sequence

log = logging.getLogger(__name__)

COMPILED_KEPT = 64  # distinct compiled grammars kept (a repeat of a schema deserializes nothing)


@dataclass(slots=True)
class RowGrammar:
    """One sequence's matcher and how many output tokens it has accepted."""

    matcher: object
    accepted: int = 0

    def accept(self, token: int) -> bool:
        """Advance past a committed token; False when the grammar does not allow it."""
        if not self.matcher.accept_token(token, False):
            return False
        self.accepted += 1
        return True

    @property
    def terminated(self) -> bool:
        """The grammar accepted a stop token: nothing may follow."""
        return bool(self.matcher.is_terminated())


class GrammarBook:
    """The vocabulary grammars are compiled against, and the compiled grammars in use, for one engine core."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.words = xg.bitmask_words(vocab_size)
        self._vocab_digest: str | None = None
        self._info = None
        self._compiled: OrderedDict[str, object] = OrderedDict()

    def set_vocab(self, vocab: GrammarVocab) -> None:
        """Take the frontend's vocabulary (a repeat with the same digest changes nothing)."""
        if vocab.digest == self._vocab_digest:
            return
        if vocab.vocab_size != self.vocab_size:
            log.error("grammar vocabulary of %d tokens for a model of %d: grammars refused", vocab.vocab_size, self.vocab_size)
            return
        self._info = xg.tokenizer_info(vocab.encoded_vocab, vocab.vocab_type, vocab.vocab_size, vocab.stop_token_ids,
                                       vocab.add_prefix_space)
        self._vocab_digest = vocab.digest
        self._compiled.clear()

    def row_grammar(self, blob: GrammarBlob, output_ids: list[int]) -> RowGrammar:
        """A matcher for a new request, past the output tokens it already has; Refused (bad_request) when the
        grammar cannot be used."""
        if self._info is None:
            raise Refused(ErrorCode.BAD_REQUEST, "structured outputs: the engine core has no grammar vocabulary")
        compiled = self._compiled.get(blob.key)
        if compiled is None:
            try:
                compiled = xg.deserialize(blob.data, self._info)
            except xg.GrammarError as exc:
                raise Refused(ErrorCode.BAD_REQUEST, f"structured outputs: {exc}") from None
            self._compiled[blob.key] = compiled
            while len(self._compiled) > COMPILED_KEPT:
                self._compiled.popitem(last=False)
        else:
            self._compiled.move_to_end(blob.key)
        row = RowGrammar(xg.matcher(compiled))
        for token in output_ids:
            if not row.accept(token):
                raise Refused(ErrorCode.BAD_REQUEST, f"structured outputs: the grammar does not allow output token {token}")
        return row


def advance(seq: Sequence, token: int) -> str | None:
    """The commit hook: move a grammar row's matcher past its committed token. Returns why the row ends, for
    the commit to finish it: an error for a token the grammar refuses (only a forced think-end can be one),
    "stop" for a finished grammar (its stop token taken); None while it goes on."""
    grammar = seq.row_state.grammar
    if not grammar.accept(token):
        return f"the output left its grammar at token {token}"
    return "stop" if grammar.terminated else None


def fill_bitmasks(seqs: list[Sequence], kinds: list[int], allowed: list[np.ndarray | None], out: np.ndarray) -> int:
    """Write the bitmask of every row that has one, in row order, into out's first rows; returns how many. kinds:
    the rows' RowMask kinds (MASK_GRAMMAR: its matcher's next tokens); allowed: each row's allowed_token_ids as
    packed words (None: none). A row with both gets the two ANDed: both constraints apply."""
    g = 0
    for seq, kind, words in zip(seqs, kinds, allowed):
        if kind & MASK_GRAMMAR:
            xg.fill_bitmask(seq.row_state.grammar.matcher, out, g)
            if words is not None:
                out[g] &= words
        elif words is not None:
            out[g] = words
        else:
            continue
        g += 1
    return g

